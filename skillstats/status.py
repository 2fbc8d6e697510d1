"""`skillstats status`: what an on-call engineer looks at first, on one screen.

Per group: Kafka's view (state, members, committed offsets, lag in records and
in seconds, measured like the lag-exporter by reading the oldest unconsumed
record) beside SQL's (the fences, any fence past its log end, offsets lost to
retention). Then whose counts the database holds (the group and the topic, by
its Kafka id, of each role) and anything that makes the consumers refuse to
run, what in the topic's configuration loses events, how fresh the windows
tables are, the DLQ's size and what was parked last, the last docsync runs, and
the partitions the last finished drain held back because the database refused
their deltas (read back from that run's error, sinks/docstats.py).
Partitions are listed only where something is owed (lag or a fence ahead);
`--json` has every partition.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, func, select

from skillstats.config import Settings, redact_url
from skillstats.dlq_admin import newest_parked
from skillstats.kafka import (
    CLEANUP_POLICY,
    TIMESTAMP_TYPE,
    TopicIds,
    commit_metadata,
    topic_config_problems,
    topic_configs,
)
from skillstats.lag import groups_of, measure_lag
from skillstats.sinks.db import open_engine
from skillstats.sinks.docstats import held_from_error
from skillstats.sinks.fences import PartitionFences
from skillstats.sinks.identity import (
    IdentityMismatch,
    Owner,
    another_database_message,
    mismatch,
    other_databases,
    owners,
    recorded_mark,
)
from skillstats.sinks.migrate import require_current
from skillstats.sinks.schema import docsync_runs, skill_hourly_stats


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


def identity_problem(recorded: Owner | None, group: str, role: str, topic: str, topic_id: str) -> str | None:
    """Why `group` would be refused its role's tables now (None: it would not), in the consumers' own words."""
    try:
        mismatch(recorded, Owner(role, group, topic, topic_id))
    except IdentityMismatch as exc:
        return str(exc)
    return None


def database_problem(settings: Settings, engine: Engine, owner: Owner | None, group: str) -> str | None:
    """Why `group` would be refused because its Kafka commits carry another database's mark (None: they do
    not), as the consumers say it (skillstats/positions.py)."""
    mark = recorded_mark(engine, owner.role) if owner is not None and owner.group_id == group else None
    if mark is None:
        return None
    theirs = other_databases(mark, commit_metadata(settings, group, settings.topic))
    if not theirs:
        return None
    return another_database_message(group, settings.topic, mark, theirs, settings.kafka_bootstrap)


def status(settings: Settings, dlq_rows: int = 5) -> dict[str, Any]:
    engine = open_engine(settings.database_url)
    require_current(engine)
    try:
        applied = {
            group: PartitionFences(engine, group, settings.topic).fences() for group, _role in groups_of(settings)
        }
        lost = {
            group: PartitionFences(engine, group, settings.topic).offsets_lost() for group, _role in groups_of(settings)
        }
        recorded = owners(engine)
        runs = recent_runs(engine, settings.docsync_group)
        snapshot = measure_lag(settings, applied=applied)
        topic_id = TopicIds(settings).get(settings.topic)
        configs = topic_configs(settings, settings.topic, (CLEANUP_POLICY, TIMESTAMP_TYPE))
        groups = []
        for group in snapshot.groups:
            fences = applied[group.group]
            owner = recorded.get(group.role)
            partitions = [
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
                for p in group.partitions
            ]
            ends = {p.partition: p.log_end for p in group.partitions}
            groups.append(
                {
                    "group": group.group,
                    "role": group.role,
                    "state": group.state,
                    "members": group.members,
                    "lag_records": group.lag_records,
                    "lag_seconds": None if group.lag_seconds is None else round(group.lag_seconds, 3),
                    "applied": sum(fences.values()),
                    "fences_ahead": sorted(p for p, f in fences.items() if f > ends.get(p, 0)),
                    "offsets_lost": {str(p): n for p, n in sorted(lost[group.group].items())},
                    "owner": None
                    if owner is None
                    else {"group": owner.group_id, "topic": owner.topic, "topic_id": owner.topic_id},
                    "refused": identity_problem(owner, group.group, group.role, settings.topic, topic_id)
                    or database_problem(settings, engine, owner, group.group),
                    "partitions": partitions,
                }
            )
        dlq: dict[str, Any] | None = None
        if snapshot.dlq is not None:
            dlq = {
                "topic": snapshot.dlq.name,
                "records": sum(end - start for start, end in snapshot.dlq.partitions.values()),
                "newest": [
                    {**r.summary(), "parked_at": _iso(r.parked_at_ms / 1000) if r.parked_at_ms is not None else None}
                    for r in newest_parked(settings, snapshot.dlq.partitions, dlq_rows)
                ],
            }
        return {
            "measured_at": _iso(snapshot.measured_at),
            "kafka": settings.kafka_bootstrap,
            "database": redact_url(settings.database_url),
            "topic": settings.topic,
            "topic_id": topic_id,
            "topic_problems": topic_config_problems(configs),
            "records": sum(end for _start, end in snapshot.topic.partitions.values()),
            "partitions": len(snapshot.topic.partitions),
            "retention_seconds": None if snapshot.topic.retention_ms is None else snapshot.topic.retention_ms / 1000,
            "groups": groups,
            "windows_tables": windows_freshness(engine),
            "dlq": dlq,
            "docsync_runs": runs,
            "docsync_held_back": held_back(settings.docsync_group, runs, applied[settings.docsync_group]),
        }
    finally:
        engine.dispose()


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
    if as_json:
        return json.dumps(report, sort_keys=True)
    retention = age(report["retention_seconds"]) if report["retention_seconds"] is not None else "unlimited"
    lines = [
        f"topic {report['topic']} (id {report['topic_id'] or 'unknown: the cluster keeps none'}) on {report['kafka']}: "
        f"{report['partitions']} partitions, "
        f"{report['records']:,} records ever written, retention {retention} (at {report['measured_at']})",
        f"database {report['database']}",
        *(f"  TOPIC CONFIGURATION: {problem}" for problem in report["topic_problems"]),
        "",
        f"  {'group':<24} {'state':<12} {'members':>7} {'applied (SQL)':>14} {'lag records':>12}  lag (oldest pending)",
    ]
    for group in report["groups"]:
        lines.append(
            f"  {group['group']:<24} {group['state']:<12} {group['members']:>7} {group['applied']:>14,} "
            f"{group['lag_records']:>12,}  {age(group['lag_seconds'])}"
        )
    owed = [
        (g, p)
        for g in report["groups"]
        for p in g["partitions"]
        if p["lag_records"] or p["partition"] in g["fences_ahead"]
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
        if group["fences_ahead"]:
            lines.append(
                f"  FENCE AHEAD OF LOG: {group['group']} partition(s) {group['fences_ahead']}: the topic was recreated "
                f"or the database restored; the consumers refuse to run (see `skillstats fences --help`)"
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
    if dlq is None:
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
