"""Initial schema: daily and hourly windows, skill and owner stats, partition fences.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _counter(name: str) -> sa.Column[int]:
    return sa.Column(name, sa.BigInteger, nullable=False, server_default="0")


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    op.create_table(
        "skill_daily_stats",
        sa.Column("skill_id", sa.Text, primary_key=True),
        sa.Column("day", sa.Date, primary_key=True),
        _counter("downloads"),
        _counter("installs"),
        sa.Column("updated_at", sa.DateTime, nullable=False),
    )
    op.create_table(
        "skill_hourly_stats",
        sa.Column("skill_id", sa.Text, primary_key=True),
        sa.Column("hour", sa.DateTime, primary_key=True),
        _counter("downloads"),
        _counter("installs"),
        sa.Column("updated_at", sa.DateTime, nullable=False),
    )
    # The registry owns `skills` and may well have created it already: then only the
    # stat columns skillstats writes are added, and nothing of the registry's is touched.
    if inspector.has_table("skills"):
        present = {column["name"] for column in inspector.get_columns("skills")}
        for column in (
            _counter("downloads"),
            _counter("installs_all_time"),
            _counter("installs_current"),
            sa.Column("stats_updated_at", sa.DateTime, nullable=True),
        ):
            if column.name not in present:
                op.add_column("skills", column)
    else:
        op.create_table(
            "skills",
            sa.Column("id", sa.Text, primary_key=True),
            sa.Column("owner_id", sa.Text, nullable=True),
            _counter("downloads"),
            _counter("installs_all_time"),
            _counter("installs_current"),
            sa.Column("stats_updated_at", sa.DateTime, nullable=True),
        )
        op.create_index("ix_skills_owner_id", "skills", ["owner_id"])
    op.create_table(
        "user_skill_stats",
        sa.Column("owner_id", sa.Text, primary_key=True),
        _counter("downloads"),
        _counter("installs_all_time"),
        _counter("installs_current"),
        sa.Column("updated_at", sa.DateTime, nullable=False),
    )
    op.create_table(
        "skillstats_partition_fences",
        sa.Column("group_id", sa.Text, primary_key=True),
        sa.Column("topic", sa.Text, primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True),
        sa.Column("next_offset", sa.BigInteger, nullable=False),
        sa.Column("updated_at", sa.DateTime, nullable=False),
    )


def downgrade() -> None:
    for table in ("skillstats_partition_fences", "user_skill_stats", "skill_hourly_stats", "skill_daily_stats"):
        op.drop_table(table)
