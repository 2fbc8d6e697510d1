"""SQLite: the windows tables WITHOUT ROWID (PostgreSQL: nothing changes).

A rowid table keeps its rows in one B-tree and its primary key (skill, bucket) in
another, so every upsert looks the key up in the index, then reads and rewrites
the row in the table: two trees' pages dirtied per row, and on a backfill's batch
those pages lie all over both. WITHOUT ROWID keeps the rows in the key's own
tree. Measured with 16 KiB pages (sinks/db.py), one worker's CPU on a backfill
into SQLite fell 10-12% (docs/performance.md, "The windows tables WITHOUT
ROWID"). The rows, the columns and the statements are the same; a version
before this one reads and writes these tables as it did.

What it costs: the upgrade copies both tables (a new one, every row copied in
key order, the old one dropped, the new one renamed), in the migration's
transaction, so it takes a time proportional to the tables and holds SQLite's
write lock meanwhile (the workers wait at their lock timeout and retry). A view
or trigger the registry made on these tables is dropped with them by SQLite
and must be made again. A rebuild's shadow and previous tables (sinks/rebuild.py)
are left as they are; shadow tables made from now on are WITHOUT ROWID too.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_TABLES = (("skill_daily_stats", "day", sa.Date), ("skill_hourly_stats", "hour", sa.DateTime))


def _counter(name: str) -> sa.Column[int]:
    return sa.Column(name, sa.BigInteger, nullable=False, server_default="0")


def _without_rowid(connection: sa.Connection, name: str) -> bool:
    sql = connection.execute(
        sa.text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = :name"), {"name": name}
    ).scalar_one()
    return "WITHOUT ROWID" in " ".join(str(sql).upper().split())


def _rewrite(with_rowid: bool) -> None:
    connection = op.get_bind()
    if connection.dialect.name != "sqlite":
        return
    for name, bucket, bucket_type in _TABLES:
        if _without_rowid(connection, name) != with_rowid:
            continue  # already laid out so (a database made by a version that did this otherwise)
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
        columns = f"skill_id, {bucket}, downloads, installs, updated_at"
        op.execute(f'INSERT INTO "{new}" ({columns}) SELECT {columns} FROM "{name}" ORDER BY skill_id, {bucket}')
        op.drop_table(name)
        op.rename_table(new, name)


def upgrade() -> None:
    _rewrite(with_rowid=False)


def downgrade() -> None:
    _rewrite(with_rowid=True)
