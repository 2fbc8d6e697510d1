"""The operators' side of the dead-letter topic: read what was parked, and replay it (`skillstats dlq`).

Parking is skillstats/dlq.py; this module reads the DLQ and brings records
back, for when the cause is gone: a contract widened to accept what was
refused, a database fixed that had refused a record.

A replay must never make a record count twice, and nothing a publisher can
write may change what it does. So a record's identity is its *root*: the
source record it was first parked from, (topic, partition, offset), never a
header and never an address in the DLQ (a record parked twice, by a worker cut
off in a rebalance, has two parcels and one root). SQL
(`skillstats_dlq_replays`, unique per root and replay number) says how many
times a root was replayed and where each copy landed in the events topic (the
copy's position, written once the broker acknowledged it). A parcel whose
source is such a copy position is a copy that was parked again; its root is the
copy's root. While every published copy of a root came back parked, none was
counted. A root is replayed:

- the first time, when selected;
- again only with `--again`, and only when every earlier copy came back parked
  (a copy that did not come back was counted, or is on its way, or its
  position was never recorded: a further copy could count twice, so not even
  `--again` sends one);
- once per replay, however many of its parcels the selection holds;
- only if today's contract accepts it (a copy of a record still invalid would
  be parked again; `--force` sends it anyway).

A record the windows group's database refused (`rejected_by_database`) is
valid, and docsync counted it: a copy on the events topic would count twice
there. It is added to the windows tables directly instead, in one transaction
with its replay row, so it counts exactly once in each group.

The rows are committed before anything is published, so a replay that dies
half-way leaves its roots recorded as replayed, never sent twice: at worst a
copy is missing and the operator sees it. Two replays at once cannot both
publish a root: each row carries the root's replay number, unique per root. A
copy keeps the source record's Kafka timestamp (validity depends on it).
Headers on copies (`skillstats.replayed_from`, `skillstats.replayed_reason`)
tell a reader where a copy came from; neither consumer nor this module trusts
them.

SQL alone is not enough: a database restored to a backup from before a replay
forgets the replay while its copy is still in the events topic, above the
restored fences, so the consumers count it again, and a second replay would
publish a second copy. So each copy is published in a Kafka transaction
together with a record of it in the *replay ledger* (`<DLQ topic>.replays`,
compacted, one small record per copy, keyed by root and replay number): a
copy counts (both groups read committed records only) exactly when its ledger
record exists. Every replay reads the ledger first and adds what SQL lacks
(a replay SQL forgot, where a copy landed when the process died before
recording it) to SQL and to its decision. The transactional id is one per DLQ
topic, so a replay starts by fencing any earlier one still alive (a hung
process whose transaction could otherwise commit after this one read the
ledger), and aborts what it left open. Scanning the events topic for copies
instead would cost a read of everything since the parcel (days of traffic)
per replay, and could not be bounded by the fences: once the consumers have
caught up after a restore, the copy is below them. A copy's position is taken
from the ledger only for the topic as it is now (the same Kafka id): a
recreated topic's entries still say their roots were replayed, never where.
What it costs: a transactional producer and a read of the ledger per replay,
and topic creation (or the topic made by an administrator) the first time.
What it does not cover: a ledger topic deleted (back to SQL alone), and a
commit whose outcome Kafka never told (the rows stay, as before).

Parcels of another database (`skillstats.database`, skillstats/dlq.py) are
that database's verdicts: one of them parking a copy of ours says nothing
about whether ours counted, so only parcels of this database (or unmarked
ones, parked before marks existed) make a copy "parked again".
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from sqlalchemy import and_, delete, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError

from skillstats.config import FIRST_ANSWER_S, Settings
from skillstats.contract import StatEvent
from skillstats.dlq import (
    H_DATABASE,
    H_GROUP,
    H_MESSAGE,
    H_OFFSET,
    H_PARKED_AT,
    H_PARTITION,
    H_REASON,
    H_REPLAYED_FROM,
    H_REPLAYED_REASON,
    H_TIMESTAMP,
    H_TOPIC,
    H_TRUNCATED,
)
from skillstats.publisher import PublishError, producer_config
from skillstats.sinks.recovery import describe
from skillstats.sinks.schema import consumers, dlq_replays, rejected_records
from skillstats.sinks.upserts import now_utc_naive


@dataclass(frozen=True)
class ParkedRecord:
    """A parcel as read back from the DLQ topic."""

    dlq_partition: int
    dlq_offset: int
    reason: str
    message: str
    group: str
    source_topic: str
    source_partition: int | None
    source_offset: int | None
    parked_at_ms: int | None
    replayed_from: str | None  # set when this parcel is a replayed copy that was parked again: its root
    truncated: bool
    timestamp_ms: int | None  # the source record's Kafka timestamp
    key: bytes | None = field(default=None, repr=False)
    value: bytes | None = field(default=None, repr=False)
    database: str | None = None  # the claim mark of the database whose group parked it (H_DATABASE)

    @property
    def address(self) -> tuple[int, int]:
        return (self.dlq_partition, self.dlq_offset)

    def summary(self) -> dict[str, Any]:
        """JSON-friendly, without the payload."""
        return {
            "dlq_partition": self.dlq_partition,
            "dlq_offset": self.dlq_offset,
            "reason": self.reason,
            "message": self.message,
            "group": self.group,
            "source_topic": self.source_topic,
            "source_partition": self.source_partition,
            "source_offset": self.source_offset,
            "parked_at_ms": self.parked_at_ms,
            "replayed_from": self.replayed_from,
            "truncated": self.truncated,
            "timestamp_ms": self.timestamp_ms,
            "database": self.database,
        }


def _parse(partition: int, offset: int, key: bytes | None, value: bytes | None, raw: Iterable[Any]) -> ParkedRecord:
    headers = {k: v.decode(errors="replace") for k, v in raw or () if v is not None}

    def number(name: str) -> int | None:
        text = headers.get(name, "")
        return int(text) if text.lstrip("-").isdigit() else None

    return ParkedRecord(
        partition,
        offset,
        headers.get(H_REASON, "?"),
        headers.get(H_MESSAGE, ""),
        headers.get(H_GROUP, "?"),
        headers.get(H_TOPIC, "?"),
        number(H_PARTITION),
        number(H_OFFSET),
        number(H_PARKED_AT),
        headers.get(H_REPLAYED_FROM),
        headers.get(H_TRUNCATED) == "true",
        number(H_TIMESTAMP),
        key,
        value,
        headers.get(H_DATABASE),
    )


def read_parked(
    settings: Settings,
    ranges: Mapping[int, tuple[int, int]],
    timeout: float = FIRST_ANSWER_S,
    keep_payload: Callable[[ParkedRecord], bool] | None = None,
) -> list[ParkedRecord]:
    """The parcels in `ranges` (DLQ partition -> [start, end) offsets), in DLQ order.

    Keys and values (up to 8 MiB each) are kept only for the parcels
    `keep_payload` accepts (all when it is None): a listing holds summaries.

    The deadline is on progress, not on the whole read: a long read that keeps
    moving finishes, a stuck one raises after `timeout`.
    """
    todo = {d: end for d, (start, end) in ranges.items() if end > start}
    found: list[ParkedRecord] = []
    if not todo:
        return found
    reader = Consumer(
        settings.kafka_config(
            **{
                "group.id": "skillstats-dlq-reader",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                # Retention may delete the first offsets while this reads: go on from the log start.
                "auto.offset.reset": "earliest",
            }
        )
    )
    try:
        reader.assign([TopicPartition(settings.dlq_topic, d, ranges[d][0]) for d in todo])
        deadline = time.monotonic() + timeout
        while todo:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {settings.dlq_topic} made no progress for {timeout:g}s")
            for message in reader.consume(500, timeout=0.2):
                d = message.partition()
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        todo.pop(d, None)
                        continue
                    raise RuntimeError(f"reading {settings.dlq_topic}: {error}")
                deadline = time.monotonic() + timeout
                at = message.offset()
                if d in todo and at < todo[d]:
                    parcel = _parse(d, at, message.key(), message.value(), message.headers() or ())
                    if keep_payload is not None and not keep_payload(parcel):
                        parcel = replace(parcel, key=None, value=None)
                    found.append(parcel)
                if at + 1 >= todo.get(d, 0):
                    todo.pop(d, None)
    finally:
        reader.close()
    found.sort(key=lambda r: r.address)
    return found


def newest_parked(
    settings: Settings, ends: Mapping[int, tuple[int, int]], limit: int = 5, timeout: float = FIRST_ANSWER_S
) -> list[ParkedRecord]:
    """The `limit` most recently parked records, newest first; `ends`: DLQ partition -> (log start, log end)."""
    ranges = {d: (max(start, end - limit), end) for d, (start, end) in ends.items()}
    found = read_parked(settings, ranges, timeout)
    found.sort(key=lambda r: (r.parked_at_ms or 0, r.dlq_partition, r.dlq_offset), reverse=True)
    return found[:limit]


@dataclass(frozen=True)
class Selection:
    """Filters; a parcel matches when it passes every one given (reason any of, parked at or after, source p:o)."""

    reasons: Sequence[str] = ()
    since_ms: int | None = None
    sources: Sequence[tuple[int, int]] = ()

    def __call__(self, r: ParkedRecord) -> bool:
        return (
            (not self.reasons or r.reason in self.reasons)
            and (self.since_ms is None or (r.parked_at_ms or 0) >= self.since_ms)
            and (not self.sources or (r.source_partition, r.source_offset) in self.sources)
        )


def counts_by_reason(parked: Iterable[ParkedRecord]) -> dict[str, int]:
    return dict(Counter(r.reason for r in parked).most_common())


Root = tuple[str, int, int]  # the source record a parcel is of: (topic, partition, offset)


@dataclass
class ReplayPlan:
    """What a replay of a selection would do: roots to publish or apply, and roots left out with why."""

    publish: list[ParkedRecord] = field(default_factory=list)  # one parcel per root (its payload is the record's)
    roots: dict[Root, ParkedRecord] = field(default_factory=dict)  # root -> parcel to publish or apply
    numbers: dict[Root, int] = field(default_factory=dict)  # root -> this replay's number
    direct: list[Root] = field(default_factory=list)  # roots applied to the windows tables, not published
    # Direct roots recorded as skipped when planned: each row must still be there when they are added (a rebuild
    # swapped in since may have counted the record and dropped the row: skillstats/rebuild/generations.py).
    proven: set[Root] = field(default_factory=set)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (root as text, why)


@dataclass
class ReplayBook:
    """What SQL says was replayed: copies published per root, and where each acknowledged copy landed."""

    published: dict[Root, int] = field(default_factory=dict)
    copies: dict[tuple[int, int], Root] = field(default_factory=dict)  # (partition, offset) in the events topic
    refused: set[Root] = field(default_factory=set)  # records the windows group's fence passed as refused
    last: dict[Root, int] = field(default_factory=dict)  # the highest replay number known per root
    database: str | None = None  # this database's claim mark: whose parcels say a copy came back

    def next_number(self, root: Root) -> int:
        """The number of a root's next replay: past every one known (SQL's or the ledger's, gaps included)."""
        return max(self.published.get(root, 0), self.last.get(root, 0)) + 1

    def ours(self, record: ParkedRecord) -> bool:
        """Whether a parcel is this database's verdict (unmarked ones, from before marks, are taken as such)."""
        return record.database is None or self.database is None or record.database == self.database


