"""`skillstats prune`: delete old events from the topic, never one a required group has not read.

Why this exists rather than leaving it all to Kafka's time retention:
`retention.ms` deletes a segment once its records are old enough, whether or
not anyone read them. A docsync CronJob that failed over a long weekend, or a
windows worker stuck on a database outage, falls behind the retention, and the
records it never counted are gone: the SQL totals can no longer be made exact
(the lag-exporter reports it as `skillstats_consumer_records_lost_to_retention`).
The system skillstats replaces never deleted an event its cursor had not passed:
its prune took the lower of "older than the retention" and the daily-stats
cursor, and refused to run ("cursor not ready") while there was no cursor. This
is the same rule on Kafka offsets. Run the topic with a generous time retention
(30 days or more) as the backstop, and this command as the routine cleanup.

Per partition of the events topic the cutoff (records below it are deleted,
with the admin API's DeleteRecords, which moves the log start offset) is the
lowest of:

- the retention bound: the first offset whose timestamp is at or after
  now - `retention_days` (ListOffsets by timestamp), so every record below it
  is older than the retention; the log end when no record is that recent;
- for every required group, its Kafka committed offset, the cursor the spec
  names: a group resumes there, so nothing below it will be read again. A
  partition where a required group has no committed offset is "not ready" and
  left alone: that group would start from the log start. An empty partition
  (no offset between its log start and end) is "empty: no records" whoever
  read it: there is nothing to delete nor to wait for;
- for every required group with a SQL fence on the partition, the fence (see
  `_group_bound`).

It is a dry run unless `apply` is asked for (the CLI also wants the
confirmation token). Commits and fences are read before the watermarks, so a
commit past the log end really is one (a recreated topic): such a partition is
left alone too, and `skillstats status` tells the rest.

`skill_hourly_stats` grows by skills x hours for ever; `--hourly-days` deletes
the hours that ended more than N days ago, in bounded transactions walking the
primary key (a few thousand rows each), so neither the windows worker nor the
database waits on one huge DELETE. An event that arrives later than that for
such an hour starts its row again from zero: choose N well beyond how late
events arrive.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec
from sqlalchemy import Engine, delete, func, select, tuple_

from skillstats.config import Settings
from skillstats.kafka import committed_offsets, watermarks, while_moving
from skillstats.sinks.fences import PartitionFences
from skillstats.sinks.schema import skill_hourly_stats

CONFIRM_TOKEN = "PRUNE_SKILL_STAT_EVENTS"
MIN_RETENTION_DAYS, MAX_RETENTION_DAYS, DEFAULT_RETENTION_DAYS = 1, 90, 7
HOURLY_BATCH_ROWS = 5_000
DAY_MS = 86_400_000
RETENTION = "retention"


@dataclass
class PartitionPlan:
    """One partition: where its log starts, where prune would cut it, and why there."""

    partition: int
    low_watermark: int
    high_watermark: int
    retention_offset: int  # first offset at or after the retention cutoff (the log end when none)
    cutoff: int | None  # records below are deleted; None: the partition is left alone
    limited_by: str | None  # "retention", or the group whose offset set the cutoff
    reason: str  # for people: why the cutoff is where it is, or why the partition is left alone
    low_watermark_after: int | None = None  # after apply: the log start offset the broker reports
    error: str | None = None  # after apply: why the deletion failed

    @property
    def records(self) -> int:
        """Offsets that go (dry run: would go): records, and the markers of any Kafka transactions among them."""
        return max(0, self.cutoff - self.low_watermark) if self.cutoff is not None else 0

    @property
    def ready(self) -> bool:
        return self.cutoff is not None


@dataclass
class HourlyPlan:
    days: int
    cutoff: datetime  # rows with an hour before this go: the whole hour ended by now - days
    rows: int  # rows older than the cutoff when counted
    oldest: datetime | None
    deleted: int = 0


@dataclass
class PrunePlan:
    topic: str
    retention_days: int
    retention_cutoff_ms: int
    groups: list[str]
    applied: bool = False
    partitions: list[PartitionPlan] = field(default_factory=list)
    hourly: HourlyPlan | None = None

    @property
    def records(self) -> int:
        return sum(p.records for p in self.partitions)

    @property
    def failed(self) -> list[PartitionPlan]:
        return [p for p in self.partitions if p.error is not None]

    def to_dict(self) -> dict[str, Any]:
        partitions = [{**asdict(p), "records": p.records, "ready": p.ready} for p in self.partitions]
        hourly = None
        if self.hourly is not None:
            hourly = {**asdict(self.hourly), "cutoff": _iso(self.hourly.cutoff), "oldest": _iso(self.hourly.oldest)}
        return {
            "topic": self.topic,
            "dry_run": not self.applied,
            "retention_days": self.retention_days,
            "retention_cutoff": _iso(datetime.fromtimestamp(self.retention_cutoff_ms / 1000, UTC)),
            "required_groups": self.groups,
            "records": self.records,
            "not_ready": [p.partition for p in self.partitions if not p.ready],
            "partitions": partitions,
            "hourly": hourly,
        }


def _iso(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    if moment.tzinfo is None:  # the tables keep naive UTC
        moment = moment.replace(tzinfo=UTC)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


def check_retention_days(days: int) -> int:
    if isinstance(days, bool) or not isinstance(days, int) or not MIN_RETENTION_DAYS <= days <= MAX_RETENTION_DAYS:
        raise ValueError(f"the retention must be {MIN_RETENTION_DAYS} to {MAX_RETENTION_DAYS} days, not {days!r}")
    return days


def _group_bound(committed: int | None, fence: int | None, keeps_fences: bool) -> tuple[int, str] | None:
    """The offset below which one group is done with a partition, and what set it; None: not ready.

    The committed offset is the cursor (the spec prunes by it), but the windows and
    docsync groups also keep a SQL fence, the next offset applied in SQL, and both
    consumers resume from the fence, not the commit, whenever the two disagree. A
    fence is written in the SQL transaction before the commit is sent, so it is
    normally at or ahead of the commit (ahead while a commit is late or lost), and
    a commit is never ahead of applied data: the commit alone is then the safe
    bound. Only a database restored from a backup, or fences reset by an operator,
    leaves a fence below the commit; the consumers will then read again from the
    fence, so the records between must stay. Hence the commit, never above the
    fence where one exists. A group that keeps no fences (not a skillstats group)
    is bound by its commit alone; a skillstats group with a commit but no fence
    row (a database restored from before its first batch there, or a new database
    pointed at the old groups) reads that partition again from the log start, so
    the partition is not ready (None).
    """
    if committed is None or (keeps_fences and fence is None):
        return None
    if fence is not None and fence < committed:
        return fence, "SQL fence"
    return committed, "committed offset"


def plan(
    settings: Settings,
    engine: Engine,
    *,
    retention_days: int = DEFAULT_RETENTION_DAYS,
    groups: Iterable[str] | None = None,
    now_ms: int | None = None,
    timeout: float = 30.0,
) -> PrunePlan:
    """What prune would delete now, per partition of the events topic; reads only."""
    check_retention_days(retention_days)
    required = list(dict.fromkeys(groups or (settings.windows_group, settings.docsync_group)))
    if not required:
        raise ValueError("at least one group must be required")
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    cutoff_ms = now_ms - retention_days * DAY_MS
    # Cursors first, then the log: high watermarks only grow, so a commit read before
    # them and found past the log end really is past it.
    commits = {
        group: while_moving(lambda g=group: committed_offsets(settings, g, settings.topic, timeout), timeout)
        for group in required
    }
    fences = {group: PartitionFences(engine, group, settings.topic).fences() for group in required}
    marks = watermarks(settings, settings.topic, timeout)
    by_time = retention_offsets(settings, sorted(marks), cutoff_ms, timeout)
    result = PrunePlan(settings.topic, retention_days, cutoff_ms, required)
    own_groups = {settings.windows_group, settings.docsync_group}  # the groups that keep SQL fences
    for partition, (low, high) in sorted(marks.items()):
        # The offset found may be past the watermark read a moment before, if records arrived since.
        retention = min(high if by_time[partition] < 0 else by_time[partition], high)
        past_end = any(
            (offset or 0) > high for g in required for offset in (commits[g].get(partition), fences[g].get(partition))
        )
        if high <= low and not past_end:  # nothing in the log: nothing to delete, nobody to wait for
            result.partitions.append(PartitionPlan(partition, low, high, retention, low, None, "empty: no records"))
            continue
        cutoff, limited_by = retention, RETENTION
        reason = (
            "retention: no record is newer than the cutoff"
            if by_time[partition] < 0
            else f"retention: offset {retention} is the first newer record"
        )
        problem = None
        for group in required:
            committed, fence = commits[group].get(partition), fences[group].get(partition)
            bound = _group_bound(committed, fence, keeps_fences=group in own_groups)
            if bound is None:
                problem = problem or (
                    f"not ready: group {group} has no committed offset"
                    if committed is None
                    else f"not ready: group {group} has a committed offset but no SQL fence (a restored or new "
                    "database): it would read this partition again from the log start"
                )
                continue
            ahead = [(what, o) for what, o in (("committed offset", committed), ("SQL fence", fence)) if o and o > high]
            if ahead:
                what, offset = ahead[0]
                problem = problem or (
                    f"left alone: group {group} {what} {offset} is past the log end {high} (topic recreated or "
                    f"database restored: see skillstats fences --help)"
                )
                continue
            offset, what = bound
            if offset < cutoff:
                cutoff, limited_by, reason = offset, group, f"group {group} {what}"
        if problem is not None:
            result.partitions.append(PartitionPlan(partition, low, high, retention, None, None, problem))
        else:
            result.partitions.append(PartitionPlan(partition, low, high, retention, cutoff, limited_by, reason))
    return result


def retention_offsets(settings: Settings, partitions: list[int], timestamp_ms: int, timeout: float) -> dict[int, int]:
    """Per partition, the first offset with a timestamp at or after `timestamp_ms`; -1 where there is none."""
    admin = AdminClient(settings.kafka_config())
    spec = OffsetSpec.for_timestamp(timestamp_ms)

    def ask() -> dict[int, int]:
        futures = admin.list_offsets(
            {TopicPartition(settings.topic, p): spec for p in partitions}, request_timeout=timeout
        )
        return {tp.partition: future.result(timeout).offset for tp, future in futures.items()}

    return while_moving(ask, timeout)


def apply(settings: Settings, prune: PrunePlan, timeout: float = 30.0) -> PrunePlan:
    """Delete the records below each ready partition's cutoff; fills low_watermark_after or error per partition."""
    admin = AdminClient(settings.kafka_config())
    pending = {p.partition: p for p in prune.partitions if p.ready and p.records > 0}
    deadline = time.monotonic() + timeout
    while pending:
        requests = [TopicPartition(settings.topic, n, p.cutoff) for n, p in sorted(pending.items())]
        futures = admin.delete_records(requests, request_timeout=timeout, operation_timeout=timeout)
        for tp, future in futures.items():
            target = pending[tp.partition]
            try:
                target.low_watermark_after = future.result(timeout).low_watermark
                target.error = None
                del pending[tp.partition]
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                target.error = str(error or exc)
                moving = isinstance(error, KafkaError) and error.retriable()
                if not moving or time.monotonic() > deadline:
                    del pending[tp.partition]
        if pending:
            time.sleep(0.5)
    prune.applied = True
    return prune


