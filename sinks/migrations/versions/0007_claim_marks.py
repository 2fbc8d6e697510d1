"""Which database counts a group: a random mark per role claim (`skillstats_consumers.claim_id`).

The consumers write the mark into the metadata of every Kafka offset commit, and
check the group's commits against it before they read (skillstats/positions.py):
a second deployment with its own database but the same group name would
otherwise join the group and silently take half the partitions. Existing claims
get a mark of their own here; their groups' older commits carry none, which
passes until the first commit that does.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("skillstats_consumers") as table:
        table.add_column(sa.Column("claim_id", sa.Text, nullable=True))
    consumers = sa.table("skillstats_consumers", sa.column("role", sa.Text), sa.column("claim_id", sa.Text))
    connection = op.get_bind()
    for (role,) in connection.execute(sa.select(consumers.c.role)).all():
        connection.execute(sa.update(consumers).where(consumers.c.role == role).values(claim_id=uuid.uuid4().hex))


def downgrade() -> None:
    with op.batch_alter_table("skillstats_consumers") as table:
        table.drop_column("claim_id")
