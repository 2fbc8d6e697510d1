"""Bounded shutdown (skillstats/shutdown.py): SIGTERM gets a consumer out within its budget, or out loudly.

A database that hangs (a lock held elsewhere) and a broker that is gone are the
two ways a shutdown can hang. In both the process must be gone within the
budget and a small margin for the interpreter to exit: status 0 after a clean
stop, or status 3 with a message that says the budget ran out. Never silence,
never a hang until SIGKILL. And in both the counts stay exact: a worker started
afterwards applies what the stopped one did not, once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from skillstats.config import Settings
from skillstats.kafka import ensure_topics
from skillstats.shutdown import EXIT_SHUTDOWN_OVERRUN
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from skillstats.workload import generate
from tests.conftest import record_metric, settings_env
from tests.helpers import (
    WorkerProcess,
    actual_windows,
    caught_up,
    expected_windows,
    free_port,
    get,
    local_service,
    publish,
    wait_until,
)

pytestmark = pytest.mark.faults
BUDGET_S = 6
ROOT = Path(__file__).resolve().parent.parent
# How long past its budget a process may take to be gone: interpreter teardown, not work.
EXIT_MARGIN_S = 10


def records(seed: int, count: int = 2000) -> list:
    return list(generate(count, now_ms=int(time.time() * 1000), skills=100, seed=seed))


def waiting_on_lock(settings: Settings, table: str) -> bool:
    """True once some session waits for a lock on `table` (the consumer's transaction, blocked)."""
    engine = create_engine(settings.database_url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.connect() as connection:
            waiting = connection.execute(
                text("SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = CAST(:t AS regclass)"),
                {"t": table},
            ).scalar()
        return bool(waiting)
    finally:
        engine.dispose()


def stopped_within_budget(process: subprocess.Popen[bytes], what: str) -> int:
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        status = process.wait(BUDGET_S + EXIT_MARGIN_S)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(f"still running {time.monotonic() - started:.0f}s after SIGTERM") from None
    assert status in (0, EXIT_SHUTDOWN_OVERRUN), status
    record_metric(
        f"shutdown, {what}: exit {status} {time.monotonic() - started:.1f}s after SIGTERM (budget {BUDGET_S}s)"
    )
    return status


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_windows_stops_within_its_budget_while_the_database_hangs(settings: Settings, tmp_path: Path) -> None:
    port = free_port()
    first = records(1)
    worker = WorkerProcess(
        settings, tmp_path / "worker.log", "--shutdown-budget", str(BUDGET_S), "--metrics-port", str(port)
    )
    publish(settings, first)
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to apply the first events")

    # Another session holds the hourly table: the next batch waits on the lock.
    holder = create_engine(settings.database_url.replace("postgresql://", "postgresql+psycopg://")).connect()
    holder.execute(text("LOCK TABLE skill_hourly_stats IN ACCESS EXCLUSIVE MODE"))
    try:
        second = records(2)
        publish(settings, second)
        wait_until(
            lambda: worker.assert_alive() or waiting_on_lock(settings, "skill_hourly_stats"),
            60,
            "the worker's batch to wait on the lock",
        )
        assert get(f"http://127.0.0.1:{port}/healthz")[0] == 200  # hanging on the database is not dead
        # The event loop is free: the batch stuck in the database is abandoned after its share
        # of the budget, the group left, a clean exit.
        assert stopped_within_budget(worker.process, "windows, database hanging") == 0, worker.log_tail()
        assert "abandoned an in-flight batch" in worker.log_tail(200)
    finally:
        holder.rollback()
        holder.close()

    again = WorkerProcess(settings, tmp_path / "again.log")
    wait_until(caught_up(settings, settings.windows_group, again), 120, "a new worker to apply the rest")
    assert again.terminate() == 0
    assert actual_windows(settings) == expected_windows(first + second)


@pytest.fixture
def own_kafka(tmp_path: Path) -> Iterator[str]:
    """A single-node Kafka of this test's own, so the test can take it away."""
    port = free_port()
    # One node, whatever the cluster of the suite has (the fault suite's is three).
    env = {"KAFKA_PORT": str(port), "KAFKA_NODES": "1", "SKILLSTATS_STATE_DIR": str(tmp_path / "state")}
    (tmp_path / "state").mkdir()
    os.symlink(ROOT / ".local" / "kafka-libs", tmp_path / "state" / "kafka-libs")
    local_service("kafka.sh", "start", **env)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        local_service("kafka.sh", "reset", **env)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_windows_stops_within_its_budget_when_the_broker_is_gone(
    database_url: str, own_kafka: str, tmp_path: Path
) -> None:
    settings = Settings(
        kafka_bootstrap=own_kafka,
        database_url=database_url,
        topic="events",
        dlq_topic="events.dlq",
        windows_group="windows",
        docsync_group="docsync",
    )
    ensure_topics(settings, {settings.topic: 4, settings.dlq_topic: 1})
    upgrade(open_engine(database_url))
    first = records(3, 500)
    publish(settings, first)
    worker = WorkerProcess(settings, tmp_path / "worker.log", "--shutdown-budget", str(BUDGET_S))
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to apply the events")

    local_service(
        "kafka.sh",
        "stop",
        KAFKA_PORT=own_kafka.rsplit(":", 1)[1],
        KAFKA_NODES="1",
        SKILLSTATS_STATE_DIR=str(tmp_path / "state"),
    )
    status = stopped_within_budget(worker.process, "windows, broker gone")
    if status == EXIT_SHUTDOWN_OVERRUN:
        assert "shutdown took longer than its budget" in worker.log_tail(200)
    assert actual_windows(settings) == expected_windows(first)


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_docsync_stops_within_its_budget_while_the_database_hangs(settings: Settings, tmp_path: Path) -> None:
    publish(settings, records(4))
    holder = create_engine(settings.database_url.replace("postgresql://", "postgresql+psycopg://")).connect()
    holder.execute(text("LOCK TABLE skills IN ACCESS EXCLUSIVE MODE"))
    log = (tmp_path / "docsync.log").open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "skillstats.cli",
            "docsync",
            "--allow-empty-registry",
            "--shutdown-budget",
            str(BUDGET_S),
        ],
        env=settings_env(settings),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # Reading is quick; then the first chunk waits on the lock.
        wait_until(
            lambda: process.poll() is None and waiting_on_lock(settings, "skills"), 60, "the drain to wait on the lock"
        )
        # The drain's only thread waits in the database driver (for the lock timeout, a
        # minute): the budget runs out, and the watchdog says so.
        assert stopped_within_budget(process, "docsync, database hanging") == EXIT_SHUTDOWN_OVERRUN
        assert "shutdown took longer than its budget" in (tmp_path / "docsync.log").read_text()
    finally:
        holder.rollback()
        holder.close()
        log.close()