def label(root: Root) -> str:
    return f"{root[0]}:{root[1]}:{root[2]}"


def root_of(record: ParkedRecord, book: ReplayBook, topic: str) -> Root | None:
    """The source record the parcel is of: a recorded copy's root, else its own source; None when unknown."""
    if record.source_partition is None or record.source_offset is None:
        return None
    if record.source_topic == topic:
        copied = book.copies.get((record.source_partition, record.source_offset))
        if copied is not None:
            return copied
    return (record.source_topic, record.source_partition, record.source_offset)


def plan_replay(
    settings: Settings,
    parked: Sequence[ParkedRecord],
    selection: Sequence[ParkedRecord],
    book: ReplayBook,
    *,
    again: bool,
    force: bool = False,
) -> ReplayPlan:
    """Decide, per root, whether the selection replays it (see the module docstring)."""
    from skillstats.contract import Invalid, decode
    from skillstats.dlq import REJECTED_BY_DATABASE

    plan = ReplayPlan()
    # Copies parked again, each once however many parcels it has (a copy parked twice came back once), by this
    # database's workers only: another database's verdict says nothing about whether ours counted it.
    came_back = Counter(
        book.copies[where]
        for where in {
            (r.source_partition, r.source_offset)
            for r in parked
            if r.source_topic == settings.topic
            and (r.source_partition, r.source_offset) in book.copies
            and book.ours(r)
        }
    )
    for record in selection:
        root = root_of(record, book, settings.topic)
        address = f"{settings.dlq_topic}:{record.dlq_partition}:{record.dlq_offset}"
        if root is None:
            plan.skipped.append((address, "its source partition and offset are not in its headers"))
            continue
        if root in plan.roots:
            continue  # one copy per root and replay
        if root[0] != settings.topic:
            plan.skipped.append((address, f"parked from another topic ({root[0]})"))
            continue
        if record.truncated:
            plan.skipped.append(
                (
                    address,
                    f"parked truncated: the whole record is only in {record.source_topic} partition "
                    f"{record.source_partition} offset {record.source_offset}",
                )
            )
            continue
        if record.reason == "bad_timestamp" and record.timestamp_ms is None:
            plan.skipped.append((address, "its Kafka timestamp, which its validity depends on, was not kept"))
            continue
        published, returned = book.published.get(root, 0), came_back.get(root, 0)
        if published > returned:
            plan.skipped.append(
                (
                    label(root),
                    "replayed before and the copy was not parked again: it counted (or is on its way, or where "
                    "it landed was never recorded); another copy could count twice",
                )
            )
            continue
        if published and not again:
            plan.skipped.append(
                (label(root), "replayed before (its copies were parked again); --again to replay it once more")
            )
            continue
        verdict = decode(record.key, record.value, record.timestamp_ms)
        if isinstance(verdict, Invalid) and not force:
            plan.skipped.append(
                (
                    label(root),
                    f"today's contract still refuses it ({verdict.reason.value}: {verdict.message[:120]}); a copy "
                    f"would be parked again. --force publishes it anyway",
                )
            )
            continue
        direct = record.reason == REJECTED_BY_DATABASE and not isinstance(verdict, Invalid)
        if direct and root not in book.refused and not force:
            plan.skipped.append(
                (
                    label(root),
                    "not recorded as skipped by the windows group (its transaction may not have committed, the "
                    "record read and counted again since, or it was parked by a version before this one): adding "
                    "it could count it twice. --force adds it anyway",
                )
            )
            continue
        plan.roots[root] = record
        plan.numbers[root] = book.next_number(root)
        if direct:
            plan.direct.append(root)
            if root in book.refused:
                plan.proven.add(root)
        else:
            plan.publish.append(record)
    return plan


