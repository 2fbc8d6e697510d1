"""`skillstats legacy` against exports whose old-system marks moved, duplicate ids, unknown skills, and a history
imported only with a later export (review findings on issue 29).

The model is tests/test_legacy.py's: the old deployment's crons (`daily_run`, `doc_sync`), its exports, and the
expectation of one count per event ever created."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from skillstats.legacy import plan as plan_module
from skillstats.legacy.export import Export
from skillstats.legacy.plan import make_plan
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.schema import legacy_exports, legacy_manifest, skill_daily_stats, skill_hourly_stats, skills
from tests.test_legacy import (
    START,
    OldSystem,
    check_moved,
    history_of_a_registry,
    imported,
    legacy,
    manifest_rows,
)

EVENTS = "skillStatEvents/documents.jsonl"
DAILY = "skillDailyStats/documents.jsonl"


@pytest.fixture
def migrated(database_url: str) -> str:
    engine = open_engine(database_url)
    upgrade(engine)
    engine.dispose()
    return database_url


def _state(url: str) -> tuple[Any, ...]:
    """Everything an import writes, to show a refusal wrote nothing."""
    engine = open_engine(url)
    try:
        with engine.connect() as connection:
            return (
                *(
                    sorted(map(tuple, connection.execute(select(table)).all()))
                    for table in (legacy_manifest, legacy_exports, skill_hourly_stats, skill_daily_stats)
                ),
                sorted(
                    map(
                        tuple,
                        connection.execute(
                            select(
                                skills.c.id, skills.c.downloads, skills.c.installs_all_time, skills.c.installs_current
                            )
                        ).all(),
                    )
                ),
            )
    finally:
        engine.dispose()


def _refused(export: Path, url: str, *extra: str) -> tuple[str, str]:
    """`plan` and `import` of `export` both refuse, exit 2, in one line, writing nothing: (plan's, import's) line."""
    before = _state(url)
    said = []
    for action in (
        ["plan", "--history"],
        ["import", "--history", "--confirm", "IMPORT_LEGACY", "--allow-unknown-skills"],
    ):
        status, out, err = legacy(action[0], str(export), *action[1:], *extra, url=url)
        lines = err.strip().splitlines()
        assert status == 2 and len(lines) == 1, (status, out, err)
        said.append(lines[0])
    assert _state(url) == before
    return said[0], said[1]


# ---------------------------------------------------------------------- 1: the old crons ran between two exports


def test_each_import_records_the_cursor_and_bound_of_its_export(migrated: str, tmp_path: Path) -> None:
    old = history_of_a_registry(11)
    old.move_registry(migrated)
    imported(old.export(tmp_path / "first", as_zip=True), migrated, "--history")
    engine = open_engine(migrated)
    with engine.connect() as connection:
        rows = connection.execute(select(legacy_exports)).all()
    engine.dispose()
    newest_event = max(e["_creationTime"] for e in old.events)
    newest_daily = max(r["_creationTime"] for r in old.daily.values())
    assert [(r.export_bound, r.cursor_creation_time, r.history_bound) for r in rows] == [
        (newest_event, old.cursor, newest_daily)
    ]


def test_a_later_export_whose_daily_cursor_moved_is_refused(migrated: str, tmp_path: Path) -> None:
    """A stopped cron's already scheduled continuation ran after the first export: the cursor moved past rows the
    first import applied to the windows tables (now also in a skillDailyStats row), and past new rows."""
    old = history_of_a_registry(12)
    old.move_registry(migrated)
    imported(old.export(tmp_path / "first", as_zip=True), migrated, "--history")
    old.write(30)
    old.daily_run()
    plan_said, import_said = _refused(old.export(tmp_path / "second", as_zip=True), migrated)
    for said in (plan_said, import_said):
        assert "the daily cursor is" in said and "the old crons ran in between" in said
        assert "processSkillStatEvents*" in said and "Nothing was written" in said


def test_a_later_export_with_new_rows_processed_by_the_doc_sync_is_refused(migrated: str, tmp_path: Path) -> None:
    """The daily cursor did not move, but the doc sync ran after the first export: new rows have processedAt (owed
    to no target) while the old totals, copied before, lack them."""
    old = history_of_a_registry(13)
    old.move_registry(migrated)
    imported(old.export(tmp_path / "first", as_zip=True), migrated, "--history")
    first_new = len(old.events)
    old.write(30)
    old.doc_sync(share=1.0)
    export = old.export(tmp_path / "second", as_zip=False)
    new_line = first_new + 1  # the first new row: documents.jsonl holds the table in order
    for said in _refused(export, migrated):
        assert said.startswith(f"skillstats legacy: {export}:{EVENTS}:{new_line}: ")
        assert "has processedAt" in said and "the old crons ran since" in said


def test_a_later_export_with_the_crons_stopped_is_still_accepted(migrated: str, tmp_path: Path) -> None:
    old = history_of_a_registry(14)
    old.move_registry(migrated)
    first_cursor = old.cursor
    imported(old.export(tmp_path / "first", as_zip=True), migrated, "--history")
    old.write(40)
    second = imported(old.export(tmp_path / "second", as_zip=True), migrated, "--history")
    assert second["import"]["applied"]["windows"] == 40 == second["import"]["applied"]["skills"]
    check_moved(old, migrated, hourly_from=first_cursor)


# ---------------------------------------------------------------------- 6: a duplicate _id


def _duplicate(export: Path, table: str, line: int, at: int) -> None:
    """Write line `line` of `table` again so that it becomes line `at`."""
    file = export / table
    lines = file.read_bytes().splitlines(keepends=True)
    lines.insert(at - 1, lines[line - 1])
    file.write_bytes(b"".join(lines))


@pytest.mark.parametrize("lookup_chunk", [5000, 7], ids=["same-chunk", "across-chunks"])
@pytest.mark.parametrize("table", [EVENTS, DAILY], ids=["events", "history"])
def test_a_duplicate_id_is_refused_naming_the_second_line(
    migrated: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lookup_chunk: int, table: str
) -> None:
    monkeypatch.setattr(plan_module, "LOOKUP_CHUNK", lookup_chunk)
    old = history_of_a_registry(15)
    old.move_registry(migrated)
    export = old.export(tmp_path / "x", as_zip=False)
    _duplicate(export, table, 3, 30)
    for said in _refused(export, migrated):
        assert said.startswith(f"skillstats legacy: {export}:{table}:30: _id ")
        assert "again (first at line 3)" in said


def test_without_duplicates_to_apply_reaches_zero_after_an_import(migrated: str, tmp_path: Path) -> None:
    old = history_of_a_registry(16)
    old.move_registry(migrated)
    export = old.export(tmp_path / "x", as_zip=True)
    imported(export, migrated, "--history", "--chunk-size", "11")
    with Export(export) as opened:
        engine = open_engine(migrated)
        plan = make_plan(opened, engine, history=True)
        engine.dispose()
    assert {name: t.to_apply for name, t in plan.targets.items()} == {"windows": 0, "skills": 0, "history": 0}


# ---------------------------------------------------------------------- 5: events for skills with no row


def test_the_plan_counts_events_for_skills_with_no_row_and_the_import_refuses_them(
    migrated: str, tmp_path: Path
) -> None:
    old = history_of_a_registry(17)
    old.move_registry(migrated)
    export = old.export(tmp_path / "x", as_zip=True)
    unknown = sum(1 for e in old.events if "processedAt" not in e and e["skillId"] not in old.registry)
    assert unknown > 0
    status, out, err = legacy("plan", str(export), url=migrated)
    assert status == 0, err
    assert f"WARNING: {unknown:,} event(s) to apply to the skill totals are for skills with no row" in out

    before = _state(migrated)
    status, _out, err = legacy("import", str(export), "--confirm", "IMPORT_LEGACY", url=migrated)
    assert status == 2 and f"{unknown:,} event(s) owed to the skill totals" in err
    assert "--allow-unknown-skills" in err and len(err.strip().splitlines()) == 1
    assert _state(migrated) == before

    done = imported(export, migrated)  # with --allow-unknown-skills
    assert done["plan"]["unknown_skill_events"] == unknown == done["import"]["unknown_skill_events"]
    status, out, err = legacy("plan", str(export), "--json", url=migrated)
    assert status == 0 and '"unknown_skill_events": 0' in out  # applied (skipped) already: nothing to decide


# ---------------------------------------------------------------------- 3: the guard against another deployment


def test_a_first_export_without_history_then_a_later_one_with_history_is_not_refused(
    migrated: str, tmp_path: Path
) -> None:
    old = history_of_a_registry(18)
    old.move_registry(migrated)
    first_cursor = old.cursor
    imported(old.export(tmp_path / "first", as_zip=True), migrated)
    old.write(25)
    second = old.export(tmp_path / "second", as_zip=True)
    status, out, err = legacy("plan", str(second), "--history", "--json", url=migrated)
    assert status == 0, err
    targets = json.loads(out)["targets"]
    assert {name: t["older_unseen"] for name, t in targets.items()} == {"windows": 0, "skills": 0, "history": 0}
    done = imported(second, migrated, "--history")  # no --allow-older-rows
    assert done["import"]["applied"]["history"] == len(old.daily) > 0
    assert done["import"]["applied"]["windows"] == 25
    check_moved(old, migrated, hourly_from=first_cursor)


def test_another_deployments_copy_under_new_creation_times_is_refused(migrated: str, tmp_path: Path) -> None:
    """A copy that does not keep _creationTime (every row newer than the first export) still carries the old
    processedAt marks: the marks check refuses it."""
    old = history_of_a_registry(19)
    old.move_registry(migrated)
    imported(old.export(tmp_path / "first", as_zip=True), migrated)
    shift = max(e["_creationTime"] for e in old.events) - START + 1000.0
    for event in old.events:
        event["_id"] = "copy" + event["_id"]
        event["_creationTime"] += shift
    before = manifest_rows(migrated)
    plan_said, _ = _refused(old.export(tmp_path / "copy", as_zip=True), migrated)
    assert "created after the first imported export was taken" in plan_said and "the old crons ran since" in plan_said
    assert manifest_rows(migrated) == before


def test_the_same_export_imported_twice_records_one_row(tmp_path: Path) -> None:
    """The marks live in a small table, one row per imported export (not one per manifest row)."""
    url = f"sqlite:///{tmp_path}/db.sqlite"
    upgrade(open_engine(url))
    old: OldSystem = history_of_a_registry(20)
    old.move_registry(url)
    imported(old.export(tmp_path / "a", as_zip=True), url)
    imported(old.export(tmp_path / "a", as_zip=True), url)  # the same export again: still one row
    engine = open_engine(url)
    with engine.connect() as connection:
        assert connection.execute(select(func.count()).select_from(legacy_exports)).scalar_one() == 1
    engine.dispose()
