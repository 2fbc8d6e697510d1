"""`skillstats status`: what an on-call engineer looks at first, on one screen.

Per group: Kafka's view (state, members, committed offsets, lag in offsets and
in seconds, measured like the lag-exporter by reading the oldest unconsumed
record) beside SQL's (the fences, when they last moved, any fence past its log
end, offsets lost to retention). Then whose counts the database holds (the
group and the topic, by its Kafka id, of each role) and anything that makes the
consumers refuse to run, what in the topic's configuration loses events, how
fresh the windows tables are, the DLQ's size and what was parked last, the last
docsync runs, and the partitions the last finished drain held back because the
database refused their deltas (read back from that run's error,
sinks/docstats.py). Partitions are listed only where something is owed (lag or
a fence ahead); `--json` has every partition.

Offsets, not records: a log end, a fence and a lag are offsets, and Kafka
transactions (ingest, DLQ replays) put a marker at an offset of their own that
holds no record. So "offsets" where the figure is one.

When Kafka cannot be reached (or refuses who we are), the database still says
most of what on call needs: each group's fences and when they last moved, the
owners, offsets lost to retention, how fresh the windows tables are, the last
docsync runs and what they held back. That is reported, with every Kafka figure
unknown (None, "Kafka: unreachable" where the lag would be), and the CLI exits
1 with the reason on stderr. It costs one metadata request before the
measurement: the topic is asked for first, so an unreachable broker is known
after one first-answer timeout and a missing topic is TopicMissing (exit 2).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any, NamedTuple

from confluent_kafka import KafkaException
from sqlalchemy import Engine, func, select

from skillstats.config import FIRST_ANSWER_S, Settings, mask, redact_url
from skillstats.dlq_admin import newest_parked
from skillstats.kafka import (
    CLEANUP_POLICY,
    TIMESTAMP_TYPE,
    KafkaUnreachable,
    TopicIds,
    commit_metadata,
    partition_count,
    topic_config_problems,
    topic_configs,
)
from skillstats.lag import LagSnapshot, groups_of, measure_lag, rebuild_group
from skillstats.sinks.db import open_engine
from skillstats.sinks.docstats import held_from_error
from skillstats.sinks.fences import PartitionFences
from skillstats.sinks.identity import (
    REBUILD,
    IdentityMismatch,
    Owner,
    another_database_message,
    mismatch,
    other_databases,
    owners,
    recorded_mark,
)
from skillstats.sinks.migrate import require_current
from skillstats.sinks.schema import docsync_runs, partition_fences, skill_hourly_stats

UNREACHABLE = "Kafka: unreachable"  # where a figure only Kafka knows would be


def _iso(moment: datetime | float | None) -> str | None:
    if moment is None:
        return None
    if isinstance(moment, int | float):
        moment = datetime.fromtimestamp(moment, UTC)
    elif moment.tzinfo is None:  # the tables keep naive UTC
        moment = moment.replace(tzinfo=UTC)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


def recent_runs(engine: Any, group: str, limit: int = 5) -> list[dict[str, Any]]:
    with engine.connect() as connection:
        rows = connection.execute(
            select(docsync_runs).where(docsync_runs.c.group_id == group).order_by(docsync_runs.c.id.desc()).limit(limit)
        ).mappings()
        return [{k: (_iso(v) if isinstance(v, datetime) else v) for k, v in row.items()} for row in rows]


def windows_freshness(engine: Any) -> dict[str, str | None]:
    """The newest hour with data in skill_hourly_stats, and when a row was last written."""
    with engine.connect() as connection:
        newest, updated = connection.execute(
            select(func.max(skill_hourly_stats.c.hour), func.max(skill_hourly_stats.c.updated_at))
        ).one()
    return {"newest_hour": _iso(newest), "last_written": _iso(updated)}


def fences_moved_at(engine: Any, group: str, topic: str) -> str | None:
    """When the group last moved (or reset) one of its fences on `topic`: its last SQL commit there.

    One aggregate over the group's fence rows (a handful per partition count)."""
    with engine.connect() as connection:
        moved = connection.execute(
            select(func.max(partition_fences.c.updated_at)).where(
                partition_fences.c.group_id == group, partition_fences.c.topic == topic
            )
        ).scalar()
    return _iso(moved)


