"""What importing a legacy export would do, with no writes (`skillstats legacy plan`), and what each event is owed.

An event of the old table is owed to exactly the tables whose cron had not reached it (`owed`):

- `windows` (skill_hourly_stats, skill_daily_stats): `_creationTime` above the daily processor's
  cursor, or every event when that cursor was never set;
- `skills` (skills, user_skill_stats): no `processedAt`, the doc sync never applied it;
- `history` (skill_daily_stats, with --history): every `skillDailyStats` row, the daily counts of
  the events at or below the cursor (hourly history is not in the export: it is not imported).

The plan also prints the old system's own figures, computed as its
`countSkillStatEventImportSurvivors` action computes them (`unprocessed`, `processedRecent`,
`survivors`), for an operator to compare with that action's answer before importing.

What the manifest cannot know: it knows documents by their `_id`, so the same events exported from
another deployment (a copy, a restore under new ids) look new. A later export of the same deployment
only adds rows created after the earlier export was taken, so a row not yet applied but created at or
before the newest `_creationTime` of an earlier imported export (`older_unseen`) is the sign of that
(or of an earlier import cut off and never rerun): the plan shows it and `import` refuses it unless
told. What it costs: one pass over the export (validating every line), and per 5,000 owed events
one indexed manifest read per target.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

from sqlalchemy import Engine, select

from skillstats.legacy.export import DAILY, EVENTS, Export, LegacyEvent, Progress
from skillstats.sinks.schema import legacy_manifest

WINDOWS: Final = "windows"
SKILLS: Final = "skills"
HISTORY: Final = "history"
TABLES: Final = {
    WINDOWS: "skill_hourly_stats, skill_daily_stats",
    SKILLS: "skills, user_skill_stats",
    HISTORY: "skill_daily_stats",
}
RULES: Final = {
    WINDOWS: "events above the daily cursor",
    SKILLS: "events without processedAt",
    HISTORY: "skillDailyStats rows (--history)",
}
LOOKUP_CHUNK: Final = 5000

T = TypeVar("T")


def owed(event: LegacyEvent, cursor: float | None) -> tuple[bool, bool]:
    """(owed to the windows tables, owed to the skill totals): what the old crons had not reached."""
    return (cursor is None or event.created > cursor, not event.processed)


def chunked(items: Iterable[T], size: int) -> Iterator[list[T]]:
    chunk: list[T] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


@dataclass
class Target:
    """One target's figures: owed by the export, applied by an earlier import, what is left."""

    name: str
    owed: int = 0
    applied: int = 0  # in the manifest already
    older_unseen: int = 0  # not in it, yet created before an earlier imported export's newest row
    # per earlier export bound: owed rows not in the manifest created at or before it (see older_unseen)
    _unseen_by_bound: dict[float, int] = field(default_factory=dict, repr=False)

    @property
    def to_apply(self) -> int:
        return self.owed - self.applied

    def to_dict(self) -> dict[str, Any]:
        return {
            "tables": TABLES[self.name],
            "rule": RULES[self.name],
            "owed": self.owed,
            "applied_before": self.applied,
            "to_apply": self.to_apply,
            "older_unseen": self.older_unseen,
        }


@dataclass
class Plan:
    export: str
    events: int = 0
    cursor: float | None = None
    bound: float = 0.0  # the newest `_creationTime` among the export's events
    earlier_bound: float | None = None  # the newest of an earlier imported export (another one than this)
    unprocessed: int = 0
    processed_recent: int = 0
    targets: dict[str, Target] = field(default_factory=dict)

    @property
    def survivors(self) -> int:
        return self.unprocessed + self.processed_recent

    @property
    def older_unseen(self) -> int:
        return sum(t.older_unseen for t in self.targets.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "export": self.export,
            "events": self.events,
            "cursor_creation_time": self.cursor,
            "export_bound": self.bound,
            "earlier_export_bound": self.earlier_bound,
            "survivors": {
                "unprocessed": self.unprocessed,
                "processedRecent": self.processed_recent,
                "survivors": self.survivors,
            },
            "targets": {name: target.to_dict() for name, target in self.targets.items()},
        }

    def render(self, as_json: bool = False) -> str:
        if as_json:
            return json.dumps(self.to_dict(), sort_keys=True)
        cursor = (
            "never set: every event is owed to the windows tables"
            if self.cursor is None
            else (f"at _creationTime {self.cursor:.3f} ({_iso(self.cursor)})")
        )
        lines = [
            f"export {self.export}: {self.events:,} events in {EVENTS}; the daily cursor {cursor}",
            "the old system's survivor figures (as countSkillStatEventImportSurvivors counts them; compare):",
            f"  unprocessed      {self.unprocessed:>12,}  no processedAt",
            f"  processedRecent  {self.processed_recent:>12,}  processed, _creationTime above the daily cursor",
            f"  survivors        {self.survivors:>12,}",
        ]
        if self.cursor is None:
            lines.append("  (without a cursor the action counts no processedRecent, yet every event is owed below)")
        lines.append("what an import does:")
        lines.append(f"  {'target':<8} {'tables':<38} {'owed':>12} {'applied before':>15} {'to apply':>12}  of")
        for name, target in self.targets.items():
            lines.append(
                f"  {name:<8} {TABLES[name]:<38} {target.owed:>12,} {target.applied:>15,} {target.to_apply:>12,}  "
                f"{RULES[name]}"
            )
        if HISTORY not in self.targets:
            lines.append(f"  (history: the old {DAILY} rows are added only with --history)")
        lines.append("  hourly history is not in the export: skill_hourly_stats gets the owed events only")
        if self.older_unseen:
            lines.append(
                f"WARNING: {self.older_unseen:,} owed row(s) are not in the manifest yet were created before the "
                f"newest row of an earlier imported export (_creationTime {self.earlier_bound:.3f}): an export of "
                f"another deployment (the same events under other _ids, which the manifest cannot recognise: "
                f"they would count twice), or an import of an earlier export cut off and never run again. "
                f"`legacy import` refuses them unless --allow-older-rows"
            )
        return "\n".join(lines)


