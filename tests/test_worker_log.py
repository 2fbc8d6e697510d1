"""A normal start of the windows worker as an operator reads its log: what it does, nothing above INFO."""

from __future__ import annotations

import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from skillstats.allocator import Outcome
from skillstats.config import Settings
from skillstats.workload import generate
from tests.conftest import settings_env
from tests.helpers import caught_up, publish, wait_until


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_normal_start_logs_what_it_does_and_nothing_above_info(settings: Settings, tmp_path: Path) -> None:
    publish(settings, generate(500, now_ms=int(time.time() * 1000), skills=20, seed=1))
    log_path = tmp_path / "worker.log"
    with log_path.open("wb") as log_file:
        worker = subprocess.Popen(
            [sys.executable, "-m", "skillstats.cli", "windows"],  # default log level, stdout not a TTY
            env={
                k: v
                for k, v in settings_env(settings).items()
                if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD"))
            },
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_until(caught_up(settings, settings.windows_group), 120, "the worker to apply the stream")
            wait_until(lambda: "assigned partitions" in log_path.read_text(), 30, "the assignment line")
        finally:
            worker.send_signal(signal.SIGTERM)
            assert worker.wait(60) == 0
    text = log_path.read_text()
    lines = text.splitlines()
    assert "\x1b" not in text, "terminal escape codes in a log file"
    start = [line for line in lines if "skillstats windows: group" in line]
    assert len(start) == 1 and " INFO " in start[0]
    assert settings.topic in start[0] and settings.windows_group in start[0]
    loud = [line for line in lines if any(f" {level} " in line for level in ("WARNING", "ERROR", "CRITICAL"))]
    assert loud == [], "\n".join(loud)
    assert not any("batch of" in line for line in lines)  # per-batch lines are DEBUG
    allocator = [line for line in lines if "glibc" in line]  # skillstats/allocator.py
    expected = Outcome.FIXED if platform.libc_ver()[0] == "glibc" else Outcome.NOT_GLIBC
    assert len(allocator) == 1 and expected.value in allocator[0] and " INFO " in allocator[0], allocator
