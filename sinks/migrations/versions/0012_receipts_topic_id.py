"""`skillstats_ingest_requests.receipts_topic`: which receipts topic a keyed request's claim was made against.

A take-over decides from the receipts topic whether a stopped request's transaction committed
(skillstats/ingest/receipts.py): no receipt there, and the request is published again. That holds only if the
topic read is the one the transaction wrote to. A topic deleted, or deleted and created again under the same name,
in between has lost what it held, and "no receipt" then says nothing. The claimant writes the topic's id (the
UUID Kafka gives each topic it creates) with its claim; a take-over compares it with the topic's id now and,
where they differ and the topic now holds no receipt of the key, publishes nothing and says the outcome cannot
be known. NULL (a row of an older version, or a claim made while the id could not be read): judged as before.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("skillstats_ingest_requests") as table:
        table.add_column(sa.Column("receipts_topic", sa.Text, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("skillstats_ingest_requests") as table:
        table.drop_column("receipts_topic")
