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
        ],
        env=settings_env(settings),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    table = result.stdout
    for case in (
        "a. bare confluent-kafka loop",
        "b. loop + decode/validate",
        "c. skillstats windows (SQLite)",
        "c. skillstats windows (PostgreSQL)",
        "d. skillstats docsync drain (SQLite)",
        "d. skillstats docsync drain (PostgreSQL)",
        "e. naive faust",
        "f. kafka-consumer-perf-test",
    ):
        row = next((line for line in table.splitlines() if line.startswith(f"| {case}")), None)
        assert row, f"no row for {case} in:\n{table}"
        rate = row.split("|")[2].strip().replace(",", "")
        assert float(rate) > 0
    assert re.search(r"p50 \d+ ms, p99 \d+ ms", table), table
