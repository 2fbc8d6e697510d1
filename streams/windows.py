"""Consumer group `skillstats-windows`: per-day and per-hour counts, seconds behind.

A faust-streaming app: faust owns the group membership, the fetcher thread,
rebalancing, pausing and seeking. What it does not do is touch each record:
faust's own stream path (a task and an Event per message, an ack per message)
tops out near 24,000 records/s on this class of machine, far below what the
broker delivers. So the consumer replaces faust's per-message drain with a
batch drain: every fetch (up to `broker_max_poll_records` records over all
partitions) is handed on as one list.

Correctness rests on the SQL fence, not on faust's `exactly_once` (docs/contract.md, exactly once):

- each batch (decode, park invalid records, fold, one SQL transaction with the
  partition fences) runs in one worker thread, in fetch order, while the event
  loop already gathers the next batch: whatever arrives while the database is
  busy becomes the next transaction, so batches grow with load and stay small
  (low latency) when the stream is quiet;
- offsets are committed to Kafka only after the SQL commit, and only up to the
  fence (`FencedConsumer`), so a kill or a rebalance at any point can cause a
  replay, which the fence skips, and never a gap.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import operator
import os
import queue
import ssl
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

import faust
from faust.transport.drivers import aiokafka as aiokafka_driver
from faust.types import TP

from skillstats.config import MaskSecrets, Settings, redact_url
from skillstats.contract import decode_many
from skillstats.dlq import H_REPLAYED_FROM, REJECTED_BY_DATABASE, DeadLetters, MarkUpdates, Parcel
from skillstats.kafka import RawRecord, end_offsets
from skillstats.metrics import PipelineMetrics, Probes, serve, watch_health
from skillstats.retry import Backoff
from skillstats.shutdown import DEFAULT_BUDGET_S, LEAVE_RESERVE_S, ShutdownWatchdog, batch_budget
from skillstats.sinks.batch import ApplyOutcome, ConsumedRecord, PartitionBatch
from skillstats.sinks.db import open_engine
from skillstats.sinks.fences import FenceAheadOfLog, check_within_log
from skillstats.sinks.migrate import require_current
from skillstats.sinks.recovery import Health, apply_with_recovery, retrying
from skillstats.sinks.windows import WindowsSink

log = logging.getLogger(__name__)
T = TypeVar("T")
# /healthz fails when the event loop has not turned for this long: long enough for
# a stop-the-world moment (a full GC, a slow rebalance callback), short of a hang.
LOOP_STALL_SECONDS = 30.0
# Default of --partition-fetch-mib: most MiB one fetch brings per partition
# (aiokafka's max_partition_fetch_bytes, faust's consumer_max_fetch_size, 1 MiB in
# both). aiokafka keeps one fetch request per broker in flight, and at 1 MiB a
# partition the worker, once through its last fetch, waited for the next one: on a
# preloaded topic the sink thread idled a fifth of the time and the bench's steady
# rate was 1.3-1.5x lower (docs/performance.md, 12.). The cost is memory: aiokafka
# holds up to one unread fetch per assigned partition (compressed), so up to this
# many MiB times the partitions a worker owns, on top of the pending batch.
PARTITION_FETCH_MIB = 4


class FetchedRecord(Protocol):
    """What the batch drain needs of a record: aiokafka's ConsumerRecord and RawRecord both fit."""

    partition: int
    offset: int
    timestamp: int | None
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes | None]]


def replayed_from(raw: FetchedRecord) -> bytes | None:
    """The H_REPLAYED_FROM header of a record `skillstats dlq replay` published, if it is one."""
    for name, value in raw.headers or ():
        if name == H_REPLAYED_FROM:
            return value
    return None


class DecodedBatch(NamedTuple):
    parts: list[PartitionBatch]
    parcels: list[Parcel]  # the invalid records, for the DLQ
    newest_event_ms: dict[int, int]  # partition -> newest occurred_at of a valid event
    newest_record_ms: dict[int, int]  # partition -> newest Kafka timestamp


