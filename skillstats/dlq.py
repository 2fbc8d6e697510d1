"""The dead-letter topic: what a parked record carries, and parking it once (docs/contract.md, failures).

Once, even across kill -9: a worker parks a batch's invalid records before the
SQL transaction that moves the fence past them, so a worker killed in between
replays that batch and would park them again. To prevent it, parcels from source
partition q always go to DLQ partition q mod N, and q's fence row keeps a DLQ
mark: an offset of that DLQ partition below which no parcel for a record at or
above q's fence can be. Before parking, the worker reads its DLQ partitions from
the marks to their ends and leaves out every parcel (group, source topic,
partition, offset) already there; the new mark, stored with the fence in the
batch's transaction, is the end it read to, or lower if the read found parcels
of records above the new fence (another worker's, in a rebalance). The cost is
one short read of the DLQ per batch that parks anything; batches with only
valid records pay nothing.

A parcel larger than the DLQ accepts is never a crash: the DLQ topic is created
with room for 8 MiB records, a parcel past that is parked truncated, and if the
broker still refuses one as too large (a DLQ topic created elsewhere with a
smaller limit) it is truncated further and sent again. A truncated parcel says
so in its headers, with its original size; partition and offset name the
source record, which stays readable in the source topic until retention.

Which parcels are the worker's own: those of the database whose counts skip
them, not merely of the group name. A parcel carries the windows role's claim
mark (`skillstats_consumers.claim_id`, made at the role's first claim and kept
by `fences takeover` and `fences reset`: the same counts go on) as
`skillstats.database`. So a group renamed by a takeover recognises what its
predecessor parked before it died (the DLQ marks moved with the fences, and
the parcels in their range carry the same mark), and a deployment with a
database of its own parking into the same DLQ under the same group name is
not taken for this one: its parcels are its verdicts, not ours. A parcel
without a mark (parked before this version) is recognised by its group name,
as before. The cost: one SQL read per process, at its first parking.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from skillstats.config import Settings
from skillstats.kafka import Headers, RawRecord
from skillstats.publisher import producer_config
from skillstats.retry import Backoff
from skillstats.sinks.fences import DlqMark
from skillstats.sinks.recovery import Abandoned, Health, NotOwned

if TYPE_CHECKING:
    from sqlalchemy import Engine

log = logging.getLogger(__name__)

# Not a docs/contract.md, validity reason: the record is valid, but the database refused it (for
# example PostgreSQL rejects a NUL character inside a TEXT skill id).
REJECTED_BY_DATABASE = "rejected_by_database"

H_REASON = "skillstats.reason"
H_MESSAGE = "skillstats.message"
H_TOPIC = "skillstats.source.topic"
H_PARTITION = "skillstats.source.partition"
H_OFFSET = "skillstats.source.offset"
H_PARKED_AT = "skillstats.parked_at"
H_GROUP = "skillstats.group"
# The claim mark of the windows role in the database of the group that parked it (skillstats_consumers.claim_id):
# the same through takeovers and resets, another for a database of its own. Absent on parcels of older versions.
H_DATABASE = "skillstats.database"
H_TRUNCATED = "skillstats.truncated"
H_ORIGINAL_BYTES = "skillstats.original_bytes"
# The source record's Kafka timestamp (ms): validity depends on it, so a replay keeps it.
H_TIMESTAMP = "skillstats.source.timestamp"
# On a record `skillstats dlq replay` published (and kept on it if it is parked again):
# "<DLQ topic>:<partition>:<offset>" of the first parcel of that record, its root
# (skillstats/dlq_admin.py); and the root's reason.
H_REPLAYED_FROM = "skillstats.replayed_from"
H_REPLAYED_REASON = "skillstats.replayed_reason"

# Room in the DLQ topic (its max.message.bytes) and in the DLQ producer.
DLQ_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
DLQ_TOPIC_CONFIG = {"max.message.bytes": str(DLQ_MAX_MESSAGE_BYTES)}
# What a parcel's key, headers and record framing may take besides the value.
_OVERHEAD_BYTES = 4096
_SMALLEST_LIMIT = 16 * 1024

# source partition -> (the mark the DLQ read started from, the mark to store with the fence)
MarkUpdates = dict[int, tuple[DlqMark | None, DlqMark]]


@dataclass(frozen=True, slots=True)
class Parcel:
    """A record on its way to the DLQ, and why."""

    record: RawRecord
    reason: str
    message: str
    replayed_from: bytes | None = None  # the source record's H_REPLAYED_FROM, carried over
    timestamp: int | None = None  # the source record's Kafka timestamp


def park_headers(
    parcel: Parcel, source_topic: str, group: str, parked_at_ms: int, database: str | None = None
) -> Headers:
    origin = [(H_REPLAYED_FROM, parcel.replayed_from)] if parcel.replayed_from is not None else []
    if parcel.timestamp is not None:
        origin.append((H_TIMESTAMP, str(parcel.timestamp).encode()))
    if database is not None:
        origin.append((H_DATABASE, database.encode()))
    return [
        *origin,
        (H_REASON, parcel.reason.encode()),
        (H_MESSAGE, parcel.message[:1000].encode()),
        (H_TOPIC, source_topic.encode()),
        (H_PARTITION, str(parcel.record.partition).encode()),
        (H_OFFSET, str(parcel.record.offset).encode()),
        (H_PARKED_AT, str(parked_at_ms).encode()),
        (H_GROUP, group.encode()),
    ]


def own_parcel(headers: Mapping[str, bytes | None], group: str, database: str | None) -> bool:
    """Whether a parcel was parked for the tables `group` writes in the database whose claim mark is `database`.

    By the parcel's database mark when both sides have one: every group that wrote
    these tables (a takeover's predecessor, a zombie of it) parked under this mark,
    and no other database did. Otherwise by the group name, as before marks existed:
    a predecessor's unmarked parcel is then not recognised (it is parked once more,
    never lost), and another database's under the same name is (its verdict taken
    for ours, as before).
    """
    theirs = headers.get(H_DATABASE)
    if theirs is not None and database is not None:
        return theirs == database.encode()
    return headers.get(H_GROUP) == group.encode()


def database_mark_of(engine: Engine) -> str | None:
    """The windows role's claim mark in `engine`'s database (None before the role was claimed).

    Whichever group asks: only the role's owner parks (any other is refused at its
    claim), save the old owner still running after a takeover forced past its
    members, and that one parks for these same tables.
    """
    from sqlalchemy import select

    from skillstats.sinks.identity import WINDOWS
    from skillstats.sinks.schema import consumers

    with engine.connect() as connection:
        found = connection.execute(select(consumers.c.claim_id).where(consumers.c.role == WINDOWS)).scalar()
    return str(found) if found is not None else None


def truncated(parcel: Parcel, limit: int) -> tuple[Parcel, Headers]:
    """The parcel cut to fit `limit` bytes, and the headers that say so (none when it fits whole)."""
    value = parcel.record.value or b""
    room = max(0, limit - _OVERHEAD_BYTES - len(parcel.record.key or b""))
    if len(value) <= room:
        return parcel, []
    cut = replace(parcel, record=replace(parcel.record, value=value[:room]))
    return cut, [(H_TRUNCATED, b"true"), (H_ORIGINAL_BYTES, str(len(value)).encode())]


class DeadLetters:
    """Parks records in the DLQ topic, once, and returns only once the broker has acknowledged them."""

    # This database's claim mark (H_DATABASE), read from `_database_url` at the first parking and kept: a
    # takeover or reset keeps it, and a takeover stops this process anyway (its owner check).
    database: str | None = None
    _database_url: str | None = None
    _database_known = False

    def __init__(self, settings: Settings, group: str, *, timeout: float = 30.0) -> None:
        self.source_topic = settings.topic
        self.topic = settings.dlq_topic
        self.group = group
        self._database_url = settings.database_url
        self.timeout = timeout
        self.limit = DLQ_MAX_MESSAGE_BYTES
        self._producer = Producer(
            producer_config(settings, **{"message.max.bytes": DLQ_MAX_MESSAGE_BYTES + _OVERHEAD_BYTES})
        )
        self._reader = Consumer(
            settings.kafka_config(
                **{
                    "group.id": f"{group}.dlq-reader",  # never subscribes or commits
                    "enable.auto.commit": False,
                    "enable.partition.eof": True,
                    "fetch.wait.max.ms": 10,
                }
            )
        )
        self._backoff = Backoff(base=0.5)

    def park(
        self,
        parcels: Sequence[Parcel],
        marks: Mapping[int, DlqMark | None],
        batch_end: Mapping[int, int],
        stop: threading.Event | None = None,
        health: Health | None = None,
        owns: Callable[[int], bool] | None = None,
    ) -> MarkUpdates:
        """Park the parcels not parked already; returns the DLQ marks to store with the fences.

        `marks` holds the stored mark of each source partition (None: never parked);
        `batch_end` one past the highest offset of each partition in the batch.
        A broker outage is retried (capped backoff, `health` degraded meanwhile)
        until it ends or `stop` is set. `owns` is asked right before each send:
        NotOwned when a parcel's source partition was revoked meanwhile (its next
        owner parks it), nothing of that attempt sent.
        """
        if not parcels:
            return {}
        attempt = 0
        while True:
            try:
                self._know_database()
                updates = self._park_once(parcels, marks, batch_end, stop, owns)
            except (KafkaException, RuntimeError) as exc:
                if health is not None:
                    health.failing(exc)
                log.warning("could not park %d record(s) in the DLQ, retry %d: %s", len(parcels), attempt + 1, exc)
                if self._backoff.sleep(attempt, stop):
                    raise
                attempt += 1
                continue
            if health is not None:
                health.ok()
            return updates

    def _park_once(
        self,
        parcels: Sequence[Parcel],
        marks: Mapping[int, DlqMark | None],
        batch_end: Mapping[int, int],
        stop: threading.Event | None,
        owns: Callable[[int], bool] | None = None,
    ) -> MarkUpdates:
        # Asked every time (a metadata request, only for batches that park): a worker
        # must not target a partition another sees differently after the DLQ grew.
        count = self._partition_count()
        sources = sorted({p.record.partition for p in parcels})
        target = {q: q % count for q in sources}
        ends: dict[int, int] = {}
        starts: dict[int, int] = {}
        for q in sources:
            wanted: list[tuple[int, int | None]] = [(target[q], None)]
            mark = marks.get(q)
            if mark is not None and mark[0] < count:  # a mark on a partition that no longer exists is no mark
                wanted = [(target[q], mark[1])] if mark[0] == target[q] else [(target[q], None), mark]
            for dlq_partition, start in wanted:
                low, high = self._reader.get_watermark_offsets(
                    TopicPartition(self.topic, dlq_partition), timeout=self.timeout
                )
                ends[dlq_partition] = high
                begin = low if start is None else max(low, start)
                starts[dlq_partition] = min(starts.get(dlq_partition, begin), begin)
        parked = self._read_parked(starts, ends)
        unique: dict[tuple[int, int], Parcel] = {}
        for parcel in parcels:  # a batch may hold a record twice (see sinks/batch.py): park it once
            unique.setdefault((parcel.record.partition, parcel.record.offset), parcel)
        fresh = [p for key, p in unique.items() if key not in parked]
        if len(fresh) < len(unique):
            log.info("%d record(s) were parked before (a replayed batch); not parked again", len(unique) - len(fresh))
        revoked = sorted({p.record.partition for p in fresh if owns is not None and not owns(p.record.partition)})
        if revoked:
            raise NotOwned(f"partitions {revoked} were revoked before their records were parked")
        self._send(fresh, target, stop)
        updates: MarkUpdates = {}
        for q in sources:
            d = target[q]
            # Parcels of records at or above the batch end belong to another writer's
            # range (a rebalance): the new mark must stay at or below them.
            above = [where for (source, offset), where in parked.items() if source == q and offset >= batch_end[q]]
            updates[q] = (marks.get(q), (d, min([ends[d], *[at for part, at in above if part == d]])))
            if any(part != d for part, _at in above):
                updates[q] = (marks.get(q), marks.get(q) or (d, 0))  # keep the old mark: always safe
        return updates

    def _know_database(self) -> None:
        """Read this database's claim mark once (RuntimeError while the database cannot say: retried)."""
        if self._database_known or self._database_url is None:
            return
        from sqlalchemy.exc import SQLAlchemyError

        from skillstats.sinks.db import open_engine

        try:
            engine = open_engine(self._database_url)
            try:
                self.database = database_mark_of(engine)
            finally:
                engine.dispose()
        except SQLAlchemyError as exc:
            raise RuntimeError(f"reading this database's claim mark: {exc}") from exc
        self._database_known = True

    def end_marks(self, partitions: Sequence[int]) -> dict[int, DlqMark]:
        """For each source partition, a mark at the current end of its DLQ partition (after a fence reset)."""
        count = self._partition_count()
        result = {}
        for q in partitions:
            _low, high = self._reader.get_watermark_offsets(TopicPartition(self.topic, q % count), timeout=self.timeout)
            result[q] = (q % count, high)
        return result

    def _partition_count(self) -> int:
        metadata = self._reader.list_topics(self.topic, timeout=self.timeout).topics.get(self.topic)
        if metadata is None or metadata.error is not None or not metadata.partitions:
            raise RuntimeError(f"DLQ topic {self.topic!r} does not exist; run 'skillstats init'")
        return len(metadata.partitions)

    def _read_parked(
        self, starts: Mapping[int, int], ends: Mapping[int, int]
    ) -> dict[tuple[int, int], tuple[int, int]]:
        """(source partition, source offset) -> (DLQ partition, DLQ offset) of this database's parcels in the ranges
        (`own_parcel`: a takeover's predecessor's included)."""
        todo = {d: ends[d] for d in starts if starts[d] < ends[d]}
        found: dict[tuple[int, int], tuple[int, int]] = {}
        if not todo:
            return found
        self._reader.assign([TopicPartition(self.topic, d, starts[d]) for d in todo])
        # A deadline on progress, not on the whole read: a long read that keeps
        # moving finishes, a stuck one fails (and is retried) after `timeout`.
        deadline = time.monotonic() + self.timeout
        try:
            while todo:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"reading the DLQ back made no progress for {self.timeout:g}s; left: {todo}")
                # A short wait: consume() blocks until it has the count asked or the time is up.
                for message in self._reader.consume(500, timeout=0.02):
                    if message.error() is not None:
                        if message.error().code() == KafkaError._PARTITION_EOF:
                            todo.pop(message.partition(), None)
                            continue
                        raise KafkaException(message.error())
                    d, at = message.partition(), message.offset()
                    deadline = time.monotonic() + self.timeout
                    headers = dict(message.headers() or [])
                    if headers.get(H_TOPIC) == self.source_topic.encode() and own_parcel(
                        headers, self.group, self.database
                    ):
                        source = _source(headers)
                        if source is not None:
                            found[source] = (d, at)
                    if at + 1 >= todo.get(d, 0):
                        todo.pop(d, None)
        finally:
            self._reader.unassign()
        return found

    def _send(self, parcels: Sequence[Parcel], target: Mapping[int, int], stop: threading.Event | None) -> None:
        """Produce and wait for every acknowledgement; a parcel refused as too large is cut and sent again."""
        todo = list(parcels)
        limit = self.limit
        refused: list[Parcel] = []
        errors: list[str] = []

        def delivered(err: KafkaError | None, _message: Message, parcel: Parcel) -> None:
            if err is None:
                return
            if err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                refused.append(parcel)
            else:
                errors.append(str(err))

        while todo:
            now_ms = int(time.time() * 1000)
            refused.clear()
            errors.clear()
            for parcel in todo:
                cut, extra = truncated(parcel, limit)
                if extra:
                    log.warning(
                        "parking %s partition %d offset %d truncated to %d of %d bytes",
                        self.source_topic,
                        parcel.record.partition,
                        parcel.record.offset,
                        len(cut.record.value or b""),
                        len(parcel.record.value or b""),
                    )
                headers = [*park_headers(cut, self.source_topic, self.group, now_ms, self.database), *extra]
                while True:
                    try:
                        self._producer.produce(
                            self.topic,
                            key=cut.record.key,
                            value=cut.record.value,
                            headers=headers,
                            partition=target[parcel.record.partition],
                            on_delivery=lambda err, msg, parcel=parcel: delivered(err, msg, parcel),
                        )
                        break
                    except BufferError:
                        self._producer.poll(0.05)
            # Until every delivery report is in, however long the broker is away: raising
            # with parcels still queued would read the DLQ back before they land and
            # send them twice. librdkafka fails a parcel it could not deliver within
            # message.timeout.ms (5 minutes), and that error is retried from the top.
            while remaining := self._producer.flush(self.timeout):
                log.warning("%d DLQ record(s) not acknowledged yet; waiting for the broker", remaining)
                if stop is not None and stop.is_set():
                    raise Abandoned(f"shutdown with {remaining} DLQ record(s) unacknowledged")
            if errors:
                raise RuntimeError(f"DLQ refused record(s): {'; '.join(errors[:5])}")
            if refused and limit <= _SMALLEST_LIMIT:
                raise RuntimeError(f"DLQ refuses even {limit}-byte records; check its max.message.bytes")
            todo, limit = list(refused), max(_SMALLEST_LIMIT, limit // 4)

    def close(self) -> None:
        self._producer.flush(self.timeout)
        self._reader.close()


def _source(headers: Mapping[str, bytes | None]) -> tuple[int, int] | None:
    """(source partition, source offset) a parcel names, None when it names none."""
    try:
        return int(headers[H_PARTITION] or b""), int(headers[H_OFFSET] or b"")
    except (KeyError, ValueError):
        return None