def held_back(group: str, runs: list[dict[str, Any]], fences: dict[int, int]) -> list[dict[str, Any]]:
    """The partitions the newest finished docsync run held back (`runs` newest first) whose fence is still
    where it held them: a drain since that applied one has moved its fence."""
    finished = next((run for run in runs if run["finished_at"] is not None), None)
    if finished is None:
        return []
    return [
        {
            "group": group,
            "partition": held.partition,
            "offset": held.offset,
            "read_to": held.read_to,
            "error": held.error,
            "run_id": finished["id"],
            "since": finished["finished_at"],
        }
        for held in held_from_error(finished["last_error"])
        if fences.get(held.partition) == held.offset
    ]


def identity_problem(recorded: Owner | None, group: str, role: str, topic: str, topic_id: str | None) -> str | None:
    """Why `group` would be refused its role's tables now (None: it would not), in the consumers' own words.
    Without the topic's id (Kafka unreachable) only the group's and the topic's names are compared."""
    try:
        mismatch(recorded, Owner(role, group, topic, topic_id))
    except IdentityMismatch as exc:
        return str(exc)
    return None


def database_problem(
    settings: Settings, engine: Engine, owner: Owner | None, group: str, timeout: float = FIRST_ANSWER_S
) -> str | None:
    """Why `group` would be refused because its Kafka commits carry another database's mark (None: they do
    not), as the consumers say it (skillstats/positions.py)."""
    mark = recorded_mark(engine, owner.role) if owner is not None and owner.group_id == group else None
    if mark is None:
        return None
    theirs = other_databases(mark, commit_metadata(settings, group, settings.topic, timeout=timeout))
    if not theirs:
        return None
    return another_database_message(group, settings.topic, mark, theirs, settings.kafka_bootstrap)


class Status(NamedTuple):
    """What `status` found: the report (render() prints it), and why Kafka's side of it is missing."""

    report: dict[str, Any]
    unreachable: KafkaUnreachable | None  # None: Kafka answered and every figure is measured


def status(settings: Settings, dlq_rows: int = 5, timeout: float = FIRST_ANSWER_S) -> Status:
    """The database's side, then Kafka's; `timeout` bounds each Kafka request (the first answer included).

    Raises SchemaOutdated (no database, an old schema) before Kafka is asked, and TopicMissing for an events
    topic that does not exist; an unreachable or refusing Kafka is not raised but returned, beside what the
    database says."""
    engine = open_engine(settings.database_url)
    try:
        require_current(engine)
        recorded = owners(engine)
        runs = recent_runs(engine, settings.docsync_group)
        applied: dict[str, dict[int, int]] = {}
        groups: list[dict[str, Any]] = []
        rebuilding = rebuild_group(engine, settings.topic)
        for group, role in groups_of(settings, rebuilding):
            fences = PartitionFences(engine, group, settings.topic)
            applied[group] = fences.fences()
            owner = recorded.get(role)
            groups.append(
                {
                    "group": group,
                    "role": role,
                    "state": None,  # Kafka's figures: None until measured
                    "members": None,
                    "lag_records": None,
                    "lag_seconds": None,
                    "applied": sum(applied[group].values()),
                    "fences_moved_at": fences_moved_at(engine, group, settings.topic),
                    "fences_ahead": None,
                    "offsets_lost": {str(p): n for p, n in sorted(fences.offsets_lost().items())},
                    "owner": None
                    if owner is None
                    else {"group": owner.group_id, "topic": owner.topic, "topic_id": owner.topic_id},
                    "refused": identity_problem(owner, group, role, settings.topic, None),
                    "partitions": [
                        {
                            "partition": p,
                            "log_start": None,
                            "log_end": None,
                            "committed": None,
                            "fence": fence,
                            "lag_records": None,
                            "lag_seconds": None,
                            "oldest_pending": None,
                        }
                        for p, fence in sorted(applied[group].items())
                    ],
                }
            )
        report: dict[str, Any] = {
            "measured_at": _iso(datetime.now(UTC)),
            "kafka": settings.kafka_bootstrap,
            "kafka_unreachable": None,
            "database": redact_url(settings.database_url),
            "topic": settings.topic,
            "topic_id": None,
            "topic_problems": [],
            "records": None,
            "partitions": None,
            "retention_seconds": None,
            "groups": groups,
            "windows_tables": windows_freshness(engine),
            "dlq": None,
            "docsync_runs": runs,
            "docsync_held_back": held_back(settings.docsync_group, runs, applied[settings.docsync_group]),
        }
        try:
            partition_count(settings, settings.topic, timeout)  # unreachable, or no such topic: said at once
            snapshot = measure_lag(settings, timeout, applied=applied, rebuild_group=rebuilding)
            _add_kafka(report, settings, engine, snapshot, recorded, dlq_rows, timeout)
        except KafkaUnreachable as exc:  # KafkaRefused too: the database's side stands alone
            report["kafka_unreachable"] = mask(str(exc), settings.secrets())  # printed on stdout: never a secret
            return Status(report, exc)
        except (KafkaException, TimeoutError) as exc:  # Kafka half-answers (no leader, a broker dying mid-run)
            unreachable = KafkaUnreachable(settings, timeout, exc)
            report["kafka_unreachable"] = mask(str(unreachable), settings.secrets())
            return Status(report, unreachable)
        return Status(report, None)
    finally:
        engine.dispose()


