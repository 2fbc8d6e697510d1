"""kill -9 of the windows worker at random points: nothing lost, nothing counted twice."""

from __future__ import annotations

import random
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from skillstats.config import Settings
from skillstats.dlq import H_OFFSET, H_PARTITION
from skillstats.workload import generate
from tests.conftest import record_metric
from tests.helpers import (
    WorkerProcess,
    actual_windows,
    caught_up,
    expected_windows,
    fences,
    publish,
    read_topic,
    wait_until,
)

EVENTS = 40_000
KILLS = 3


@pytest.mark.faults  # with the fault suite's five kills under load (test_faults_cluster.py)
def test_kill_9_mid_stream_then_restart(settings: Settings, tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    records = list(generate(EVENTS, now_ms=int(time.time() * 1000), skills=1500, seed=seed, invalid_ratio=0.005))
    # Kill points as shares of the stream applied so far, drawn anew each run.
    # The first kill comes while only the first half is published (so below 0.5);
    # the rest of the stream arrives while the worker is being killed and restarted.
    first = rng.uniform(0.1, 0.45)
    kill_points = [first, *sorted(rng.uniform(first, 0.85) for _ in range(KILLS - 1))]
    log = tmp_path / "worker.log"

    half = len(records) // 2
    assert publish(settings, records[:half]) == half
    worker = WorkerProcess(settings, log, "--fetch-size", "500", "--batch-size", "1000", "--instance-id", "worker-a")
    for index, share in enumerate(kill_points):
        if index == 1:
            # The rest of the stream arrives while the worker is being killed and restarted.
            assert publish(settings, records[half:]) == len(records) - half
        target = int(share * EVENTS)
        wait_until(applied_at_least(settings, worker, target), 120, f"{target} records applied", interval=0.02)
        worker.kill9()
        applied = sum(fences(settings, settings.windows_group).values())
        record_metric(
            f"kill -9 ({settings.database_url.split(':')[0]}, seed {seed}): killed at {applied} "
            f"of {EVENTS} records applied (aimed at {target})"
        )
        worker = WorkerProcess(
            settings, log, "--fetch-size", "500", "--batch-size", "1000", "--instance-id", "worker-a"
        )

    wait_until(caught_up(settings, settings.windows_group, worker), 180, "the restarted worker to catch up")
    assert worker.terminate() == 0, worker.log_tail()

    expected_daily, expected_hourly = expected_windows(records)
    daily, hourly = actual_windows(settings)
    assert daily == expected_daily, f"seed {seed}"
    assert hourly == expected_hourly, f"seed {seed}"
    # Every invalid record is parked exactly once, kills between the DLQ
    # acknowledgement and the SQL commit included (the DLQ marks, skillstats/dlq.py).
    parked = Counter((h[H_PARTITION], h[H_OFFSET]) for _, _, h in read_topic(settings, settings.dlq_topic))
    assert len(parked) == sum(1 for r in records if not r.valid), f"seed {seed}"
    assert [key for key, times in parked.items() if times > 1] == [], f"seed {seed}: parked more than once"


def applied_at_least(settings: Settings, worker: WorkerProcess, target: int) -> Callable[[], bool]:
    deadline = time.monotonic() + 110

    def check() -> bool:
        worker.assert_alive()
        if time.monotonic() > deadline:
            raise AssertionError(f"worker stalled below {target}; its log:\n{worker.log_tail(80)}")
        return sum(fences(settings, settings.windows_group).values()) >= target

    return check


@pytest.mark.faults  # two workers joining and leaving over a stream: in the longer suite
def test_rebalances_between_two_workers(settings: Settings, tmp_path: Path) -> None:
    records = list(generate(EVENTS, now_ms=int(time.time() * 1000), skills=1500, seed=5, invalid_ratio=0.005))
    third = len(records) // 3
    publish(settings, records[:third])
    first = WorkerProcess(settings, tmp_path / "a.log", "--fetch-size", "500")
    wait_until(lambda: sum(fences(settings, settings.windows_group).values()) >= third // 2, 120, "a first batch")
    second = WorkerProcess(settings, tmp_path / "b.log", "--fetch-size", "500")  # joins: partitions move
    publish(settings, records[third : 2 * third])
    wait_until(lambda: sum(fences(settings, settings.windows_group).values()) >= third, 120, "the second third")
    assert first.terminate() == 0, first.log_tail()  # leaves: its partitions move to `second`
    publish(settings, records[2 * third :])
    wait_until(caught_up(settings, settings.windows_group, second), 180, "the remaining worker to catch up")
    assert second.terminate() == 0, second.log_tail()

    expected_daily, expected_hourly = expected_windows(records)
    daily, hourly = actual_windows(settings)
    assert daily == expected_daily
    assert hourly == expected_hourly
    # Both took part: each applied records of its own.
    assert applied_by(first) > 0 and applied_by(second) > 0


def applied_by(worker: WorkerProcess) -> int:
    return sum(int(n) for n in re.findall(r"batch of \d+: applied (\d+)", worker.log_path.read_text()))