def hourly_cutoff(days: int, now: datetime | None = None) -> datetime:
    """Naive UTC: rows whose hour is before it ended at least `days` days before `now`."""
    if days < 1:
        raise ValueError(f"--hourly-days must be at least 1, not {days}")
    moment = (now or datetime.now(UTC)).astimezone(UTC).replace(tzinfo=None) - timedelta(days=days)
    return moment.replace(minute=0, second=0, microsecond=0)


def count_hourly(engine: Engine, days: int, now: datetime | None = None) -> HourlyPlan:
    cutoff = hourly_cutoff(days, now)
    table = skill_hourly_stats
    with engine.connect() as connection:
        rows, oldest = connection.execute(
            select(func.count(), func.min(table.c.hour)).where(table.c.hour < cutoff)
        ).one()
    return HourlyPlan(days, cutoff, int(rows), oldest)


def delete_hourly(
    engine: Engine,
    hourly: HourlyPlan,
    *,
    batch_rows: int = HOURLY_BATCH_ROWS,
    progress: Callable[[int], None] | None = None,
) -> HourlyPlan:
    """Delete the rows before `hourly.cutoff`, at most `batch_rows` per transaction, walking the primary key.

    Each transaction finds the next `batch_rows` old rows in key order after the
    last batch (an index range, not a scan from the start each time), then deletes
    the old rows in that key range. `progress` gets the running total.
    """
    table = skill_hourly_stats
    key = tuple_(table.c.skill_id, table.c.hour)
    old = table.c.hour < hourly.cutoff
    after: tuple[str, datetime] | None = None
    while True:
        with engine.begin() as connection:
            found = select(table.c.skill_id, table.c.hour).where(old)
            if after is not None:
                found = found.where(key > tuple_(*after))
            keys = connection.execute(found.order_by(table.c.skill_id, table.c.hour).limit(batch_rows)).all()
            if not keys:
                break
            last = (keys[-1][0], keys[-1][1])
            doomed = delete(table).where(old, key <= tuple_(*last))
            if after is not None:
                doomed = doomed.where(key > tuple_(*after))
            hourly.deleted += connection.execute(doomed).rowcount
        after = last
        if progress is not None:
            progress(hourly.deleted)
        if len(keys) < batch_rows:
            break
    return hourly


