"""`skillstats legacy`: a Convex export of the old system, counted once (skillstats/legacy/).

The old system is modelled here in its own terms (../shared/seeds/000_*.txt): events inserted over
time into one table, the daily processor moving its cursor over `_creationTime` and bumping
`skillDailyStats`, the doc sync marking events processed and adding to the skills' totals (a deleted
skill's events only marked), the pruning of processed events below the cursor, and the export. The
registry moves its `skills` rows (with the old totals) and owners' totals over before importing. The
expectation is then what one system counting every event ever created once would hold, computed by
tests/helpers.py's independent restatement of the kind table, from the model's full event list.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from skillstats_bench.legacy_export import (
    KINDS,
    START,
    cursor_documents,
    listed_tables,
    load_registry,
    skill_deltas,
    write_export,
)
from sqlalchemy import func, select

from skillstats.cli import main
from skillstats.legacy.export import Export
from skillstats.legacy.importer import Importer
from skillstats.legacy.plan import make_plan
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.schema import legacy_manifest
from skillstats.workload import Record
from tests.helpers import assert_four_tables, expected_docstats, expected_windows, registry

MS_HOUR = 3_600_000


@dataclass
class OldSystem:
    """The Convex deployment the registry moves away from: its three tables and its two crons."""

    seed: int
    skills: int = 30
    rng: random.Random = field(init=False)
    clock: float = START
    events: list[dict[str, Any]] = field(default_factory=list)  # the table now (pruning removes rows)
    ever: list[dict[str, Any]] = field(default_factory=list)  # every event ever inserted
    cursor: float | None = None
    daily: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    totals: dict[str, list[int]] = field(default_factory=dict)  # what the doc sync added, per skill
    deployment: str = "a"

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.registry = registry(self.seed, skills=self.skills)  # the skills that exist (2 in 3)

    def _id(self) -> str:
        return f"{self.deployment}{self.rng.getrandbits(96):024x}"

    def write(self, count: int) -> None:
        """`insertStatEvent`, `count` times: occurredAt defaults to now, some are given an earlier time."""
        for _ in range(count):
            self.clock += self.rng.uniform(1, 30 * 60_000)
            kind = self.rng.choice(KINDS)
            occurred = int(self.clock) - (self.rng.randrange(3 * 86_400_000) if self.rng.random() < 0.2 else 0)
            event: dict[str, Any] = {
                "_id": self._id(),
                "_creationTime": self.clock,
                "skillId": f"sk_{self.rng.randrange(self.skills):06d}",
                "kind": kind,
                "occurredAt": float(occurred) if self.rng.random() < 0.3 else occurred,
            }
            if kind == "install_clear" and self.rng.random() < 0.9:
                event["delta"] = {"allTime": -self.rng.randrange(3), "current": float(-self.rng.randrange(3))}
            self.events.append(event)
            self.ever.append(event)

    def daily_run(self, share: float = 1.0) -> None:
        """`processSkillStatEventsAction`: the events above the cursor, oldest first, into the daily rows."""
        above = sorted(
            (e for e in self.events if self.cursor is None or e["_creationTime"] > self.cursor),
            key=lambda e: e["_creationTime"],
        )
        taken = above[: int(len(above) * share)]
        for event in taken:
            column = {"download": "downloads", "install_new": "installs"}.get(event["kind"])
            if column is not None:
                key = (event["skillId"], int(event["occurredAt"]) // 86_400_000)
                row = self.daily.setdefault(
                    key,
                    {
                        "_id": self._id(),
                        "_creationTime": self.clock,
                        "skillId": key[0],
                        "day": key[1],
                        "downloads": 0,
                        "installs": 0,
                    },
                )
                row[column] += 1
        if taken:
            self.cursor = taken[-1]["_creationTime"]

    def doc_sync(self, share: float = 1.0) -> None:
        """`processSkillStatEventBatchInternal`: some unprocessed events applied to their skills and marked."""
        for event in self.events:
            if "processedAt" in event or self.rng.random() >= share:
                continue
            event["processedAt"] = self.clock
            if event["skillId"] in self.registry:  # a deleted skill's events are only marked
                totals = self.totals.setdefault(event["skillId"], [0, 0, 0])
                for column, amount in enumerate(skill_deltas(event)):
                    totals[column] += amount

    def prune(self) -> None:
        """`pruneProcessedSkillStatEvents`: processed events at or below the cursor go."""
        self.events = [
            e for e in self.events if "processedAt" not in e or self.cursor is None or e["_creationTime"] > self.cursor
        ]

    def export(self, where: Path, as_zip: bool) -> Path:
        """What `npx convex export` writes: a folder per table, documents.jsonl in each (the shared writer)."""
        ids = iter(self._id, None)
        return write_export(
            where,
            [
                ("_tables", listed_tables()),
                ("skillStatEvents", self.events),
                ("skillStatUpdateCursors", cursor_documents(self.cursor, ids, self.clock)),
                ("skillDailyStats", [{**r, "downloads": float(r["downloads"])} for r in self.daily.values()]),
            ],
            as_zip=as_zip,
        )

    # ------------------------------------------------------------------ the move and what it must give

    def move_registry(self, url: str) -> None:
        """The registry's rows, with the old totals, and its owners' totals: what the old system had counted."""
        engine = open_engine(url)
        try:
            load_registry(engine, self.registry, self.totals)
        finally:
            engine.dispose()

    def records(self) -> list[Record]:
        return [as_record(e) for e in self.ever]

    def above_cursor(self, cursor: float | None) -> list[Record]:
        return [as_record(e) for e in self.ever if cursor is None or e["_creationTime"] > cursor]


def as_record(event: dict[str, Any]) -> Record:
    """The event as the Kafka record a skillstats publisher would have sent (tests/helpers.py reads those)."""
    body: dict[str, Any] = {
        "v": 1,
        "event_id": event["_id"],
        "skill_id": event["skillId"],
        "kind": event["kind"],
        "occurred_at": int(event["occurredAt"]),
    }
    if event["kind"] == "install_clear":
        _d, all_time, current = skill_deltas(event)
        body["delta"] = {"all_time": all_time, "current": current}
    return Record(event["skillId"].encode(), orjson.dumps(body), True)


def check_moved(old: OldSystem, url: str, hourly_from: float | None, live: Sequence[Record] = ()) -> None:
    """The tables hold every event ever created once (hourly: those above `hourly_from`, the first import's
    cursor: the old hourly stats are not in the export), plus the `live` records."""
    daily, _ = expected_windows([*old.records(), *live])
    _, hourly = expected_windows([*old.above_cursor(hourly_from), *live])
    want_skills, want_owners, _unknown = expected_docstats([*old.records(), *live], old.registry)
    assert_four_tables(url, daily, hourly, want_skills, want_owners)


def legacy(*args: str, url: str) -> tuple[int, str, str]:
    """`skillstats legacy ...` in this process: (exit status, stdout, stderr)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(["legacy", *args, "--database-url", url])
        except SystemExit as exc:
            status = int(exc.code or 0)
    return status, out.getvalue(), err.getvalue()


