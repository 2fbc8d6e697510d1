"""Database faults that are not about the data are retried, never parked (docs/contract.md), on real databases."""

from __future__ import annotations

import gc
import logging
import sqlite3
import threading
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, select, text
from sqlalchemy.exc import DBAPIError

from skillstats.contract import make_event
from skillstats.retry import Backoff
from skillstats.sinks.batch import ApplyOutcome, ConsumedRecord
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.recovery import Health, apply_with_recovery, is_data_error
from skillstats.sinks.schema import skill_daily_stats, skill_hourly_stats
from skillstats.sinks.windows import WindowsSink
from tests.helpers import wait_until

NOW = 1_764_460_800_000


def downloads(partition: int, offsets: range) -> list[ConsumedRecord]:
    return [ConsumedRecord(partition, o, make_event("sk_1", "download", NOW - 1, now_ms=NOW)) for o in offsets]


def sqlite_error(tmp_path: Path, statement: str) -> BaseException:
    connection = sqlite3.connect(tmp_path / "e.db")
    connection.execute("CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v TEXT NOT NULL)")
    connection.execute("INSERT OR IGNORE INTO t VALUES (1, 'x')")
    try:
        connection.execute(statement)
    except sqlite3.Error as exc:
        return exc
    finally:
        connection.close()
    raise AssertionError(f"{statement} did not fail")


def test_sqlite_errors_are_classified_by_their_code(tmp_path: Path) -> None:
    assert is_data_error(sqlite_error(tmp_path, "INSERT INTO t VALUES (1, 'again')"))  # CONSTRAINT
    assert is_data_error(sqlite_error(tmp_path, "INSERT INTO t VALUES (2, NULL)"))  # CONSTRAINT (NOT NULL)
    assert not is_data_error(sqlite_error(tmp_path, "INSERT INTO missing VALUES (1)"))  # no such table
    assert not is_data_error(sqlite_error(tmp_path, "SELEC 1"))  # not the record's fault
    assert is_data_error(OverflowError("Python int too large to convert to SQLite INTEGER"))
    assert not is_data_error(RuntimeError("a bug, not a record"))


