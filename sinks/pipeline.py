"""The windows group's batches between the fetch and SQL: decode, park the invalid, fold, one transaction.

Quix Streams' sinks keep batches per partition, drop them on revoke and commit
offsets only after the flush; so does this, with the fence as the offset. The
consumer (streams/windows.py) hands fetched records over per partition with
where their read started (and, past transaction markers, where it stands);
`BatchSink` keeps at most one batch in the database while the next one forms
(group commit: batches grow with load and stay small when the stream is
quiet), and `WindowsPipeline` does one batch's work in the sink thread:

- the topic's Kafka id is confirmed before anything leaves for the DLQ or SQL
  (a replaced topic is counted and parked by no one: skillstats/positions.py);
- invalid records are parked once, by their partition's current owner only
  (`Ownership`), before the transaction that moves the fence past them;
- the fold and the fences go in one transaction (sinks/batch.py), a database
  error is retried or isolated (sinks/recovery.py).

After each batch the consumer learns the fences as the transaction found them
(the truth, for its Kafka commits) and which partitions must be read again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import operator
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from skillstats.config import redact_url
from skillstats.contract import Invalid, StatEvent, decode_many, decode_pending
from skillstats.dlq import H_REPLAYED_FROM, REJECTED_BY_DATABASE, DeadLetters, MarkUpdates, Parcel
from skillstats.kafka import RawRecord
from skillstats.metrics import PipelineMetrics, watch_health
from skillstats.positions import Positions
from skillstats.retry import Backoff
from skillstats.shutdown import LEAVE_RESERVE_S
from skillstats.sinks.batch import ApplyOutcome, ConsumedRecord, DecodedOnUse, PartitionBatch
from skillstats.sinks.identity import IdentityMismatch
from skillstats.sinks.recovery import Abandoned, Health, NotOwned, apply_with_recovery, retrying
from skillstats.sinks.windows import WindowsSink

log = logging.getLogger(__name__)
T = TypeVar("T")


# The cyclic collector's first-generation threshold in a process that runs this pipeline (the windows worker sets
# it, and the bench's measurements as the worker runs): streams/windows.py says why.
COLLECTOR_THRESHOLD = 1_000_000


class FetchedRecord(Protocol):
    """What the batch drain needs of a record (a record's partition is its batch's key): RecordColumns' records
    (streams/aiokafka_records.py reads aiokafka's fetches into columns) and aiokafka's own records and
    ConsumerRecord all fit."""

    offset: int
    timestamp: int | None
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes | None]]


class ColumnRecord(NamedTuple):
    """One record of RecordColumns, made when asked for (a rare path: a filter after a seek, a rejected record)."""

    offset: int
    timestamp: int | None
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes | None]]


class RecordColumns(Sequence[ColumnRecord]):
    """A run of one partition's fetched records as five columns, in fetch order: what the drain reads of each
    record, with no object per record (streams/aiokafka_records.py reads record batches straight into them).

    decode_batch reads the columns as they are; anything else sees a Sequence of FetchedRecord (`ColumnRecord`,
    made per item asked for). A record without headers has an empty tuple.
    """

    __slots__ = ("headers", "keys", "offsets", "timestamps", "values")

    def __init__(self) -> None:
        self.offsets: list[int] = []
        self.timestamps: list[int | None] = []
        self.keys: list[bytes | None] = []
        self.values: list[bytes | None] = []
        self.headers: list[Sequence[tuple[str, bytes | None]]] = []

    @property
    def columns(self) -> tuple[list[Any], ...]:
        return self.offsets, self.timestamps, self.keys, self.values, self.headers

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            part = RecordColumns()
            for mine, theirs in zip(self.columns, part.columns, strict=True):
                theirs[:] = mine[index]
            return part
        return ColumnRecord(*(column[index] for column in self.columns))

    def extend(self, records: Sequence[FetchedRecord]) -> None:
        """Append `records` (columns: theirs appended whole; any other records: theirs read)."""
        if isinstance(records, RecordColumns):
            for mine, theirs in zip(self.columns, records.columns, strict=True):
                mine += theirs
            return
        for record in records:
            self.offsets.append(record.offset)
            self.timestamps.append(record.timestamp)
            self.keys.append(record.key)
            self.values.append(record.value)
            self.headers.append(record.headers)


def replayed_from(raw: FetchedRecord) -> bytes | None:
    """The H_REPLAYED_FROM header of a record, carried onto its parcel as information (never trusted)."""
    for name, value in raw.headers or ():
        if name == H_REPLAYED_FROM:
            return value
    return None


class DecodedBatch(NamedTuple):
    parts: list[PartitionBatch]
    parcels: list[Parcel]  # the invalid records, for the DLQ
    newest_event_ms: dict[int, int]  # partition -> newest occurred_at of a valid event
    newest_record_ms: dict[int, int]  # partition -> newest Kafka timestamp
    folded: Any = None  # the `fold` handed in, with every valid event of `parts` in it


def decode_batch(
    fetched: Mapping[int, Sequence[FetchedRecord]],
    since: Mapping[int, int],
    until: Mapping[int, int] | None = None,
    fold: Any = None,
) -> DecodedBatch:
    """Decode a batch, kept per partition; invalid records become fence-only entries plus parcels for the DLQ.

    `since`: per partition, where the read of its records started; `until`, where
    it stood after them, past any transaction markers (see sinks/batch.py; a
    partition in `until` may have no records: the read passed only markers).
    Validity is a function of the record alone (its key, value and Kafka
    timestamp), so this group and docsync always agree on it. Records are read
    into columns and decoded in one call per partition: no object per record
    beyond the event itself.

    `fold`: a sink's `fold_at_decode` (skillstats._native.WindowFold), or None.
    With one, the records the C reader can prove valid are added to it from
    their bytes, with no event built, the rest decoded as always and their
    valid events added: the entries' events are then DecodedOnUse, built only
    if a rarer path asks for them.
    """
    parts: list[PartitionBatch] = []
    parcels: list[Parcel] = []
    newest_event: dict[int, int] = {}
    newest_record: dict[int, int] = {}
    until = until or {}
    for partition, end in until.items():
        if not fetched.get(partition):
            parts.append(PartitionBatch(partition, [], [], since[partition], end))
    for partition, raws in fetched.items():
        if not raws:
            continue
        if isinstance(raws, RecordColumns):
            offsets, stamps, keys, values = raws.offsets, raws.timestamps, raws.keys, raws.values
        else:
            offsets, stamps = [raw.offset for raw in raws], [raw.timestamp for raw in raws]
            keys, values = [raw.key for raw in raws], [raw.value for raw in raws]
        events, invalid, newest = decode_columns(keys, values, stamps, fold)
        if newest is not None:
            newest_event[partition] = newest
        for index, why in invalid:
            raw = raws[index]
            parcels.append(
                Parcel(
                    RawRecord(partition, raw.offset, raw.key, raw.value),
                    why.reason.value,
                    why.message,
                    replayed_from(raw),
                    raw.timestamp,
                )
            )
        parts.append(PartitionBatch(partition, offsets, events, since[partition], until.get(partition)))
        newest_stamp = max(filter(_NOT_NONE, stamps), default=-1)
        if newest_stamp >= 0:  # -1: Kafka's "no timestamp", not a time
            newest_record[partition] = newest_stamp
    return DecodedBatch(parts, parcels, newest_event, newest_record, fold)


def decode_columns(
    keys: Sequence[bytes | None], values: Sequence[bytes | None], stamps: Sequence[int | None], fold: Any = None
) -> tuple[Sequence[StatEvent | None], list[tuple[int, Invalid]], int | None]:
    """One read's records decoded: their events (None for an invalid one), the invalid ones by index, and the
    newest occurred_at of a valid one (None: no valid one); with `fold`, the valid ones added to it and the
    events DecodedOnUse (see decode_batch)."""
    if fold is None:
        events, invalid = decode_many(keys, values, stamps)
        return events, invalid, max(map(_OCCURRED_AT, filter(None, events)), default=None)
    pending, newest = fold.add_records(keys, values, stamps)
    decided, invalid = decode_pending(keys, values, stamps, pending)
    if decided:
        valid = list(filter(None, decided))
        fold.add_events(valid)
        newest = max(filter(_NOT_NONE, (newest, *map(_OCCURRED_AT, valid))), default=None)
    return DecodedOnUse(keys, values, stamps), invalid, newest


_OCCURRED_AT = operator.attrgetter("occurred_at")
_NOT_NONE = functools.partial(operator.is_not, None)


class Ownership:
    """Which partitions this worker owns now, for parking: a record is parked only by its partition's owner.

    The event loop replaces the set at every revoke and assignment; the sink thread
    checks it, under `parking`, right before it parks. A revoke takes `parking`
    after shrinking the set, so once it has it no parking of a revoked partition
    is under way or can begin, and the next owner cannot park the same records at
    the same time (a batch whose partition was revoked leaves that partition to the
    next owner, unapplied).
    """

    def __init__(self) -> None:
        self.owned: frozenset[int] = frozenset()
        self.parking = threading.Lock()

    def owns(self, partition: int) -> bool:
        return partition in self.owned


class WindowsPipeline:
    """The synchronous work for one batch; runs in the sink thread."""

    def __init__(
        self,
        sink: WindowsSink,
        dead_letters: DeadLetters,
        positions: Positions | None = None,
        ownership: Ownership | None = None,
    ) -> None:
        self.sink = sink
        self.dead_letters = dead_letters
        self.positions = positions  # None only in unit tests: no topic id to check
        self.ownership = ownership
        self.topic_ids = positions.topic_ids if positions is not None else None
        self.stop = threading.Event()
        self.health = Health(target=redact_url(sink.engine.url.render_as_string(hide_password=False)))
        self.metrics = PipelineMetrics(sink.group_id)
        watch_health(sink.group_id, self.health)

    def process(
        self,
        fetched: Mapping[int, Sequence[FetchedRecord]],
        since: Mapping[int, int],
        until: Mapping[int, int] | None = None,
    ) -> ApplyOutcome:
        """Decode, park the invalid, fold and apply one batch (partition -> its records in fetch order)."""
        began = time.perf_counter()
        # Asked now, answered before the transaction: the request runs while this decodes.
        asked = self.topic_ids.request(self.sink.topic) if self.topic_ids is not None else None
        parts, parcels, newest_event_ms, newest_record_ms, folded = decode_batch(
            fetched, since, until, self.sink.fold_at_decode()
        )
        prepared = self.sink.prepare(parts, folded_at_decode=folded)  # the fold, and each partition's end, once
        if asked is not None:
            # Before anything leaves for the DLQ: a replaced topic's records are parked by no one.
            self._verify_topic(asked)
        marks: MarkUpdates = {}
        while parcels:
            with self._parking():
                gone = {p.record.partition for p in parcels if not self._owns(p.record.partition)}
                if gone:
                    # Revoked since it was fetched: its next owner parks these (and counts the rest).
                    log.info("partitions %s were revoked before their invalid records were parked", sorted(gone))
                    parts = [part for part in parts if part.partition not in gone]
                    parcels = [p for p in parcels if p.record.partition not in gone]
                    prepared = self.sink.prepare(parts)
                    continue
                # A record below its fence was parked (and acknowledged) before the fence
                # first moved past it; one above may have been parked by a worker that
                # died before its commit: DeadLetters reads the DLQ from the marks.
                rows = retrying(self.sink.rows, "reading the fences", self.health, self.stop)
                stored = {p: row.dlq_mark for p, row in rows.items()}
                parcels = [
                    p
                    for p in parcels
                    if p.record.offset >= (rows[p.record.partition].next_offset if p.record.partition in rows else 0)
                ]
                try:
                    marks = self.dead_letters.park(
                        parcels, stored, prepared.end, self.stop, self.health, owns=self._owns
                    )
                except NotOwned:
                    continue  # revoked while the DLQ was retried: left out above, on the next turn
                break

        rejected: list[ConsumedRecord] = []

        def park_rejected(record: ConsumedRecord, exc: BaseException) -> MarkUpdates:
            raw = next(r for r in fetched[record.partition] if r.offset == record.offset)
            parcel = Parcel(
                RawRecord(record.partition, raw.offset, raw.key, raw.value),
                REJECTED_BY_DATABASE,
                str(exc),
                replayed_from(raw),
                raw.timestamp,
            )
            with self._parking():
                if not self._owns(record.partition):
                    raise NotOwned(f"partition {record.partition} was revoked before a rejected record was parked")
                rows = retrying(self.sink.rows, "reading the fences", self.health, self.stop)
                current = {p: row.dlq_mark for p, row in rows.items()}
                updates = self.dead_letters.park(
                    [parcel], current, {record.partition: record.offset + 1}, self.stop, self.health, self._owns
                )
            rejected.append(record)
            return updates

        outcome = apply_with_recovery(
            self.sink, prepared, park_rejected, stop=self.stop, health=self.health, dlq_marks=marks
        )
        outcome.parked += len(parcels)
        self.metrics.batch(outcome, prepared.count, time.perf_counter() - began)
        self.metrics.invalid(Counter(p.reason for p in parcels), parked=True)
        self.metrics.parked(REJECTED_BY_DATABASE, len(rejected))
        self.metrics.newest(newest_event_ms, newest_record_ms)
        self.metrics.undelivered(outcome.undelivered)
        return outcome

    def _verify_topic(self, asked: Any) -> None:
        """The topic still has the id the worker claimed (IdentityMismatch if not); asked again while Kafka
        cannot say (degraded meanwhile): not knowing is not a pass."""
        assert self.positions is not None and self.topic_ids is not None
        topic = self.sink.topic
        attempt = 0
        while True:
            try:
                self.positions.check_topic_id(self.topic_ids.answer(topic, asked))
                if attempt:
                    self.health.ok()
                return
            except IdentityMismatch:
                raise
            except Exception as exc:  # Kafka did not answer, or the topic is gone for now
                self.health.failing(exc)
                log.warning(
                    "cannot confirm topic %s's id before applying a batch (try %d): %s", topic, attempt + 1, exc
                )
                if Backoff().sleep(attempt, self.stop):
                    raise Abandoned("shutdown while confirming the topic id") from exc
                attempt += 1
                asked = self.topic_ids.request(topic)

    def _owns(self, partition: int) -> bool:
        return self.ownership is None or self.ownership.owns(partition)

    def _parking(self) -> Any:
        return self.ownership.parking if self.ownership is not None else _NO_LOCK


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None


_NO_LOCK = _NoLock()


class SinkThread:
    """One daemon thread running the batches, in order.

    A daemon (unlike a ThreadPoolExecutor's worker) cannot hold the process past
    its shutdown budget while a database call hangs: the budget decides, and what
    the abandoned batch had not committed is replayed by the next owner.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Callable[[], Any]]]
        self._jobs = queue.SimpleQueue()
        threading.Thread(target=self._run, name="windows-sink", daemon=True).start()

    def submit(self, job: Callable[[], T]) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((loop, future, job))
        return future

    def _run(self) -> None:
        while True:
            loop, future, job = self._jobs.get()
            try:
                result = job()
            except BaseException as exc:  # handed to the awaiting coroutine
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


