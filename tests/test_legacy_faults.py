"""`skillstats legacy import` killed, stopped, or losing its database mid-way: never half-applied, and run again it
ends exactly where one uninterrupted run would, on SQLite and PostgreSQL.

"Never half-applied" is checked against the manifest: after an interruption the tables hold exactly the old
totals plus the events and rows the manifest says were applied, each once. The importer is held at a chunk
boundary by a lock the test takes on the manifest (so a kill or a signal lands mid-import without any sleep or
timing bet), then killed or signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, event, select, text
from sqlalchemy.exc import OperationalError

from skillstats.legacy.export import Export
from skillstats.legacy.importer import DatabaseAway, Importer
from skillstats.retry import Backoff
from skillstats.sinks.db import open_engine, sqlite_path
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.schema import legacy_manifest
from tests.helpers import assert_four_tables, expected_docstats, expected_windows, wait_until
from tests.test_legacy import OldSystem, as_record, check_moved, history_of_a_registry, manifest_rows


def _old(seed: int, events: int) -> OldSystem:
    old = history_of_a_registry(seed)
    old.write(events)
    return old


def _applied(url: str) -> dict[str, set[str]]:
    engine = open_engine(url)
    with engine.connect() as connection:
        rows = connection.execute(select(legacy_manifest.c.target, legacy_manifest.c.legacy_id)).all()
    engine.dispose()
    found: dict[str, set[str]] = {"windows": set(), "skills": set(), "history": set()}
    for target, doc_id in rows:
        found[target].add(doc_id)
    return found


def check_what_the_manifest_says(old: OldSystem, url: str) -> None:
    """The tables hold the old totals plus what the manifest lists, each once: nothing half-applied."""
    applied = _applied(url)
    windows = [as_record(e) for e in old.ever if e["_id"] in applied["windows"]]
    processed = [as_record(e) for e in old.ever if "processedAt" in e]
    to_skills = [as_record(e) for e in old.ever if e["_id"] in applied["skills"]]
    daily, hourly = expected_windows(windows)
    for row in old.daily.values():
        if row["_id"] in applied["history"]:
            key = (row["skillId"], _day(row["day"]))
            d, i = daily.get(key, (0, 0))
            daily[key] = (d + int(row["downloads"]), i + int(row["installs"]))
    want_skills, want_owners, _ = expected_docstats([*processed, *to_skills], old.registry)
    assert_four_tables(url, daily, hourly, want_skills, want_owners)


def _day(day: int) -> Any:
    from datetime import date, timedelta

    return date(1970, 1, 1) + timedelta(days=day)


@contextlib.contextmanager
def manifest_locked(url: str) -> Iterator[None]:
    """Hold the manifest (PostgreSQL) or the database (SQLite) against writers: an import waits at its next chunk."""
    path = sqlite_path(url)
    if path is not None:
        connection = sqlite3.connect(path, timeout=60, isolation_level=None)
        connection.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            connection.execute("ROLLBACK")
            connection.close()
        return
    engine = create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with engine.begin() as connection:
            connection.execute(text("LOCK TABLE skillstats_legacy_manifest IN EXCLUSIVE MODE"))
            yield
    finally:
        engine.dispose()


def _start(export: Path, url: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "skillstats.cli",
            "legacy",
            "import",
            str(export),
            "--history",
            "--confirm",
            "IMPORT_LEGACY",
            "--allow-unknown-skills",
            "--chunk-size",
            "5",
        ],
        env={**os.environ, "SKILLSTATS_DATABASE_URL": url},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _migrated(url: str) -> str:
    engine = open_engine(url)
    upgrade(engine)
    engine.dispose()
    return url


@pytest.mark.faults  # a broker (or a process) stopped mid-run: the fault suite
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_an_import_killed_or_stopped_mid_way_then_run_again_counts_every_event_once(
    database_url: str, tmp_path: Path, how: str
) -> None:
    url = _migrated(database_url)
    old = _old(21, 4000)
    old.move_registry(url)
    export = old.export(tmp_path / "snapshot", as_zip=True)
    child = _start(export, url)
    try:
        wait_until(lambda: child.poll() is not None or manifest_rows(url) >= 40, 120, "the first chunks", 0.005)
        assert child.poll() is None, child.communicate()
        with manifest_locked(url):
            if how == "SIGKILL":
                child.send_signal(signal.SIGKILL)
                child.wait(60)
            else:
                child.send_signal(signal.SIGTERM)
        _out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    if how == "SIGKILL":
        assert child.returncode == -signal.SIGKILL
    else:
        assert child.returncode == 130, err
        assert "stopped by a signal at a chunk boundary" in err and "run the same command again" in err
    cut = manifest_rows(url)
    check_what_the_manifest_says(old, url)

    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "skillstats.cli",
            "legacy",
            "import",
            str(export),
            "--history",
            "--confirm",
            "IMPORT_LEGACY",
            "--allow-unknown-skills",
        ],
        env={**os.environ, "SKILLSTATS_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr
    assert 40 <= cut < manifest_rows(url)  # it was cut off mid-way
    check_moved(old, url, hourly_from=old.cursor)


def _failing_commits(engine: Any, failing: set[int]) -> list[int]:
    commits = [0]

    @event.listens_for(engine, "commit")
    def _commit(_connection: Any) -> None:
        commits[0] += 1
        if commits[0] in failing or (-1 in failing and commits[0] >= min(f for f in failing if f > 0)):
            raise OperationalError("COMMIT", {}, ConnectionError("server closed the connection unexpectedly"))

    return commits


def _run(engine: Any, export: Path, chunk: int) -> Any:
    importer = Importer(engine, chunk_size=chunk, backoff=Backoff(base=0.0, cap=0.0))
    with Export(export) as opened:
        plan = importer.plan(opened, history=True)
        return importer.run(opened, plan, history=True)


def test_a_database_lost_for_a_moment_is_retried_and_nothing_counts_twice(database_url: str, tmp_path: Path) -> None:
    url = _migrated(database_url)
    old = _old(22, 200)
    old.move_registry(url)
    export = old.export(tmp_path / "snapshot", as_zip=False)
    engine = open_engine(url)
    _failing_commits(engine, {3, 4, 9})
    outcome = _run(engine, export, 50)
    engine.dispose()
    assert outcome.retries == 3 and not outcome.stopped
    check_moved(old, url, hourly_from=old.cursor)


def test_a_database_that_stays_away_stops_the_import_between_chunks(database_url: str, tmp_path: Path) -> None:
    url = _migrated(database_url)
    old = _old(23, 200)
    old.move_registry(url)
    export = old.export(tmp_path / "snapshot", as_zip=False)
    engine = open_engine(url)
    _failing_commits(engine, {3, -1})  # every commit from the third on
    with pytest.raises(DatabaseAway, match=r"failed chunk 3 .*6 times: stopped there\. 2 chunk\(s\) were applied"):
        _run(engine, export, 50)
    engine.dispose()
    check_what_the_manifest_says(old, url)
    assert manifest_rows(url) > 0
    engine = open_engine(url)
    _run(engine, export, 50)
    engine.dispose()
    check_moved(old, url, hourly_from=old.cursor)