def decode_batch(fetched: Mapping[int, Sequence[FetchedRecord]]) -> DecodedBatch:
    """Decode a batch, kept per partition; invalid records become fence-only entries plus parcels for the DLQ.

    Validity is a function of the record alone (its key, value and Kafka
    timestamp), so this group and docsync always agree on it. Records are read
    into columns and decoded in one call per partition: no object per record
    beyond the event itself.
    """
    parts: list[PartitionBatch] = []
    parcels: list[Parcel] = []
    newest_event: dict[int, int] = {}
    newest_record: dict[int, int] = {}
    for partition, raws in fetched.items():
        if not raws:
            continue
        stamps = [raw.timestamp for raw in raws]
        events, invalid = decode_many([raw.key for raw in raws], [raw.value for raw in raws], stamps)
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
        parts.append(PartitionBatch(partition, [raw.offset for raw in raws], events))
        newest = max(map(_OCCURRED_AT, filter(None, events)), default=None)
        if newest is not None:
            newest_event[partition] = newest
        newest = max(filter(_NOT_NONE, stamps), default=-1)
        if newest >= 0:  # -1: Kafka's "no timestamp", not a time
            newest_record[partition] = newest
    return DecodedBatch(parts, parcels, newest_event, newest_record)


_OCCURRED_AT = operator.attrgetter("occurred_at")
_NOT_NONE = functools.partial(operator.is_not, None)


class WindowsPipeline:
    """The synchronous work for one batch; runs in the sink thread."""

    def __init__(self, sink: WindowsSink, dead_letters: DeadLetters) -> None:
        self.sink = sink
        self.dead_letters = dead_letters
        self.stop = threading.Event()
        self.health = Health()
        self.metrics = PipelineMetrics(sink.group_id)
        watch_health(sink.group_id, self.health)

    def process(self, fetched: Mapping[int, Sequence[FetchedRecord]]) -> ApplyOutcome:
        """Decode, park the invalid, fold and apply one batch (partition -> its records in fetch order)."""
        began = time.perf_counter()
        parts, parcels, newest_event_ms, newest_record_ms = decode_batch(fetched)
        prepared = self.sink.prepare(parts)  # the fold, and each partition's end, once
        marks: MarkUpdates = {}
        if parcels:
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
            marks = self.dead_letters.park(parcels, stored, prepared.end, self.stop, self.health)

        rejected: list[ConsumedRecord] = []

        def park_rejected(record: ConsumedRecord, exc: BaseException) -> MarkUpdates:
            rejected.append(record)
            raw = next(r for r in fetched[record.partition] if r.offset == record.offset)
            parcel = Parcel(
                RawRecord(record.partition, raw.offset, raw.key, raw.value),
                REJECTED_BY_DATABASE,
                str(exc),
                replayed_from(raw),
            )
            rows = retrying(self.sink.rows, "reading the fences", self.health, self.stop)
            current = {p: row.dlq_mark for p, row in rows.items()}
            return self.dead_letters.park(
                [parcel], current, {record.partition: record.offset + 1}, self.stop, self.health
            )

        outcome = apply_with_recovery(
            self.sink, prepared, park_rejected, stop=self.stop, health=self.health, dlq_marks=marks
        )
        outcome.parked += len(parcels)
        self.metrics.batch(outcome, prepared.count, time.perf_counter() - began)
        self.metrics.invalid(Counter(p.reason for p in parcels), parked=True)
        self.metrics.parked(REJECTED_BY_DATABASE, len(rejected))
        self.metrics.newest(newest_event_ms, newest_record_ms)
        return outcome


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