def _add_kafka(
    report: dict[str, Any],
    settings: Settings,
    engine: Engine,
    snapshot: LagSnapshot,
    recorded: dict[str, Owner],
    dlq_rows: int,
    timeout: float,
) -> None:
    """Fill in what only Kafka knows: the topic, each group's state and lag per partition, the DLQ. Everything
    is asked before anything is written into `report`, so a Kafka that goes away half-way leaves the database's
    report whole, never half of each."""
    topic_id = TopicIds(settings, timeout).get(settings.topic)
    configs = topic_configs(settings, settings.topic, (CLEANUP_POLICY, TIMESTAMP_TYPE), timeout)
    by_name = {group["group"]: group for group in report["groups"]}
    measured_groups: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for measured in snapshot.groups:
        group = by_name[measured.group]
        fences = {p["partition"]: p["fence"] for p in group["partitions"]}
        ends = {p.partition: p.log_end for p in measured.partitions}
        owner = recorded.get(measured.role)
        kafka_side = dict(
            state=measured.state,
            members=measured.members,
            lag_records=measured.lag_records,
            lag_seconds=None if measured.lag_seconds is None else round(measured.lag_seconds, 3),
            fences_ahead=sorted(p for p, f in fences.items() if f > ends.get(p, 0)),
            refused=identity_problem(owner, measured.group, measured.role, settings.topic, topic_id)
            or database_problem(settings, engine, owner, measured.group, timeout),
            partitions=[
                {
                    "partition": p.partition,
                    "log_start": p.log_start,
                    "log_end": p.log_end,
                    "committed": p.committed,
                    "fence": fences.get(p.partition),
                    "lag_records": p.lag_records,
                    "lag_seconds": None if p.lag_seconds is None else round(p.lag_seconds, 3),
                    "oldest_pending": _iso(p.oldest_pending_ms / 1000) if p.oldest_pending_ms is not None else None,
                }
                for p in measured.partitions
            ],
        )
        measured_groups.append((group, kafka_side))
    dlq: dict[str, Any] | None = None
    if snapshot.dlq is not None:
        dlq = {
            "topic": snapshot.dlq.name,
            "records": sum(end - start for start, end in snapshot.dlq.partitions.values()),
            "newest": [
                {**r.summary(), "parked_at": _iso(r.parked_at_ms / 1000) if r.parked_at_ms is not None else None}
                for r in newest_parked(settings, snapshot.dlq.partitions, dlq_rows, timeout)
            ],
        }
    for group, kafka_side in measured_groups:
        group.update(kafka_side)
    report.update(
        measured_at=_iso(snapshot.measured_at),
        topic_id=topic_id,
        topic_problems=topic_config_problems(configs),
        records=sum(end for _start, end in snapshot.topic.partitions.values()),
        partitions=len(snapshot.topic.partitions),
        retention_seconds=None if snapshot.topic.retention_ms is None else snapshot.topic.retention_ms / 1000,
        dlq=dlq,
    )


