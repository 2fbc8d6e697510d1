"""A fence ahead of the log is loud, and `skillstats fences reset` is the explicit way out (docs/contract.md)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from skillstats.config import Settings
from skillstats.workload import generate
from tests.helpers import (
    WorkerProcess,
    actual_windows,
    caught_up,
    expected_windows,
    fences,
    forget_topic_ids,
    publish,
    recreate_topic,
    wait_until,
)
from tests.test_publish import cli


def test_windows_refuses_a_fence_ahead_of_the_log_until_reset(settings: Settings, tmp_path: Path) -> None:
    """In a database migrated from before topic ids were kept, a recreated topic shorter than the fences is caught
    by the fences (with the id recorded, the id comes first: test_positions.py)."""
    now = int(time.time() * 1000)
    first = list(generate(3000, now_ms=now, skills=50, seed=1))
    assert publish(settings, first) == len(first)
    worker = WorkerProcess(settings, tmp_path / "a.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the first worker to catch up")
    assert worker.terminate() == 0, worker.log_tail()
    before = actual_windows(settings)
    fences_before = fences(settings, settings.windows_group)

    forget_topic_ids(settings)
    recreate_topic(settings, 12)
    second = list(generate(300, now_ms=now, skills=50, seed=2))
    assert publish(settings, second) == len(second)

    # The worker stops by itself, exit 2, naming the partition, its fence and the log end.
    refused = WorkerProcess(settings, tmp_path / "b.log")
    code = refused.process.wait(120)
    log = refused.log_path.read_text(errors="replace")
    assert code == 2, log[-3000:]
    assert "past the end of topic" in log and "fence" in log and "log end" in log, log[-3000:]
    assert actual_windows(settings) == before
    assert fences(settings, settings.windows_group) == fences_before

    status = cli(settings, "status")
    assert status.returncode == 1, status.stderr  # for on-call scripts: a group refuses to run
    assert "FENCE AHEAD OF LOG" in status.stdout

    dry = cli(settings, "fences", "reset", "--group", settings.windows_group, "--to", "start")
    assert dry.returncode == 0, dry.stderr
    assert "AHEAD OF LOG" in dry.stdout and "dry run" in dry.stdout
    assert fences(settings, settings.windows_group) == fences_before
    wrong = cli(settings, "fences", "reset", "--group", settings.windows_group, "--to", "start", "--confirm", "yes")
    assert wrong.returncode == 2 and "RESET_FENCES" in wrong.stderr

    done = cli(
        settings, "fences", "reset", "--group", settings.windows_group, "--to", "start", "--confirm", "RESET_FENCES"
    )
    assert done.returncode == 0, done.stderr
    worker = WorkerProcess(settings, tmp_path / "c.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to count the new topic")
    assert worker.terminate() == 0, worker.log_tail()
    assert actual_windows(settings) == expected_windows(first + second)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_reset_says_what_it_counts_again_and_waits_for_the_group_to_stop(settings: Settings, tmp_path: Path) -> None:
    records = list(generate(1200, now_ms=int(time.time() * 1000), skills=40, seed=7))
    assert publish(settings, records) == len(records)
    worker = WorkerProcess(settings, tmp_path / "a.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to catch up")
    reset = ["fences", "reset", "--group", settings.windows_group, "--to", "start"]
    dry = cli(settings, *reset)
    assert dry.returncode == 0, dry.stderr
    assert "1,200 record(s) already counted would be counted again" in dry.stdout, dry.stdout
    assert "counted again" in dry.stdout.splitlines()[1]  # per partition, too
    running = cli(settings, *reset, "--confirm", "RESET_FENCES")
    assert running.returncode == 2 and "active member" in running.stderr, running.stderr
    assert sum(fences(settings, settings.windows_group).values()) == 1200  # nothing changed
    assert worker.terminate() == 0
    helped = " ".join(cli(settings, "fences", "reset", "--help").stdout.split())
    assert "Not the tool for a database restored from a backup of its own" in helped