class BatchSink:
    """Feeds fetched records to the pipeline one transaction at a time, in fetch order.

    At most one batch is in the database; records fetched meanwhile wait in
    `pending`, kept per partition, and form the next batch. When a rebalance
    moves a partition to another consumer its pending records are dropped (they
    were never applied, and the new owner reads them again from the committed
    offset, which is never past the fence); a partition that stays keeps them,
    since its fetch position may not be rewound (it is not, for a partition with
    no committed offset yet), and dropping them would leave a gap. When `pending`
    reaches `max_pending`, the fetcher waits for the database (backpressure), so
    memory stays bounded.
    """

    def __init__(self, app: WindowsApp, pipeline: WindowsPipeline, topic: str, max_pending: int) -> None:
        self.app = app
        self.pipeline = pipeline
        self.topic = topic
        self.max_pending = max_pending
        self.pending: dict[int, list[FetchedRecord]] = {}
        self.pending_count = 0
        self.in_flight: asyncio.Future[ApplyOutcome] | None = None
        self.in_flight_size = 0
        self.totals = ApplyOutcome()
        self._thread = SinkThread()

    async def add(self, fetched: Mapping[int, Sequence[FetchedRecord]]) -> None:
        for partition, records in fetched.items():
            if records:
                self.pending.setdefault(partition, []).extend(records)
                self.pending_count += len(records)
        if self.in_flight is not None and (self.in_flight.done() or self.pending_count >= self.max_pending):
            await self._finish_in_flight()
        if self.in_flight is None and self.pending_count:
            self._start()

    async def settle(self, timeout: float) -> None:
        """Wait (at most `timeout` s) for the batch in the database; it is checkpointed as usual later."""
        if self.in_flight is not None and not self.in_flight.done():
            await asyncio.wait({self.in_flight}, timeout=timeout)

    def drop(self, partitions: set[int]) -> int:
        """Forget what is pending for partitions now owned elsewhere; returns how many records were dropped."""
        dropped = 0
        for partition in partitions:
            dropped += len(self.pending.pop(partition, ()))
        self.pending_count -= dropped
        return dropped

    async def idle(self) -> None:
        """Nothing fetched this round: make sure what is pending gets applied."""
        if self.in_flight is not None and self.in_flight.done():
            await self._finish_in_flight()
        if self.in_flight is None and self.pending_count:
            self._start()

    def _start(self) -> None:
        batch, self.in_flight_size = self.pending, self.pending_count
        self.pending, self.pending_count = {}, 0
        self.in_flight = self._thread.submit(lambda: self.pipeline.process(batch))

    async def _finish_in_flight(self) -> None:
        assert self.in_flight is not None
        outcome = await self.in_flight
        self.in_flight = None
        await self._checkpoint(outcome)

    async def _checkpoint(self, outcome: ApplyOutcome, commit_timeout: float = 10.0) -> None:
        self.totals.merge(outcome)
        offsets = {}
        for partition, next_offset in outcome.next_offsets.items():
            tp = TP(self.topic, partition)
            self.app.sql_fences[tp] = max(self.app.sql_fences.get(tp, 0), next_offset)
            offsets[tp] = self.app.sql_fences[tp]
        log.debug(
            "batch of %d: applied %d, replayed %d, parked %d (total applied %d)",
            self.in_flight_size,
            outcome.applied,
            outcome.replayed,
            outcome.parked,
            self.totals.applied,
        )
        if offsets:
            # Bounded: a commit stuck on a coordinator that went away must not stop the
            # drain; the fence holds the truth and the next batch commits again.
            try:
                await asyncio.wait_for(self.app.consumer._commit(offsets), commit_timeout)
            except TimeoutError:
                log.warning("Kafka commit of %d partition(s) timed out; continuing", len(offsets))

    async def drain_on_shutdown(self, budget: float) -> None:
        """Give the batch in the database a bounded time to commit; drop what is only pending.

        What is dropped was never applied, and Kafka holds no commit past it, so it
        is read again by whoever owns the partition next.
        """
        self.pipeline.stop.set()
        self.pending, self.pending_count = {}, 0
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


