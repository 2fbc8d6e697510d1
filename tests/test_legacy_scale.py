"""`skillstats legacy import` of an export of 1,000,000 events: every event counted once, in bounded memory.

The export is bench/legacy_export.py's `Deployment`, the old deployment's history generated in
creation order and written streaming (this process never holds the events): events created over 20
days, a prune of processed events at an early cursor, the daily processor run up to a cursor (its
skillDailyStats rows), the doc sync marking most events processed (the old totals the registry's
rows are loaded with), the last fifth created after both crons stopped. The import runs as the
command an operator runs, a process of its own whose peak RSS `wait4` reports; the tables are then
compared, row by row, with what one system counting every event ever created once holds, computed
by tests/helpers.py's own restatement of the contract from the regenerated events (three passes,
memory per skill and hour only).

On SQLite the import runs whole (its time and peak RSS are the figures README "Moving in" states);
on PostgreSQL it is killed (SIGKILL) part-way and run again, and must end where one run would. In
the fault suite (minutes, not seconds): deploy/local/test-faults.sh.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from skillstats_bench.legacy_export import Deployment, load_registry
from skillstats_bench.measure import Watched

from skillstats.config import Settings
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from tests.helpers import actual_docstats, actual_windows, expected_docstats, expected_windows, nonzero, wait_until
from tests.test_legacy import as_record, manifest_rows

EVENTS = 1_000_000
# Peak RSS of the import process. Measured on the 2-vCPU machine of docs/performance.md: 109 MiB on SQLite,
# 87 MiB on PostgreSQL (SQLite's page cache is in the process). Memory that grew with the export (even 150
# bytes per event) would pass this bound at a million events.
PEAK_RSS_BOUND_MB = 256


@dataclass
class Million:
    deployment: Deployment
    export: Path
    exported: int
    owed: dict[str, int]  # per target, counted here from the documents
    daily: dict[Any, tuple[int, ...]]
    hourly: dict[Any, tuple[int, ...]]
    skills: dict[str, tuple[int, int, int]]
    owners: dict[str, tuple[int, int, int]]


@pytest.fixture(scope="module")
def million(tmp_path_factory: pytest.TempPathFactory) -> Million:
    deployment = Deployment(EVENTS, seed=1_000_000, skills=300, days=20)
    started = time.monotonic()
    export = deployment.write(tmp_path_factory.mktemp("million") / "snapshot", as_zip=True)
    wrote = time.monotonic() - started
    cursor = deployment.cursor
    assert cursor is not None

    counted = {"exported": 0, "windows": 0, "skills": 0}

    def every_event() -> Iterator[Any]:
        for document, pruned in deployment.created():
            if not pruned:
                counted["exported"] += 1
                counted["windows"] += document["_creationTime"] > cursor
                counted["skills"] += "processedAt" not in document
            yield as_record(document)

    daily, _ = expected_windows(every_event())
    exported, windows, skills = counted["exported"], counted["windows"], counted["skills"]
    above = (as_record(d) for d, _pruned in deployment.created() if d["_creationTime"] > cursor)
    _, hourly = expected_windows(above)
    want_skills, want_owners, _unknown = expected_docstats(
        (as_record(d) for d, _pruned in deployment.created()),  # type: ignore[arg-type]
        deployment.registry,
    )
    print(
        f"\nthe export: {exported:,} events ({deployment.figures.pruned:,} more pruned before it), "
        f"{export.stat().st_size / 2**20:.1f} MiB ZIP written in {wrote:.1f} s; expectations computed in "
        f"{time.monotonic() - started - wrote:.1f} s; this process's peak RSS so far "
        f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB"
    )
    return Million(
        deployment,
        export,
        exported,
        {"windows": windows, "skills": skills, "history": len(deployment.daily_rows)},
        nonzero(daily),
        nonzero(hourly),
        want_skills,
        nonzero(want_owners),
    )


def _import(export: Path, url: str, kill_after_rows: int | None = None) -> tuple[int, dict[str, Any], float, float]:
    """`skillstats legacy import` as a process: (exit status, its JSON summary, seconds, peak RSS MiB). With
    `kill_after_rows`, SIGKILLed once the manifest holds that many rows."""
    argv = [
        *(sys.executable, "-m", "skillstats.cli", "legacy", "import", str(export), "--history"),
        *("--confirm", "IMPORT_LEGACY", "--allow-unknown-skills", "--json"),
    ]
    out, err = (export.with_name(f"import-{time.monotonic_ns()}.{suffix}") for suffix in ("out", "err"))
    with out.open("wb") as stdout, err.open("wb") as stderr:
        started = time.monotonic()
        child = subprocess.Popen(argv, env={**os.environ, "SKILLSTATS_DATABASE_URL": url}, stdout=stdout, stderr=stderr)
        # Its own peak (VmHWM), not wait4's ru_maxrss: that starts at this process's, the test's, peak.
        watched = Watched(child)
        measured = False
        try:
            if kill_after_rows is not None:
                wait_until(
                    lambda: child.poll() is not None or manifest_rows(url) >= kill_after_rows,
                    600,
                    "the import to get part-way",
                    1.0,
                )
                assert child.poll() is None, "the import ended before it could be killed"
                child.send_signal(signal.SIGKILL)
            status, _cpu, peak = watched.wait()
            measured = True
        finally:
            if not measured:
                child.kill()
                child.wait()
        seconds = time.monotonic() - started
    text = out.read_text().strip()
    summary = json.loads(text.splitlines()[-1]) if text else {}
    assert kill_after_rows is not None or status == 0, err.read_text()[-3000:]
    return status, summary, seconds, peak


@pytest.mark.faults  # minutes, not seconds: the fault suite (deploy/local/test-faults.sh)
@pytest.mark.parametrize(
    ("database_url", "killed"),
    [("sqlite", False), ("postgresql", True)],
    ids=["sqlite-whole", "postgresql-killed-and-run-again"],
    indirect=["database_url"],
)
def test_a_million_event_export_is_counted_once_in_bounded_memory(
    million: Million, database_url: str, killed: bool, record_property: Any
) -> None:
    assert million.exported >= 1_000_000
    engine = open_engine(database_url)
    upgrade(engine)
    load_registry(engine, million.deployment.registry, million.deployment.totals)
    engine.dispose()
    owed = sum(million.owed.values())

    runs: list[tuple[float, float]] = []
    if killed:
        status, _summary, seconds, peak = _import(million.export, database_url, kill_after_rows=owed * 2 // 5)
        assert status == -signal.SIGKILL
        cut = manifest_rows(database_url)
        assert owed * 2 // 5 <= cut < owed
        runs.append((seconds, peak))
    status, summary, seconds, peak = _import(million.export, database_url)
    runs.append((seconds, peak))
    for number, (seconds, peak) in enumerate(runs, start=1):
        print(f"\nimport run {number} of {len(runs)}: {seconds:.1f} s, peak RSS {peak:.1f} MiB")
        record_property(f"run{number}_seconds", round(seconds, 1))
        record_property(f"run{number}_peak_rss_mib", round(peak, 1))
        assert peak < PEAK_RSS_BOUND_MB, f"the import's peak RSS was {peak:.0f} MiB"

    plan, done = summary["plan"], summary["import"]
    assert plan["events"] == million.exported
    assert {name: target["owed"] for name, target in plan["targets"].items()} == million.owed
    assert {name: done["applied"][name] + done["already_applied"][name] for name in million.owed} == million.owed
    assert (done["already_applied"]["windows"] > 0) == killed and not done["stopped"]
    assert manifest_rows(database_url) == owed

    state = Settings(database_url=database_url)
    got_daily, got_hourly = actual_windows(state)
    assert nonzero(got_daily) == million.daily
    assert nonzero(got_hourly) == million.hourly
    got_skills, got_owners = actual_docstats(state)
    assert got_skills == million.skills
    assert nonzero(got_owners) == million.owners