def render(report: Mapping[str, Any], as_json: bool) -> str:
    """The plan (or what was done) as one JSON line, or a table per partition."""
    if as_json:
        return json.dumps(report, sort_keys=True)
    done = not report["dry_run"]
    lines = [
        f"topic {report['topic']}: keep {report['retention_days']} day(s) (records before "
        f"{report['retention_cutoff']} may go), and whatever {', '.join(report['required_groups'])} "
        f"{'has' if len(report['required_groups']) == 1 else 'have'} not committed past",
        f"  {'partition':>9} {'low watermark':>14} {'cutoff':>12} {'deleted' if done else 'would delete':>13}  reason",
    ]
    for p in report["partitions"]:
        cutoff = "-" if p["cutoff"] is None else f"{p['cutoff']:,}"
        line = f"  {p['partition']:>9} {p['low_watermark']:>14,} {cutoff:>12} {p['records']:>13,}  {p['reason']}"
        if p["error"]:
            line += f"  FAILED: {p['error']}"
        elif p["low_watermark_after"] is not None:
            line += f"  (low watermark now {p['low_watermark_after']:,})"
        lines.append(line)
    ready = [p for p in report["partitions"] if p["ready"] and p["records"]]
    failed = [p for p in report["partitions"] if p["error"]]
    not_ready = report["not_ready"]
    gone = sum(p["records"] for p in ready if not p["error"])
    if done:
        lines.append(f"deleted {gone:,} offset(s) from {len(ready) - len(failed)} partition(s)")
        if failed:
            lines.append(f"FAILED in {len(failed)} partition(s): {', '.join(str(p['partition']) for p in failed)}")
    else:
        lines.append(f"dry run: {report['records']:,} offset(s) in {len(ready)} partition(s) would be deleted")
    if not_ready:
        lines.append(f"left alone: {len(not_ready)} partition(s) ({', '.join(map(str, not_ready))}), see the reasons")
    hourly = report["hourly"]
    if hourly is not None:
        if done:
            lines.append(
                f"skill_hourly_stats: deleted {hourly['deleted']:,} row(s) with an hour before {hourly['cutoff']}"
            )
        else:
            oldest = f", the oldest {hourly['oldest']}" if hourly["oldest"] else ""
            lines.append(
                f"skill_hourly_stats: {hourly['rows']:,} row(s) with an hour before {hourly['cutoff']} would be "
                f"deleted{oldest}"
            )
    if not done:
        lines.append(f"nothing was changed; add --apply --confirm {CONFIRM_TOKEN} to delete")
    return "\n".join(lines)
