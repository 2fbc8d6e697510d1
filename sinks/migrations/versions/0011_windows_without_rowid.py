"""SQLite: the windows tables WITHOUT ROWID (PostgreSQL: nothing changes).

A rowid table keeps its rows in one B-tree and its primary key (skill, bucket) in
another, so every upsert looks the key up in the index, then reads and rewrites
the row in the table: two trees' pages dirtied per row, and on a backfill's batch
those pages lie all over both. WITHOUT ROWID keeps the rows in the key's own
tree. Measured with 16 KiB pages (sinks/db.py), one worker's CPU on a backfill
into SQLite fell 10-12% (docs/performance.md, "The windows tables WITHOUT
ROWID"). The rows, the columns and the statements are the same; a version
before this one reads and writes these tables as it did.

What it costs: the upgrade copies the tables (a new one, every row copied in
key order, the old one dropped, the new one renamed), in the migration's
transaction. That takes time in proportion to the tables, holds SQLite's write
lock meanwhile (a worker waits up to its lock timeout, then retries: nothing is
lost), and needs free disk of about twice the tables (the copy, and the WAL
that holds it until a checkpoint). A rebuild's shadow and previous tables
(sinks/rebuild.py), where they exist, are copied too, so a later swap or
rollback brings no rowid table back. Views on these tables are kept (the
rename runs with legacy_alter_table, which neither checks nor rewrites them:
they name the table, and the new one has the name). A table that carries
anything this copy would drop (an index or a trigger of its own, a column
skillstats did not make) is refused, with what to drop, before anything is
copied: nothing is dropped silently (`skillstats init` exits 2 with the message).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from skillstats.sinks.migrate import MigrationRefused

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_TABLES = (("skill_daily_stats", "day", sa.Date), ("skill_hourly_stats", "hour", sa.DateTime))
_GENERATIONS = ("", "_rebuild", "_previous")  # the live tables, a rebuild's shadow ones, the previous ones
_COLUMNS = ("skill_id", "{bucket}", "downloads", "installs", "updated_at")


def _counter(name: str) -> sa.Column[int]:
    return sa.Column(name, sa.BigInteger, nullable=False, server_default="0")


def _ddl(connection: sa.Connection, name: str) -> str | None:
    return connection.execute(
        sa.text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = :name"), {"name": name}
    ).scalar_one_or_none()


def _refuse_what_the_copy_would_drop(connection: sa.Connection, name: str, bucket: str) -> None:
    extra = [
        f"{kind} {object_name}"
        for kind, object_name in connection.execute(
            sa.text(
                "SELECT type, name FROM sqlite_master WHERE tbl_name = :name AND type IN ('index', 'trigger') "
                "AND sql IS NOT NULL"  # SQLite's own indexes (a primary key's) have no SQL
            ),
            {"name": name},
        )
    ]
    columns = [row[1] for row in connection.execute(sa.text(f'PRAGMA table_info("{name}")'))]
    expected = [column.format(bucket=bucket) for column in _COLUMNS]
    extra += [f"column {column}" for column in columns if column not in expected]
    if extra or sorted(columns) != sorted(expected):
        raise MigrationRefused(
            f"schema revision 0011 copies {name} into a new table and would drop what the copy does not carry: "
            f"{', '.join(extra) or 'its columns differ from ' + ', '.join(expected)}. Drop what is named (and make "
            f"it again after the upgrade), or give the table back the columns named, then run 'skillstats init' "
            f"again; nothing was changed."
        )


def _rewrite(with_rowid: bool) -> None:
    connection = op.get_bind()
    if connection.dialect.name != "sqlite":
        return
    todo: list[tuple[str, str, type[sa.types.TypeEngine[object]]]] = []
    for base, bucket, bucket_type in _TABLES:
        for generation in _GENERATIONS:
            name = base + generation
            ddl = _ddl(connection, name)
            if ddl is None or ("WITHOUT ROWID" in " ".join(ddl.upper().split())) != with_rowid:
                continue  # absent, or already laid out so
            _refuse_what_the_copy_would_drop(connection, name, bucket)
            todo.append((name, bucket, bucket_type))
    if not todo:
        return
    # A view naming one of these tables would fail the rename (SQLite checks every view since 3.26); in the legacy
    # mode it neither checks nor rewrites them, and they find the new table by its name. Per connection: put back.
    legacy = connection.exec_driver_sql("PRAGMA legacy_alter_table").scalar()
    connection.exec_driver_sql("PRAGMA legacy_alter_table=ON")
    try:
        for name, bucket, bucket_type in todo:
            new = f"{name}_0011"
            op.create_table(
                new,
                sa.Column("skill_id", sa.Text, primary_key=True),
                sa.Column(bucket, bucket_type, primary_key=True),
                _counter("downloads"),
                _counter("installs"),
                sa.Column("updated_at", sa.DateTime, nullable=False),
                sqlite_with_rowid=with_rowid,
            )
            columns = ", ".join(column.format(bucket=bucket) for column in _COLUMNS)
            op.execute(f'INSERT INTO "{new}" ({columns}) SELECT {columns} FROM "{name}" ORDER BY skill_id, {bucket}')
            op.drop_table(name)
            op.rename_table(new, name)
    finally:
        connection.exec_driver_sql(f"PRAGMA legacy_alter_table={'ON' if legacy else 'OFF'}")


def upgrade() -> None:
    _rewrite(with_rowid=False)


def downgrade() -> None:
    _rewrite(with_rowid=True)
