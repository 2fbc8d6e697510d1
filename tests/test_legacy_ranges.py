"""Legacy events outside the contract's ranges: counted by the old system, not by the live consumers.

An `occurredAt` before 2000-01-01 or after 9999-12-31, or an install_clear `delta` over 1e9 in size
(the contract's `bad_timestamp` and `bad_delta` bounds), is no refusal of the whole export: `plan`
counts such events in a line of their own, `import` refuses while any is owed to a target, and with
--skip-out-of-contract records each in the manifest under `skipped`, counting it nowhere, so a rerun
knows them. The old daily rows of such events (a day outside those years, --history) go the same
way. A document wrong in shape stays refused, whatever its range (tests/test_legacy_input.py).

The model is tests/test_legacy.py's: the events are out of range from the start, so the old crons
counted them as they counted any other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from skillstats.contract import EPOCH_2000_MS, MAX_ABS_DELTA, MAX_OCCURRED_AT_MS
from skillstats.legacy.export import Export, parse_event
from skillstats.legacy.plan import make_plan
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.schema import legacy_manifest
from tests.helpers import assert_four_tables, expected_docstats, expected_windows
from tests.test_legacy import OldSystem, as_record, imported, legacy
from tests.test_legacy_marks import _state

EVENTS = "skillStatEvents/documents.jsonl"
DAILY = "skillDailyStats/documents.jsonl"


def outside(event: dict[str, Any]) -> bool:
    """Outside the contract's ranges, restated from docs/contract.md's validity rules."""
    at = int(event["occurredAt"])
    if not EPOCH_2000_MS <= at <= MAX_OCCURRED_AT_MS:
        return True
    delta = event.get("delta") or {}
    return any(abs(int(delta.get(name, 0))) > MAX_ABS_DELTA for name in ("allTime", "current"))


def _spoil(old: OldSystem, first: int) -> None:
    """Put some of the events from `first` on outside the ranges, as the services once wrote them."""
    downloads = [e for e in old.events[first:] if e["kind"] in ("download", "install_new")]
    clears = [e for e in old.events[first:] if e["kind"] == "install_clear"]
    for event, at in zip(downloads[::7], [5, MAX_OCCURRED_AT_MS + 1, 1e16, -86_400_000.0], strict=False):
        event["occurredAt"] = at
    for event, delta in zip(
        clears[::2], [{"allTime": -2e9, "current": 0}, {"allTime": 0, "current": 3e12}], strict=False
    ):
        event["delta"] = delta


def _old() -> OldSystem:
    """Events out of range below the daily cursor (some processed by the doc sync) and above it."""
    old = OldSystem(41)
    old.write(120)
    _spoil(old, 0)
    old.daily_run()  # every event so far at or below the cursor, in skillDailyStats (days out of range too)
    old.doc_sync(share=0.5)
    old.write(120)
    _spoil(old, 120)
    old.doc_sync(share=0.3)
    # An install_clear neither cron counted (at or below the cursor it adds to no daily row, and no doc sync
    # reached it) may be out of range as well: as if written so.
    unreached = next(
        e
        for e in old.events
        if e["kind"] == "install_clear" and "processedAt" not in e and e["_creationTime"] <= old.cursor
    )
    unreached["delta"] = {"allTime": -1, "current": -(MAX_ABS_DELTA + 1)}
    return old


def _classes(old: OldSystem) -> dict[str, list[dict[str, Any]]]:
    """The out-of-range events by what the import owes them."""
    assert old.cursor is not None
    found: dict[str, list[dict[str, Any]]] = {"windows": [], "skills only": [], "nothing": []}
    for event in old.events:
        if outside(event):
            above, unprocessed = event["_creationTime"] > old.cursor, "processedAt" not in event
            found["windows" if above else "skills only" if unprocessed else "nothing"].append(event)
    return found


@pytest.fixture
def migrated(database_url: str) -> str:
    engine = open_engine(database_url)
    upgrade(engine)
    engine.dispose()
    return database_url


def test_a_range_violation_is_marked_not_refused_and_a_wrong_shape_still_refused() -> None:
    base = {"_id": "e1", "_creationTime": 1.0, "skillId": "sk", "kind": "download", "occurredAt": 5}
    assert parse_event(base, "f", 3).outside == "occurredAt 5 is before 2000-01-01T00:00Z"
    late = parse_event({**base, "occurredAt": 1e300}, "f", 3)
    assert late.event is None and late.outside is not None and "is after 9999-12-31" in late.outside
    clear = {**base, "kind": "install_clear", "occurredAt": 1.7e12, "delta": {"allTime": 0, "current": -1e10}}
    why = parse_event(clear, "f", 3).outside
    assert why is not None and "|x| <= 1000000000" in why and "current -10000000000" in why
    from skillstats.legacy.export import ExportError

    for shape, said in (
        ({"skillId": "s" * 129}, "skillId must be a string of 1-128 characters"),
        ({"kind": "like"}, "unknown kind"),
        ({"occurredAt": 5.5}, "occurredAt must be an integral number"),
        ({"delta": {"allTime": 1, "current": 1}}, "a delta on a 'download' event"),
    ):
        with pytest.raises(ExportError, match=f"^f:3: .*{said}"):
            parse_event({**base, **shape}, "f", 3)  # out of range as well: the shape is refused first


def _empty(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path}/db.sqlite"
    upgrade(open_engine(url))
    return url


def test_the_plan_counts_events_outside_the_ranges_in_a_line_of_their_own(tmp_path: Path) -> None:
    old = _old()
    classes = _classes(old)
    assert all(classes.values()), {k: len(v) for k, v in classes.items()}  # each kind of owed present
    owed = classes["windows"] + classes["skills only"]
    out_of_range_days = [r for r in old.daily.values() if not 10957 <= r["day"] <= 2932896]
    assert out_of_range_days
    export = old.export(tmp_path / "x", as_zip=True)
    status, out, err = legacy("plan", str(export), "--history", url=_empty(tmp_path))
    assert status == 0, err
    assert (
        f"outside the contract's ranges: {len(owed)} events and {len(out_of_range_days)} skillDailyStats rows "
        f"(0 skipped before, {len(owed) + len(out_of_range_days)} to skip)"
    ) in out
    lines = {e["_id"]: number for number, e in enumerate(old.events, start=1)}
    first = min(owed, key=lambda e: lines[e["_id"]])
    assert f"  skillStatEvents/documents.jsonl:{lines[first['_id']]}: _id {first['_id']!r}: " in out
    assert "WARNING: `legacy import` refuses them unless --skip-out-of-contract" in out

    with Export(export) as opened:
        plan = make_plan(opened, None, history=True)
    # The old system's own figures count every event; the targets owe the others only.
    unprocessed = sum(1 for e in old.events if "processedAt" not in e)
    assert plan.unprocessed == unprocessed
    assert plan.targets["skills"].owed == unprocessed - sum(1 for e in owed if "processedAt" not in e)
    assert plan.targets["windows"].owed == sum(1 for e in old.events if e["_creationTime"] > old.cursor) - len(
        classes["windows"]
    )
    assert plan.targets["history"].owed == len(old.daily) - len(out_of_range_days)
    as_json = plan.to_dict()["out_of_contract"]
    assert (as_json["events"], as_json["history_rows"], as_json["to_skip"]) == (
        len(owed),
        len(out_of_range_days),
        len(owed) + len(out_of_range_days),
    )
    assert [f["line"] for f in as_json["first"][:2]] == sorted(lines[e["_id"]] for e in owed)[:2]


def test_the_import_refuses_them_unless_told_then_skips_records_and_a_rerun_applies_nothing(
    migrated: str, tmp_path: Path
) -> None:
    old = _old()
    old.move_registry(migrated)
    owed = len(_classes(old)["windows"]) + len(_classes(old)["skills only"])
    days = sum(1 for r in old.daily.values() if not 10957 <= r["day"] <= 2932896)
    export = old.export(tmp_path / "x", as_zip=False)

    before = _state(migrated)
    status, _out, err = legacy(
        "import", str(export), "--history", "--confirm", "IMPORT_LEGACY", "--allow-unknown-skills", url=migrated
    )
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, err
    assert f"{owed + days} document(s) owed to a target are outside the contract's ranges" in lines[0]
    assert "--skip-out-of-contract" in lines[0] and "Nothing was written" in lines[0]
    assert _state(migrated) == before

    done = imported(export, migrated, "--history", "--skip-out-of-contract", "--chunk-size", "17")
    assert done["import"]["out_of_contract"] == {"skipped": owed + days, "skipped_before": 0}
    assert _skipped(migrated) == owed + days
    check_counted_in_range(old, migrated)

    again = imported(export, migrated, "--history")  # the decision is recorded: no flag needed, nothing refused
    assert again["plan"]["out_of_contract"]["skipped_before"] == owed + days
    assert again["plan"]["out_of_contract"]["to_skip"] == 0
    assert again["import"]["applied"] == {"windows": 0, "skills": 0, "history": 0}
    assert again["import"]["out_of_contract"] == {"skipped": 0, "skipped_before": owed + days}
    assert _skipped(migrated) == owed + days
    check_counted_in_range(old, migrated)
    status, out, _err = legacy("plan", str(export), "--history", url=migrated)
    assert status == 0 and f"({owed + days} skipped before, 0 to skip)" in out
    assert "--skip-out-of-contract" not in out
    status, out, _err = legacy(
        "import", str(export), "--history", "--confirm", "IMPORT_LEGACY", "--allow-unknown-skills", url=migrated
    )
    assert status == 0 and f"0 skipped, {owed + days:,} skipped before" in out


def _skipped(url: str) -> int:
    engine = open_engine(url)
    with engine.connect() as connection:
        rows = connection.execute(select(legacy_manifest.c.legacy_id).where(legacy_manifest.c.target == "skipped"))
        found = len(rows.all())
    engine.dispose()
    return found


def check_counted_in_range(old: OldSystem, url: str) -> None:
    """What the old crons counted stays (out-of-range events included: the old totals and daily rows in range),
    and skillstats counted every event inside the ranges once, and none outside them."""
    inside = [as_record(e) for e in old.ever if not outside(e)]
    assert old.cursor is not None
    daily, _ = expected_windows(inside)  # an out-of-range event's day is out of range: its daily row is skipped
    _, hourly = expected_windows([as_record(e) for e in old.ever if not outside(e) and e["_creationTime"] > old.cursor])
    # The skills: the old totals (the doc sync applied what it reached, out of range or not) plus the rest in range.
    applied_by_the_old = [as_record(e) for e in old.ever if outside(e) and "processedAt" in e]
    want_skills, want_owners, _ = expected_docstats([*inside, *applied_by_the_old], old.registry)
    assert_four_tables(url, daily, hourly, want_skills, want_owners)


def test_json_output_of_the_plan_names_them(tmp_path: Path) -> None:
    old = _old()
    status, out, err = legacy("plan", str(old.export(tmp_path / "x", as_zip=True)), "--json", url=_empty(tmp_path))
    assert status == 0, err
    found = json.loads(out)["out_of_contract"]
    assert found["events"] > 0 and found["history_rows"] == 0  # without --history the daily rows are not read
    assert all(set(f) == {"table", "line", "id", "why"} for f in found["first"]) and len(found["first"]) <= 5
