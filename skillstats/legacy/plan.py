"""What importing a legacy export would do, with no writes (`skillstats legacy plan`), and what each event is owed.

An event of the old table is owed to exactly the tables whose cron had not reached it (`owed`):

- `windows` (skill_hourly_stats, skill_daily_stats): `_creationTime` above the daily processor's
  cursor, or every event when that cursor was never set;
- `skills` (skills, user_skill_stats): no `processedAt`, the doc sync never applied it;
- `history` (skill_daily_stats, with --history): every `skillDailyStats` row, the daily counts of
  the events at or below the cursor (hourly history is not in the export: it is not imported).

A document outside the contract's ranges (export.py: an `occurredAt` before 2000 or after 9999, a
delta over 1e9 in size, a daily row of a day outside those years) is owed to none of them: the live
consumers would not count it. The plan counts those an import would otherwise apply
(`OutOfContract`: events above the cursor or without `processedAt`, daily rows), with the first few;
`import` refuses while any is not yet recorded, or with --skip-out-of-contract records each in the
manifest under a target of its own, `skipped`, counting it nowhere, so that a rerun knows them
(`skipped before`). Such an event the old crons had both reached is owed nothing and not counted.

The plan also prints the old system's own figures, computed as its
`countSkillStatEventImportSurvivors` action computes them (`unprocessed`, `processedRecent`,
`survivors`), for an operator to compare with that action's answer before importing.

What the manifest cannot know: it knows documents by their `_id`, so the same events exported from
another deployment (a copy, a restore under new ids) look new. A later export of the same deployment
only adds rows created after the earlier export was taken, so a row not yet applied but created at or
before the newest `_creationTime` of an earlier imported export (`older_unseen`) is the sign of that
(or of an earlier import cut off and never rerun): the plan shows it and `import` refuses it unless
told (history rows are judged against the history bound of an earlier import with --history).

The old crons must not run between two imported exports: each import records its export's cursor
and bound (`skillstats_legacy_exports`), and a later export whose cursor differs, or with a row
created after the first imported export that is processed or at or below the cursor, is refused
(`_Marks`, LegacyRefusal). A duplicate `_id` in a table is refused (export.Duplicates); plan counts
events still owed to `skills` whose skill has no row (`unknown_skills`). What it costs: one pass over
the export (validating every line), and per 5,000 owed events one indexed manifest read per target
and one `skills` read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, TypeVar

from sqlalchemy import Engine, select

from skillstats.legacy.export import DAILY, EVENTS, Duplicates, Export, LegacyEvent, Progress
from skillstats.sinks.schema import legacy_exports, legacy_manifest, skills

WINDOWS: Final = "windows"
SKILLS: Final = "skills"
HISTORY: Final = "history"
SKIPPED: Final = "skipped"  # the manifest's target for documents outside the contract's ranges, counted nowhere
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
SHOWN: Final = 5  # documents outside the contract's ranges the plan names
RANGES: Final = (
    "an occurredAt before 2000-01-01 or after 9999-12-31, an install_clear delta over 1,000,000,000 in size, or a "
    "skillDailyStats day outside those years (the contract's bad_timestamp and bad_delta bounds)"
)

T = TypeVar("T")


class LegacyRefusal(Exception):
    """An operator's decision is needed before this import may write (exit 2); nothing was written."""