class FencedConsumer(aiokafka_driver.Consumer):
    """faust's aiokafka consumer with a batch drain, never committing past the SQL fence.

    Two private faust methods are overridden, `_commit` and `_drain_messages`
    (faust has no public hook for either); pyproject.toml pins faust-streaming to
    the range they were written against and tests/test_faust_pins.py fails when
    what they rely on changes. Rebalances go through faust's public signals
    (`on_partitions_revoked`, `on_partitions_assigned`), see build_app.
    """

    def _new_consumer_thread(self) -> aiokafka_driver.AIOKafkaConsumerThread:
        return ReadCommittedConsumerThread(self, loop=self.loop, beacon=self.beacon)

    def verify_event_path(self, now: float, tp: TP) -> None:
        """faust's livelock check, per assigned partition; here it checks nothing.

        It watches faust's per-message stream path, which this worker does not use:
        the batch drain never sets the stream's inbound times, so on a partition
        with records it would report "stream has not started processing", and on
        one idle since the start "has not sent fetch request", both at ERROR, on a
        healthy worker. What it is for is covered otherwise: /healthz fails when the
        event loop stops turning, the degraded state when the database fails, and
        the lag alerts when records stop being applied for any reason.
        """

    async def _commit(self, offsets: Mapping[TP, int]) -> bool:
        # Only partitions still assigned: a batch that finishes after a rebalance has
        # nothing to commit for the partitions it lost, and faust's commit of an empty
        # set raises inside aiokafka and crashes the worker.
        fences: dict[TP, int] = getattr(self.app, "sql_fences", {})
        assigned = self.assignment()
        clamped = {tp: min(offset, fences[tp]) for tp, offset in offsets.items() if tp in fences and tp in assigned}
        if not clamped:
            return False
        return await super()._commit(clamped)

    async def _drain_messages(self, fetcher: Any) -> None:
        sink: BatchSink = self.app.batch_sink  # type: ignore[attr-defined]
        read_offsets = self._read_offset
        try:
            while not (self.should_stop or fetcher.should_stop):
                generation = self.app.consumer_generation_id
                records, _active = await self._wait_next_records(timeout=0.2)
                if not records or self.should_stop:
                    await sink.idle()
                    continue
                # Nothing fetched is thrown away while its partition may still be ours:
                # faust rewinds a partition at a rebalance only to its committed offset,
                # and not at all when it has none, so a record dropped here could be
                # skipped for good. Records fetched across an assignment change are kept
                # for the partitions assigned now (the rest went to another consumer,
                # which reads them from the committed offset); in the middle of a
                # rebalance all are kept, and the assignment handler drops those of
                # partitions that went elsewhere. What is read twice the fence skips.
                if generation != self.app.consumer_generation_id:
                    ours: set[TP] | None = set(self.assignment())
                else:
                    ours = None
                batch: dict[int, Sequence[FetchedRecord]] = {}
                for tp, fetched in records.items():
                    if not fetched or (ours is not None and tp not in ours):
                        continue
                    floor = read_offsets[tp]  # below it: read before, and at or below the fence
                    if floor is None or fetched[0].offset >= floor:
                        batch[tp.partition] = fetched
                    else:
                        batch[tp.partition] = [r for r in fetched if r.offset >= floor]
                    read_offsets[tp] = fetched[-1].offset
                # No await between the generation check above and here: the assignment
                # handler (on the event loop) cannot run in between.
                await sink.add(batch)
        except asyncio.CancelledError:
            # faust cancels the drain only to stop the worker. Ending normally rather
            # than re-raising: faust treats a cancelled fetcher during a rebalance as a
            # crash to restart, and its restart path fails when the worker is stopping
            # (a SIGTERM that lands mid-rebalance exited 1 instead of 0).
            await sink.drain_on_shutdown(batch_budget(self.app.shutdown_budget))  # type: ignore[attr-defined]
            return
        except Exception as exc:
            # Not a database or broker outage (those are retried inside the batch):
            # a bug. Crash the worker, loudly, so it is restarted and replays from the
            # fence, rather than stay in the group holding partitions it never reads.
            log.exception("batch drain failed; stopping the worker")
            await self.crash(exc)
            raise


class ReadCommittedConsumerThread(aiokafka_driver.AIOKafkaConsumerThread):
    """aiokafka reads uncommitted records unless faust runs its own transactions.

    Events of an aborted transaction must count nowhere, and docsync (librdkafka,
    read_committed by default) never sees them, so this group reads committed
    records only. aiokafka takes the level as a constructor argument that faust
    does not expose; it is read when the consumer starts (tests/test_faust_pins.py
    checks both facts for the pinned versions).
    """

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        consumer._isolation_level = "read_committed"
        return consumer


class FencedTransport(aiokafka_driver.Transport):
    Consumer = FencedConsumer


class WindowsApp(faust.App):
    """A faust App whose consumer drains in batches into the SQL sink."""

    sql_fences: dict[TP, int]
    batch_sink: BatchSink
    shutdown_budget: float
    shutdown_watchdog: ShutdownWatchdog
    fence_error: FenceAheadOfLog | None
    start_message: str = "started"
    heartbeat: float = 0.0  # time.monotonic() of the event loop's last turn (see `live`)
    joined: bool = False  # has had an assignment (possibly empty) since it started

    def live(self) -> str | None:
        """/healthz: the event loop turns (a timer beats every second)."""
        silent = time.monotonic() - self.heartbeat
        return None if silent < LOOP_STALL_SECONDS else f"event loop silent for {silent:.0f}s"

    def ready(self) -> str | None:
        """/readyz: joined the group, and the database is not failing."""
        if self.fence_error is not None:
            return f"fence ahead of the log: {self.fence_error}"
        if not self.joined:
            return "not yet joined the consumer group"
        health = self.batch_sink.pipeline.health
        if health.degraded:
            return f"degraded: {health.last_error}"
        return None

    async def on_start(self) -> None:
        """mode's lifecycle hook, run before faust waits for the first assignment (its timers
        start only after it): the heartbeat must beat while the group forms, however long."""
        await super().on_start()
        loop = asyncio.get_running_loop()

        def beat() -> None:
            self.heartbeat = time.monotonic()
            loop.call_later(1.0, beat)

        beat()

    async def on_stop(self) -> None:
        """mode's lifecycle hook, first thing when the worker stops (SIGTERM, SIGINT, a crash)."""
        self.shutdown_watchdog.start()
        await super().on_stop()

    async def on_started(self) -> None:
        """mode's public lifecycle hook: runs once logging is set up and the app is up."""
        await super().on_started()
        log.info("%s", self.start_message)

    def _new_transport(self) -> Any:
        return FencedTransport(self.conf.broker_consumer, self)