def _iso(ms: float) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class _Manifest:
    """Which of some owed documents an earlier import applied (one indexed read per target and chunk)."""

    def __init__(self, engine: Engine | None) -> None:
        self.engine = engine
        self.bounds: list[float] = []
        if engine is not None:
            with engine.connect() as connection:
                self.bounds = sorted(
                    b for (b,) in connection.execute(select(legacy_manifest.c.export_bound).distinct())
                )

    def count(self, target: Target, owed: Sequence[tuple[str, float]]) -> None:
        target.owed += len(owed)
        if not owed:
            return
        seen: set[str] = set()
        if self.engine is not None:
            seen = applied(self.engine, target.name, [doc_id for doc_id, _created in owed])
        target.applied += len(seen)
        for bound in self.bounds:
            older = sum(1 for doc_id, created in owed if created <= bound and doc_id not in seen)
            target._unseen_by_bound[bound] = target._unseen_by_bound.get(bound, 0) + older


def applied(engine: Engine, target: str, ids: Sequence[str]) -> set[str]:
    """The ids among `ids` the manifest holds for `target`."""
    found: set[str] = set()
    with engine.connect() as connection:
        for start in range(0, len(ids), LOOKUP_CHUNK):
            chunk = ids[start : start + LOOKUP_CHUNK]
            found.update(
                connection.execute(
                    select(legacy_manifest.c.legacy_id).where(
                        legacy_manifest.c.target == target, legacy_manifest.c.legacy_id.in_(chunk)
                    )
                ).scalars()
            )
    return found


def make_plan(
    export: Export,
    engine: Engine | None,
    *,
    history: bool,
    progress: Progress | None = None,
    on_event: Callable[[LegacyEvent], None] | None = None,
) -> Plan:
    """Read the whole export (validating every line: ExportError before anything is written) and count.

    With `engine`, also what the manifest says an earlier import applied; without, the plan
    says what a first import would do."""
    cursor = export.cursor()
    plan = Plan(export=export.name, cursor=cursor)
    manifest = _Manifest(engine)
    windows, skills = Target(WINDOWS), Target(SKILLS)
    plan.targets = {WINDOWS: windows, SKILLS: skills}
    bound = 0.0
    for chunk in chunked(export.events(progress), LOOKUP_CHUNK):
        to_windows: list[tuple[str, float]] = []
        to_skills: list[tuple[str, float]] = []
        for event in chunk:
            if on_event is not None:
                on_event(event)
            bound = max(bound, event.created)
            in_windows, in_skills = owed(event, cursor)
            if in_windows:
                to_windows.append((event.id, event.created))
            if in_skills:
                to_skills.append((event.id, event.created))
                plan.unprocessed += 1
            elif cursor is not None and event.created > cursor:
                plan.processed_recent += 1
        plan.events += len(chunk)
        manifest.count(windows, to_windows)
        manifest.count(skills, to_skills)
    if history:
        rows = Target(HISTORY)
        plan.targets[HISTORY] = rows
        for chunk in chunked(export.history(), LOOKUP_CHUNK):
            manifest.count(rows, [(row.id, row.created) for row in chunk])
    plan.bound = bound
    earlier = [b for b in manifest.bounds if b != bound]
    if earlier:
        plan.earlier_bound = max(earlier)
        for target in plan.targets.values():
            target.older_unseen = target._unseen_by_bound.get(plan.earlier_bound, 0)
    return plan
