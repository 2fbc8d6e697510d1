"""Table definitions the sink reads and writes (docs/contract.md, tables).

These describe the tables as the code uses them today; `migrations/` holds the
frozen history that creates them. Table and column names are a contract.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Date, DateTime, Index, Integer, MetaData, Table, Text

metadata = MetaData()


def _counter(name: str) -> Column[int]:
    return Column(name, BigInteger, nullable=False, server_default="0")


skill_daily_stats = Table(
    "skill_daily_stats",
    metadata,
    Column("skill_id", Text, primary_key=True),
    Column("day", Date, primary_key=True),
    _counter("downloads"),
    _counter("installs"),
    Column("updated_at", DateTime, nullable=False),
)

skill_hourly_stats = Table(
    "skill_hourly_stats",
    metadata,
    Column("skill_id", Text, primary_key=True),
    Column("hour", DateTime, primary_key=True),  # UTC, start of the hour, naive
    _counter("downloads"),
    _counter("installs"),
    Column("updated_at", DateTime, nullable=False),
)

skills = Table(
    "skills",
    metadata,
    Column("id", Text, primary_key=True),
    Column("owner_id", Text, nullable=True, index=True),
    _counter("downloads"),
    _counter("installs_all_time"),
    _counter("installs_current"),
    Column("stats_updated_at", DateTime, nullable=True),
)

user_skill_stats = Table(
    "user_skill_stats",
    metadata,
    Column("owner_id", Text, primary_key=True),
    _counter("downloads"),
    _counter("installs_all_time"),
    _counter("installs_current"),
    Column("updated_at", DateTime, nullable=False),
)

# The per-partition cursor each consumer group advances in the same transaction
# as its counters: the record at `next_offset` is the first not yet applied.
partition_fences = Table(
    "skillstats_partition_fences",
    metadata,
    Column("group_id", Text, primary_key=True),
    Column("topic", Text, primary_key=True),
    Column("partition", Integer, primary_key=True),
    Column("next_offset", BigInteger, nullable=False),
    Column("updated_at", DateTime, nullable=False),
    # The windows group's DLQ mark (see sinks/fences.py); NULL until it first parks.
    Column("dlq_partition", Integer, nullable=True),
    Column("dlq_next_offset", BigInteger, nullable=True),
)

# One row per `skillstats docsync` run: the seed's lease row made visible. A run
# that died without finishing keeps finished_at NULL; `status` and the metrics
# read the last successful one.
docsync_runs = Table(
    "skillstats_docsync_runs",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("group_id", Text, nullable=False),
    Column("started_at", DateTime, nullable=False),
    Column("finished_at", DateTime, nullable=True),
    _counter("events_read"),
    _counter("skills_updated"),
    _counter("unknown_skill_events"),
    _counter("invalid_skipped"),
    Column("stopped_reason", Text, nullable=True),  # caught_up | budget | error; NULL while running
    Column("last_error", Text, nullable=True),
    Column("host", Text, nullable=True),
    Column("pid", Integer, nullable=True),
)

# One row per copy `skillstats dlq replay` published, keyed by the record's root parcel
# (its first one in the DLQ) and the replay's number for that root, unique: the DLQ
# and these rows together say whether a copy was counted (skillstats/dlq_admin.py).
dlq_replays = Table(
    "skillstats_dlq_replays",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("dlq_topic", Text, nullable=False),
    Column("dlq_partition", Integer, nullable=False),
    Column("dlq_offset", BigInteger, nullable=False),
    Column("replay_number", Integer, nullable=False),
    Column("source_partition", Integer, nullable=True),
    Column("source_offset", BigInteger, nullable=True),
    Column("replayed_at", DateTime, nullable=False),
    Index("ux_skillstats_dlq_replays_root", "dlq_topic", "dlq_partition", "dlq_offset", "replay_number", unique=True),
)