@dataclass(frozen=True)
class ReplayRow:
    """One row of skillstats_dlq_replays: a root's replay, the parcel it was made from, where its copy landed."""

    root: Root
    number: int
    dlq_partition: int
    dlq_offset: int
    copy: tuple[int, int] | None


@dataclass(frozen=True)
class LedgerEntry:
    """One published copy as the replay ledger keeps it: committed in the copy's own Kafka transaction."""

    root: Root
    number: int
    dlq_partition: int
    dlq_offset: int
    reason: str
    copy: tuple[int, int] | None  # where it landed in the events topic
    topic_id: str | None  # the events topic's Kafka id when it landed (None: a cluster without ids)

    def key(self) -> bytes:
        return f"{label(self.root)}#{self.number}".encode()

    def encode(self) -> bytes:
        return json.dumps(
            {
                "v": 1,
                "root": list(self.root),
                "replay_number": self.number,
                "dlq": [self.dlq_partition, self.dlq_offset],
                "reason": self.reason,
                "copy": list(self.copy) if self.copy is not None else None,
                "topic_id": self.topic_id,
            },
            sort_keys=True,
        ).encode()

    @staticmethod
    def decode(value: bytes | None) -> LedgerEntry | None:
        """None for anything that is not an entry of version 1 (skipped: it cannot say what was published)."""
        try:
            data = json.loads(value or b"")
            topic, partition, offset = data["root"]
            copy = data["copy"]
            return LedgerEntry(
                (str(topic), int(partition), int(offset)),
                int(data["replay_number"]),
                int(data["dlq"][0]),
                int(data["dlq"][1]),
                str(data.get("reason") or ""),
                (int(copy[0]), int(copy[1])) if copy is not None else None,
                data.get("topic_id"),
            )
        except (ValueError, KeyError, TypeError, IndexError):
            return None


