"""DLQ marks on the partition fences, so a replayed batch parks nothing twice.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("skillstats_partition_fences") as table:
        table.add_column(sa.Column("dlq_partition", sa.Integer, nullable=True))
        table.add_column(sa.Column("dlq_next_offset", sa.BigInteger, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("skillstats_partition_fences") as table:
        table.drop_column("dlq_next_offset")
        table.drop_column("dlq_partition")
