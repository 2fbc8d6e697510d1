"""Whose counts these are: the group and the Kafka topic (by its id) of each role, offsets lost to retention,
replays keyed by their source record.

- `skillstats_consumers`: one row per role (windows, docsync): the consumer group that writes that role's
  tables, the topic it reads, and the topic's Kafka id (KIP-516), NULL until a consumer first sees it.
- `skillstats_partition_fences.offsets_lost`: offsets a fence was moved over because retention had deleted
  them before they were applied (counted, never silent).
- `skillstats_dlq_replays`: the root's source record (topic, partition, offset) with a unique index, the
  reason it was parked for, and where the published copy landed (filled in once the broker acknowledged it).
- `skillstats_rejected_records`: the records the windows group's database refused, written with the fence
  that passes them (the proof a replay into the windows tables needs that the record was not counted).

A database that already holds fences gets its roles filled in from what it holds, so the first start after
the upgrade already refuses a renamed group: docsync is the group of the newest docsync run; windows is the
one other group with fences, when there is exactly one. Their topic ids stay NULL: the first consumer to
start records the topic it finds (there is nothing older to compare it with).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "skillstats_consumers",
        sa.Column("role", sa.Text, primary_key=True),
        sa.Column("group_id", sa.Text, nullable=False),
        sa.Column("topic", sa.Text, nullable=False),
        sa.Column("topic_id", sa.Text, nullable=True),
        sa.Column("registered_at", sa.DateTime, nullable=False),
        sa.Column("updated_at", sa.DateTime, nullable=False),
    )
    with op.batch_alter_table("skillstats_partition_fences") as table:
        table.add_column(sa.Column("offsets_lost", sa.BigInteger, nullable=False, server_default="0"))
    with op.batch_alter_table("skillstats_dlq_replays") as table:
        table.add_column(sa.Column("source_topic", sa.Text, nullable=True))
        table.add_column(sa.Column("reason", sa.Text, nullable=True))
        table.add_column(sa.Column("copy_partition", sa.Integer, nullable=True))
        table.add_column(sa.Column("copy_offset", sa.BigInteger, nullable=True))
    op.create_table(
        "skillstats_rejected_records",
        sa.Column("group_id", sa.Text, primary_key=True),
        sa.Column("topic", sa.Text, primary_key=True),
        sa.Column("partition", sa.Integer, primary_key=True),
        sa.Column("offset", sa.BigInteger, primary_key=True),
        sa.Column("rejected_at", sa.DateTime, nullable=False),
    )
    op.create_index(
        "ux_skillstats_dlq_replays_source",
        "skillstats_dlq_replays",
        ["source_topic", "source_partition", "source_offset", "replay_number"],
        unique=True,
    )
    _register_existing_groups()


def _register_existing_groups() -> None:
    connection = op.get_bind()
    now = datetime.now(UTC).replace(tzinfo=None)
    pairs = connection.execute(
        sa.text("SELECT DISTINCT group_id, topic FROM skillstats_partition_fences ORDER BY group_id, topic")
    ).all()
    docsync = connection.execute(
        sa.text("SELECT group_id FROM skillstats_docsync_runs ORDER BY id DESC LIMIT 1")
    ).scalar()
    rows = []
    docsync_topics = sorted({topic for group, topic in pairs if group == docsync})
    if docsync is not None and len(docsync_topics) == 1:
        rows.append(("docsync", docsync, docsync_topics[0]))
    others = [(group, topic) for group, topic in pairs if group != docsync]
    if len(others) == 1:
        rows.append(("windows", *others[0]))
    for role, group, topic in rows:
        connection.execute(
            sa.text(
                "INSERT INTO skillstats_consumers (role, group_id, topic, topic_id, registered_at, updated_at) "
                "VALUES (:role, :group, :topic, NULL, :now, :now)"
            ),
            {"role": role, "group": group, "topic": topic, "now": now},
        )


def downgrade() -> None:
    op.drop_index("ux_skillstats_dlq_replays_source", table_name="skillstats_dlq_replays")
    op.drop_table("skillstats_rejected_records")
    with op.batch_alter_table("skillstats_dlq_replays") as table:
        for column in ("copy_offset", "copy_partition", "reason", "source_topic"):
            table.drop_column(column)
    with op.batch_alter_table("skillstats_partition_fences") as table:
        table.drop_column("offsets_lost")
    op.drop_table("skillstats_consumers")
