"""Table definitions the sink reads and writes (docs/contract.md, tables).

These describe the tables as the code uses them today; `migrations/` holds the
frozen history that creates them. Table and column names are a contract.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Date, DateTime, Double, Index, Integer, MetaData, Table, Text

metadata = MetaData()


def _counter(name: str) -> Column[int]:
    return Column(name, BigInteger, nullable=False, server_default="0")


# On SQLite both windows tables are WITHOUT ROWID (migration 0011): one B-tree keyed by (skill, bucket) rather
# than a row table beside an index of its key, so an upsert finds and changes its row in one tree.
skill_daily_stats = Table(
    "skill_daily_stats",
    metadata,
    Column("skill_id", Text, primary_key=True),
    Column("day", Date, primary_key=True),
    _counter("downloads"),
    _counter("installs"),
    Column("updated_at", DateTime, nullable=False),
    sqlite_with_rowid=False,
)

skill_hourly_stats = Table(
    "skill_hourly_stats",
    metadata,
    Column("skill_id", Text, primary_key=True),
    Column("hour", DateTime, primary_key=True),  # UTC, start of the hour, naive
    _counter("downloads"),
    _counter("installs"),
    Column("updated_at", DateTime, nullable=False),
    sqlite_with_rowid=False,
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
    # Offsets the fence was moved over because retention deleted them before they were
    # applied (a fence below the log start): lost, and counted here rather than hidden.
    _counter("offsets_lost"),
)

# Whose counts these are (sinks/identity.py): per role, the one consumer group that writes
# its tables, the topic it reads and that topic's Kafka id (KIP-516; NULL until first seen).
consumers = Table(
    "skillstats_consumers",
    metadata,
    Column("role", Text, primary_key=True),  # windows | docsync
    Column("group_id", Text, nullable=False),
    Column("topic", Text, nullable=False),
    Column("topic_id", Text, nullable=True),
    Column("registered_at", DateTime, nullable=False),
    Column("updated_at", DateTime, nullable=False),
    # A random mark made by the claim: which database counts the group, written into its Kafka commits.
    Column("claim_id", Text, nullable=True),
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

# The records the windows group's database refused (parked as rejected_by_database), written
# in the transaction that moves the fence past them: the proof that such a record was skipped,
# not counted, which a replay into the windows tables requires (skillstats/dlq_admin.py).
rejected_records = Table(
    "skillstats_rejected_records",
    metadata,
    Column("group_id", Text, primary_key=True),
    Column("topic", Text, primary_key=True),
    Column("partition", Integer, primary_key=True),
    Column("offset", BigInteger, primary_key=True),
    Column("rejected_at", DateTime, nullable=False),
)

# One row per replay of a record by `skillstats dlq replay`, keyed by the record's root,
# the source record it was parked from (topic, partition, offset), and the replay's number
# for that root, unique: these rows and where the copies landed say whether a copy was
# counted (skillstats/dlq_admin.py). The DLQ address is the parcel the copy was made from.
dlq_replays = Table(
    "skillstats_dlq_replays",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("dlq_topic", Text, nullable=False),
    Column("dlq_partition", Integer, nullable=False),
    Column("dlq_offset", BigInteger, nullable=False),
    Column("replay_number", Integer, nullable=False),
    Column("source_topic", Text, nullable=True),  # NULL only on rows written before revision 0005
    Column("source_partition", Integer, nullable=True),
    Column("source_offset", BigInteger, nullable=True),
    Column("reason", Text, nullable=True),
    # Where the copy landed in the events topic, once the broker acknowledged it (NULL:
    # not known, or applied to the windows tables directly: no copy was published).
    Column("copy_partition", Integer, nullable=True),
    Column("copy_offset", BigInteger, nullable=True),
    Column("replayed_at", DateTime, nullable=False),
    Index("ux_skillstats_dlq_replays_root", "dlq_topic", "dlq_partition", "dlq_offset", "replay_number", unique=True),
    Index(
        "ux_skillstats_dlq_replays_source",
        "source_topic",
        "source_partition",
        "source_offset",
        "replay_number",
        unique=True,
    ),
)

# The requests `skillstats ingest` answered with 202 under an Idempotency-Key, so that the
# same request sent again is answered the same and published once (skillstats/ingest/
# idempotency.py). `key` is the token's scope and the client's key; `body_sha256` refuses
# the same key with another body; a row with no `status` is a request in flight, claimed
# at `claimed_at` (a lease: docs/contract.md, HTTP). Rows go after `expires_at`.
ingest_requests = Table(
    "skillstats_ingest_requests",
    metadata,
    Column("key", Text, primary_key=True),
    Column("body_sha256", Text, nullable=False),
    Column("status", Integer, nullable=True),
    Column("response", Text, nullable=True),
    Column("claimed_at", DateTime, nullable=False),
    Column("expires_at", DateTime, nullable=False, index=True),
    Column("renewed_at", DateTime, nullable=True),  # the lease renewed while the request waits on its commit
    Column("lease_until", DateTime, nullable=True),  # where the claimant's own lease ends (migration 0008)
    # the id of the receipts topic the claim was made against (migration 0012); NULL: not known
    Column("receipts_topic", Text, nullable=True),
)

# What `skillstats legacy import` applied from a Convex export of the system skillstats replaces
# (skillstats/legacy/): one row per legacy document and target, written in the transaction that adds
# its counts, so an export imported again (whole, cut off and rerun, or a later one holding more
# rows) applies each document to each target once. `target`: `windows` (hourly and daily rows of an
# event above the old daily cursor), `skills` (skill and owner totals of an event the old doc sync
# had not applied), `history` (a `skillDailyStats` row added to skill_daily_stats), `skipped` (a
# document outside the contract's ranges, counted nowhere: --skip-out-of-contract). `created_ms` is
# the document's `_creationTime`; `export_bound` the newest `_creationTime` of the export it came
# from, which lets a plan see rows of another deployment's export the ids cannot (docs/operations.md).
legacy_manifest = Table(
    "skillstats_legacy_manifest",
    metadata,
    Column("legacy_id", Text, primary_key=True),
    Column("target", Text, primary_key=True),
    Column("created_ms", Double, nullable=False),
    Column("export_bound", Double, nullable=False),
    Column("imported_at", DateTime, nullable=False),
)

# The old system's marks each imported export carried (skillstats/legacy/plan.py): its daily cursor
# and its bounds, written in the transactions that add its counts. A later export must carry the
# same cursor, and none of its rows created after an earlier export's bound may be processed or at
# or below that cursor: else the old crons ran in between, and importing it would count twice or
# miss rows. `history_bound` (the newest `skillDailyStats` `_creationTime`) is set once its history
# rows are imported (--history); NULL: never with --history.
legacy_exports = Table(
    "skillstats_legacy_exports",
    metadata,
    Column("export_bound", Double, primary_key=True),
    Column("cursor_creation_time", Double, nullable=True),
    Column("history_bound", Double, nullable=True),
    Column("recorded_at", DateTime, nullable=False),
)

# One row per `skillstats rebuild` (skillstats/rebuild/): the windows tables recomputed from the log beside the
# live ones under a group of its own (role `rebuild`), then swapped in. `owns_from`: the first UTC day it
# recomputes (NULL: every day); earlier days, and days in skillstats_imported_days, are carried over from the live
# tables. `starts`: JSON, partition -> the offset its read starts at. `state`: building | live (swapped in) |
# previous (put aside by a later swap or a rollback) | dropped. `swap_fences`: JSON, the live group's fences at
# the swap (the position both generations were brought to).
rebuilds = Table(
    "skillstats_rebuilds",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("group_id", Text, nullable=False, unique=True),
    Column("topic", Text, nullable=False),
    Column("topic_id", Text, nullable=True),
    Column("owns_from", Date, nullable=True),
    Column("starts", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("started_at", DateTime, nullable=False),
    Column("swapped_at", DateTime, nullable=True),
    Column("swap_fences", Text, nullable=True),
    Column("note", Text, nullable=True),
    # JSON list of [partition, offset]: the live group's refused records the swap made counted (their
    # skillstats_rejected_records rows were deleted; a rollback's swap puts them back). A rollback's rebuild,
    # while building: the rows its swap puts back.
    Column("unrejected", Text, nullable=True),
)

# Per rebuild, the records of the topic the live group had parked in the DLQ when the rebuild started: counted
# nowhere by the rebuild, as the live group counted them nowhere (a replay publishes a copy both groups count).
rebuild_skips = Table(
    "skillstats_rebuild_skips",
    metadata,
    Column("rebuild_id", Integer, primary_key=True),
    Column("partition", Integer, primary_key=True),
    Column("offset", BigInteger, primary_key=True),
)

# Every UTC day `skillstats legacy import` added counts to in skill_daily_stats or skill_hourly_stats: counts that
# are not in the log, so a rebuild carries these days over instead of recomputing them.
imported_days = Table(
    "skillstats_imported_days",
    metadata,
    Column("day", Date, primary_key=True),
    Column("imported_at", DateTime, nullable=False),
)