LEDGER_SUFFIX = ".replays"
# Compacted, never deleted by age: a copy stays in the events topic for its whole retention, and its record must
# outlive it. One small record per copy ever published.
LEDGER_CONFIG = {"cleanup.policy": "compact"}
# Long enough for a replay's copies to be acknowledged; a process that dies mid-transaction holds read_committed
# consumers of the events topic at its first copy at most this long (late, never wrong).
TRANSACTION_TIMEOUT_S = 60.0


def ledger_topic(settings: Settings) -> str:
    """The replay ledger of `settings`' DLQ topic."""
    return settings.dlq_topic + LEDGER_SUFFIX


def merge_ledger(
    rows: Sequence[ReplayRow], ledger: Sequence[LedgerEntry], topic_id: str | None
) -> tuple[list[LedgerEntry], list[LedgerEntry]]:
    """What the ledger knows and SQL does not: (replays with no row, to add; rows without the copy position
    their entry has, to fill).

    A position is taken only from an entry written for the topic as it is now (its
    Kafka id, known on both sides): a recreated topic reuses positions, and a new
    record there is no copy. Such an entry still adds its replay, without a
    position: its root stays replayed, never sent again (as `fences reset` leaves
    SQL's rows). Adding a replay only ever refuses a further copy, never allows one.
    """
    known = {(row.root, row.number): row for row in rows}
    missing: list[LedgerEntry] = []
    fill: list[LedgerEntry] = []
    for entry in ledger:
        here = topic_id is not None and entry.topic_id == topic_id and entry.copy is not None
        row = known.get((entry.root, entry.number))
        if row is None:
            missing.append(entry if here else replace(entry, copy=None))
        elif (
            row.copy is None and here and (row.dlq_partition, row.dlq_offset) == (entry.dlq_partition, entry.dlq_offset)
        ):
            fill.append(entry)
    return missing, fill


