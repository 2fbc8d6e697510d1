"""Consumer group `skillstats-windows`: per-day and per-hour counts, seconds behind.

A faust-streaming app: faust owns the group membership, the fetcher thread,
rebalancing, pausing and seeking. What it does not do is touch each record:
faust's own stream path (a task and an Event per message, an ack per message)
tops out near 24,000 records/s on this class of machine, far below what the
broker delivers. So the consumer replaces faust's per-message drain with a
batch drain: every fetch (up to `broker_max_poll_records` records over all
partitions) is handed on as one list.

Correctness rests on the SQL fence, not on faust's `exactly_once` (SPEC §5):

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
import gc
import logging
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import faust
from faust.transport.drivers import aiokafka as aiokafka_driver
from faust.types import TP

from skillstats.config import Settings
from skillstats.contract import Invalid, decode
from skillstats.dlq import REJECTED_BY_DATABASE, DeadLetters, Parcel
from skillstats.kafka import RawRecord
from skillstats.sinks.apply import ApplyOutcome, ConsumedRecord, WindowsSink, apply_with_recovery
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import require_current

log = logging.getLogger(__name__)


class FetchedRecord(Protocol):
    """What the batch drain needs of a record: aiokafka's ConsumerRecord and RawRecord both fit."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


def decode_batch(raws: Sequence[FetchedRecord], now_ms: int) -> tuple[list[ConsumedRecord], list[Parcel]]:
    """Decode a batch; invalid records become fence-only entries plus parcels for the DLQ."""
    records: list[ConsumedRecord] = []
    parcels: list[Parcel] = []
    append = records.append
    for raw in raws:
        decoded = decode(raw.key, raw.value, now_ms)
        if isinstance(decoded, Invalid):
            parcels.append(
                Parcel(RawRecord(raw.partition, raw.offset, raw.key, raw.value), decoded.reason.value, decoded.message)
            )
            append(ConsumedRecord(raw.partition, raw.offset, None))
        else:
            append(ConsumedRecord(raw.partition, raw.offset, decoded))
    return records, parcels


class WindowsPipeline:
    """The synchronous work for one batch; runs in the sink thread."""

    def __init__(self, sink: WindowsSink, dead_letters: DeadLetters) -> None:
        self.sink = sink
        self.dead_letters = dead_letters
        self.stop = threading.Event()

    def process(self, raws: Sequence[FetchedRecord]) -> ApplyOutcome:
        records, parcels = decode_batch(raws, int(time.time() * 1000))
        if parcels:
            # A replayed batch must not park its invalid records a second time: they
            # were parked (and acknowledged) before the fence first moved past them.
            fences = self.sink.fences()
            parcels = [p for p in parcels if p.record.offset >= fences.get(p.record.partition, 0)]
            self.dead_letters.park(parcels, self.stop)

        def park_rejected(record: ConsumedRecord, exc: BaseException) -> None:
            raw = next(r for r in raws if (r.partition, r.offset) == (record.partition, record.offset))
            parcel = Parcel(RawRecord(raw.partition, raw.offset, raw.key, raw.value), REJECTED_BY_DATABASE, str(exc))
            self.dead_letters.park([parcel], self.stop)

        outcome = apply_with_recovery(self.sink, records, park_rejected, stop=self.stop)
        outcome.parked += len(parcels)
        return outcome


