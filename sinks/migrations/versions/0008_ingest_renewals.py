"""`skillstats_ingest_requests.renewed_at`: the lease of a keyed request still waiting on its Kafka commit.

A request renews its claim while it waits on its commit, so that only a process that died stops renewing and
lets another request take the key over (skillstats/ingest/idempotency.py). The lease runs from the later of
`claimed_at` and `renewed_at`; `claimed_at` stays the claim's own time, which names the claim and bounds the
read of the receipts a take-over makes (skillstats/ingest/receipts.py). NULL: never renewed.

`lease_until`: where the claimant's lease ends, written by the claimant from its own lease at every claim and
renewal, so a replica with a shorter `--publish-timeout` (a rolling change of it) never takes over a key
whose claimant's longer lease still runs. NULL (a row of an older version): from `claimed_at`/`renewed_at`.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("skillstats_ingest_requests") as table:
        table.add_column(sa.Column("renewed_at", sa.DateTime, nullable=True))
        table.add_column(sa.Column("lease_until", sa.DateTime, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("skillstats_ingest_requests") as table:
        table.drop_column("lease_until")
        table.drop_column("renewed_at")