@dataclass(frozen=True, slots=True)
class Recorded:
    """An export an earlier import applied (skillstats_legacy_exports): the marks it carried."""

    bound: float
    cursor: float | None
    history_bound: float | None


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
    earlier_bound: float | None = None  # that bound (history rows: the newest history row imported before)
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
class OutOfContract:
    """Documents outside the contract's ranges an import would otherwise apply: counted nowhere by skillstats."""

    events: int = 0  # above the daily cursor or without processedAt
    history: int = 0  # skillDailyStats rows (--history)
    skipped_before: int = 0  # of those, recorded by an earlier import (the manifest's `skipped` target)
    first: list[dict[str, Any]] = field(default_factory=list)  # the first few: table, line, id, why

    @property
    def total(self) -> int:
        return self.events + self.history

    @property
    def to_skip(self) -> int:
        return self.total - self.skipped_before

    def note(self, table: str, doc_id: str, line: int, why: str) -> None:
        if len(self.first) < SHOWN:
            self.first.append({"table": table, "line": line, "id": doc_id, "why": why})

    def to_dict(self) -> dict[str, Any]:
        return {
            "events": self.events,
            "history_rows": self.history,
            "skipped_before": self.skipped_before,
            "to_skip": self.to_skip,
            "first": self.first,
        }

    def render(self) -> list[str]:
        if not self.total:
            return []
        rows = f" and {self.history:,} skillDailyStats row{'s' * (self.history != 1)}" if self.history else ""
        lines = [
            f"outside the contract's ranges: {self.events:,} event{'s' * (self.events != 1)}{rows} "
            f"({self.skipped_before:,} skipped before, "
            f"{self.to_skip:,} to skip): {RANGES}. The old system counted them; the live consumers would not "
            f"(invalid there, sent to the DLQ)",
            *(f"  {f['table']}/documents.jsonl:{f['line']}: _id {f['id']!r}: {f['why']}" for f in self.first),
        ]
        if self.total > len(self.first):
            lines.append(f"  ... and {self.total - len(self.first):,} more")
        if self.to_skip:
            lines.append(
                "WARNING: `legacy import` refuses them unless --skip-out-of-contract (then they are counted nowhere "
                "and recorded in the manifest as skipped)"
            )
        return lines


@dataclass
class Plan:
    export: str
    events: int = 0
    cursor: float | None = None
    bound: float = 0.0  # the newest `_creationTime` among the export's events
    history_bound: float | None = None  # the newest among its skillDailyStats rows (read with --history)
    earlier_bound: float | None = None  # the newest of an earlier imported export (another one than this)
    unknown_skills: int | None = None  # events still to apply to `skills` whose skill has no row (None: no database)
    unprocessed: int = 0
    processed_recent: int = 0
    targets: dict[str, Target] = field(default_factory=dict)
    outside: OutOfContract = field(default_factory=OutOfContract)  # outside the contract's ranges

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
            "history_bound": self.history_bound,
            "earlier_export_bound": self.earlier_bound,
            "unknown_skill_events": self.unknown_skills,
            "survivors": {
                "unprocessed": self.unprocessed,
                "processedRecent": self.processed_recent,
                "survivors": self.survivors,
            },
            "targets": {name: target.to_dict() for name, target in self.targets.items()},
            "out_of_contract": self.outside.to_dict(),
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
        lines += self.outside.render()
        if self.unknown_skills:
            lines.append(
                f"WARNING: {self.unknown_skills:,} event(s) to apply to the skill totals are for skills with no row "
                f"in `skills`: they would be skipped for good (the rule for deleted skills). Create the missing rows "
                f"first; `legacy import` refuses them unless --allow-unknown-skills"
            )
        for name, target in self.targets.items():
            if target.older_unseen:
                lines.append(
                    f"WARNING: {target.older_unseen:,} {name} row(s) are not in the manifest yet were created before "
                    f"the newest such row of an earlier imported export (_creationTime {target.earlier_bound:.3f}): "
                    f"an export of another deployment (the same rows under other _ids, which the manifest cannot "
                    f"recognise: they would count twice), or an import of an earlier export cut off and never run "
                    f"again. `legacy import` refuses them unless --allow-older-rows"
                )
        return "\n".join(lines)