def imported(export: Path, url: str, *extra: str) -> dict[str, Any]:
    """An import that must succeed; the model's deleted skills' events are skipped, as docsync skips them."""
    status, out, err = legacy(
        "import", str(export), "--confirm", "IMPORT_LEGACY", "--json", "--allow-unknown-skills", *extra, url=url
    )
    assert status == 0, err
    return json.loads(out.strip().splitlines()[-1])


def manifest_rows(url: str) -> int:
    engine = open_engine(url)
    try:
        with engine.connect() as connection:
            return int(connection.execute(select(func.count()).select_from(legacy_manifest)).scalar_one())
    finally:
        engine.dispose()


def history_of_a_registry(seed: int) -> OldSystem:
    """Events over some days: the daily processor every few batches, the doc sync less often, a prune."""
    old = OldSystem(seed)
    for step in range(8):
        old.write(60)
        if step % 2 == 1:
            old.daily_run(share=0.8)
        if step in (2, 5, 7):
            old.doc_sync(share=0.7)
        if step == 5:
            old.prune()
    old.write(40)  # the last events, neither cron reached
    return old


@pytest.fixture
def migrated(database_url: str) -> Iterator[str]:
    engine = open_engine(database_url)
    upgrade(engine)
    engine.dispose()
    yield database_url


