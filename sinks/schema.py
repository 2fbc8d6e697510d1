"""Table definitions the sink reads and writes (SPEC §4).

These describe the tables as the code uses them today; `migrations/` holds the
frozen history that creates them. Table and column names are a contract.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Date, DateTime, Integer, MetaData, Table, Text

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
)
