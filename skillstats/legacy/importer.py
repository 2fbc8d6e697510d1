"""Applying a legacy export straight into SQL, exactly once (`skillstats legacy import`).

The events of an export are finite and known, so they go to SQL directly, not through Kafka: each to
exactly the tables its old cron had not reached (skillstats/legacy/plan.py, `owed`), with the
contract's kind table and the sinks' own code (the windows sink's fold and additive upserts for the
hourly and daily rows, docsync's per-skill and per-owner apply for `skills` and `user_skill_stats`,
unknown skills skipped for good as docsync skips them). No fence of either group is read or moved.

Exactly once: the manifest (`skillstats_legacy_manifest`, keyed by the legacy `_id` and the target)
is written in the same transaction as the counts. Each chunk's transaction first inserts its rows'
manifest entries with ON CONFLICT DO NOTHING and applies only the entries that insert returns, so
whatever ran before (a second run of the export, a later export holding the same rows, a run killed
mid-way, another import running at the same time, a retried commit whose answer was lost) nothing is
applied twice, and nothing half: a chunk is one transaction.

The whole export is read and validated first (the plan's pass): a bad line stops the import before
its first write. Documents outside the contract's ranges (plan.py, `OutOfContract`) stop it too,
unless --skip-out-of-contract: each is then claimed in the manifest under `skipped`, in its chunk's
transaction, and counted nowhere. What it costs: the export read twice; per chunk (`--chunk-size`,
2,000 events by default) one transaction holding its rows' locks for milliseconds, so the live
`windows` and `docsync` groups on the same database wait at most that long; one manifest row (about
100 bytes) per owed event and target, kept.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import date, timedelta
from typing import Any, Final

from sqlalchemy import Connection, Engine
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError

from skillstats.contract import MS_PER_DAY, StatEvent
from skillstats.legacy.export import Export, HistoryRow, LegacyEvent, Progress
from skillstats.legacy.plan import (
    HISTORY,
    RANGES,
    SKILLS,
    SKIPPED,
    WINDOWS,
    LegacyRefusal,
    Plan,
    chunked,
    make_plan,
    owed,
)
from skillstats.retry import Backoff
from skillstats.sinks.docstats import DocStatsSink, PartitionDeltas
from skillstats.sinks.rebuild import day_of, record_imported_days
from skillstats.sinks.recovery import describe, is_data_error
from skillstats.sinks.schema import legacy_exports, legacy_manifest, skill_daily_stats
from skillstats.sinks.upserts import now_utc_naive, upsert_adding
from skillstats.sinks.windows import WindowsSink

log = logging.getLogger(__name__)

CONFIRM_TOKEN: Final = "IMPORT_LEGACY"
DEFAULT_CHUNK: Final = 2000
ATTEMPTS: Final = 6  # per chunk, on a database error that is not about the data (connection lost, ...)
_EPOCH_DAY = date(1970, 1, 1)


__all__ = ["CONFIRM_TOKEN", "DatabaseAway", "Importer", "LegacyRefusal", "Outcome"]


class DatabaseAway(Exception):
    """The database failed a chunk ATTEMPTS times: the import stopped between chunks (exit 1)."""


@dataclass
class Outcome:
    """What one import run applied and skipped."""

    chunks: int = 0
    applied: dict[str, int] = field(default_factory=lambda: {WINDOWS: 0, SKILLS: 0, HISTORY: 0})
    skipped: dict[str, int] = field(default_factory=lambda: {WINDOWS: 0, SKILLS: 0, HISTORY: 0})  # manifest had them
    unknown_skill_events: int = 0
    out_of_contract: int = 0  # outside the contract's ranges: recorded as skipped by this run, counted nowhere
    out_of_contract_before: int = 0  # ... recorded by an earlier run
    retries: int = 0
    stopped: bool = False  # stopped at a chunk boundary (SIGTERM, SIGINT) before the end

    def to_dict(self) -> dict[str, Any]:
        return {
            "chunks": self.chunks,
            "applied": self.applied,
            "already_applied": self.skipped,
            "unknown_skill_events": self.unknown_skill_events,
            "out_of_contract": {"skipped": self.out_of_contract, "skipped_before": self.out_of_contract_before},
            "retries": self.retries,
            "stopped": self.stopped,
        }

    def render(self) -> str:
        lines = [f"{'stopped after' if self.stopped else 'done:'} {self.chunks:,} chunk(s)"]
        for name, tables in ((WINDOWS, "hourly and daily rows"), (SKILLS, "skills and owners"), (HISTORY, "history")):
            lines.append(
                f"  {name:<8} {self.applied[name]:>12,} applied ({tables}), {self.skipped[name]:,} applied before"
            )
        lines.append(
            f"  events for skills with no row in `skills` (skipped for good, as docsync does): "
            f"{self.unknown_skill_events:,}"
        )
        if self.out_of_contract or self.out_of_contract_before:
            lines.append(
                f"  outside the contract's ranges (counted nowhere, recorded as skipped): {self.out_of_contract:,} "
                f"skipped, {self.out_of_contract_before:,} skipped before"
            )
        return "\n".join(lines)


class Importer:
    """Applies an export's owed events and rows chunk by chunk, each chunk one transaction with its manifest rows."""

    def __init__(
        self,
        engine: Engine,
        *,
        chunk_size: int = DEFAULT_CHUNK,
        stop: threading.Event | None = None,
        backoff: Backoff | None = None,
        on_chunk: Callable[[Outcome], None] | None = None,
    ) -> None:
        self.engine = engine
        self.chunk_size = chunk_size
        self.stop = stop or threading.Event()
        self.backoff = backoff or Backoff(base=0.5, cap=10.0)
        self.on_chunk = on_chunk
        self.windows = WindowsSink(engine, "skillstats-legacy-import", "")
        self.totals = DocStatsSink(engine, "skillstats-legacy-import", "")

    def plan(self, export: Export, *, history: bool, progress: Progress | None = None) -> Plan:
        return make_plan(export, self.engine, history=history, progress=progress)

    def check(
        self,
        plan: Plan,
        *,
        allow_older_rows: bool,
        allow_empty_registry: bool,
        allow_unknown_skills: bool = False,
        skip_out_of_contract: bool = False,
    ) -> None:
        """Refuse (LegacyRefusal) what needs an operator's decision, before any write."""
        _refuse_out_of_contract(plan, skip_out_of_contract)
        if plan.older_unseen and not allow_older_rows:
            raise LegacyRefusal(
                f"{plan.older_unseen:,} owed row(s) of {plan.export} are not in the manifest yet were created before "
                f"the newest row of an earlier imported export: the same events from another deployment (the "
                f"manifest knows rows by _id only; they would count twice), or an earlier import cut off: run that "
                f"export's import again first. See `skillstats legacy plan`; --allow-older-rows imports them "
                f"anyway. Nothing was written"
            )
        if plan.targets[SKILLS].to_apply and not allow_empty_registry and self.totals.registry_is_empty():
            raise LegacyRefusal(
                f"the `skills` table has no rows: the {plan.targets[SKILLS].to_apply:,} event(s) owed to the skill "
                f"totals would all be skipped for good (the rule for deleted skills). Create the registry's rows "
                f"first (with the old totals), or pass --allow-empty-registry. Nothing was written"
            )
        if plan.unknown_skills and not allow_unknown_skills and not allow_empty_registry:
            raise LegacyRefusal(
                f"{plan.unknown_skills:,} event(s) owed to the skill totals are for skills with no row in `skills`: "
                f"they would be skipped for good (the rule for deleted skills). Create the missing rows first, or "
                f"pass --allow-unknown-skills (a deleted skill's events). Nothing was written"
            )

    def run(
        self,
        export: Export,
        plan: Plan,
        *,
        history: bool,
        progress: Progress | None = None,
        skip_out_of_contract: bool = False,
    ) -> Outcome:
        """Apply what `plan` (made from this export) owes; stops at a chunk boundary when `stop` is set. Documents
        outside the contract's ranges are recorded as skipped only with `skip_out_of_contract` (LegacyRefusal
        before any write otherwise, as `check` refuses them)."""
        _refuse_out_of_contract(plan, skip_out_of_contract)
        outcome = Outcome()
        for chunk in chunked(export.events(progress), self.chunk_size):
            if self.stop.is_set():
                outcome.stopped = True
                return outcome
            self._with_retries(outcome, lambda c, chunk=chunk: self._apply_events(c, chunk, plan))
        if history:
            for rows in chunked(export.history(), self.chunk_size):
                if self.stop.is_set():
                    outcome.stopped = True
                    return outcome
                self._with_retries(outcome, lambda c, rows=rows: self._apply_history(c, rows, plan))
        return outcome

    # ------------------------------------------------------------------ one chunk, one transaction

    def _with_retries(self, outcome: Outcome, apply: Callable[[Connection], Outcome]) -> None:
        for attempt in range(ATTEMPTS):
            try:
                with self.engine.begin() as connection:
                    step = apply(connection)
            except DBAPIError as exc:
                if is_data_error(exc) or attempt == ATTEMPTS - 1:
                    raise DatabaseAway(
                        f"the database failed chunk {outcome.chunks + 1} ({describe(exc)}) "
                        f"{'on the data' if is_data_error(exc) else f'{ATTEMPTS} times'}: stopped there. "
                        f"{outcome.chunks:,} chunk(s) were applied, each whole with its manifest rows, nothing "
                        f"half; run the same command again to go on"
                    ) from exc
                outcome.retries += 1
                log.warning(
                    "chunk %d: %s; trying again (attempt %d of %d)",
                    outcome.chunks + 1,
                    describe(exc),
                    attempt + 2,
                    ATTEMPTS,
                )
                if self.backoff.sleep(attempt, self.stop):
                    outcome.stopped = True
                    raise DatabaseAway(
                        f"stopped while the database was away, at chunk {outcome.chunks + 1}: {outcome.chunks:,} "
                        f"chunk(s) were applied, nothing half; run the same command again to go on"
                    ) from exc
                continue
            outcome.chunks += 1
            for name in (WINDOWS, SKILLS, HISTORY):
                outcome.applied[name] += step.applied[name]
                outcome.skipped[name] += step.skipped[name]
            outcome.unknown_skill_events += step.unknown_skill_events
            outcome.out_of_contract += step.out_of_contract
            outcome.out_of_contract_before += step.out_of_contract_before
            if self.on_chunk is not None:
                self.on_chunk(outcome)
            return

    def _claim(self, connection: Connection, target: str, rows: Sequence[tuple[str, float]], bound: float) -> set[str]:
        """Insert the manifest rows of `rows` for `target`; the ids this transaction inserted (the others were
        applied before, or by an import committing meanwhile: ON CONFLICT waits for it, then skips)."""
        if not rows:
            return set()
        now = now_utc_naive()
        values = [
            {"legacy_id": doc_id, "target": target, "created_ms": created, "export_bound": bound, "imported_at": now}
            for doc_id, created in sorted(dict(rows).items())  # one row per id, in key order (no deadlocks)
        ]
        insert = (postgresql if connection.dialect.name == "postgresql" else sqlite).insert(legacy_manifest)
        statement = insert.on_conflict_do_nothing(index_elements=["legacy_id", "target"]).returning(
            legacy_manifest.c.legacy_id
        )
        return set(connection.execute(statement, values).scalars())

    def _record(self, connection: Connection, plan: Plan, *, history: bool) -> None:
        """The export's marks (skillstats_legacy_exports), in the chunk's transaction: recorded once any of its
        counts are, so a later export whose marks moved is refused (plan.py, `_Marks`). `history`: its
        history rows are being imported; their bound is recorded with them."""
        insert = (postgresql if connection.dialect.name == "postgresql" else sqlite).insert(legacy_exports)
        statement = insert.values(
            export_bound=plan.bound,
            cursor_creation_time=plan.cursor,
            history_bound=plan.history_bound if history else None,
            recorded_at=now_utc_naive(),
        )
        if history:
            connection.execute(
                statement.on_conflict_do_update(
                    index_elements=["export_bound"],
                    set_={"history_bound": statement.excluded.history_bound},
                    where=legacy_exports.c.history_bound.is_(None),
                )
            )
        else:
            connection.execute(statement.on_conflict_do_nothing(index_elements=["export_bound"]))

    def _apply_events(self, connection: Connection, chunk: Sequence[LegacyEvent], plan: Plan) -> Outcome:
        step = Outcome()
        self._record(connection, plan, history=False)
        windows_rows: list[tuple[str, float]] = []
        skills_rows: list[tuple[str, float]] = []
        outside_rows: list[tuple[str, float]] = []
        for event in chunk:
            in_windows, in_skills = owed(event, plan.cursor)
            if event.event is None:  # outside the contract's ranges: recorded, counted nowhere
                if in_windows or in_skills:
                    outside_rows.append((event.id, event.created))
                continue
            if in_windows:
                windows_rows.append((event.id, event.created))
            if in_skills:
                skills_rows.append((event.id, event.created))
        new_windows = self._claim(connection, WINDOWS, windows_rows, plan.bound)
        new_skills = self._claim(connection, SKILLS, skills_rows, plan.bound)
        step.out_of_contract = len(self._claim(connection, SKIPPED, outside_rows, plan.bound))
        step.out_of_contract_before = len(outside_rows) - step.out_of_contract
        for_windows: list[StatEvent] = []
        for_skills: list[StatEvent] = []
        for event in chunk:  # the first of an id repeated in the export counts, the others are skipped
            if event.event is None:
                continue
            if event.id in new_windows:
                new_windows.discard(event.id)
                for_windows.append(event.event)
            if event.id in new_skills:
                new_skills.discard(event.id)
                for_skills.append(event.event)
        now = now_utc_naive()
        # The days these events count in, and those of the events an earlier run applied (a run from before the
        # days were recorded): counts not in the log, which a rebuild must carry over (sinks/rebuild.py).
        owed_days = {
            e.event.occurred_at // MS_PER_DAY for e in chunk if e.event is not None and owed(e, plan.cursor)[0]
        }
        record_imported_days(connection, (day_of(d) for d in owed_days), now)
        if for_windows:
            self.windows.write(connection, self.windows.fold(for_windows), now)
        if for_skills:
            deltas = PartitionDeltas(partition=0, start=0, next_offset=0)
            deltas.add_decoded(for_skills, [])
            _skills, _owners, step.unknown_skill_events = self.totals.add_deltas(connection, [deltas], now)
        step.applied[WINDOWS], step.skipped[WINDOWS] = len(for_windows), len(windows_rows) - len(for_windows)
        step.applied[SKILLS], step.skipped[SKILLS] = len(for_skills), len(skills_rows) - len(for_skills)
        return step

    def _apply_history(self, connection: Connection, rows: Sequence[HistoryRow], plan: Plan) -> Outcome:
        step = Outcome()
        self._record(connection, plan, history=True)
        outside = [(row.id, row.created) for row in rows if row.outside is not None]
        rows = [row for row in rows if row.outside is None]
        step.out_of_contract = len(self._claim(connection, SKIPPED, outside, plan.bound))
        step.out_of_contract_before = len(outside) - step.out_of_contract
        new = self._claim(connection, HISTORY, [(row.id, row.created) for row in rows], plan.bound)
        per_day: dict[tuple[str, date], list[int]] = {}
        record_imported_days(connection, {_EPOCH_DAY + timedelta(days=row.day) for row in rows}, now_utc_naive())
        taken = 0
        for row in rows:
            if row.id not in new:
                continue
            new.discard(row.id)
            taken += 1
            counts = per_day.setdefault((row.skill_id, _EPOCH_DAY + timedelta(days=row.day)), [0, 0])
            counts[0] += row.downloads
            counts[1] += row.installs
        upsert_adding(
            connection,
            skill_daily_stats,
            ("skill_id", "day"),
            ("downloads", "installs"),
            [(skill, day, d, i) for (skill, day), (d, i) in per_day.items()],
            "updated_at",
            now_utc_naive(),
        )
        step.applied[HISTORY], step.skipped[HISTORY] = taken, len(rows) - taken
        return step


def _refuse_out_of_contract(plan: Plan, skip: bool) -> None:
    outside = plan.outside
    if outside.to_skip and not skip:
        first = outside.first[0]
        where = f"{first['table']}/documents.jsonl:{first['line']}"
        raise LegacyRefusal(
            f"{plan.export}: {outside.to_skip:,} document(s) owed to a target are outside the contract's ranges "
            f"(the first in the export: {where}: _id {first['id']!r}: {first['why']}): "
            f"{RANGES}. The old system counted such events; the live consumers would not. See `skillstats legacy "
            f"plan`; --skip-out-of-contract leaves them uncounted (recorded in the manifest as skipped). Nothing was "
            f"written"
        )