def faust_credentials(settings: Settings) -> Any:
    """The librdkafka-style security settings, as faust (aiokafka) wants them."""
    security = settings.kafka_security
    protocol = security.get("security.protocol", "PLAINTEXT").upper()
    if protocol == "PLAINTEXT":
        return None
    context = None
    if protocol in ("SSL", "SASL_SSL"):
        context = ssl.create_default_context(cafile=security.get("ssl.ca.location"))
        if "ssl.certificate.location" in security:
            context.load_cert_chain(
                security["ssl.certificate.location"], security.get("ssl.key.location"), security.get("ssl.key.password")
            )
    if protocol == "SSL":
        return faust.SSLCredentials(context)
    return faust.SASLCredentials(
        username=security.get("sasl.username"),
        password=security.get("sasl.password"),
        mechanism=security.get("sasl.mechanism", "PLAIN"),
        ssl_context=context,
    )


def build_app(
    settings: Settings,
    *,
    batch_size: int = 50_000,
    fetch_size: int = 10_000,
    partition_fetch_mib: int = PARTITION_FETCH_MIB,
    shutdown_budget: float = DEFAULT_BUDGET_S,
    instance_id: str | None = None,
) -> WindowsApp:
    app = WindowsApp(
        settings.windows_group,
        broker=f"kafka://{settings.kafka_bootstrap}",
        key_serializer="raw",
        value_serializer="raw",
        store="memory://",
        web_enabled=False,
        topic_disable_leader=True,
        consumer_auto_offset_reset="earliest",
        stream_wait_empty=False,
        broker_max_poll_records=fetch_size,
        consumer_max_fetch_size=partition_fetch_mib * 1024 * 1024,
        # Static membership: a worker restarted under the same id (a crashed container
        # in the same pod) takes its partitions back at once, instead of the whole
        # group waiting a session timeout for the dead member to be declared gone.
        consumer_group_instance_id=instance_id,
        broker_credentials=faust_credentials(settings),
        # faust makes a data directory at start even for in-memory tables; in the temp
        # directory, not the working directory (read-only in the container image).
        datadir=os.path.join(tempfile.gettempdir(), "skillstats-faust-{conf.name}"),
    )
    app.sql_fences = {}
    app.shutdown_budget = shutdown_budget
    app.shutdown_watchdog = ShutdownWatchdog("windows", shutdown_budget)
    app.heartbeat = time.monotonic()
    # Registered with faust's conductor so the consumer subscribes to it; no agent
    # iterates it, the batch drain above reads it.
    app.topics.add(app.topic(settings.topic, key_type=bytes, value_type=bytes))
    engine = open_engine(settings.database_url)
    require_current(engine)
    sink = WindowsSink(engine, settings.windows_group, settings.topic)
    pipeline = WindowsPipeline(sink, DeadLetters(settings, settings.windows_group))
    app.batch_sink = BatchSink(app, pipeline, settings.topic, max_pending=batch_size)
    app.fence_error = None
    app.start_message = (
        f"skillstats windows: group {settings.windows_group} reads topic {settings.topic} from "
        f"{settings.kafka_bootstrap} and writes daily and hourly counts to {redact_url(settings.database_url)}"
    )

    @app.on_partitions_revoked.connect
    async def settle_on_revoke(_app: Any, revoked: set[TP], **_: Any) -> None:
        # Let the batch in the database finish first (bounded): the next owner then
        # starts after it committed, instead of both parking the same invalid records.
        await app.batch_sink.settle(shutdown_budget)

    @app.on_partitions_assigned.connect
    async def on_assigned(_app: Any, assigned: set[TP], **_: Any) -> None:
        partitions = {tp.partition for tp in assigned if tp.topic == settings.topic}
        log.info("assigned partitions %s of %s", sorted(partitions) or "none", settings.topic)
        app.joined = True
        pipeline.metrics.assigned(len(partitions))
        # Faust revokes every partition at a rebalance (eager protocol), so what is
        # pending is dropped only for partitions that went to another consumer: it
        # reads them again from the committed offset (never past the fence). Records
        # of a partition that stayed are kept: whether or not the consumer rewinds it,
        # nothing is skipped, and what is read twice the fence skips.
        dropped = app.batch_sink.drop(set(app.batch_sink.pending) - partitions)
        if dropped:
            log.info("rebalance: dropped %d fetched, unapplied record(s) of partitions now elsewhere", dropped)
        if partitions:
            await check_assigned_fences(app, sink, settings, partitions)

    return app