# One partition's part of a fetch: where its read started, its records, and where the read
# stands after them when that is past them (it passed transaction markers); None otherwise.
Chunk = tuple[int, Sequence[Any], int | None]


class BatchSink:
    """Feeds fetched records to the pipeline one transaction at a time, in fetch order.

    At most one batch is in the database; records fetched meanwhile wait in
    `pending`, kept per partition with where their read started (`since`), and
    form the next batch. A partition whose read starts again (a new assignment, a
    fence found behind) has its pending records dropped: they were never
    applied, and the new read fetches them again from the fence. When `pending`
    reaches `max_pending`, the fetcher waits for the database (backpressure), so
    memory stays bounded. After each batch the consumer learns the fences (the
    truth, `on_fences`) and which partitions must be read again (`on_behind`).
    """

    def __init__(
        self,
        pipeline: WindowsPipeline,
        max_pending: int,
        commit: Callable[[dict[int, int]], Any],
        on_behind: Callable[[dict[int, tuple[int, int]]], None] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.max_pending = max_pending
        self.commit = commit
        self.on_behind = on_behind
        self.pending: dict[int, RecordColumns] = {}
        self.pending_since: dict[int, int] = {}
        self.pending_until: dict[int, int] = {}  # where the reads stood, past markers (when past the records)
        self.pending_count = 0
        self.in_flight: asyncio.Future[ApplyOutcome] | None = None
        self.in_flight_size = 0
        self.totals = ApplyOutcome()
        self.fences: dict[int, int] = {}  # partition -> its fence, as the last transaction found it
        self._thread = SinkThread()

    async def add(self, fetched: Mapping[int, Chunk]) -> None:
        """Hand on each partition's records, with where their read started (the end of the previous ones) and,
        when it passed transaction markers after them, where it stands now."""
        for partition, (since, records, until) in fetched.items():
            if not records and until is None:
                continue
            if partition not in self.pending_since:
                self.pending[partition] = RecordColumns()
                self.pending_since[partition] = since
            self.pending[partition].extend(records)
            self.pending_count += len(records)
            if until is not None:
                self.pending_until[partition] = until
            else:
                self.pending_until.pop(partition, None)  # records after the markers: they say where it ends
        if self.in_flight is not None and (self.in_flight.done() or self.pending_count >= self.max_pending):
            await self.finish_in_flight()
        if self.in_flight is None and self.pending_since:
            self._start()

    async def settle(self, timeout: float) -> None:
        """Wait (at most `timeout` s) for the batch in the database; it is checkpointed as usual later."""
        if self.in_flight is not None and not self.in_flight.done():
            await asyncio.wait({self.in_flight}, timeout=timeout)

    def drop(self, partitions: set[int]) -> int:
        """Forget what is pending for `partitions` (owned elsewhere now, or read again); returns how many."""
        dropped = 0
        for partition in partitions:
            dropped += len(self.pending.pop(partition, ()))
            self.pending_since.pop(partition, None)
            self.pending_until.pop(partition, None)
        self.pending_count -= dropped
        return dropped

    async def idle(self) -> None:
        """Nothing fetched this round: make sure what is pending gets applied."""
        if self.in_flight is not None and self.in_flight.done():
            await self.finish_in_flight()
        if self.in_flight is None and self.pending_since:
            self._start()

    def _start(self) -> None:
        batch, since, until = self.pending, self.pending_since, self.pending_until
        self.in_flight_size = self.pending_count
        self.pending, self.pending_since, self.pending_until, self.pending_count = {}, {}, {}, 0
        self.in_flight = self._thread.submit(lambda: self.pipeline.process(batch, since, until))

    async def finish_in_flight(self) -> None:
        """Wait for the batch in the database, if any, and checkpoint it."""
        if self.in_flight is None:
            return
        outcome = await self.in_flight
        self.in_flight = None
        await self._checkpoint(outcome)

    async def _checkpoint(self, outcome: ApplyOutcome, commit_timeout: float = 10.0) -> None:
        self.totals.merge(outcome)
        # The fences as the transaction found them under their row locks: the truth,
        # lower than before too when the database went back in time.
        self.fences.update(outcome.next_offsets)
        log.debug(
            "batch of %d: applied %d, replayed %d, parked %d (total applied %d)",
            self.in_flight_size,
            outcome.applied,
            outcome.replayed,
            outcome.parked,
            self.totals.applied,
        )
        if outcome.behind and self.on_behind is not None:
            self.on_behind(outcome.behind)
        if outcome.next_offsets:
            # Bounded: a commit stuck on a coordinator that went away must not stop the
            # drain; the fence holds the truth and the next batch commits again.
            try:
                await asyncio.wait_for(self.commit(dict(outcome.next_offsets)), commit_timeout)
            except TimeoutError:
                log.warning("Kafka commit of %d partition(s) timed out; continuing", len(outcome.next_offsets))

    async def drain_on_shutdown(self, budget: float) -> None:
        """Give the batch in the database a bounded time to commit; drop what is only pending.

        What is dropped was never applied, and is read again from the fence by
        whoever owns the partition next.
        """
        self.pipeline.stop.set()
        self.pending, self.pending_since, self.pending_until, self.pending_count = {}, {}, {}, 0
        if self.in_flight is None:
            return
        try:
            outcome = await asyncio.wait_for(asyncio.shield(self.in_flight), budget)
        except Exception:
            log.warning("abandoned an in-flight batch of %d records at shutdown", self.in_flight_size)
            return
        self.in_flight = None
        try:
            # Within the shutdown budget's reserve: the fence holds the truth whether it lands or not.
            await self._checkpoint(outcome, commit_timeout=LEAVE_RESERVE_S / 2)
        except Exception as exc:  # the group may be gone already; the fence holds the truth
            log.info("final commit skipped: %s", exc)
