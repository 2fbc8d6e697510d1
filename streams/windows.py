"""Consumer group `skillstats-windows`: per-day and per-hour counts, seconds behind.

A faust-streaming app. faust owns the group membership, fetching and
rebalancing; the correctness rests on the SQL fence, not on faust's
`exactly_once` (SPEC §5):

- batches come from `take_events`, and the whole batch (decode, park invalid
  records, fold, one SQL transaction with the fences) runs in a worker thread,
  so the event loop keeps heartbeating while the database works;
- the consumer never commits an offset to Kafka beyond what SQL already holds
  (`FencedConsumer`), whatever faust has acked, so a SIGTERM that cancels a
  batch half-way, or an ack faust makes early, can only cause a replay, which
  the fence then skips.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import time
from collections.abc import AsyncIterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import faust
from faust.transport.drivers import aiokafka as aiokafka_driver
from faust.types import TP, EventT

from skillstats.config import Settings
from skillstats.contract import Invalid, decode
from skillstats.dlq import REJECTED_BY_DATABASE, DeadLetters, Parcel
from skillstats.kafka import RawRecord
from skillstats.sinks.apply import ApplyOutcome, ConsumedRecord, WindowsSink, apply_with_recovery
from skillstats.sinks.db import open_engine

log = logging.getLogger(__name__)


def decode_batch(raws: Sequence[RawRecord], now_ms: int) -> tuple[list[ConsumedRecord], list[Parcel]]:
    """Decode a batch; invalid records become fence-only entries plus parcels for the DLQ."""
    records: list[ConsumedRecord] = []
    parcels: list[Parcel] = []
    for raw in raws:
        decoded = decode(raw.key, raw.value, now_ms)
        if isinstance(decoded, Invalid):
            parcels.append(Parcel(raw, decoded.reason.value, decoded.message))
            records.append(ConsumedRecord(raw.partition, raw.offset, None))
        else:
            records.append(ConsumedRecord(raw.partition, raw.offset, decoded))
    return records, parcels


class WindowsPipeline:
    """The synchronous work for one batch; runs in a worker thread."""

    def __init__(self, settings: Settings, sink: WindowsSink, dead_letters: DeadLetters) -> None:
        self.settings = settings
        self.sink = sink
        self.dead_letters = dead_letters
        self.stop = threading.Event()

    def process(self, raws: Sequence[RawRecord]) -> ApplyOutcome:
        records, parcels = decode_batch(raws, int(time.time() * 1000))
        if parcels:
            # A replayed batch must not park its invalid records a second time: they
            # were parked (and acknowledged) before the fence first moved past them.
            fences = self.sink.fences()
            parcels = [p for p in parcels if p.record.offset >= fences.get(p.record.partition, 0)]
            self.dead_letters.park(parcels, self.stop)
        by_position = {(raw.partition, raw.offset): raw for raw in raws}

        def park_rejected(record: ConsumedRecord, exc: BaseException) -> None:
            raw = by_position[(record.partition, record.offset)]
            self.dead_letters.park([Parcel(raw, REJECTED_BY_DATABASE, str(exc))], self.stop)

        outcome = apply_with_recovery(self.sink, records, park_rejected, stop=self.stop)
        outcome.parked += len(parcels)
        return outcome


class FencedConsumer(aiokafka_driver.Consumer):
    """faust's aiokafka consumer, except it never commits past the SQL fence."""

    async def _commit(self, offsets: Mapping[TP, int]) -> bool:
        fences: dict[TP, int] = getattr(self.app, "sql_fences", {})
        clamped = {tp: min(offset, fences[tp]) for tp, offset in offsets.items() if tp in fences}
        if not clamped:
            return False
        return await super()._commit(clamped)


class FencedTransport(aiokafka_driver.Transport):
    Consumer = FencedConsumer


class WindowsApp(faust.App):
    """A faust App whose consumer commits only what SQL holds (see FencedConsumer)."""

    sql_fences: dict[TP, int]

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
    batch_size: int = 5000,
    batch_seconds: float = 0.5,
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
        broker_commit_interval=1.0,
        stream_wait_empty=False,
        stream_buffer_maxsize=max(4096, batch_size * 2),
        broker_max_poll_records=max(500, batch_size),
        # Static membership: a worker restarted under the same id (a crashed container
        # in the same pod) takes its partitions back at once, instead of the whole
        # group waiting a session timeout for the dead member to be declared gone.
        consumer_group_instance_id=instance_id,
        broker_credentials=faust_credentials(settings),
    )
    app.sql_fences = {}
    source = app.topic(settings.topic, key_type=bytes, value_type=bytes)
    engine = open_engine(settings.database_url)
    pipeline = WindowsPipeline(
        settings,
        WindowsSink(engine, settings.windows_group, settings.topic),
        DeadLetters(settings, settings.windows_group),
    )
    # One thread: batches are applied strictly in the order they were consumed.
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="windows-sink")
    totals = ApplyOutcome()

    async def apply(events: Sequence[EventT]) -> None:
        raws = [
            RawRecord(e.message.partition, e.message.offset, e.message.key, e.message.value, e.message.timestamp)
            for e in events
        ]
        future = asyncio.get_running_loop().run_in_executor(executor, pipeline.process, raws)
        try:
            outcome = await asyncio.shield(future)
        except asyncio.CancelledError:
            # Shutting down: give the batch in the database a bounded time to commit,
            # so the fence (and then Kafka) records it; if it does not make it, it is
            # abandoned whole and replayed by whoever owns the partition next.
            pipeline.stop.set()
            try:
                outcome = await asyncio.wait_for(future, shutdown_budget)
            except Exception:
                log.warning("abandoned an in-flight batch of %d records at shutdown", len(raws))
                raise asyncio.CancelledError() from None
            _advance_fences(app, settings.topic, outcome)
            raise
        _advance_fences(app, settings.topic, outcome)
        totals.merge(outcome)
        log.info(
            "batch of %d: applied %d, replayed %d, parked %d (total applied %d)",
            len(raws),
            outcome.applied,
            outcome.replayed,
            outcome.parked,
            totals.applied,
        )

    @app.agent(source, name="skillstats-windows")
    async def windows(stream: AsyncIterable[Any]) -> None:
        async for events in stream.take_events(batch_size, within=batch_seconds):  # type: ignore[attr-defined]
            await apply(events)

    return app


def _advance_fences(app: WindowsApp, topic: str, outcome: ApplyOutcome) -> None:
    for partition, next_offset in outcome.next_offsets.items():
        tp = TP(topic, partition)
        app.sql_fences[tp] = max(app.sql_fences.get(tp, 0), next_offset)


def run(settings: Settings, *, log_level: str = "warning", **options: Any) -> None:
    """Run the worker until SIGTERM/SIGINT (never returns; exits the process)."""
    app = build_app(settings, **options)
    worker = faust.Worker(app, loglevel=log_level, quiet=True)
    worker.execute_from_commandline()
