"""`skillstats status`: how far each consumer group is, and the last doc-stats runs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import select

from skillstats.config import Settings
from skillstats.kafka import committed_offsets, end_offsets
from skillstats.sinks.db import open_engine
from skillstats.sinks.fences import PartitionFences
from skillstats.sinks.migrate import require_current
from skillstats.sinks.schema import docsync_runs


@dataclass
class GroupStatus:
    group: str
    end: int  # records in the topic (sum of end offsets)
    applied: int  # records below the SQL fences
    committed: int  # records below Kafka's committed offsets
    lag: int  # end - applied
    partitions: dict[int, dict[str, int]]
    fences_ahead: list[int]  # partitions whose fence is past the log end: the consumers refuse to run


def group_status(settings: Settings, engine: Any, group: str, ends: dict[int, int]) -> GroupStatus:
    fences = PartitionFences(engine, group, settings.topic).fences()
    committed = committed_offsets(settings, group, settings.topic)
    partitions = {
        p: {"end": end, "applied": fences.get(p, 0), "committed": committed.get(p, 0), "lag": end - fences.get(p, 0)}
        for p, end in sorted(ends.items())
    }
    applied = sum(v["applied"] for v in partitions.values())
    ahead = sorted(p for p, f in fences.items() if f > ends.get(p, 0))
    return GroupStatus(
        group,
        sum(ends.values()),
        applied,
        sum(v["committed"] for v in partitions.values()),
        sum(ends.values()) - applied,
        partitions,
        ahead,
    )


def recent_runs(engine: Any, group: str, limit: int = 5) -> list[dict[str, Any]]:
    with engine.connect() as connection:
        rows = connection.execute(
            select(docsync_runs).where(docsync_runs.c.group_id == group).order_by(docsync_runs.c.id.desc()).limit(limit)
        ).mappings()
        return [{k: (v.isoformat() + "Z" if hasattr(v, "isoformat") else v) for k, v in row.items()} for row in rows]


def status(settings: Settings) -> dict[str, Any]:
    engine = open_engine(settings.database_url)
    require_current(engine)
    try:
        ends = end_offsets(settings, settings.topic)
        groups = [group_status(settings, engine, g, ends) for g in (settings.windows_group, settings.docsync_group)]
        return {
            "topic": settings.topic,
            "groups": [asdict(g) for g in groups],
            "docsync_runs": recent_runs(engine, settings.docsync_group),
        }
    finally:
        engine.dispose()


def render(report: dict[str, Any], as_json: bool) -> str:
    if as_json:
        return json.dumps(report, sort_keys=True)
    lines = [f"topic {report['topic']}"]
    for group in report["groups"]:
        lines.append(
            f"  {group['group']:<28} applied {group['applied']:>12,} of {group['end']:>12,}  lag {group['lag']:>10,}"
            f"  (Kafka committed {group['committed']:,})"
        )
        if group["fences_ahead"]:
            lines.append(
                f"    FENCE AHEAD OF LOG on partition(s) {group['fences_ahead']}: the topic was recreated or the "
                f"database restored; the consumers refuse to run (see `skillstats fences --help`)"
            )
    lines.append("recent docsync runs:")
    for run in report["docsync_runs"] or []:
        lines.append(
            f"  #{run['id']:<5} started {run['started_at']}  {run['stopped_reason'] or 'running/killed':<14} "
            f"events {run['events_read']:,}, skills {run['skills_updated']:,}"
            + (f", error: {run['last_error']}" if run["last_error"] else "")
        )
    if not report["docsync_runs"]:
        lines.append("  none yet")
    return "\n".join(lines)
