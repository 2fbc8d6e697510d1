"""Usage mistakes a newcomer makes, refused at once with exit status 2 and a message that says what to do.

Run as a user runs the CLI: a subprocess, its output and exit code. Nothing
here needs Kafka or a database: each mistake is caught before connecting.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from skillstats.streams.docsync import parse_interval


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SKILLSTATS_KAFKA_BOOTSTRAP": "127.0.0.1:1", "SKILLSTATS_DATABASE_URL": "sqlite:///unused.db"}
    return subprocess.run(
        [sys.executable, "-m", "skillstats.cli", *args], env=env, capture_output=True, text=True, timeout=20
    )


@pytest.mark.parametrize("every", ["6", "0s", "-5m", "6 hours", "h", "nans"])
def test_docsync_every_needs_a_positive_interval_with_a_unit(every: str) -> None:
    result = run_cli("docsync", f"--every={every}")
    assert result.returncode == 2, result.stderr
    assert "e.g. 30s, 15m, 6h" in result.stderr or "positive" in result.stderr
    assert "Traceback" not in result.stderr


def test_intervals_with_units() -> None:
    assert [parse_interval(t) for t in ("30s", "15m", "6h", "1d", "1.5h")] == [30, 900, 21600, 86400, 5400]


@pytest.mark.parametrize("kind", ["download", "install_new", "star"])
def test_a_delta_on_a_kind_without_one_is_refused(kind: str) -> None:
    result = run_cli("publish", "--skill-id", "sk_1", "--kind", kind, "--delta-all-time", "5")
    assert result.returncode == 2
    assert "install_clear only" in result.stderr and kind in result.stderr
