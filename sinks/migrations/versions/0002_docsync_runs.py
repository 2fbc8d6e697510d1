"""Run records of the doc-stats drain.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def _counter(name: str) -> sa.Column[int]:
    return sa.Column(name, sa.BigInteger, nullable=False, server_default="0")


def upgrade() -> None:
    op.create_table(
        "skillstats_docsync_runs",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("group_id", sa.Text, nullable=False),
        sa.Column("started_at", sa.DateTime, nullable=False),
        sa.Column("finished_at", sa.DateTime, nullable=True),
        _counter("events_read"),
        _counter("skills_updated"),
        _counter("unknown_skill_events"),
        _counter("invalid_skipped"),
        sa.Column("stopped_reason", sa.Text, nullable=True),
        sa.Column("last_error", sa.Text, nullable=True),
        sa.Column("host", sa.Text, nullable=True),
        sa.Column("pid", sa.Integer, nullable=True),
    )
    op.create_index("ix_skillstats_docsync_runs_group_started", "skillstats_docsync_runs", ["group_id", "started_at"])


def downgrade() -> None:
    op.drop_table("skillstats_docsync_runs")