def book_of(
    rows: Sequence[ReplayRow],
    ledger: Sequence[LedgerEntry] = (),
    topic_id: str | None = None,
    refused: Iterable[Root] = (),
    database: str | None = None,
) -> ReplayBook:
    """The replay book of SQL's rows and the ledger's entries together (merge_ledger)."""
    missing, fill = merge_ledger(rows, ledger, topic_id)
    filled = {(e.root, e.number): e.copy for e in fill}
    every = [replace(row, copy=filled.get((row.root, row.number), row.copy)) for row in rows] + [
        ReplayRow(e.root, e.number, e.dlq_partition, e.dlq_offset, e.copy) for e in missing
    ]
    book = ReplayBook(refused=set(refused), database=database)
    for row in every:
        book.published[row.root] = book.published.get(row.root, 0) + 1
        book.last[row.root] = max(book.last.get(row.root, 0), row.number)
        if row.copy is not None:
            book.copies[row.copy] = row.root
    return book


def replay_rows(engine: Any, topic: str) -> list[ReplayRow]:
    """skillstats_dlq_replays' rows of the events topic `topic`'s records."""
    with engine.connect() as connection:
        found = connection.execute(
            select(
                dlq_replays.c.source_topic,
                dlq_replays.c.source_partition,
                dlq_replays.c.source_offset,
                dlq_replays.c.replay_number,
                dlq_replays.c.dlq_partition,
                dlq_replays.c.dlq_offset,
                dlq_replays.c.copy_partition,
                dlq_replays.c.copy_offset,
            )
        )
        rows = []
        for source_topic, partition, offset, number, dlq_partition, dlq_offset, copy_partition, copy_offset in found:
            if partition is None or offset is None:
                continue
            copy = (copy_partition, copy_offset) if copy_partition is not None and copy_offset is not None else None
            # Rows from before revision 0005 name no topic.
            rows.append(ReplayRow((source_topic or topic, partition, offset), number, dlq_partition, dlq_offset, copy))
        return rows


def _still_refused(connection: Any, roots: set[Root]) -> set[Root]:
    """Inside the replay's transaction: which of `roots` still have their skillstats_rejected_records row."""
    if not roots:
        return set()
    partitions = {p for _t, p, _o in roots}
    found = connection.execute(
        select(rejected_records.c.topic, rejected_records.c.partition, rejected_records.c.offset)
        .where(rejected_records.c.partition.in_(partitions))
        .with_for_update()
    )
    return {(t, p, o) for t, p, o in found} & roots