@pytest.fixture
def restricted(postgres_admin_url: str) -> Iterator[tuple[WindowsSink, object]]:
    """A fresh database, migrated by the admin, and a sink connected as a role with only the grants it needs."""
    from tests.conftest import _fresh_postgres_database

    role = f"worker_{uuid.uuid4().hex[:10]}"
    for url in _fresh_postgres_database(postgres_admin_url):
        admin = create_engine(url.replace("postgresql://", "postgresql+psycopg://"), isolation_level="AUTOCOMMIT")
        upgrade(open_engine(url))
        with admin.connect() as connection:
            connection.execute(text(f"CREATE ROLE {role} LOGIN"))
            connection.execute(text(f"GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA public TO {role}"))
        worker_url = url.replace("postgresql://postgres@", f"postgresql://{role}@")
        sink = WindowsSink(open_engine(worker_url), "g", "t")
        try:
            yield sink, admin
        finally:
            sink.engine.dispose()
            with admin.connect() as connection:
                connection.execute(
                    text(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'")
                )
                connection.execute(text(f"DROP OWNED BY {role}"))
            admin.dispose()
        with create_engine(
            postgres_admin_url.replace("postgresql://", "postgresql+psycopg://"), isolation_level="AUTOCOMMIT"
        ).connect() as connection:
            connection.execute(text(f"DROP ROLE IF EXISTS {role}"))


def run_in_background(
    sink: WindowsSink, records: list[ConsumedRecord], health: Health
) -> tuple[threading.Thread, list]:
    results: list[ApplyOutcome | BaseException] = []
    parked: list[ConsumedRecord] = []

    def work() -> None:
        try:
            results.append(
                apply_with_recovery(
                    sink, records, lambda r, _e: parked.append(r), backoff=Backoff(base=0.05, cap=0.5), health=health
                )
            )
        except BaseException as exc:
            results.append(exc)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread, [results, parked]


def total(sink: WindowsSink) -> int:
    with sink.engine.connect() as connection:
        return connection.execute(select(skill_daily_stats.c.downloads)).scalar() or 0


@pytest.mark.parametrize(
    ("fault", "cure"),
    [
        pytest.param(
            "REVOKE INSERT, UPDATE ON skill_daily_stats, skill_hourly_stats FROM {role}",
            "GRANT INSERT, UPDATE ON skill_daily_stats, skill_hourly_stats TO {role}",
            id="revoked-grant-42501",
        ),
        pytest.param(
            "ALTER ROLE {role} SET default_transaction_read_only = on",
            "ALTER ROLE {role} RESET default_transaction_read_only",
            id="read-only-25006",
        ),
        pytest.param(
            "ALTER TABLE skill_hourly_stats RENAME TO skill_hourly_stats_away",
            "ALTER TABLE skill_hourly_stats_away RENAME TO skill_hourly_stats",
            id="missing-table-42P01",
        ),
    ],
)
@pytest.mark.postgres
def test_database_faults_are_retried_until_cured(restricted: tuple[WindowsSink, object], fault: str, cure: str) -> None:
    sink, admin = restricted
    role = sink.engine.url.username
    assert sink.apply(downloads(0, range(10))).applied == 10

    def run_admin(statement: str) -> None:
        with admin.connect() as connection:  # type: ignore[attr-defined]
            connection.execute(text(statement.format(role=role)))
            # Sessions pick up role settings when they start, as after a failover.
            connection.execute(text(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '{role}'"))

    run_admin(fault)
    health = Health()
    thread, (results, parked) = run_in_background(sink, downloads(0, range(10, 60)) + downloads(1, range(40)), health)
    wait_until(lambda: health.retries >= 3, 60, "three retries of the failing batch")
    assert health.degraded
    assert thread.is_alive(), results
    run_admin(cure)
    thread.join(60)
    assert not thread.is_alive()
    (outcome,) = results
    assert isinstance(outcome, ApplyOutcome), outcome
    assert parked == []
    assert outcome.applied == 90
    assert not health.degraded
    assert total(sink) == 100
    assert sink.fences() == {0: 60, 1: 40}
    with sink.engine.connect() as connection:
        assert connection.execute(select(skill_hourly_stats.c.downloads)).scalar() == 100


@pytest.mark.postgres
def test_postgres_data_errors_are_data_errors(restricted: tuple[WindowsSink, object]) -> None:
    sink, _admin = restricted
    with sink.engine.connect() as connection:
        for statement, data in (
            ("SELECT 1/0", True),  # 22012 division_by_zero
            ("SELECT 'x'::int", True),  # 22P02
            ("INSERT INTO skills (id) VALUES (NULL)", True),  # 23502
            ("SELECT * FROM nowhere", False),  # 42P01
            ("SET TRANSACTION READ ONLY; INSERT INTO skills (id) VALUES ('a')", False),  # 25006
        ):
            with pytest.raises(DBAPIError) as caught:
                connection.execute(text(statement))
            connection.rollback()
            assert is_data_error(caught.value) is data, statement


def test_sqlite_readers_do_not_queue_behind_a_writer(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/w.db"
    upgrade(open_engine(url))
    sink = WindowsSink(open_engine(url, lock_timeout_s=1), "g", "t")
    sink.apply(downloads(0, range(5)))
    writer = sqlite3.connect(tmp_path / "w.db", isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")  # a worker in the middle of a batch holds the write lock
    try:
        assert sink.fences() == {0: 5}  # would wait for the lock, then fail, with BEGIN IMMEDIATE
        assert total(sink) == 5
        with pytest.raises(Exception) as caught:  # a writer still waits (bounded) and is told why
            sink.apply(downloads(0, range(5, 10)))
        assert not is_data_error(caught.value)
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert sink.apply(downloads(0, range(5, 10))).applied == 5


@pytest.mark.postgres
def test_a_held_fence_lock_times_out_as_a_transient_error(restricted: tuple[WindowsSink, object]) -> None:
    sink, admin = restricted
    sink.apply(downloads(0, range(5)))
    impatient = WindowsSink(
        open_engine(sink.engine.url.render_as_string(hide_password=False), lock_timeout_s=1), "g", "t"
    )
    with admin.connect() as holder:  # type: ignore[attr-defined]
        holder.execute(text("BEGIN"))
        holder.execute(text("SELECT * FROM skillstats_partition_fences FOR UPDATE"))
        with pytest.raises(DBAPIError) as caught:
            impatient.apply(downloads(0, range(5, 10)))
        holder.execute(text("ROLLBACK"))
    assert getattr(caught.value.orig, "sqlstate", None) == "55P03"  # lock_not_available
    assert not is_data_error(caught.value)
    assert impatient.apply(downloads(0, range(5, 10))).applied == 5
    impatient.engine.dispose()


def test_an_outage_is_logged_once_with_its_target_and_once_when_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    health = Health(target="postgresql://app:***@db/stats")
    with caplog.at_level("INFO", logger="skillstats"):
        for _ in range(5):
            health.failing(RuntimeError("connection refused"))
        health.ok()
        health.ok()
    said = [r.getMessage() for r in caplog.records if "degraded" in r.getMessage() or "answers again" in r.getMessage()]
    assert len(said) == 2, said
    assert said[0].startswith("degraded: postgresql://app:***@db/stats is failing (")
    assert said[1].startswith("recovered: postgresql://app:***@db/stats answers again after")


def test_a_waiting_dependency_is_warned_once_reminded_sparsely_and_its_return_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from skillstats.retry import Outage

    outage = Outage(logging.getLogger("skillstats.test"))
    with caplog.at_level("DEBUG", logger="skillstats.test"):
        for _ in range(20):
            outage.failed("waiting for Kafka at 127.0.0.1:1", "connection refused", 1.0)
        outage.failed("waiting for the database sqlite:///x.db", "locked", 1.0)  # another cause: said at once
        outage.recovered("Kafka and the database answer; starting")
        outage.recovered("Kafka and the database answer; starting")  # no outage: nothing said
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    warnings = [m for level, m in lines if level == "WARNING" and "answer; starting" not in m]
    assert warnings == [
        "waiting for Kafka at 127.0.0.1:1: connection refused (attempt 1, again in 1.0s)",
        "waiting for the database sqlite:///x.db: locked (attempt 21, again in 1.0s)",
    ]
    reminders = [m for level, m in lines if level == "INFO" and "still" in m]
    assert [m.rsplit("after ", 1)[1] for m in reminders] == [f"{n} attempts)" for n in (2, 4, 8, 16)]
    # The end at WARNING like the start: a process logging only warnings (the default) shows both.
    assert [(level, m) for level, m in lines if "answer; starting" in m] == [
        ("WARNING", "Kafka and the database answer; starting (after 22 attempt(s))")
    ]


def test_each_retry_collects_what_the_failed_attempts_left_in_reference_cycles(tmp_path: Path) -> None:
    """A failed statement leaves its parameters in a cycle through the exception's traceback; the windows worker
    runs the cyclic collector rarely, so the retry collects: what earlier attempts left is gone by the next one
    (here with the collector off altogether, an object in a cycle per failed attempt)."""

    class Left:
        cycle: object = None

    left: list[weakref.ref[Left]] = []
    engine = open_engine(f"sqlite:///{tmp_path / 'w.db'}")
    upgrade(engine)
    sink = WindowsSink(engine, "g", "t")
    apply = sink.apply

    def failing_three_times(*args: Any, **kwargs: Any) -> ApplyOutcome:
        if len(left) < 3:
            garbage = Left()
            garbage.cycle = garbage
            left.append(weakref.ref(garbage))
            raise sqlite_error(tmp_path, "INSERT INTO missing VALUES (1)")
        return apply(*args, **kwargs)

    sink.apply = failing_three_times  # type: ignore[method-assign]
    gc.disable()
    try:
        outcome = apply_with_recovery(sink, downloads(0, range(3)), lambda r, _e: None, backoff=Backoff(0.01, 0.01))
    finally:
        gc.enable()
        engine.dispose()
    assert (outcome.applied, outcome.retries) == (3, 3)
    assert [ref() is None for ref in left[:2]] == [True, True]