async def check_assigned_fences(app: WindowsApp, sink: WindowsSink, settings: Settings, partitions: set[int]) -> None:
    """Stop the worker (exit 2, a clear message) if an assigned partition's fence is past its log end."""
    loop = asyncio.get_running_loop()
    for attempt in range(6):
        try:
            fences = await loop.run_in_executor(None, sink.fences)
            ends = await loop.run_in_executor(None, end_offsets, settings, settings.topic)
            break
        except Exception as exc:
            # Not knowing is not a pass: after a few tries the worker stops (and is
            # restarted) rather than risk skipping a recreated topic's records.
            log.warning("could not compare fences with the log ends (try %d): %s", attempt + 1, exc)
            if attempt == 5:
                raise
            await asyncio.sleep(Backoff().delay(attempt))
    try:
        check_within_log(sink.group_id, sink.topic, {p: f for p, f in fences.items() if p in partitions}, ends)
    except FenceAheadOfLog as exc:
        log.critical("%s", exc)
        app.fence_error = exc
        raise


# Third-party loggers speak at WARNING and above (INFO with --log-level debug): their
# INFO lines narrate every service starting and stopping.
_THIRD_PARTY_LOGGERS = ("faust", "mode", "aiokafka", "kafka")
# What every normal start or rebalance logs above INFO, though nothing is wrong.
_ROUTINE = (
    "GroupCoordinatorNotAvailable",  # aiokafka, the first start of a new group
    "Missing sensor state for rebalance",  # faust, a rebalance it did not see start
    "Heartbeat failed for group",  # aiokafka, while a rebalance is under way
    "OffsetCommit failed for group",  # aiokafka, a commit that raced a rebalance (the fence holds the truth)
)


class RoutineAtInfo(logging.Filter):
    """Shows the routine messages above as what they are, INFO (and so not at all above INFO)."""

    def __init__(self, shown_level: int) -> None:
        super().__init__()
        self.shown_level = shown_level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO and any(text in record.getMessage() for text in _ROUTINE):
            record.levelno, record.levelname = logging.INFO, "INFO"
            return self.shown_level <= logging.INFO
        return True


def logging_config(level: str, secrets: list[str]) -> dict[str, Any]:
    """Plain lines on stdout (no colour codes, no spinner), secrets masked, routine noise at INFO."""
    number = logging.getLevelName(level.upper())
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {
            "routine": {"()": RoutineAtInfo, "shown_level": number},
            "mask": {"()": MaskSecrets, "secrets": secrets},
        },
        "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
        "handlers": {
            "default": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stdout",
                "formatter": "plain",
                "filters": ["routine", "mask"],
            }
        },
        "root": {"level": number, "handlers": ["default"]},
        "loggers": {
            name: {"level": logging.INFO if number <= logging.DEBUG else logging.WARNING}
            for name in _THIRD_PARTY_LOGGERS
        },
    }


def run(
    settings: Settings,
    *,
    log_level: str = "info",
    metrics_host: str = "0.0.0.0",
    metrics_port: int = 0,
    **options: Any,
) -> None:
    """Run the worker until SIGTERM/SIGINT (never returns; exits the process); metrics_port 0: none."""
    app = build_app(settings, **options)
    if metrics_port:
        serve(metrics_host, metrics_port, Probes(app.live, app.ready))
    # aiokafka allocates a GC-tracked record object per message, so at the default
    # threshold (700) the cyclic collector ran every few hundred records and cost
    # ~15% of throughput (measured alternately: 112-128k vs 137-145k events/s).
    # Almost nothing here forms cycles; refcounting frees it. freeze() keeps the
    # import-time heap out of the full collections that still run.
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    worker = faust.Worker(
        app, loglevel=log_level, quiet=True, logging_config=logging_config(log_level, settings.secrets())
    )
    worker.spinner = None  # a service's log is a file, not a terminal
    try:
        worker.execute_from_commandline()
    finally:
        if app.fence_error is not None:
            print(f"skillstats windows: {app.fence_error}", file=sys.stderr)
            raise SystemExit(2)
