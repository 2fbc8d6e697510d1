"""Records of `skillstats dlq replay`, so a replayed record never counts twice.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "skillstats_dlq_replays",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("dlq_topic", sa.Text, nullable=False),
        sa.Column("dlq_partition", sa.Integer, nullable=False),
        sa.Column("dlq_offset", sa.BigInteger, nullable=False),
        sa.Column("replay_number", sa.Integer, nullable=False),
        sa.Column("source_partition", sa.Integer, nullable=True),
        sa.Column("source_offset", sa.BigInteger, nullable=True),
        sa.Column("replayed_at", sa.DateTime, nullable=False),
    )
    op.create_index(
        "ux_skillstats_dlq_replays_root",
        "skillstats_dlq_replays",
        ["dlq_topic", "dlq_partition", "dlq_offset", "replay_number"],
        unique=True,
    )


def downgrade() -> None:
    op.drop_index("ux_skillstats_dlq_replays_root", table_name="skillstats_dlq_replays")
    op.drop_table("skillstats_dlq_replays")
