"""Which database counts a group: a mark per role claim (`skillstats_consumers.claim_id`).

The consumers write the mark into the metadata of every Kafka offset commit, and
check the group's commits against it before they read (skillstats/positions.py):
a second deployment with its own database but the same group name would
otherwise join the group and silently take half the partitions. Existing claims
get their mark here, derived from the role and its first claim's time as a new
claim derives it (sinks/identity.py `claim_mark`), so a backup restored from
before this revision gets the same mark its database had; their groups' older
commits carry none, which passes until the first commit that does.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from skillstats.sinks.identity import claim_mark

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("skillstats_consumers") as table:
        table.add_column(sa.Column("claim_id", sa.Text, nullable=True))
    consumers = sa.table(
        "skillstats_consumers",
        sa.column("role", sa.Text),
        sa.column("registered_at", sa.DateTime),
        sa.column("claim_id", sa.Text),
    )
    connection = op.get_bind()
    for role, registered_at in connection.execute(sa.select(consumers.c.role, consumers.c.registered_at)).all():
        connection.execute(
            sa.update(consumers).where(consumers.c.role == role).values(claim_id=claim_mark(role, registered_at))
        )


def downgrade() -> None:
    with op.batch_alter_table("skillstats_consumers") as table:
        table.drop_column("claim_id")