def age(seconds: float | None) -> str:
    """3s, 4m05s, 2h13m, 3d04h; '?' when unknown."""
    if seconds is None:
        return "?"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def render(report: dict[str, Any], as_json: bool, partition_lines: int = 12) -> str:
    """The report as one JSON line, or as the screen on call reads; without Kafka, what only Kafka knows is
    said to be unknown ("Kafka: unreachable") rather than left out, so the screen keeps its shape."""
    if as_json:
        return json.dumps(report, sort_keys=True)
    offline = report.get("kafka_unreachable") is not None
    if offline:
        topic_line = (
            f"topic {report['topic']} on {report['kafka']}: {UNREACHABLE} (at {report['measured_at']}); "
            f"what the database says:"
        )
    else:
        retention = age(report["retention_seconds"]) if report["retention_seconds"] is not None else "unlimited"
        topic_line = (
            f"topic {report['topic']} (id {report['topic_id'] or 'unknown: the cluster keeps none'}) on "
            f"{report['kafka']}: {report['partitions']} partitions, {report['records']:,} offsets ever written, "
            f"retention {retention} (at {report['measured_at']})"
        )
    lines = [
        topic_line,
        f"database {report['database']}",
        *(f"  TOPIC CONFIGURATION: {problem}" for problem in report["topic_problems"]),
        "",
        f"  {'group':<24} {'state':<12} {'members':>7} {'applied (SQL)':>14} {'lag offsets':>12}  lag (oldest pending)",
    ]
    for group in report["groups"]:
        if offline:
            lines.append(
                f"  {group['group']:<24} {'?':<12} {'?':>7} {group['applied']:>14,}  {UNREACHABLE}; fences last "
                f"moved {group['fences_moved_at'] or 'never'}"
            )
            continue
        lines.append(
            f"  {group['group']:<24} {group['state']:<12} {group['members']:>7} {group['applied']:>14,} "
            f"{group['lag_records']:>12,}  {age(group['lag_seconds'])}"
        )
    owed = [
        (g, p)
        for g in report["groups"]
        for p in g["partitions"]
        if p["lag_records"] or p["partition"] in (g["fences_ahead"] or ())
    ]
    if owed:
        lines += ["", "  partitions with lag:"]
        for group, p in owed[:partition_lines]:
            committed = "none" if p["committed"] is None else f"{p['committed']:,}"
            fence = "none" if p["fence"] is None else f"{p['fence']:,}"
            lines.append(
                f"    {group['group']:<22} p{p['partition']:<3} end {p['log_end']:>9,}  committed {committed:>9}  "
                f"fence {fence:>9}  lag {p['lag_records']:>7,}  oldest {p['oldest_pending'] or '-'} "
                f"({age(p['lag_seconds'])})"
            )
        if len(owed) > partition_lines:
            lines.append(f"    ... and {len(owed) - partition_lines} more (--json lists every partition)")
    for group in report["groups"]:
        if group["role"] == REBUILD:
            lines.append(
                f"  REBUILDING: {group['group']} recomputes the windows tables from the log beside the live ones "
                f"(`skillstats rebuild status` says how far, and whether it may be swapped in)"
            )
        if group["fences_ahead"]:
            lines.append(
                f"  FENCE AHEAD OF LOG: {group['group']} partition(s) {group['fences_ahead']}: the topic was recreated "
                f"or the database restored; the consumers refuse to run (see "
                + (
                    "`skillstats rebuild --help`: a rebuild is dropped, not reset)"
                    if group["role"] == REBUILD
                    else "`skillstats fences --help`)"
                )
            )
        if group["refused"]:
            lines.append(f"  REFUSED: {group['group']} would not run: {group['refused']}")
        if group["offsets_lost"]:
            total = sum(group["offsets_lost"].values())
            where = ", ".join(f"p{p} {n:,}" for p, n in group["offsets_lost"].items())
            lines.append(
                f"  LOST TO RETENTION: {group['group']}: {total:,} offset(s) deleted before they were applied ({where})"
            )
    for held in report.get("docsync_held_back") or []:
        lines.append(
            f"  HELD BACK: {held['group']} p{held['partition']} at offset {held['offset']:,} (read to "
            f"{held['read_to']:,}; run #{held['run_id']}, {held['since']}): the database refused its deltas; every "
            f"other partition moves, this one waits: {held['error']}"
        )
    tables = report["windows_tables"]
    lines += [
        "",
        f"windows tables: newest hour with data {tables['newest_hour'] or 'none yet'}, "
        f"last written {tables['last_written'] or 'never'}",
    ]
    dlq = report["dlq"]
    if offline:
        lines.append(f"DLQ: {UNREACHABLE}")
    elif dlq is None:
        lines.append("DLQ: the topic does not exist (run `skillstats init`)")
    else:
        lines.append(f"DLQ {dlq['topic']}: {dlq['records']:,} records" + (", newest:" if dlq["newest"] else ""))
        for parked in dlq["newest"]:
            lines.append(
                f"  {parked['parked_at'] or '?':<20} {parked['reason']:<20} p{parked['source_partition']}@"
                f"{parked['source_offset']}  {parked['message'][:70]}"
            )
    lines.append("recent docsync runs:")
    for run in report["docsync_runs"] or []:
        lines.append(
            f"  #{run['id']:<5} started {run['started_at']}  {run['stopped_reason'] or 'running/killed':<14} "
            f"events {run['events_read'] or 0:,}, skills {run['skills_updated'] or 0:,}"
            + (f", error: {run['last_error'].splitlines()[0]}" if run["last_error"] else "")
        )
    if not report["docsync_runs"]:
        lines.append("  none yet")
    return "\n".join(lines)