def replay_book(engine: Any, topic: str, ledger: Sequence[LedgerEntry] = (), topic_id: str | None = None) -> ReplayBook:
    """What skillstats_dlq_replays says of the events topic `topic`'s records, with what the ledger adds."""
    from skillstats.sinks.identity import WINDOWS

    rows = replay_rows(engine, topic)
    with engine.connect() as connection:
        refused = connection.execute(
            select(rejected_records.c.topic, rejected_records.c.partition, rejected_records.c.offset)
        )
        roots = {(t, p, o) for t, p, o in refused}
        database = connection.execute(select(consumers.c.claim_id).where(consumers.c.role == WINDOWS)).scalar()
    return book_of(rows, ledger, topic_id, roots, database)


def record_ledger(engine: Any, settings: Settings, ledger: Sequence[LedgerEntry], topic_id: str | None) -> int:
    """Add to SQL what the ledger knows and SQL does not (merge_ledger), in one transaction; returns how many
    rows were added or completed. An added row that clashes with one there (two replays at once) is left out:
    the book used for the decision holds the ledger's entries anyway."""
    missing, fill = merge_ledger(replay_rows(engine, settings.topic), ledger, topic_id)
    if not missing and not fill:
        return 0
    now = now_utc_naive()
    with engine.begin() as connection:
        dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
        if missing:
            connection.execute(
                dialect.insert(dlq_replays).on_conflict_do_nothing(),
                [
                    {
                        "dlq_topic": settings.dlq_topic,
                        "dlq_partition": e.dlq_partition,
                        "dlq_offset": e.dlq_offset,
                        "replay_number": e.number,
                        "source_topic": e.root[0],
                        "source_partition": e.root[1],
                        "source_offset": e.root[2],
                        "reason": e.reason,
                        "copy_partition": e.copy[0] if e.copy is not None else None,
                        "copy_offset": e.copy[1] if e.copy is not None else None,
                        "replayed_at": now,
                    }
                    for e in missing
                ],
            )
        for e in fill:
            assert e.copy is not None
            connection.execute(
                update(dlq_replays)
                .where(_row_of(e.root, e.number), dlq_replays.c.copy_partition.is_(None))
                .values(copy_partition=e.copy[0], copy_offset=e.copy[1])
            )
    return len(missing) + len(fill)


def _row_of(root: Root, number: int) -> Any:
    """The SQL condition for a root's replay `number` (rows this version writes always name their topic)."""
    return and_(
        dlq_replays.c.source_topic == root[0],
        dlq_replays.c.source_partition == root[1],
        dlq_replays.c.source_offset == root[2],
        dlq_replays.c.replay_number == number,
    )


def read_ledger(settings: Settings, timeout: float = FIRST_ANSWER_S) -> list[LedgerEntry]:
    """Every committed entry of the replay ledger ([] when it does not exist yet: nothing was published with one).

    Read committed: an entry of a transaction still open (another replay, or one a
    dead process left, until the broker aborts it) is not seen, nor is its copy
    counted; a replay fences such a process before it reads (CopyPublisher).
    """
    topic = ledger_topic(settings)
    reader = Consumer(
        settings.kafka_config(
            **{
                "group.id": "skillstats-dlq-reader",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "isolation.level": "read_committed",
            }
        )
    )
    found: dict[bytes, LedgerEntry] = {}
    try:
        metadata = reader.list_topics(topic, timeout=timeout).topics.get(topic)
        if metadata is None or (
            metadata.error is not None and metadata.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART
        ):
            return []
        if metadata.error is not None:
            raise RuntimeError(f"reading {topic}: {metadata.error}")
        todo: dict[int, int] = {}
        for partition in metadata.partitions:
            low, high = reader.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout)
            if high > low:
                todo[partition] = high
        if not todo:
            return []
        reader.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in todo])
        deadline = time.monotonic() + timeout
        while todo:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic} made no progress for {timeout:g}s")
            for message in reader.consume(500, timeout=0.2):
                p = message.partition()
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        todo.pop(p, None)
                        continue
                    raise RuntimeError(f"reading {topic}: {error}")
                deadline = time.monotonic() + timeout
                entry = LedgerEntry.decode(message.value())
                if entry is not None:
                    found[message.key() or entry.key()] = entry
                if message.offset() + 1 >= todo.get(p, 0):
                    todo.pop(p, None)
    finally:
        reader.close()
    return list(found.values())


