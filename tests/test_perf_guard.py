"""A guard against gross performance regressions (issue 31): a short side by side of the bare confluent-kafka loop
and one windows worker on the test broker, the ratio printed with the run's measured figures.

Both read the same 200,000 backfill events and are timed from their first record to caught up (the bench's steady
rate, bench/measure.py: start-up is not in it). The bare loop's rate on so short a run is two-valued: about
1,300,000 events/s when every fetch is answered at once, about 170,000 when one partition's last fetch stalls for
a second (a third to a half of the runs here; the worker pays such stalls too). The slowest of five runs is taken,
the rate the worker is held to, and a comparison below the floor is made once more with fresh runs before it
fails: both attempts fall below it only if ten bare runs in a row miss the stall, or the worker really is several
times slower than today (0.6-0.9 here). In the fault suite, the longer run: about half a minute.
"""

from __future__ import annotations

import os
import sys
import uuid

import pytest
from skillstats_bench.measure import any_sql_progress, caught_up_sql, measure
from skillstats_bench.run import preload
from skillstats_bench.workload import WORKLOADS

from skillstats.config import Settings
from skillstats.kafka import end_offsets
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.windows import WindowsSink
from tests.conftest import record_metric, settings_env

FLOOR = 0.2
EVENTS = 200_000
BARE_RUNS = 5


def side_by_side(settings: Settings, group: str) -> tuple[float, list[float]]:
    """One windows worker of `group` from the topic's start to caught up, and BARE_RUNS bare loops: their rates."""
    ends = end_offsets(settings, settings.topic)
    bare_rates = []
    for _ in range(BARE_RUNS):
        argv = [sys.executable, "-m", "skillstats_bench", "bare", settings.kafka_bootstrap, settings.topic]
        argv += [f"guard-bare-{uuid.uuid4().hex[:8]}", str(EVENTS)]
        bare_rates.append(measure("bare loop", argv, dict(os.environ), EVENTS, None).rate)
    engine = open_engine(settings.database_url)
    sink = WindowsSink(engine, group, settings.topic)
    worker = [sys.executable, "-m", "skillstats.cli", "windows", "--metrics-port", "0", "--group", group]
    windows = measure(
        "windows", worker, settings_env(settings), EVENTS, caught_up_sql(sink, ends), any_sql_progress(sink)
    )
    engine.dispose()
    return windows.rate, bare_rates


@pytest.mark.faults
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_one_windows_worker_keeps_a_fifth_of_the_bare_loops_rate(settings: Settings, tmp_path: object) -> None:
    preload(settings, settings.topic, EVENTS, 20_000, WORKLOADS["backfill"])
    assert sum(end_offsets(settings, settings.topic).values()) == EVENTS
    ratios = []
    for attempt in range(2):
        # Each attempt a database of its own: the windows tables of one group per database.
        attempt_settings = settings.override(database_url=f"sqlite:///{tmp_path}/guard-{attempt}.db")
        upgrade(open_engine(attempt_settings.database_url))
        windows, bare_rates = side_by_side(attempt_settings, f"{settings.windows_group}-{attempt}")
        ratio = windows / min(bare_rates)
        ratios.append(ratio)
        shown = ", ".join(f"{rate:,.0f}" for rate in bare_rates)
        record_metric(
            f"performance guard: windows (SQLite) {windows:,.0f} events/s, bare loop {min(bare_rates):,.0f} "
            f"events/s (slowest of {shown}), ratio {ratio:.2f} over {EVENTS:,} backfill events (floor {FLOOR})"
        )
        if ratio >= FLOOR:
            return
    pytest.fail(f"one windows worker ran at {ratios[0]:.2f}x, then {ratios[1]:.2f}x the bare loop: below {FLOOR}")
