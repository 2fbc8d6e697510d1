"""How skillstats lays out a SQLite file: 16 KiB pages for a new one, the windows tables WITHOUT ROWID (0011).

The layout is a matter of CPU (docs/performance.md, "The windows tables WITHOUT ROWID"); what these tests hold
is that it changes nothing else: every row an older layout held is there after the migration, and after its
downgrade, and the upserts go on adding to them.
"""

from __future__ import annotations

import sqlite3
from datetime import date, datetime
from pathlib import Path

from sqlalchemy import Connection, Engine, text

from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import _config, upgrade
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
