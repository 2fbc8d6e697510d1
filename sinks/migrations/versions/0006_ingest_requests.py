"""The requests `skillstats ingest` answered under an Idempotency-Key (`skillstats_ingest_requests`).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "skillstats_ingest_requests",
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("body_sha256", sa.Text, nullable=False),
        sa.Column("status", sa.Integer, nullable=True),
        sa.Column("response", sa.Text, nullable=True),
        sa.Column("claimed_at", sa.DateTime, nullable=False),
        sa.Column("expires_at", sa.DateTime, nullable=False),
    )
    op.create_index("ix_skillstats_ingest_requests_expires_at", "skillstats_ingest_requests", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_skillstats_ingest_requests_expires_at", "skillstats_ingest_requests")
    op.drop_table("skillstats_ingest_requests")
