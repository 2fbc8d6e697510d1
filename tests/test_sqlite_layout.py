"""How skillstats lays out a SQLite file: 16 KiB pages for a new one, the windows tables WITHOUT ROWID (0011).

The layout is a matter of CPU (docs/performance.md, "The windows tables WITHOUT ROWID"); what these tests hold
is that it changes nothing else: every row an older layout held is there after the migration, and after its
downgrade, and the upserts go on adding to them.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from datetime import date, datetime
from pathlib import Path

from sqlalchemy import Connection, Engine, text

from skillstats.cli.common import EXIT_USAGE
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import MigrationRefused, _config, upgrade
from skillstats.sinks.upserts import now_utc_naive
from skillstats.sinks.windows import write_rows

WINDOWS_TABLES = ("skill_daily_stats", "skill_hourly_stats")


def _without_rowid(connection: Connection, name: str) -> bool:
    sql = connection.execute(text("SELECT sql FROM sqlite_master WHERE name = :n"), {"n": name}).scalar_one()
    return "WITHOUT ROWID" in " ".join(sql.upper().split())


def _pragma(connection: Connection, name: str) -> int:
    return int(connection.execute(text(f"PRAGMA {name}")).scalar_one())


def _rows(engine: Engine) -> dict[str, list[tuple[object, ...]]]:
    with engine.connect() as connection:
        return {
            name: [tuple(row) for row in connection.execute(text(f"SELECT * FROM {name} ORDER BY 1, 2"))]
            for name in WINDOWS_TABLES
        }


def _migrate(engine: Engine, revision: str, *, down: bool = False) -> None:
    from alembic import command

    config = _config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        (command.downgrade if down else command.upgrade)(config, revision)


def test_a_new_database_takes_16_kib_pages_and_every_windows_table_without_rowid(tmp_path: Path) -> None:
    from skillstats.sinks.rebuild import SHADOW, create_shadow, generation

    engine = open_engine(f"sqlite:///{tmp_path}/new.db")
    upgrade(engine)
    with engine.begin() as connection:
        create_shadow(connection)  # a rebuild's tables, made from the live ones' definitions
        assert _pragma(connection, "page_size") == 16384
        assert _pragma(connection, "wal_autocheckpoint") == 40 * 1024 * 1024 // 16384
        for name in (*WINDOWS_TABLES, *generation(SHADOW).names):
            assert _without_rowid(connection, name), name
        assert not _without_rowid(connection, "skills")  # the other tables as they were


def test_0011_keeps_every_row_of_an_older_file_and_its_pages_both_ways(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as raw:  # a file made before 16 KiB pages: SQLite's default, 4 KiB
        raw.execute("PRAGMA page_size=4096")
        raw.execute("CREATE TABLE registry_note (id INTEGER PRIMARY KEY)")
    engine = open_engine(f"sqlite:///{path}")
    _migrate(engine, "0010")
    hours = [datetime(2026, 11, 30, h) for h in (0, 1, 23)]
    with engine.begin() as connection:
        assert not any(_without_rowid(connection, name) for name in WINDOWS_TABLES)
        for index, skill in enumerate(["sk_1", "sk_é", "sk_" + "x" * 300, "0", "sk_1 "]):
            big = 2**62 + index  # counters near BIGINT's top survive the copy exactly
            connection.execute(
                text("INSERT INTO skill_daily_stats VALUES (:s, :d, :a, :b, :u)"),
                {"s": skill, "d": "2026-11-30", "a": big, "b": index, "u": "2026-12-01 00:00:00.000000"},
            )
            for hour in hours:
                connection.execute(
                    text("INSERT INTO skill_hourly_stats VALUES (:s, :h, :a, :b, :u)"),
                    {"s": skill, "h": str(hour) + ".000000", "a": index, "b": big, "u": "2026-12-01 00:00:00.000000"},
                )
    before = _rows(engine)
    assert len(before["skill_hourly_stats"]) == 15

    upgrade(engine)
    with engine.connect() as connection:
        assert all(_without_rowid(connection, name) for name in WINDOWS_TABLES)
        assert _pragma(connection, "page_size") == 4096  # an existing file keeps its pages
        assert _pragma(connection, "wal_autocheckpoint") == 40 * 1024 * 1024 // 4096
    assert _rows(engine) == before

    with engine.begin() as connection:  # the upserts meet the copied rows
        write_rows(
            connection,
            _live_tables(),
            ([("sk_é", hours[1], 2, 3)], [("sk_é", date(2026, 11, 30), 2, 3)]),
            now_utc_naive(),
        )
    after = _rows(engine)
    assert len(after["skill_hourly_stats"]) == 15 and len(after["skill_daily_stats"]) == 5
    assert [r[2:4] for r in after["skill_daily_stats"] if r[0] == "sk_é"] == [(2**62 + 1 + 2, 1 + 3)]

    _migrate(engine, "0010", down=True)
    with engine.connect() as connection:
        assert not any(_without_rowid(connection, name) for name in WINDOWS_TABLES)
    assert _rows(engine) == after
    upgrade(engine)
    assert _rows(engine) == after


def _live_tables() -> tuple[object, object]:
    from skillstats.sinks.schema import skill_daily_stats, skill_hourly_stats

    return skill_hourly_stats, skill_daily_stats


def _at_0010_with_a_row(tmp_path: Path) -> Engine:
    engine = open_engine(f"sqlite:///{tmp_path}/at-0010.db")
    _migrate(engine, "0010")
    with engine.begin() as connection:
        connection.execute(
            text("INSERT INTO skill_daily_stats VALUES ('sk_1', '2026-11-30', 7, 1, '2026-12-01 00:00:00.000000')")
        )
    return engine


def test_a_view_on_a_windows_table_is_kept_and_reads_the_new_one(tmp_path: Path) -> None:
    engine = _at_0010_with_a_row(tmp_path)
    with engine.begin() as connection:
        connection.execute(text("CREATE VIEW registry_downloads AS SELECT skill_id, downloads FROM skill_daily_stats"))
    for step in (lambda: upgrade(engine), lambda: _migrate(engine, "0010", down=True), lambda: upgrade(engine)):
        step()
        with engine.connect() as connection:
            assert connection.execute(text("SELECT * FROM registry_downloads")).all() == [("sk_1", 7)]
            assert _pragma(connection, "legacy_alter_table") == 0  # the migration's connection setting put back


def test_what_the_copy_would_drop_is_refused_before_anything_changes(tmp_path: Path) -> None:
    import pytest

    engine = _at_0010_with_a_row(tmp_path)
    for ddl, named in (
        ("CREATE INDEX registry_by_day ON skill_daily_stats (day)", "index registry_by_day"),
        ("ALTER TABLE skill_daily_stats ADD COLUMN registry_note TEXT", "column registry_note"),
        (
            "CREATE TRIGGER registry_audit AFTER UPDATE ON skill_daily_stats BEGIN SELECT 1; END",
            "trigger registry_audit",
        ),
    ):
        with engine.begin() as connection:
            connection.execute(text(ddl))
        before = _rows(engine)
        with pytest.raises(MigrationRefused, match=f"skill_daily_stats .*{named}.*nothing was changed"):
            upgrade(engine)
        if named.startswith("index"):  # what an operator sees: one line, exit 2 (a refusal, not a failure)
            done = subprocess.run(
                [sys.executable, "-m", "skillstats.cli", "init", "--skip-topics"],
                env={**os.environ, "SKILLSTATS_DATABASE_URL": engine.url.render_as_string()},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == EXIT_USAGE, done.stderr
            assert done.stderr.count("\n") == 1 and named in done.stderr and "Traceback" not in done.stderr
        with engine.connect() as connection:
            assert not _without_rowid(connection, "skill_daily_stats")
            assert connection.execute(text("SELECT version_num FROM skillstats_schema_version")).scalar() == "0010"
        assert _rows(engine) == before
        with engine.begin() as connection:  # what the refusal says to do
            object_kind, name = named.split()
            if object_kind == "column":
                connection.execute(text(f"ALTER TABLE skill_daily_stats DROP COLUMN {name}"))
            else:
                connection.execute(text(f"DROP {object_kind.upper()} {name}"))
    upgrade(engine)
    assert _rows(engine) == before


def test_a_rebuilds_tables_made_before_the_upgrade_are_laid_out_anew_too(tmp_path: Path) -> None:
    engine = _at_0010_with_a_row(tmp_path)
    names = ("skill_daily_stats_rebuild", "skill_daily_stats_previous", "skill_hourly_stats_previous")
    with engine.begin() as connection:
        for name in names:  # as a version at 0010 made them: rowid tables of the live ones' columns
            bucket, bucket_type = ("day", "DATE") if "daily" in name else ("hour", "DATETIME")
            connection.execute(
                text(
                    f"CREATE TABLE {name} (skill_id TEXT NOT NULL, {bucket} {bucket_type} NOT NULL, "
                    f"downloads BIGINT DEFAULT '0' NOT NULL, installs BIGINT DEFAULT '0' NOT NULL, "
                    f"updated_at DATETIME NOT NULL, PRIMARY KEY (skill_id, {bucket}))"
                )
            )
            connection.execute(text(f"INSERT INTO {name} VALUES ('sk_9', '2026-11-29', 3, 4, '2026-12-01')"))
    upgrade(engine)
    with engine.connect() as connection:
        for name in names:
            assert _without_rowid(connection, name), name
            assert connection.execute(text(f"SELECT skill_id, downloads, installs FROM {name}")).all() == [
                ("sk_9", 3, 4)
            ]
        assert not any(
            name.endswith("_0011") for name in connection.execute(text("SELECT name FROM sqlite_master")).scalars()
        )
