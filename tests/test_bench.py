"""A small run of the benchmark, so the harness cannot rot (no figure is asserted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from skillstats_bench.legacy_import import build_export, measure, render
from skillstats_bench.measure import cpu_seconds_so_far

from skillstats.config import Settings
from tests.conftest import settings_env
from tests.helpers import assert_four_tables, expected_docstats, expected_windows
from tests.test_legacy import as_record


@pytest.mark.faults  # every case of the bench, about 100 s: in the longer suite
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_bench_smoke(settings: Settings, database_url: str, tmp_path: object) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "skillstats.cli",
            "bench",
            "--events",
            "3000",
            "--skills",
            "200",
            "--naive-events",
            "600",
            "--postgres",
            database_url,
            "--latency-seconds",
            "3",
            "--latency-rate",
            "300",
            "--ingest-rate",
            "100",
            "--ingest-seconds",
            "2",
            "--import-events",
            "2000",
            "--rebuild-events",
            "3000",
        ],
        env=settings_env(settings),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    sections = sections_by_workload(result.stdout)
    assert list(sections) == ["steady", "backfill"], result.stdout
    everywhere = [
        "a. bare confluent-kafka loop",
        "b. loop + decode/validate",
        "c. skillstats windows (SQLite)",
        "c. skillstats windows (PostgreSQL)",
        "h. two windows workers (SQLite)",
        "h. two windows workers (PostgreSQL)",
        "d. skillstats docsync drain (SQLite)",
        "d. skillstats docsync drain (PostgreSQL)",
        "g. librdkafka loop + the windows sink (SQLite)",
    ]
    first_only = ["e. naive faust", "f. kafka-consumer-perf-test"]
    for workload, rows in sections.items():
        cases = everywhere + (first_only if workload == "steady" else [])
        for case in cases:
            row = next((cells for name, cells in rows.items() if name.startswith(case)), None)
            assert row, f"{workload}: no row for {case} in:\n{result.stdout}"
            assert parse_number(row["events/s (steady)"]) > 0
            if case.startswith(("a.", "b.", "c.", "d.", "g.", "h.")):
                assert parse_number(row["CPU s per million events"]) > 0, row
            if case.startswith(("a.", "b.", "c.", "g.", "h.")):
                # From the first record to caught up: within what the process spent from start to exit.
                steady = parse_number(row["CPU s per million, steady"])
                assert 0 <= steady <= parse_number(row["CPU s per million events"]), row
            if case.startswith(("c.", "d.", "h.")):
                # Every event of the workload lands in some row: at least one row per
                # transaction, never more rows than events per table (two tables each).
                assert 0 < parse_number(row["SQL rows upserted/s"]) <= 2 * parse_number(row["events/s (steady)"]), row
        assert not [name for name in rows if name.startswith(tuple(first_only))] or workload == "steady"
    assert re.search(r"p50 \d+ ms, p99 \d+ ms", result.stdout), result.stdout
    # Case i: ingest beside the direct publisher, and its single-event latency.
    assert re.search(
        r"\| `skillstats ingest`, 1,000-event requests, 16 clients \| [\d,]+ \| \d+\.\d\d \|", result.stdout
    )
    assert re.search(r"accept latency \(due -> 202\) p50 [\d.]+ ms, p99 [\d.]+ ms; 0 not answered", result.stdout)
    # Case j: the legacy import of a synthetic export, into a fresh database on each.
    imports = table_rows(result.stdout, "| database |")
    assert list(imports) == ["SQLite", "PostgreSQL"], result.stdout
    for row in imports.values():
        assert parse_number(row["events"]) == 2000 and parse_number(row["events/s"]) > 0, row
        assert parse_number(row["peak RSS"].removesuffix(" MiB")) > 0, row
    # Case k: a rebuild beside the live worker, then its swap, on each database.
    rebuilds = table_rows(result.stdout, "| run |")
    for label in ("SQLite", "PostgreSQL"):
        for run in ("live windows alone", "rebuild worker beside the live worker", "live windows while a rebuild runs"):
            row = rebuilds[f"k. {run} ({label})"]
            assert parse_number(row["events/s"]) > 0 and parse_number(row["CPU s per million events"]) > 0, row
        assert rebuilds[f"k. rebuild worker beside the live worker ({label})"]["swap"].endswith(" s")


def test_the_legacy_import_case_reports_every_event_and_the_tables_hold_them(database_url: str, tmp_path: Path) -> None:
    """Case j on a small export: the figures it reports are of every event, and the tables hold each once."""
    events = 2500
    built = build_export(tmp_path, events, skills=120, seed=5)
    report = render(built, measure({"the database": database_url}, built, tmp_path))
    row = table_rows(report, "| database |")["the database"]

    # What the export holds and owes, counted here from the model's documents, not from its figures.
    created = list(built.deployment.created())
    cursor = built.deployment.cursor
    exported = [document for document, pruned in created if not pruned]
    above = [document for document, _pruned in created if cursor is None or document["_creationTime"] > cursor]
    unprocessed = [document for document in exported if "processedAt" not in document]
    assert len(exported) == events and 0 < len(above) < events and 0 < len(unprocessed) < events
    assert parse_number(row["events"]) == events
    assert parse_number(row["windows applied"]) == len(above)
    assert parse_number(row["skills applied"]) == len(unprocessed)
    assert parse_number(row["history applied"]) == len(built.deployment.daily_rows) > 0
    assert parse_number(row["manifest rows"]) == len(above) + len(unprocessed) + len(built.deployment.daily_rows)
    assert parse_number(row["events/s"]) > 0 and parse_number(row["peak RSS"].removesuffix(" MiB")) > 0

    # The tables: every event ever created (the pruned ones too) counted once, by tests/helpers.py's restatement.
    records = [as_record(document) for document, _pruned in created]
    daily, _ = expected_windows(records)
    _, hourly = expected_windows([as_record(document) for document in above])
    want_skills, want_owners, _unknown = expected_docstats(records, built.deployment.registry)
    assert_four_tables(database_url, daily, hourly, want_skills, want_owners)


def parse_number(cell: str) -> float:
    return float(cell.replace(",", ""))


def table_rows(report: str, header: str) -> dict[str, dict[str, str]]:
    """first cell -> column -> cell, of the markdown table whose header line starts with `header`."""
    rows: dict[str, dict[str, str]] = {}
    columns: list[str] = []
    for line in report.splitlines():
        if line.startswith(header):
            columns = [cell.strip() for cell in line.strip("|").split("|")]
        elif columns and line.startswith("| ") and not line.startswith("|---"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[0]] = dict(zip(columns, cells, strict=True))
        elif columns and not line.startswith("|"):
            columns = []
    return rows


def sections_by_workload(report: str) -> dict[str, dict[str, dict[str, str]]]:
    """workload -> consumer -> column -> cell, from the markdown the bench prints."""
    sections: dict[str, dict[str, dict[str, str]]] = {}
    header: list[str] = []
    current: dict[str, dict[str, str]] = {}
    for line in report.splitlines():
        if match := re.match(r"### Workload `(\w+)`", line):
            current = sections.setdefault(match.group(1), {})
        elif line.startswith("### "):  # another part (case i): not a workload's table
            current, header = {}, []
        elif line.startswith("| consumer |"):
            header = [cell.strip() for cell in line.strip("|").split("|")]
        elif line.startswith("| ") and header and not line.startswith("|---"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            current[cells[0]] = dict(zip(header, cells, strict=True))
    return sections


def test_case_f_finds_the_kafka_jars_whatever_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kafka.sh keeps its jars in the checkout's .local (or SKILLSTATS_STATE_DIR): the bench looks there, not in
    the directory it was started from."""
    from skillstats_bench.measure import kafka_libs

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SKILLSTATS_STATE_DIR", raising=False)
    assert kafka_libs() == Path(__file__).resolve().parents[1] / ".local" / "kafka-libs"
    monkeypatch.setenv("SKILLSTATS_STATE_DIR", str(tmp_path / "state"))
    assert kafka_libs() == tmp_path / "state" / "kafka-libs"


def test_a_process_cpu_read_from_proc_is_its_own_and_grows() -> None:
    """cpu_seconds_so_far (the steady CPU's two readings) reads this process's user + system time: what
    time.process_time says, to the kernel's tick, and more after some work."""
    before = cpu_seconds_so_far(os.getpid())
    spent = time.process_time()
    while time.process_time() - spent < 0.3:
        pass
    after = cpu_seconds_so_far(os.getpid())
    assert after - before >= 0.2
    assert abs(after - time.process_time()) < 0.1
