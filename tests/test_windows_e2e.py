"""End to end: a randomized stream through real Kafka into SQLite and PostgreSQL."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import insert

from skillstats.config import Settings
from skillstats.dlq import H_OFFSET, H_PARTITION, H_REASON
from skillstats.kafka import committed_offsets
from skillstats.sinks.db import open_engine
from skillstats.sinks.schema import skills
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

EVENTS = 50_000


def test_randomized_stream_is_counted_exactly(settings: Settings, tmp_path: Path) -> None:
    now_ms = int(time.time() * 1000)
    records = list(generate(EVENTS, now_ms=now_ms, skills=3000, seed=11, invalid_ratio=0.01, late_ratio=0.1))
    invalid = [r for r in records if not r.valid]
    assert len(invalid) > 100 and len({r.value for r in invalid}) > 12
    # The registry has rows for only some skills; daily/hourly rows are due for all.
    registered = {f"sk_{i:06d}" for i in range(0, 3000, 2)}
    engine = open_engine(settings.database_url)
    with engine.begin() as connection:
        connection.execute(insert(skills), [{"id": skill, "owner_id": "u1"} for skill in sorted(registered)])
    engine.dispose()

    worker = WorkerProcess(settings, tmp_path / "worker.log")
    assert publish(settings, records) == EVENTS
    # From the first applied batch (the worker has joined the group) to caught up.
    first = wait_until(lambda: worker.assert_alive() or fences(settings, settings.windows_group), 120, "a batch")
    started, applied_first = time.monotonic(), sum(first.values())
    wait_until(caught_up(settings, settings.windows_group, worker), 180, "the windows worker to catch up")
    elapsed, measured = time.monotonic() - started, EVENTS - applied_first
    database = settings.database_url.split(":")[0]
    if elapsed >= 2 and measured >= EVENTS // 2:  # a rate only over a window long enough to mean one
        record_metric(
            f"windows e2e {database}: {measured} events applied at {measured / elapsed:,.0f} events/s "
            f"({elapsed:.1f}s from the first batch to caught up)"
        )
    else:
        record_metric(
            f"windows e2e {database}: caught up {elapsed:.1f}s after its first batch ({applied_first} of {EVENTS} "
            f"events in it): too short a window for a rate"
        )

    expected_daily, expected_hourly = expected_windows(records)
    daily, hourly = actual_windows(settings)
    assert daily == expected_daily
    assert hourly == expected_hourly
    assert {skill for skill, _ in daily} - registered, "no rows for skills the registry does not know"

    parked = read_topic(settings, settings.dlq_topic)
    assert Counter((k, v) for k, v, _ in parked) == Counter((r.key, r.value) for r in invalid)
    positions = [(h[H_PARTITION], h[H_OFFSET]) for _, _, h in parked]
    assert len(set(positions)) == len(positions), "a record was parked twice"
    assert {h[H_REASON].decode() for _, _, h in parked} == {
        "malformed",
        "unsupported_version",
        "bad_field",
        "key_mismatch",
        "unknown_kind",
        "bad_timestamp",
        "bad_delta",
    }

    # SIGTERM: a clean exit, and Kafka's committed offsets never ahead of SQL.
    assert worker.terminate() == 0, worker.log_tail()
    committed = committed_offsets(settings, settings.windows_group, settings.topic)
    applied = fences(settings, settings.windows_group)
    assert committed, "the worker committed nothing to Kafka"
    assert all(offset <= applied.get(partition, 0) for partition, offset in committed.items())


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_day_and_hour_boundaries(settings: Settings, tmp_path: Path) -> None:
    from skillstats.contract import make_event
    from skillstats.workload import Record

    midnight = int(time.time() * 1000) // 86_400_000 * 86_400_000
    times = [midnight - 1, midnight, midnight + 3_600_000 - 1, midnight + 3_600_000 - 0]
    times = [t - 86_400_000 for t in times]  # yesterday, so none is in the future
    events = [make_event("sk_edge", "download", t) for t in times]
    records = [Record(e.key, e.encode(), True) for e in events]
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    publish(settings, records)
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to catch up")
    daily, hourly = actual_windows(settings)
    worker.terminate()
    assert sorted((str(day), counts) for (_, day), counts in daily.items()) == [
        (str(_day(times[0])), (1, 0)),
        (str(_day(times[1])), (3, 0)),
    ]
    assert sorted(counts[0] for counts in hourly.values()) == [1, 1, 2]


def _day(ms: int) -> object:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(ms // 1000, UTC).date()