class ReplayRefused(Exception):
    """Nothing in the selection can be replayed (the message says why)."""


class ReplayAborted(PublishError):
    """The copies' transaction was aborted, or never committed: none of them will ever count."""


class CopyPublisher:
    """Publishes a replay's copies and their ledger entries in one Kafka transaction.

    The transactional id is one per DLQ topic: making this producer fences any
    earlier replay still alive and aborts the transaction it left open, so that
    nothing is committed behind the ledger this replay reads next. Two replays at
    once therefore cannot both publish a root unknown to the other: the earlier
    one's commit is refused, and it says that Kafka did not confirm its copies
    (its rows stay, as for any unconfirmed copy; the ledger tells the next replay
    where they landed if they did commit). Creates the ledger topic when it does
    not exist (an operator without that right creates it as `skillstats init`
    would).
    """

    def __init__(self, settings: Settings, timeout: float = 30.0) -> None:
        from skillstats.kafka import ensure_topics

        self.settings = settings
        self.timeout = timeout
        self.ledger = ledger_topic(settings)
        ensure_topics(settings, {self.ledger: 1}, configs={self.ledger: LEDGER_CONFIG}, timeout=timeout)
        self._producer = Producer(
            producer_config(
                settings,
                **{
                    "transactional.id": f"skillstats-dlq-replay.{settings.dlq_topic}",
                    "transaction.timeout.ms": int(TRANSACTION_TIMEOUT_S * 1000),
                },
            )
        )
        self._producer.init_transactions(timeout)

    def publish(
        self, copies: Sequence[tuple[Root, int, ParkedRecord]], topic_id: str | None
    ) -> dict[Root, tuple[int, int]]:
        """Publish each (root, replay number, parcel) as a copy, and its ledger entry, in one transaction;
        returns where each copy landed. ReplayAborted: none of them counts; PublishError: the outcome is not
        known (the ledger will say, to the next replay)."""
        producer = self._producer
        landed: dict[Root, tuple[int, int]] = {}
        failed: list[str] = []

        def delivered(err: KafkaError | None, message: Message, root: Root) -> None:
            if err is None:
                landed[root] = (message.partition(), message.offset())
            else:
                failed.append(f"{label(root)} ({err})")

        producer.begin_transaction()
        try:
            for root, _number, record in copies:
                headers = [
                    (H_REPLAYED_FROM, f"{self.settings.dlq_topic}:{record.dlq_partition}:{record.dlq_offset}".encode()),
                    (H_REPLAYED_REASON, record.reason.encode()),
                ]
                producer.produce(
                    self.settings.topic,
                    key=record.key,
                    value=record.value,
                    headers=headers,
                    timestamp=record.timestamp_ms or 0,
                    on_delivery=lambda err, msg, root=root: delivered(err, msg, root),
                )
                producer.poll(0)
            unsent = producer.flush(self.timeout)
        except (BufferError, KafkaException) as exc:
            failed.append(str(exc))
            unsent = 0
        if failed or unsent or len(landed) < len(copies):
            self._abort(f"{len(failed) + unsent} cop(ies) not acknowledged ({'; '.join(failed[:5])})", len(copies))
        # Where each copy landed is known now, inside the transaction: its entry says so, atomically with it.
        for root, number, record in copies:
            entry = LedgerEntry(
                root, number, record.dlq_partition, record.dlq_offset, record.reason, landed[root], topic_id
            )
            producer.produce(self.ledger, key=entry.key(), value=entry.encode())
        for attempt in range(3):
            try:
                producer.commit_transaction(self.timeout)
                return landed
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if error.txn_requires_abort():
                    self._abort(f"the transaction was refused ({error.str()})", len(copies))
                if not error.retriable() or attempt == 2:
                    raise PublishError(
                        f"Kafka did not say whether the replay's transaction of {len(copies)} cop(ies) committed "
                        f"({error.str()}). They stay recorded as replayed, so no replay sends them twice; the next "
                        f"replay learns from the ledger ({self.ledger}) where those that committed landed.",
                        len(copies),
                    ) from None
        raise AssertionError("unreachable")

    def _abort(self, why: str, count: int) -> None:
        """Abort the transaction (or leave it to the broker's timeout, which aborts it too) and raise."""
        # Should even that fail, it never committed: the broker aborts it within transaction.timeout.ms.
        with contextlib.suppress(KafkaException):
            self._producer.abort_transaction(self.timeout)
        raise ReplayAborted(f"{why}: the transaction was aborted, none of its copies will count", count)

    def close(self) -> None:
        self._producer.flush(0)


