"""A small run of the benchmark, so the harness cannot rot (no figure is asserted)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from skillstats.config import Settings
from tests.conftest import settings_env


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


def parse_number(cell: str) -> float:
    return float(cell.replace(",", ""))


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