# ---------------------------------------------------------------------- the tests


def test_the_plan_gives_the_old_systems_own_survivor_figures(tmp_path: Path) -> None:
    old = history_of_a_registry(1)
    assert old.cursor is not None and any("processedAt" in e for e in old.events)
    # countSkillStatEventImportSurvivorsInternal, restated: no processedAt; processed and above the cursor.
    unprocessed = sum(1 for e in old.events if "processedAt" not in e)
    recent = sum(1 for e in old.events if "processedAt" in e and e["_creationTime"] > old.cursor)
    with Export(old.export(tmp_path / "x", as_zip=True)) as export:
        plan = make_plan(export, None, history=True)
    assert (plan.unprocessed, plan.processed_recent, plan.survivors) == (unprocessed, recent, unprocessed + recent)
    assert plan.targets["windows"].owed == sum(1 for e in old.events if e["_creationTime"] > old.cursor)
    assert plan.targets["skills"].owed == unprocessed
    assert plan.targets["history"].owed == len(old.daily)
    assert recent > 0 and unprocessed > 0


@pytest.mark.parametrize("as_zip", [True, False], ids=["zip", "directory"])
def test_an_import_counts_every_event_once_and_a_second_run_applies_nothing(
    migrated: str, tmp_path: Path, as_zip: bool
) -> None:
    old = history_of_a_registry(2)
    old.move_registry(migrated)
    export = old.export(tmp_path / "snapshot", as_zip=as_zip)
    status, out, err = legacy("plan", str(export), "--history", url=migrated)
    assert status == 0, err
    assert "survivors" in out and "hourly history is not in the export" in out

    first = imported(export, migrated, "--history", "--chunk-size", "37")
    assert first["import"]["applied"]["windows"] == first["plan"]["targets"]["windows"]["owed"] > 0
    assert first["import"]["applied"]["skills"] == first["plan"]["targets"]["skills"]["owed"] > 0
    assert first["import"]["unknown_skill_events"] > 0  # deleted skills' events: skipped, as docsync does
    check_moved(old, migrated, hourly_from=old.cursor)
    rows = manifest_rows(migrated)

    again = imported(export, migrated, "--history")
    assert again["plan"]["targets"]["windows"]["to_apply"] == 0
    assert again["import"]["applied"] == {"windows": 0, "skills": 0, "history": 0}
    assert manifest_rows(migrated) == rows
    check_moved(old, migrated, hourly_from=old.cursor)


def test_a_later_export_applies_only_the_rows_written_since(migrated: str, tmp_path: Path) -> None:
    old = history_of_a_registry(3)
    old.move_registry(migrated)
    first_cursor = old.cursor
    imported(old.export(tmp_path / "first", as_zip=True), migrated, "--history")
    owed_before = manifest_rows(migrated)
    old.write(50)  # services still writing to the old table after the cut-over; the crons are stopped
    second = imported(old.export(tmp_path / "second", as_zip=True), migrated, "--history")
    targets = second["plan"]["targets"]
    assert targets["windows"]["applied_before"] + targets["skills"]["applied_before"] > 0
    assert second["import"]["applied"]["windows"] == 50 == second["import"]["applied"]["skills"]
    assert second["import"]["applied"]["history"] == 0
    assert manifest_rows(migrated) == owed_before + 100
    check_moved(old, migrated, hourly_from=first_cursor)


