"""`skillstats_rebuilds`: recomputing the windows tables from the log beside the live ones (`skillstats rebuild`).

One row per rebuild: its own consumer group (fences and claim of their own, role `rebuild`), the topic and its
Kafka id, the first UTC day it recomputes (`owns_from`; NULL: every day) and where each partition's read
starts, its state (`building`, `live` once swapped in, `previous` once a later swap or a rollback put it
aside, `dropped`), the live fences at its swap, and the records the live group's database had refused that the
swap made counted (`unrejected`: their skillstats_rejected_records rows, put back by a rollback).

`skillstats_rebuild_skips`: per rebuild, the records the live group had parked in the DLQ when it started (read
from the DLQ then): the rebuild counts them nowhere, as the live group did not, whatever today's contract says of
them (a replay of one publishes a copy both count). The shadow and previous tables themselves
(`skill_*_stats_rebuild`, `skill_*_stats_previous`) are made and renamed by the commands, not here: they
come and go with each rebuild.

`skillstats_imported_days`: every UTC day `skillstats legacy import` added counts to in the windows tables
(counts that are not in the log): a rebuild never recomputes those days, it carries them over.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "skillstats_rebuilds",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("group_id", sa.Text, nullable=False, unique=True),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("topic_id", sa.Text, nullable=True),
        sa.Column("owns_from", sa.Date, nullable=True),
        sa.Column("starts", sa.Text, nullable=False),
        sa.Column("state", sa.Text, nullable=False),
        sa.Column("started_at", sa.DateTime, nullable=False),
        sa.Column("swapped_at", sa.DateTime, nullable=True),
        sa.Column("swap_fences", sa.Text, nullable=True),
        sa.Column("note", sa.Text, nullable=True),
        sa.Column("unrejected", sa.Text, nullable=True),
    )
    op.create_table(
        "skillstats_rebuild_skips",
        sa.Column("rebuild_id", sa.Integer, primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True),
        sa.Column("offset", sa.BigInteger, primary_key=True),
    )
    op.create_table(
        "skillstats_imported_days",
        sa.Column("day", sa.Date, primary_key=True),
        sa.Column("imported_at", sa.DateTime, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("skillstats_imported_days")
    op.drop_table("skillstats_rebuild_skips")
    op.drop_table("skillstats_rebuilds")