class BatchSink:
    """Feeds fetched records to the pipeline one transaction at a time, in fetch order.

    At most one batch is in the database; records fetched meanwhile wait in
    `pending` and form the next batch. When `pending` reaches `max_pending`, the
    fetcher waits for the database (backpressure), so memory stays bounded.
    """

    def __init__(self, app: WindowsApp, pipeline: WindowsPipeline, topic: str, max_pending: int) -> None:
        self.app = app
        self.pipeline = pipeline
        self.topic = topic
        self.max_pending = max_pending
        self.pending: list[FetchedRecord] = []
        self.in_flight: asyncio.Future[ApplyOutcome] | None = None
        self.in_flight_size = 0
        self.totals = ApplyOutcome()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="windows-sink")

    async def add(self, records: list[FetchedRecord]) -> None:
        self.pending.extend(records)
        if self.in_flight is not None and (self.in_flight.done() or len(self.pending) >= self.max_pending):
            await self._finish_in_flight()
        if self.in_flight is None and self.pending:
            self._start()

    async def idle(self) -> None:
        """Nothing fetched this round: make sure what is pending gets applied."""
        if self.in_flight is not None and self.in_flight.done():
            await self._finish_in_flight()
        if self.in_flight is None and self.pending:
            self._start()

    def _start(self) -> None:
        batch, self.pending = self.pending, []
        self.in_flight_size = len(batch)
        self.in_flight = asyncio.get_running_loop().run_in_executor(self._executor, self.pipeline.process, batch)

    async def _finish_in_flight(self) -> None:
        assert self.in_flight is not None
        outcome = await self.in_flight
        self.in_flight = None
        await self._checkpoint(outcome)

    async def _checkpoint(self, outcome: ApplyOutcome) -> None:
        self.totals.merge(outcome)
        offsets = {}
        for partition, next_offset in outcome.next_offsets.items():
            tp = TP(self.topic, partition)
            self.app.sql_fences[tp] = max(self.app.sql_fences.get(tp, 0), next_offset)
            offsets[tp] = self.app.sql_fences[tp]
        log.info(
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
                await asyncio.wait_for(self.app.consumer._commit(offsets), 10.0)
            except TimeoutError:
                log.warning("Kafka commit of %d partition(s) timed out; continuing", len(offsets))

    async def drain_on_shutdown(self, budget: float) -> None:
        """Give the batch in the database a bounded time to commit; drop what is only pending.

        What is dropped was never applied, and Kafka holds no commit past it, so it
        is read again by whoever owns the partition next.
        """
        self.pipeline.stop.set()
        self.pending = []
        if self.in_flight is None:
            return
        try:
            outcome = await asyncio.wait_for(asyncio.shield(self.in_flight), budget)
        except Exception:
            log.warning("abandoned an in-flight batch of %d records at shutdown", self.in_flight_size)
            return
        self.in_flight = None
        try:
            await self._checkpoint(outcome)
        except Exception as exc:  # the group may be gone already; the fence holds the truth
            log.info("final commit skipped: %s", exc)


class FencedConsumer(aiokafka_driver.Consumer):
    """faust's aiokafka consumer with a batch drain, never committing past the SQL fence."""

    async def _commit(self, offsets: Mapping[TP, int]) -> bool:
        fences: dict[TP, int] = getattr(self.app, "sql_fences", {})
        clamped = {tp: min(offset, fences[tp]) for tp, offset in offsets.items() if tp in fences}
        if not clamped:
            return False
        return await super()._commit(clamped)

    async def _drain_messages(self, fetcher: Any) -> None:
        sink: BatchSink = self.app.batch_sink  # type: ignore[attr-defined]
        read_offsets = self._read_offset
        try:
            while not (self.should_stop or fetcher.should_stop):
                records, _active = await self._wait_next_records(timeout=0.2)
                if not records or self.should_stop or not self.flow_active:
                    # Paused for a rebalance: what was fetched is dropped here and
                    # fetched again after faust seeks the new assignment.
                    await sink.idle()
                    continue
                batch: list[FetchedRecord] = []
                for tp, fetched in records.items():
                    floor = read_offsets[tp]
                    if floor is None or fetched[0].offset >= floor:
                        batch.extend(fetched)
                    else:
                        batch.extend(r for r in fetched if r.offset >= floor)
                    read_offsets[tp] = fetched[-1].offset
                await sink.add(batch)
        except asyncio.CancelledError:
            await sink.drain_on_shutdown(self.app.shutdown_budget)  # type: ignore[attr-defined]
            raise
        except Exception as exc:
            # Not a database or broker outage (those are retried inside the batch):
            # a bug. Crash the worker, loudly, so it is restarted and replays from the
            # fence, rather than stay in the group holding partitions it never reads.
            log.exception("batch drain failed; stopping the worker")
            await self.crash(exc)
            raise


class FencedTransport(aiokafka_driver.Transport):
    Consumer = FencedConsumer


class WindowsApp(faust.App):
    """A faust App whose consumer drains in batches into the SQL sink."""

    sql_fences: dict[TP, int]
    batch_sink: BatchSink
    shutdown_budget: float

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
    shutdown_budget: float = 15.0,
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
        # Static membership: a worker restarted under the same id (a crashed container
        # in the same pod) takes its partitions back at once, instead of the whole
        # group waiting a session timeout for the dead member to be declared gone.
        consumer_group_instance_id=instance_id,
        broker_credentials=faust_credentials(settings),
    )
    app.sql_fences = {}
    app.shutdown_budget = shutdown_budget
    # Registered with faust's conductor so the consumer subscribes to it; no agent
    # iterates it, the batch drain above reads it.
    app.topics.add(app.topic(settings.topic, key_type=bytes, value_type=bytes))
    engine = open_engine(settings.database_url)
    require_current(engine)
    sink = WindowsSink(engine, settings.windows_group, settings.topic)
    pipeline = WindowsPipeline(sink, DeadLetters(settings, settings.windows_group))
    app.batch_sink = BatchSink(app, pipeline, settings.topic, max_pending=batch_size)
    return app


def run(settings: Settings, *, log_level: str = "warning", **options: Any) -> None:
    """Run the worker until SIGTERM/SIGINT (never returns; exits the process)."""
    app = build_app(settings, **options)
    # aiokafka allocates a GC-tracked record object per message, so at the default
    # threshold (700) the cyclic collector ran every few hundred records and cost
    # ~15% of throughput (measured alternately: 112-128k vs 137-145k events/s).
    # Almost nothing here forms cycles; refcounting frees it. freeze() keeps the
    # import-time heap out of the full collections that still run.
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    worker = faust.Worker(app, loglevel=log_level, quiet=True)
    worker.execute_from_commandline()