def test_another_deployments_export_is_shown_by_the_plan_and_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/db.sqlite"
    upgrade(open_engine(url))
    old = history_of_a_registry(4)
    old.move_registry(url)
    imported(old.export(tmp_path / "first", as_zip=True), url)
    before = manifest_rows(url)
    # The same events, copied into another deployment: every _id differs.
    for event in old.events:
        event["_id"] = "copy" + event["_id"]
    old.write(5)
    copy = old.export(tmp_path / "copy", as_zip=True)
    status, out, _err = legacy("plan", str(copy), "--json", url=url)
    plan = json.loads(out)
    assert status == 0 and plan["targets"]["windows"]["older_unseen"] == plan["targets"]["windows"]["owed"] - 5 > 0
    status, _out, err = legacy("import", str(copy), "--confirm", "IMPORT_LEGACY", url=url)
    assert status == 2 and "another deployment" in err and "--allow-older-rows" in err
    assert manifest_rows(url) == before


def test_an_import_needs_the_confirmation_token(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/db.sqlite"
    upgrade(open_engine(url))
    export = history_of_a_registry(5).export(tmp_path / "x", as_zip=False)
    status, _out, err = legacy("import", str(export), url=url)
    assert status == 2 and "--confirm IMPORT_LEGACY" in err and manifest_rows(url) == 0


# ---------------------------------------------------------------------- property: any history, any interruptions

_TEMPLATE: dict[str, bytes] = {}


def _fresh_sqlite(path: Path) -> str:
    if not _TEMPLATE:
        seed = path.with_name("template.sqlite")
        engine = open_engine(f"sqlite:///{seed}")
        upgrade(engine)
        engine.dispose()
        _TEMPLATE["db"] = seed.read_bytes()
    path.write_bytes(_TEMPLATE["db"])
    return f"sqlite:///{path}"


operations = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(1, 25)),
        st.tuples(st.just("daily"), st.floats(0, 1)),
        st.tuples(st.just("docsync"), st.floats(0, 1)),
        st.tuples(st.just("prune"), st.just(0)),
        # an export taken now, imported in chunks of `n`, the run cut off after some chunks (or not)
        st.tuples(st.just("import"), st.tuples(st.integers(1, 40), st.integers(0, 4))),
    ),
    max_size=14,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), ops=operations)
def test_any_history_and_any_cut_off_imports_end_in_one_count_per_event(
    tmp_path_factory: pytest.TempPathFactory, seed: int, ops: list[tuple[str, Any]]
) -> None:
    """Crons run until the cut-over; from the first import on they are stopped, services may still write, and
    exports are imported (cut off at any chunk boundary, or not); a last whole import must leave every event
    counted once."""
    where = tmp_path_factory.mktemp("prop")
    url = _fresh_sqlite(where / "db.sqlite")
    old = OldSystem(seed, skills=12)
    engine = open_engine(url)
    moved = False
    first_cursor: float | None = None
    try:
        for number, (op, arg) in enumerate(ops):
            if op == "write":
                old.write(arg)
            elif moved:
                if op == "import":
                    _import(engine, old.export(where / f"e{number}", as_zip=number % 2 == 0), *arg)
            elif op == "daily":
                old.daily_run(arg)
            elif op == "docsync":
                old.doc_sync(arg)
            elif op == "prune":
                old.prune()
            else:
                old.move_registry(url)
                moved, first_cursor = True, old.cursor
                _import(engine, old.export(where / f"e{number}", as_zip=True), *arg)
        if not moved:
            old.move_registry(url)
            first_cursor = old.cursor
        _import(engine, old.export(where / "last", as_zip=False), 500, 0)
        check_moved(old, url, hourly_from=first_cursor)
    finally:
        engine.dispose()


def _import(engine: Any, path: Path, chunk: int, cut_after: int) -> None:
    """An import; with `cut_after`, stopped (as by SIGTERM) once that many chunks are in."""
    importer = Importer(engine, chunk_size=chunk)
    if cut_after:
        importer.on_chunk = lambda outcome: importer.stop.set() if outcome.chunks >= cut_after else None
    with Export(path) as export:
        plan = importer.plan(export, history=True)
        importer.check(plan, allow_older_rows=True, allow_empty_registry=True, allow_unknown_skills=True)
        importer.run(export, plan, history=True)