def replay(
    settings: Settings,
    engine: Any,
    plan: ReplayPlan,
    publisher: CopyPublisher | None = None,
    topic_id: str | None = None,
) -> int:
    """Apply the plan's direct roots, record the rest as replayed, publish one copy each (with its ledger entry)
    and record where each landed; returns how many were applied or published.

    `publisher` should be made before the ledger was read (it fences an earlier
    replay still alive); one is made here when none is given. `topic_id` is the
    events topic's Kafka id, kept in the ledger entries. Raises PublishError when
    Kafka did not say whether the copies committed: they stay recorded (never
    sent twice). When the transaction was aborted, nothing counts, and their rows
    are removed again: the same replay can simply be run again.
    """
    from skillstats.contract import decode
    from skillstats.sinks.windows import WindowsSink

    now = now_utc_naive()

    def row(root: Root) -> dict[str, Any]:
        record = plan.roots[root]
        return {
            "dlq_topic": settings.dlq_topic,
            "dlq_partition": record.dlq_partition,
            "dlq_offset": record.dlq_offset,
            "replay_number": plan.numbers[root],
            "source_topic": root[0],
            "source_partition": root[1],
            "source_offset": root[2],
            "reason": record.reason,
            "replayed_at": now,
        }

    applied = 0
    concurrent = "another replay of the same records ran at the same time; nothing was published"
    if plan.direct:
        # Counted and recorded in one transaction: recorded means counted, once.
        sink = WindowsSink(engine, settings.windows_group, settings.topic)
        events = [decode(plan.roots[r].key, plan.roots[r].value, plan.roots[r].timestamp_ms) for r in plan.direct]
        with engine.begin() as connection:
            try:
                connection.execute(insert(dlq_replays), [row(root) for root in plan.direct])
            except IntegrityError:
                raise ReplayRefused(concurrent) from None
            gone = plan.proven - _still_refused(connection, plan.proven)
            if gone:
                raise ReplayRefused(
                    f"{len(gone)} of these record(s) are no longer recorded as skipped by the windows group (a "
                    f"rebuild swapped in since the plan counts them): adding them would count them twice; nothing "
                    f"was added"
                )
            try:
                sink.write(connection, sink.fold([e for e in events if isinstance(e, StatEvent)]), now)
            except Exception as exc:
                raise ReplayRefused(
                    f"the database still refuses {len(plan.direct)} record(s) ({describe(exc)}); nothing was added"
                ) from None
        applied = len(plan.direct)
    published = [root for root in plan.roots if root not in plan.direct]
    if not published:
        return applied
    # Recorded before anything is published: a replay that dies from here on leaves its roots replayed.
    try:
        with engine.begin() as connection:
            connection.execute(insert(dlq_replays), [row(root) for root in published])
    except IntegrityError:
        raise ReplayRefused(concurrent) from None
    own = publisher is None
    if publisher is None:
        publisher = CopyPublisher(settings)
    try:
        landed = publisher.publish([(root, plan.numbers[root], plan.roots[root]) for root in published], topic_id)
    except ReplayAborted as exc:
        with engine.begin() as connection:  # nothing of it counts: not replayed after all
            for root in published:
                connection.execute(delete(dlq_replays).where(_row_of(root, plan.numbers[root])))
        raise ReplayAborted(f"{exc}; nothing was recorded either: replay again", exc.unconfirmed) from None
    finally:
        if own:
            publisher.close()
    # Where each copy landed (the ledger has it too): a parcel of it later is known as a copy parked again,
    # whatever its headers say.
    with engine.begin() as connection:
        for root, (partition, offset) in landed.items():
            connection.execute(
                update(dlq_replays)
                .where(_row_of(root, plan.numbers[root]))
                .values(copy_partition=partition, copy_offset=offset)
            )
    return applied + len(landed)
