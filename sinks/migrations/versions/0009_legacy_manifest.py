"""`skillstats_legacy_manifest`: what `skillstats legacy import` applied, so a legacy export counts once.

One row per legacy document (its Convex `_id`) and target (`windows`, `skills`, `history`; `skipped` for an
event outside the contract's ranges that `--skip-out-of-contract` counted nowhere), written in the
transaction that adds its counts (skillstats/legacy/importer.py): an export imported again, cut off and
rerun, or followed by a later export holding more rows, applies each document to each target once. It
grows by one row per imported event and target (about 100 bytes each), for good: the rows are the proof.

`skillstats_legacy_exports`: one row per imported export (its newest event `_creationTime`), the old
daily cursor it carried and its history bound, written in the same transactions: a later export whose
marks moved (the old crons ran in between) is refused by `plan` and `import`.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "skillstats_legacy_manifest",
        sa.Column("legacy_id", sa.Text, primary_key=True),
        sa.Column("target", sa.Text, primary_key=True),
        sa.Column("created_ms", sa.Double, nullable=False),
        sa.Column("export_bound", sa.Double, nullable=False),
        sa.Column("imported_at", sa.DateTime, nullable=False),
    )
    op.create_table(
        "skillstats_legacy_exports",
        sa.Column("export_bound", sa.Double, primary_key=True),
        sa.Column("cursor_creation_time", sa.Double, nullable=True),
        sa.Column("history_bound", sa.Double, nullable=True),
        sa.Column("recorded_at", sa.DateTime, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("skillstats_legacy_exports")
    op.drop_table("skillstats_legacy_manifest")
