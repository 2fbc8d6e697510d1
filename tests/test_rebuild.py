"""`skillstats rebuild`: the windows tables recomputed from the log beside the live ones and swapped in, on the real
broker and both databases, with the live worker running and events arriving throughout."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select, update

from skillstats.config import Settings
from skillstats.lag import LagExporter
from skillstats.sinks.db import open_engine
from skillstats.sinks.schema import rebuilds, skill_daily_stats
from skillstats.status import status as skillstats_status
from skillstats.workload import generate
from tests.conftest import settings_env
from tests.helpers import (
    WorkerProcess,
    actual_windows,
    caught_up,
    expected_windows,
    publish,
    recreate_topic,
    wait_until,
)
from tests.scenario import SKILLS, SteadyPublisher


def rebuild(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skillstats.cli", "rebuild", *args],
        env=settings_env(settings),
        capture_output=True,
        text=True,
        timeout=180,
    )


def status(settings: Settings) -> dict[str, object]:
    done = rebuild(settings, "status", "--json")
    assert done.returncode in (0, 1) and done.stdout, done.stderr
    return json.loads(done.stdout)


def measured_rebuild_groups(settings: Settings) -> tuple[list[str], set[str]]:
    """The rebuild groups `skillstats status` lists, and those the lag exporter serves lag series of (role
    "rebuild")."""
    listed = [g["group"] for g in skillstats_status(settings).report["groups"] if g["role"] == "rebuild"]
    exporter = LagExporter(settings, interval=60, timeout=10, open_database=lambda: open_engine(settings.database_url))
    try:
        exporter.read_database()
        exporter.refresh()
        served = {
            sample.labels["group"]
            for family in exporter.collect()
            if family.name == "skillstats_consumer_lag_records"
            for sample in family.samples
            if sample.labels["role"] == "rebuild"
        }
    finally:
        exporter.close()
    return listed, served


def corrupt(settings: Settings, days: list[date], skill: str, extra: int) -> None:
    """A bug's work: `extra` downloads too many on `skill`'s daily rows of `days` (rows that exist)."""
    engine = open_engine(settings.database_url)
    try:
        with engine.begin() as connection:
            for day in days:
                changed = connection.execute(
                    update(skill_daily_stats)
                    .where(skill_daily_stats.c.skill_id == skill, skill_daily_stats.c.day == day)
                    .values(downloads=skill_daily_stats.c.downloads + extra)
                ).rowcount
                assert changed == 1, (skill, day)
    finally:
        engine.dispose()


@pytest.mark.faults  # a slow scenario: the default test run stays inside its 15 minutes
def test_a_rebuild_swapped_in_under_load_fixes_the_days_it_owns_and_a_rollback_puts_the_old_tables_back(
    settings: Settings, tmp_path: Path
) -> None:
    now_ms = int(time.time() * 1000)
    first = list(generate(6000, now_ms=now_ms, skills=SKILLS, seed=31, invalid_ratio=0.01, days=6, late_ratio=0.3))
    assert publish(settings, first) == len(first)
    live = WorkerProcess(settings, tmp_path / "live.log")
    wait_until(caught_up(settings, settings.windows_group, live), 120, "the live worker caught up")
    today = datetime.now(UTC).date()
    from_day = today - timedelta(days=2)
    daily, _hourly = expected_windows(first)
    # A skill with a row on an owned day and one on a carried day: the bug touched both.
    skill = next(
        s
        for s in sorted({s for s, _d in daily})
        if (s, from_day) in daily and (s, from_day - timedelta(days=2)) in daily
    )
    owned_day, carried_day = from_day, from_day - timedelta(days=2)
    corrupt(settings, [owned_day, carried_day], skill, 7)

    started = rebuild(settings, "start", "--from", from_day.isoformat())
    assert started.returncode == 0, started.stderr
    assert f"the days from {from_day.isoformat()} on" in started.stdout
    with SteadyPublisher(settings, 400, seed=32) as publisher:
        worker = WorkerProcess(settings, tmp_path / "rebuild.log", "--rebuild")
        wait_until(lambda: worker.assert_alive() or status(settings)["swap_allowed"], 120, "the rebuild caught up")
        # Measured as the rebuild, beside the live groups: listed by status, its lag served with role "rebuild".
        group = status(settings)["rebuild"]["group"]  # type: ignore[index]
        assert measured_rebuild_groups(settings) == ([group], {group})
        compared = rebuild(settings, "diff", "--json")
        assert compared.returncode == 1 and compared.stdout, compared.stdout + compared.stderr
        found = json.loads(compared.stdout)
        # The owned day's corrupted row, and nothing else (the carried day is not the rebuild's to judge).
        assert found["differing"] == {"skill_hourly_stats": 0, "skill_daily_stats": 1}, found
        row = found["first"][0]
        assert (row["skill_id"], row["bucket"]) == (skill, owned_day.isoformat())
        assert row["live"][0] - row["rebuilt"][0] == 7
        wait_until(lambda: publisher.confirmed_since(0) > 400, 60, "events arriving during the swap")
        swapped = rebuild(settings, "swap", "--confirm", "SWAP")
        assert swapped.returncode == 0, swapped.stderr
        assert "is live" in swapped.stdout
        # The rebuild's worker finds its rebuild swapped in at its next transaction and stops, exit 2.
        wait_until(lambda: worker.process.poll() is not None, 60, "the rebuild worker stopped")
        assert worker.process.returncode == 2, worker.log_tail()
        wait_until(lambda: publisher.confirmed_since(0) > 1200, 60, "events arriving after the swap")
        assert measured_rebuild_groups(settings) == ([], set())
        sent = publisher.stop()
    wait_until(caught_up(settings, settings.windows_group, live), 120, "the live worker caught up after the swap")
    live.assert_alive()
    want_daily, want_hourly = expected_windows(first + sent)
    got_daily, got_hourly = actual_windows(settings)
    assert got_hourly == want_hourly
    # Fixed where the rebuild owns the day; carried over as it was where it does not.
    carried = dict(want_daily)
    carried[(skill, carried_day)] = (want_daily[(skill, carried_day)][0] + 7, want_daily[(skill, carried_day)][1])
    assert got_daily == carried
    info = status(settings)
    assert info["rebuild"] is None and info["previous_kept"] is True

    rolled = rebuild(settings, "rollback", "--confirm", "ROLLBACK")
    assert rolled.returncode == 0, rolled.stderr
    assert rolled.stdout.startswith("rolled back"), rolled.stdout
    got_daily, got_hourly = actual_windows(settings)
    assert got_hourly == want_hourly
    both = dict(carried)
    both[(skill, owned_day)] = (want_daily[(skill, owned_day)][0] + 7, want_daily[(skill, owned_day)][1])
    assert got_daily == both
    live.assert_alive()
    assert live.terminate() == 0
    engine = open_engine(settings.database_url)
    try:
        with engine.connect() as connection:
            states = [s for (s,) in connection.execute(select(rebuilds.c.state).order_by(rebuilds.c.id))]
    finally:
        engine.dispose()
    assert states == ["previous", "live"]


@pytest.mark.faults  # a slow scenario: the default test run stays inside its 15 minutes
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_record_the_live_database_refused_is_counted_by_the_swap_and_refused_again_only_by_the_swap_back(
    settings: Settings, tmp_path: Path
) -> None:
    from skillstats.kafka import end_offsets
    from skillstats.rebuild import generations
    from skillstats.rebuild.log import read_between
    from skillstats.sinks.rebuild import LIVE_TABLES, add_events
    from skillstats.sinks.schema import rejected_records
    from skillstats.sinks.upserts import now_utc_naive

    records = list(generate(1500, now_ms=int(time.time() * 1000), skills=SKILLS, seed=51, days=2))
    assert publish(settings, records) == len(records)
    live = WorkerProcess(settings, tmp_path / "live.log")
    wait_until(caught_up(settings, settings.windows_group, live), 120, "the live worker caught up")
    assert live.terminate() == 0
    # The live group's database refused one record: it counts nowhere, and its row says so (a replay's proof).
    ends = end_offsets(settings, settings.topic)
    refused = read_between(settings, settings.topic, {p: (0, end) for p, end in ends.items()})[7]
    engine = open_engine(settings.database_url)

    def refused_rows() -> int:
        with engine.connect() as connection:
            return len(connection.execute(select(rejected_records)).all())

    try:
        with engine.begin() as connection:
            add_events(connection, LIVE_TABLES, [refused.event], -1, now_utc_naive())
            connection.execute(
                rejected_records.insert().values(
                    group_id=settings.windows_group,
                    topic=settings.topic,
                    partition=refused.partition,
                    offset=refused.offset,
                    rejected_at=now_utc_naive(),
                )
            )
        without = actual_windows(settings)
        assert rebuild(settings, "start", "--from-start").returncode == 0
        worker = WorkerProcess(settings, tmp_path / "rebuild.log", "--rebuild")
        wait_until(lambda: worker.assert_alive() or status(settings)["gap"] == 0, 120, "the rebuild caught up")
        assert worker.terminate() == 0
        swapped = rebuild(settings, "swap", "--confirm", "SWAP")
        assert swapped.returncode == 0 and "1 record(s) the live group's database had refused" in swapped.stdout
        assert actual_windows(settings) == expected_windows(records) and refused_rows() == 0
        # Rolled back half-way (the swap back not made yet): the live tables count the record, so no row says it
        # was refused; a DLQ replay now would count it twice.
        rolled = generations.rollback(engine, settings)
        assert rolled.behind == 0
        assert actual_windows(settings) == expected_windows(records) and refused_rows() == 0
        generations.swap(engine, settings)
        assert actual_windows(settings) == without and refused_rows() == 1
    finally:
        engine.dispose()


# The topic's id is asked of Kafka, not of the database: the same for either database. A fault (a topic deleted
# and created again), and slow: in the fault suite.
@pytest.mark.faults
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_swap_status_and_diff_refuse_a_topic_created_again_while_both_workers_were_stopped(
    settings: Settings, tmp_path: Path
) -> None:
    now_ms = int(time.time() * 1000)
    first = list(generate(2000, now_ms=now_ms, skills=SKILLS, seed=41, days=2))
    assert publish(settings, first) == len(first)
    live = WorkerProcess(settings, tmp_path / "live.log")
    wait_until(caught_up(settings, settings.windows_group, live), 120, "the live worker caught up")
    assert rebuild(settings, "start", "--from-start").returncode == 0
    worker = WorkerProcess(settings, tmp_path / "rebuild.log", "--rebuild")
    wait_until(lambda: worker.assert_alive() or status(settings)["gap"] == 0, 120, "the rebuild at the live fences")
    assert worker.terminate() == 0
    # The live group goes on alone: the swap would read the records between the two groups' fences from the log.
    more = list(generate(500, now_ms=now_ms, skills=SKILLS, seed=42, days=2))
    assert publish(settings, more) == len(more)
    wait_until(caught_up(settings, settings.windows_group, live), 120, "the live worker caught up again")
    assert live.terminate() == 0
    assert status(settings)["gap"] > 0
    tables = actual_windows(settings)

    recreate_topic(settings, 12)
    other = list(generate(3000, now_ms=now_ms, skills=SKILLS, seed=43, days=2))
    assert publish(settings, other) == len(other)  # the new log holds records at every offset the fences name

    swapped = rebuild(settings, "swap", "--confirm", "SWAP")
    assert swapped.returncode == 2 and "created again" in swapped.stderr, swapped.stdout + swapped.stderr
    compared = rebuild(settings, "diff")
    assert compared.returncode == 2 and "created again" in compared.stderr, compared.stdout + compared.stderr
    info = status(settings)
    assert info["failing"] is True and info["swap_allowed"] is False, info
    assert actual_windows(settings) == tables
    assert info["rebuild"] is not None  # nothing changed: still building, the live tables as they were


@pytest.mark.faults  # a slow scenario: the default test run stays inside its 15 minutes
def test_a_rebuild_is_refused_when_retention_cut_what_it_needs(settings: Settings) -> None:
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    records = list(generate(600, now_ms=int(time.time() * 1000), skills=SKILLS, seed=33))
    assert publish(settings, records) == len(records)
    live = rebuild(settings, "start", "--from-start", "--dry-run")
    assert live.returncode == 2 and "no windows group counts" in live.stderr, live.stderr
    engine = open_engine(settings.database_url)
    from skillstats.sinks.identity import WINDOWS, Owner, claim
    from skillstats.sinks.upserts import now_utc_naive

    claim(engine, Owner(WINDOWS, settings.windows_group, settings.topic, None), now_utc_naive())
    engine.dispose()
    whole = rebuild(settings, "start", "--from-start", "--dry-run")
    assert whole.returncode == 0 and "every day (retention has deleted nothing)" in whole.stdout, whole.stderr
    admin = AdminClient({"bootstrap.servers": settings.kafka_bootstrap})
    cut = [TopicPartition(settings.topic, p, 10) for p in range(12)]
    for future in admin.delete_records(cut).values():
        future.result(30)
    today = datetime.now(UTC).date()
    refused = rebuild(settings, "start", "--from", today.isoformat())
    assert refused.returncode == 2, refused.stdout
    assert f"no longer holds every event of {today.isoformat()}" in refused.stderr
    earliest = rebuild(settings, "start", "--from-start")
    assert earliest.returncode == 0, earliest.stderr
    # Every retained record is stamped today: the first day the log wholly holds is tomorrow (or the day after,
    # within ten minutes of midnight).
    assert any(f"the days from {(today + timedelta(days=n)).isoformat()} on" in earliest.stdout for n in (1, 2))
    # A rebuild's fences are its tables' truth: the operator's fence tools leave them alone.
    group = status(settings)["rebuild"]["group"]  # type: ignore[index]
    moved = subprocess.run(
        [sys.executable, "-m", "skillstats.cli", "fences", "reset", "--group", group, "--to", "start"],
        env=settings_env(settings),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert moved.returncode == 2 and "is a rebuild's" in moved.stderr, moved.stderr


@pytest.mark.faults
def test_kill_9_of_the_rebuild_worker_and_of_the_live_worker_around_the_swap_loses_and_doubles_nothing(
    settings: Settings, tmp_path: Path
) -> None:
    now_ms = int(time.time() * 1000)
    first = list(generate(20_000, now_ms=now_ms, skills=SKILLS, seed=41, invalid_ratio=0.01, days=4, late_ratio=0.3))
    assert publish(settings, first) == len(first)
    live = WorkerProcess(settings, tmp_path / "live.log")
    wait_until(caught_up(settings, settings.windows_group, live), 120, "the live worker caught up")
    started = rebuild(settings, "start", "--from-start")
    assert started.returncode == 0, started.stderr
    with SteadyPublisher(settings, 500, seed=42) as publisher:
        worker = WorkerProcess(settings, tmp_path / "rebuild.log", "--rebuild", "--batch-size", "500")
        wait_until(lambda: sum(status(settings)["rows"].values()) > 0, 120, "the rebuild wrote rows")  # type: ignore[union-attr]
        worker.kill9()
        worker = WorkerProcess(settings, tmp_path / "rebuild-2.log", "--rebuild")
        wait_until(lambda: worker.assert_alive() or status(settings)["swap_allowed"], 180, "the rebuild caught up")
        swapped = rebuild(settings, "swap", "--confirm", "SWAP")
        assert swapped.returncode == 0, swapped.stderr
        live.kill9()  # whatever it had in flight
        live = WorkerProcess(settings, tmp_path / "live-2.log")
        wait_until(lambda: publisher.confirmed_since(0) > 1500, 60, "events arriving after the swap")
        sent = publisher.stop()
    wait_until(caught_up(settings, settings.windows_group, live), 180, "the live worker caught up after the swap")
    assert actual_windows(settings) == expected_windows(first + sent)
    wait_until(lambda: worker.process.poll() is not None, 60, "the rebuild worker stopped")
    assert live.terminate() == 0


@pytest.mark.faults  # a slow scenario: the default test run stays inside its 15 minutes
def test_a_rebuild_carries_over_the_days_a_legacy_import_added_to(settings: Settings, tmp_path: Path) -> None:
    from sqlalchemy import delete

    from skillstats.sinks.schema import imported_days
    from tests.helpers import expected_windows as windows_of
    from tests.helpers import nonzero
    from tests.test_legacy import history_of_a_registry, imported

    old = history_of_a_registry(5)
    old.move_registry(settings.database_url)
    export = old.export(tmp_path / "snapshot", as_zip=True)
    imported(export, settings.database_url, "--history")
    # An import from before the days were recorded: the rebuild cannot know which days hold imported counts.
    engine = open_engine(settings.database_url)
    with engine.begin() as connection:
        connection.execute(delete(imported_days))
    live_records = list(generate(2000, now_ms=int(time.time() * 1000), skills=SKILLS, seed=51, days=3))
    assert publish(settings, live_records) == len(live_records)
    live = WorkerProcess(settings, tmp_path / "live.log")
    wait_until(caught_up(settings, settings.windows_group, live), 120, "the live worker caught up")
    refused = rebuild(settings, "start", "--from-start")
    assert refused.returncode == 2 and "Run the same `skillstats legacy import" in refused.stderr, refused.stderr
    imported(export, settings.database_url, "--history")  # applies nothing again; records the days
    with engine.connect() as connection:
        assert connection.execute(select(imported_days.c.day)).first() is not None
    engine.dispose()
    started = rebuild(settings, "start", "--from-start")
    assert started.returncode == 0, started.stderr
    assert "every day" in started.stdout
    worker = WorkerProcess(settings, tmp_path / "rebuild.log", "--rebuild")
    wait_until(lambda: worker.assert_alive() or status(settings)["swap_allowed"], 120, "the rebuild caught up")
    compared = rebuild(settings, "diff")
    assert compared.returncode == 0, compared.stdout + compared.stderr
    assert "the tables agree" in compared.stdout and "day(s) holding imported counts" in compared.stdout
    before = actual_windows(settings)
    swapped = rebuild(settings, "swap", "--confirm", "SWAP")
    assert swapped.returncode == 0, swapped.stderr
    assert actual_windows(settings) == before  # the imported history and the live counts, all kept
    daily, _hourly = windows_of([*old.records(), *live_records])
    assert nonzero(actual_windows(settings)[0]) == nonzero(daily)
    wait_until(lambda: worker.process.poll() is not None, 60, "the rebuild worker stopped")
    assert live.terminate() == 0