def _iso(ms: float) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class _Manifest:
    """What earlier imports applied: which of some owed documents (one indexed read per target and chunk), and
    the marks of the exports they came from."""

    def __init__(self, engine: Engine | None) -> None:
        self.engine = engine
        self.recorded: list[Recorded] = []
        if engine is not None:
            with engine.connect() as connection:
                self.recorded = [
                    Recorded(*row)
                    for row in connection.execute(
                        select(
                            legacy_exports.c.export_bound,
                            legacy_exports.c.cursor_creation_time,
                            legacy_exports.c.history_bound,
                        ).order_by(legacy_exports.c.export_bound)
                    )
                ]

    def count(self, target: Target, owed: Sequence[tuple[str, float]], bounds: Sequence[float]) -> set[str]:
        """Count `owed` (id, _creationTime) into `target`; the ids an earlier import applied. Per earlier
        export bound in `bounds`, the rows not applied yet created at or before it (see `_settle`)."""
        target.owed += len(owed)
        if not owed:
            return set()
        seen: set[str] = set()
        if self.engine is not None:
            seen = applied(self.engine, target.name, [doc_id for doc_id, _created in owed])
        target.applied += sum(1 for doc_id, _created in owed if doc_id in seen)
        for earlier in bounds:
            older = sum(1 for doc_id, created in owed if created <= earlier and doc_id not in seen)
            target._unseen_by_bound[earlier] = target._unseen_by_bound.get(earlier, 0) + older
        return seen

    def skipped(self, ids: Sequence[str]) -> int:
        """How many of `ids` (outside the contract's ranges) an earlier import recorded as skipped."""
        if self.engine is None or not ids:
            return 0
        return len(applied(self.engine, SKIPPED, ids))

    def unknown_skills(self, skill_ids: Sequence[str]) -> int:
        """How many of `skill_ids` (one per event, repeats counted) have no row in `skills`: one IN read."""
        if self.engine is None or not skill_ids:
            return 0
        with self.engine.connect() as connection:
            known = set(
                connection.execute(select(skills.c.id).where(skills.c.id.in_(sorted(set(skill_ids))))).scalars()
            )
        return sum(1 for skill in skill_ids if skill not in known)


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

    With `engine`, also what the manifest says an earlier import applied, and LegacyRefusal when the old
    system's marks moved since an earlier imported export (`check_marks`); without, the plan says what
    a first import would do."""
    cursor = export.cursor()
    plan = Plan(export=export.name, cursor=cursor)
    manifest = _Manifest(engine)
    if engine is not None:
        plan.unknown_skills = 0
    marks = _Marks(export, cursor, manifest.recorded)
    windows, skills_target = Target(WINDOWS), Target(SKILLS)
    plan.targets = {WINDOWS: windows, SKILLS: skills_target}
    # Which earlier export a row is judged against (older_unseen): the newest recorded one older than this
    # export; this export's own bound is only known at the end, so the newest one below each row is kept.
    bounds = [r.bound for r in manifest.recorded]
    bound = 0.0
    duplicates = Duplicates(export.where(EVENTS))
    try:
        for chunk in chunked(export.events(progress), LOOKUP_CHUNK):
            duplicates.check([(event.id, event.line) for event in chunk])
            to_windows: list[tuple[str, float]] = []
            to_skills: list[tuple[str, float, str]] = []
            outside: list[str] = []
            for event in chunk:
                if on_event is not None:
                    on_event(event)
                marks.check(event)
                bound = max(bound, event.created)
                in_windows, in_skills = owed(event, cursor)
                if in_skills:
                    plan.unprocessed += 1
                elif cursor is not None and event.created > cursor:
                    plan.processed_recent += 1
                if event.event is None:  # outside the contract's ranges: owed to no target
                    if in_windows or in_skills:  # else the old crons counted it everywhere: nothing to skip
                        outside.append(event.id)
                        plan.outside.note(EVENTS, event.id, event.line, event.outside or "")
                    continue
                if in_windows:
                    to_windows.append((event.id, event.created))
                if in_skills:
                    to_skills.append((event.id, event.created, event.event.skill_id))
            plan.events += len(chunk)
            manifest.count(windows, to_windows, bounds)
            seen = manifest.count(skills_target, [(doc_id, created) for doc_id, created, _ in to_skills], bounds)
            if plan.unknown_skills is not None:
                plan.unknown_skills += manifest.unknown_skills(
                    [skill for doc_id, _created, skill in to_skills if doc_id not in seen]
                )
            plan.outside.events += len(outside)
            plan.outside.skipped_before += manifest.skipped(outside)
    finally:
        duplicates.close()
    plan.bound = bound
    if history:
        rows = Target(HISTORY)
        plan.targets[HISTORY] = rows
        history_bounds = [r.history_bound for r in manifest.recorded if r.history_bound is not None]
        newest: float | None = None
        duplicates = Duplicates(export.where(DAILY))
        try:
            for chunk in chunked(export.history(), LOOKUP_CHUNK):
                duplicates.check([(row.id, row.line) for row in chunk])
                outside = []
                for row in chunk:
                    newest = row.created if newest is None else max(newest, row.created)
                    if row.outside is not None:
                        outside.append(row.id)
                        plan.outside.note(DAILY, row.id, row.line, row.outside)
                counted = [(row.id, row.created) for row in chunk if row.outside is None]
                manifest.count(rows, counted, history_bounds)
                plan.outside.history += len(outside)
                plan.outside.skipped_before += manifest.skipped(outside)
        finally:
            duplicates.close()
        plan.history_bound = newest
    _settle(plan, bounds)
    return plan


# The older_unseen figures, per target: owed rows not applied are counted against each recorded bound
# during the pass (a handful of recorded exports); the one kept is the newest bound that is not this
# export's own (a rerun of the same export is no "earlier" one). History rows are judged against the
# history bounds of the exports imported with --history, not the events' bounds: their `_creationTime`
# says when the daily row was created, and an export first imported without --history holds no
# history rows in the manifest.


def _settle(plan: Plan, bounds: list[float]) -> None:
    for name, target in plan.targets.items():
        own = plan.history_bound if name == HISTORY else plan.bound
        per_bound = target._unseen_by_bound
        earlier = [b for b in per_bound if b != own]
        if earlier:
            target.earlier_bound = max(earlier)
            target.older_unseen = per_bound[target.earlier_bound]
    event_bounds = [b for b in bounds if b != plan.bound]
    plan.earlier_bound = max(event_bounds) if event_bounds else None


class _Marks:
    """Refuses (LegacyRefusal) an export whose old-system marks moved since an earlier imported one.

    With the crons stopped, a later export of the same deployment carries the same daily cursor, and
    every row created after an earlier export was taken (after its newest event, `bound`) is
    unprocessed and above that cursor. A cursor that differs, or a new row processed or at or below
    it, means the old crons ran in between (a stopped cron's already scheduled continuation, or crons
    never stopped): the old daily rows then hold events imported already (counted twice with
    --history) and the new rows they processed are owed to no target (lost). Nothing is kept per row:
    one comparison each."""

    def __init__(self, export: Export, cursor: float | None, recorded: list[Recorded]) -> None:
        self.where = export.where(EVENTS)
        self.cursor = cursor
        self.first = min((r.bound for r in recorded), default=None)
        moved = [r for r in recorded if r.cursor != cursor]
        if moved:
            raise LegacyRefusal(
                f"{export.name}: the daily cursor is {_show_ms(cursor)}, but an earlier imported export (newest "
                f"event {moved[0].bound:.3f}) had {_show_ms(moved[0].cursor)}: the old crons ran in between, and "
                f"this export would count daily history twice and miss the rows they processed. Stop the crons "
                f"(no scheduled processSkillStatEvents* runs pending) and see docs/operations.md, 'Cut-over from "
                f"the legacy system'. Nothing was written"
            )

    def check(self, event: LegacyEvent) -> None:
        if self.first is None or event.created <= self.first:
            return
        if event.processed or (self.cursor is not None and event.created <= self.cursor):
            why = "has processedAt" if event.processed else "is at or below the daily cursor"
            raise LegacyRefusal(
                f"{self.where}:{event.line}: _id {event.id!r} was created after the first imported export was "
                f"taken (its newest event: {self.first:.3f}) yet {why}: the old crons ran since, and the rows they "
                f"processed would be owed to no target. Stop the crons (no scheduled processSkillStatEvents* runs "
                f"pending) and see docs/operations.md, 'Cut-over from the legacy system'. Nothing was written"
            )


def _show_ms(value: float | None) -> str:
    return "never set" if value is None else f"{value:.3f}"
