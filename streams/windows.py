"""Consumer group `skillstats-windows`: per-day and per-hour counts, seconds behind.

A faust-streaming app: faust owns the group membership, the fetcher thread and
rebalancing. What it does not do is touch each record: faust's own stream path
(a task and an Event per message, an ack per message) tops out near 24,000
records/s on this class of machine, far below what the broker delivers. So the
consumer replaces faust's per-message drain with a batch drain: every fetch (up
to `broker_max_poll_records` records over all partitions) is handed on as one
list.

Correctness rests on the SQL fence, not on faust's `exactly_once` nor on
Kafka's committed offsets (docs/contract.md, exactly once):

- each batch (decode, park invalid records, fold, one SQL transaction with the
  partition fences: sinks/pipeline.py) runs in one worker thread, in fetch
  order, while the event loop already gathers the next batch: whatever arrives
  while the database is busy becomes the next transaction, so batches grow
  with load and stay small (low latency) when the stream is quiet;
- every partition is read from its SQL fence: after each assignment, after an
  out-of-range fetch, and whenever a transaction finds the fence behind where
  the read started (the database went back in time: a restored backup, a
  failover). The drain positions it (`PartitionReads`) before a record of it
  reaches a batch, and hands on only records fetched after that seek, in the
  same assignment; each batch says where its read started, and the sink
  refuses to move a fence over offsets no read covered (sinks/batch.py). The
  consumer never resets a position by itself (auto_offset_reset "none");
- the topic's Kafka id is checked at every positioning and before every
  batch's transaction, and the database's record of which group owns the
  windows tables inside it (sinks/identity.py): a recreated topic or a renamed
  group stops the worker (exit 2) before anything is counted against it;
- offsets are committed to Kafka only after the SQL commit, and only up to the
  fence: a hint for lag tools (`kafka-consumer-groups`), never a position;
- a worker cut off from Kafka says so itself (`KafkaReach`): one WARNING when no
  fetch has been answered for KAFKA_SILENCE_SECONDS, one when Kafka answers
  again, /readyz 503 and `skillstats_kafka_unreachable` 1 in between, while
  aiokafka's own line per failed connection attempt (about 80 a second) is
  folded into those two (`KafkaClientNoise`).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import itertools
import logging
import logging.config
import os
import signal
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import faust
from aiokafka.consumer.fetcher import FetchError
from aiokafka.errors import ConsumerStoppedError, NoOffsetForPartitionError, OffsetOutOfRangeError
from faust.transport.drivers import aiokafka as aiokafka_driver
from faust.types import TP
from sqlalchemy import Engine

from skillstats.allocator import fix_thresholds
from skillstats.config import MaskSecrets, Settings, redact_url
from skillstats.contract import NATIVE_MISSING
from skillstats.dlq import DeadLetters
from skillstats.kafka import KafkaUnreachable, TopicMissing
from skillstats.metrics import METRICS_HOST, PipelineMetrics, Probes, serve, watch_kafka
from skillstats.positions import Positions
from skillstats.rebuild.state import Rebuild
from skillstats.rebuild.worker import NotParked
from skillstats.retry import Backoff, Outage
from skillstats.shutdown import DEFAULT_BUDGET_S, ShutdownWatchdog, batch_budget
from skillstats.sinks.fences import FenceAheadOfLog
from skillstats.sinks.identity import REBUILD, WINDOWS, IdentityMismatch, Owner, commit_metadata_for
from skillstats.sinks.pipeline import COLLECTOR_THRESHOLD, BatchSink, Chunk, Ownership, WindowsPipeline
from skillstats.sinks.rebuild import RebuildSink
from skillstats.sinks.recovery import describe
from skillstats.sinks.windows import WindowsSink
from skillstats.startup import Starting, wait_for_dependencies
from skillstats.streams import aiokafka_records

log = logging.getLogger(__name__)
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
# What stops the worker with exit status 2: an operator's decision or a setting to fix,
# never a reason to count (docs/contract.md). The message says what to do.
REFUSALS = (FenceAheadOfLog, IdentityMismatch, TopicMissing)
# How often a worker checks its claim (the topic's id, the database's owner) besides every
# assignment and every batch: what a worker with nothing to read would otherwise miss.
WATCH_SECONDS = 10.0
# How long a worker reading partitions goes without any answer from Kafka before it says it is cut
# off (KafkaReach). The broker answers an idle partition's fetch after at most 1.5 s (faust's
# fetch_max_wait_ms), so this is six silent rounds: past a broker's GC pause or a leader moving,
# yet said within seconds of the bound start-up and positioning give Kafka's first answer
# (FIRST_ANSWER_S, 8 s). The cost: an outage shorter than this is said by nothing but aiokafka's
# first line of it (at INFO).
KAFKA_SILENCE_SECONDS = 10.0
# Outside an outage the worker has declared, at most one of aiokafka's connection lines is shown in
# this long (at INFO); the rest are counted (skillstats_kafka_client_errors_total). A broker that
# stays away while the worker's partitions are read elsewhere is still mentioned every minute.
CLIENT_LINE_EVERY_SECONDS = 60.0
# What aiokafka logs, at ERROR or WARNING, for every failed attempt to reach a broker or the group's
# coordinator: it retries every 100 ms (retry_backoff_ms), so a broker away is 80 such lines a second.
# These are symptoms of what KafkaReach reports once; matched on the message template (the texts are
# pinned by tests/test_windows_outage.py against the aiokafka version in use).
_KAFKA_CLIENT_NOISE = (
    "Unable connect to",  # client.py: a connection to a broker (or a bootstrap address) failed
    "Unable to request metadata from",
    "Unable to update metadata from",
    "Failed fetch messages from",  # fetcher.py
    "Failed fetch offsets from",
    "Group Coordinator Request failed",  # group_coordinator.py
    "-- marking coordinator dead",  # "Error sending <request> to node <id> [<error>] -- marking ..."
    "Heartbeat send request failed",
    "Heartbeat session expired",
    "Marking the coordinator dead",
    "is either not started or not valid",
)
# Never folded, whatever the template: a broker refusing our TLS or SASL (an expired certificate on one broker
# is no outage of the worker's, and must stay an ERROR).
_KAFKA_CLIENT_NEVER_FOLDED = ("SSL", "certificate", "SASL", "uthenticat")


def _utc(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


class KafkaReach:
    """Whether the worker hears from Kafka: said once when it stops (WARNING), once when it hears again.

    What counts as hearing from Kafka: a fetch of an assigned partition answered
    (aiokafka stamps each answer, records or not: `last_poll_timestamp`, public),
    records handed on, an assignment, a partition positioned at its fence, and,
    for a worker with nothing to fetch, the periodic claim check (WATCH_SECONDS).
    While partitions are being fetched, no answer for `silence` seconds is an
    outage, dated from the last answer. With nothing to fetch (no partition, or
    none positioned yet), an outage is a positioning or a claim check that could
    not reach Kafka; the silence of fetches that are not made says nothing.

    aiokafka's own lines (KafkaClientNoise hands them to `client_error`) are
    counted and the latest kept as the outage's cause; outside an outage one a
    minute is shown. Thread-safe: aiokafka logs from its own thread.
    """

    def __init__(self, bootstrap: str, silence: float = KAFKA_SILENCE_SECONDS) -> None:
        self.bootstrap = bootstrap
        self.silence = silence
        self.since: float | None = None  # while unreachable: when Kafka last answered (epoch seconds)
        self.cause: str | None = None  # while unreachable: why, as said
        self.client_errors = 0  # aiokafka connection lines seen, ever (skillstats_kafka_client_errors_total)
        self.last_client_error: str | None = None
        self._lock = threading.Lock()
        self._heard_at = time.monotonic()
        self._heard_wall = time.time()
        self._errors_at_heard = 0
        self._polled = 0  # the newest fetch answer's stamp last seen (aiokafka's, epoch ms)
        self._fetching = False
        self._shown_at = float("-inf")

    @property
    def unreachable(self) -> bool:
        return self.since is not None

    @property
    def fetching_now(self) -> bool:
        return self._fetching

    def heard(self) -> None:
        """Kafka answered just now: the end of an outage, if there was one."""
        with self._lock:  # the lines are logged outside it: logging runs KafkaClientNoise, which takes it
            self._heard_at, self._heard_wall = time.monotonic(), time.time()
            ended, self.since, self.cause = self.since, None, None
            folded, self._errors_at_heard = self.client_errors - self._errors_at_heard, self.client_errors
        if ended is not None:
            log.warning(
                "Kafka at %s answers again: reading again after %.0fs unreachable (%d aiokafka connection error "
                "line(s) meanwhile, folded)",
                self.bootstrap,
                self._heard_wall - ended,
                folded,
            )

    def fetched(self, records: bool, polled: int | None) -> None:
        """After each fetch of positioned partitions: records handed on, and the newest fetch answer's stamp
        (a wall-clock stamp: any change is a new answer, so a clock set back cannot fake a silence)."""
        if records or (polled is not None and polled != self._polled):
            self._polled = polled if polled is not None else self._polled
            self.heard()
        elif self.since is None and time.monotonic() - self._heard_at >= self.silence:
            self._declare(f"no fetch answered for {self.silence:.0f}s")

    def fetching(self, now: bool) -> None:
        """Whether the drain fetches positioned partitions now. Silence is timed only while it does: when
        fetching starts again (after a rebalance, a positioning) the wait for an answer starts then."""
        if now and not self._fetching and self.since is None:
            self._heard_at = max(self._heard_at, time.monotonic())
        self._fetching = now

    def lost(self, problem: str) -> None:
        """Kafka did not answer a request of the worker's own (a positioning, the claim check): an outage when
        nothing is being fetched (while fetches are, their answers decide)."""
        if not self._fetching and self.since is None:
            self._declare(problem)

    def client_error(self, message: str) -> bool:
        """One of aiokafka's connection lines: counted; True when it is to be shown (one a minute, outside an
        outage this worker has said)."""
        with self._lock:
            self.client_errors += 1
            self.last_client_error = message
            if self.since is not None:
                return False
            now = time.monotonic()
            if now - self._shown_at < CLIENT_LINE_EVERY_SECONDS:
                return False
            self._shown_at = now
            return True

    def problem(self) -> str | None:
        """For /readyz: why the worker is not consuming, while Kafka is unreachable."""
        since, cause = self.since, self.cause
        return None if since is None else f"Kafka at {self.bootstrap} unreachable since {_utc(since)}: {cause}"

    def _declare(self, problem: str) -> None:
        with self._lock:
            if self.since is not None:
                return
            last = self.last_client_error if self.client_errors > self._errors_at_heard else None
            since, cause = self._heard_wall, f"{problem} (aiokafka: {last})" if last else problem
            self.cause, self.since = cause, since  # the cause first: `problem` reads them without the lock
        log.warning(
            "Kafka at %s unreachable since %s: %s; not consuming until it answers (/readyz 503, "
            "skillstats_kafka_unreachable 1); aiokafka's repeats are folded into this line and the next",
            self.bootstrap,
            _utc(since),
            cause,
        )


class KafkaClientNoise(logging.Filter):
    """aiokafka's connection lines (_KAFKA_CLIENT_NOISE) handed to KafkaReach: one a minute shown at INFO
    outside an outage, none during one (the outage's two lines say it), all of them at DEBUG with
    --log-level debug."""

    def __init__(self, reach: KafkaReach, shown_level: int) -> None:
        super().__init__()
        self.reach = reach
        self.shown_level = shown_level

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith("aiokafka") or not any(text in str(record.msg) for text in _KAFKA_CLIENT_NOISE):
            return True
        if any(text in record.getMessage() for text in _KAFKA_CLIENT_NEVER_FOLDED):
            return True
        if self.reach.client_error(record.getMessage()):
            record.levelno, record.levelname = logging.INFO, "INFO"
            return self.shown_level <= logging.INFO
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return self.shown_level <= logging.DEBUG


@dataclass(slots=True)
class Reading:
    """One partition's read since it was last positioned at its SQL fence."""

    since: int  # the offset it was positioned at
    assignment: Any  # aiokafka's Assignment object the seek was made in
    step: int  # the consumer thread's step counter at the seek
    next: int  # one past the last offset handed on


class PartitionReads:
    """Where each assigned partition's read stands, and positioning those that have none (at their fences).

    aiokafka hands over a partition's records only from its current position in
    its current assignment, and moves that position only when told (a seek) or
    by consuming: with no automatic reset, a read positioned at the fence and
    accepted only while the assignment it was made in lasts, and only from
    fetches that ran after the seek, is one contiguous read from the fence. The
    seek and every fetch run in aiokafka's own thread, where a step counter
    orders them; records from a fetch that ran before the seek, or in another
    assignment, are dropped and the partition positioned again.
    """

    def __init__(self, app: WindowsApp, positions: Positions, sink: BatchSink, metrics: PipelineMetrics) -> None:
        self.app = app
        self.positions = positions
        self.sink = sink
        self.metrics = metrics
        self.topic = positions.fences.topic
        self.readings: dict[int, Reading] = {}
        self.steps = itertools.count()  # only advanced in aiokafka's thread
        self.problem: str | None = None  # why positioning fails now (readiness)
        self._failures = 0
        self._retry_at = 0.0
        self._backoff = Backoff(base=0.5)
        self._outage = Outage(log)
        self._watched_at = time.monotonic()
        self._watching: asyncio.Future[Any] | None = None

    def forget(self, partitions: set[int], reason: str | None) -> None:
        """These partitions are read again from their fences before anything more of them is handed on."""
        gone = {p for p in partitions if self.readings.pop(p, None) is not None}
        self.sink.drop(set(partitions))
        if reason is not None:
            self.metrics.restarted(reason, len(gone))

    def on_behind(self, behind: dict[int, tuple[int, int]]) -> None:
        for partition, (fence, since) in sorted(behind.items()):
            log.warning(
                "%s partition %d: the SQL fence is %s, behind where this read started (%d): the database went back "
                "in time (a backup restored, a failover to a replica that lost its last transactions) or its "
                "fences were reset; reading the partition again from its fence",
                self.topic,
                partition,
                fence if fence >= 0 else "gone (no fence row)",
                since,
            )
        self.forget(set(behind), "fence_behind")

    async def position(self, consumer: FencedConsumer) -> None:
        """Seek every assigned partition without a read to its SQL fence (REFUSALS stop the worker)."""
        assigned = {tp.partition for tp in consumer.assignment() if tp.topic == self.topic}
        todo = assigned - set(self.readings)
        if not todo or time.monotonic() < self._retry_at:
            return
        # The batch in the database lands first: the fences read next are then current,
        # and nothing of an older read of these partitions is still pending.
        await self.sink.finish_in_flight()
        self.sink.drop(todo)
        loop = asyncio.get_running_loop()
        try:
            starts = await loop.run_in_executor(None, self.positions.starts, todo)
        except REFUSALS as exc:
            if isinstance(exc, TopicMissing):  # deleted under a running worker: wait (a new one is checked)
                self._failed(exc)
                return
            raise
        except Exception as exc:  # Kafka or the database did not answer: try again shortly
            self._failed(exc)
            return
        targets = {TP(self.topic, p): start.offset for p, start in starts.items()}
        aiokafka = consumer._thread._ensure_consumer()
        assignment, step, done = await consumer._thread.call_thread(_seek_in_thread, aiokafka, targets, self.steps)
        for tp in done:
            self.readings[tp.partition] = Reading(targets[tp], assignment, step, targets[tp])
            self.sink.fences[tp.partition] = targets[tp]
        self.app.kafka.heard()  # the starts came from Kafka (the log's offsets, the topic's id)
        if self._failures:
            self._outage.recovered("positioning at the SQL fences works again")
        elif self.problem:
            log.info("positioning at the SQL fences works again")
        self._failures, self.problem = 0, None
        shown = ", ".join(f"{tp.partition}@{targets[tp]}" for tp in sorted(done))
        log.info("reading %s partition(s) from their SQL fences: %s", self.topic, shown or "none (assignment moved)")

    async def watch(self) -> None:
        """Every WATCH_SECONDS, the claim again (the topic's id, the database's owner), for a worker that may not
        see a batch for a while: a topic deleted under it leaves it with no partitions (aiokafka notices a topic
        created again only at its next metadata refresh, minutes later), a restored database another owner.

        In the background, its outcome taken at a later turn: asking Kafka can take a while when a broker
        just died, and the drain must not wait for it."""
        checking = self._watching
        if checking is not None and checking.done():
            self._watching = None
            error = checking.exception()
            if isinstance(error, TopicMissing):
                if self.problem is None:
                    log.error("%s (deleted under the worker?); waiting for it", error)
                self.problem = str(error)
            elif isinstance(error, REFUSALS):
                raise error
            elif error is not None:  # not known now: the next batch's own check stands
                log.debug("could not check the topic's id: %s", error)
                if isinstance(error, KafkaUnreachable):  # an outage, for a worker with nothing to fetch
                    self.app.kafka.lost(f"the periodic check of the topic's id: {describe(error)}")
            else:
                if not self.app.kafka.fetching_now:  # fetching, the fetches' answers decide
                    self.app.kafka.heard()
                if self.problem is not None and self._failures == 0:
                    log.info("topic %s is back", self.topic)
                    self.problem = None
        if self._watching is None and time.monotonic() - self._watched_at >= WATCH_SECONDS:
            self._watched_at = time.monotonic()
            self._watching = asyncio.ensure_future(
                asyncio.get_running_loop().run_in_executor(None, self.positions.claim)
            )

    def _failed(self, exc: BaseException) -> None:
        delay = self._backoff.delay(self._failures)
        self._retry_at = time.monotonic() + delay
        self.problem = f"cannot position the assigned partitions at their SQL fences: {exc}"
        settings = self.positions.settings
        self._failures += 1
        if isinstance(exc, KafkaUnreachable):
            self.app.kafka.lost(f"positioning at the SQL fences: {describe(exc)}")
            if self.app.kafka.unreachable:  # said once, by KafkaReach, with when it began
                return
        self._outage.failed(
            f"positioning at the SQL fences (Kafka at {settings.kafka_bootstrap}, "
            f"the database {redact_url(settings.database_url)})",
            describe(exc),
            delay,
        )

    def fetchable(self, consumer: FencedConsumer) -> set[TP]:
        return {tp for tp in consumer.assignment() if tp.topic == self.topic and tp.partition in self.readings}

    def accept(
        self,
        records: Mapping[Any, Sequence[Any]],
        assignment: Any,
        step: int,
        positions: Mapping[int, int] | None = None,
    ) -> dict[int, Chunk]:
        """The records that continue their partition's read, with where they start (and where the read stands
        after them, when it passed transaction markers: `positions`, aiokafka's, taken with the records); the
        rest are dropped and their partitions positioned again."""
        batch: dict[int, Chunk] = {}
        stale: set[int] = set()
        positions = positions or {}
        for tp, fetched in records.items():
            if not fetched or tp.topic != self.topic:
                continue
            reading = self.readings.get(tp.partition)
            if reading is None or reading.assignment is not assignment or reading.step > step:
                stale.add(tp.partition)  # fetched before the seek, or in another assignment
                continue
            if fetched[0].offset < reading.next:
                fetched = [r for r in fetched if r.offset >= reading.next]
                if not fetched:
                    continue
            since, reading.next = reading.next, fetched[-1].offset + 1
            batch[tp.partition] = (since, fetched, None)
        for partition, position in positions.items():
            reading = self.readings.get(partition)
            if reading is None or reading.assignment is not assignment or reading.step > step:
                continue
            if position > reading.next:  # passed markers (or aborted records) the read was not handed
                since, records_of, _ = batch.get(partition, (reading.next, [], None))
                batch[partition] = (since, records_of, position)
                reading.next = position
        if stale:
            log.debug("dropped records of partitions %s fetched before their seek; positioning again", sorted(stale))
            self.forget(stale, "stale")
        return batch


async def _seek_in_thread(consumer: Any, targets: Mapping[TP, int], steps: Any) -> tuple[Any, int, set[TP]]:
    """In aiokafka's thread: seek each partition still assigned; (the assignment, the step, the ones sought)."""
    subscription = consumer._subscription.subscription
    assignment = subscription.assignment if subscription is not None else None
    done = set()
    for tp, offset in targets.items():
        try:
            consumer.seek(aiokafka_driver.ensure_aiokafka_TP(tp), offset)
        except Exception:  # IllegalStateError: no longer assigned (a rebalance under way)
            continue
        done.add(tp)
    return assignment, next(steps), done


class Fetch(NamedTuple):
    """What `_fetch_in_thread` found."""

    records: Mapping[Any, Sequence[Any]]
    assignment: Any  # aiokafka's Assignment the records were taken in
    step: int
    lost: set[int]  # partitions whose position is out of range or unknown
    positions: dict[int, int]  # each partition's position right after
    polled: int | None  # the newest answer to a fetch of these partitions (aiokafka's stamp, epoch ms)
    watched: bool  # aiokafka fetches at least one of them (not paused): their silence means something


async def _fetch_in_thread(consumer: Any, partitions: set[TP], timeout: float, max_records: int, steps: Any) -> Fetch:
    """In aiokafka's thread: the records fetched for `partitions`, the assignment and step they were taken in,
    the partitions whose position is out of range or unknown (to be positioned again), each partition's
    position right after (past the transaction markers and aborted records aiokafka passed), and when a fetch
    of them was last answered (the public `last_poll_timestamp`: stamped on every answer, records or not)."""
    fetcher = consumer._fetcher
    if consumer._closed or fetcher._closed:
        raise ConsumerStoppedError()
    lost: set[int] = set()
    aiokafka_records.install(fetcher)
    with fetcher._subscriptions.fetch_context():
        try:
            records = await fetcher.fetched_records(
                {aiokafka_driver.ensure_aiokafka_TP(tp) for tp in partitions}, timeout=timeout, max_records=max_records
            )
        except OffsetOutOfRangeError as exc:  # auto_offset_reset "none": reported, never reset silently
            records, lost = {}, {tp.partition for tp in (exc.args[0] if exc.args else {})}
        except NoOffsetForPartitionError as exc:  # a partition of a new assignment, not positioned yet
            records, lost = {}, {exc.args[0].partition} if exc.args else set()
    subscription = consumer._subscription.subscription
    assignment = subscription.assignment if subscription is not None else None
    positions: dict[int, int] = {}
    polled: int | None = None
    watched = False
    if assignment is not None and assignment.active:
        paused = consumer.paused()
        for tp in partitions:
            atp = aiokafka_driver.ensure_aiokafka_TP(tp)
            state = assignment.state_value(atp) if atp in assignment.tps else None
            if state is not None and atp not in paused:
                watched = True
                stamp = consumer.last_poll_timestamp(atp)
                if stamp is not None and (polled is None or stamp > polled):
                    polled = stamp
            # Not past a record aiokafka skipped with an error still to raise (a record too
            # large for the fetch moves the position over it): that is no marker to pass.
            if isinstance(fetcher._records.get(atp), FetchError):
                continue
            if state is not None and state.has_valid_position:
                positions[tp.partition] = state.position
    return Fetch(records, assignment, next(steps), lost, positions, polled, watched)


async def _commit_in_thread(consumer: Any, offsets: Mapping[TP, int], metadata: str) -> bool:
    """In aiokafka's thread: commit the partitions assigned right now, each with `metadata` (this database's
    mark: skillstats/positions.py); any refusal is logged, never raised."""
    from aiokafka.structs import OffsetAndMetadata

    assigned = consumer.assignment()
    wanted = {
        aiokafka_driver.ensure_aiokafka_TP(tp): OffsetAndMetadata(offset, metadata)
        for tp, offset in offsets.items()
        if aiokafka_driver.ensure_aiokafka_TP(tp) in assigned
    }
    if not wanted:
        return False
    try:
        await consumer.commit(wanted)
    except Exception as exc:  # a rebalance between the filter and the commit, a coordinator gone: a hint lost
        log.info("Kafka commit of %d partition(s) skipped (the SQL fences hold the truth): %r", len(wanted), exc)
        return False
    return True


class FencedConsumer(aiokafka_driver.Consumer):
    """faust's aiokafka consumer with a batch drain reading from the SQL fences, committing only up to them.

    Private faust and aiokafka members are used where there is no public hook:
    faust's `_drain_messages` and `_commit` are overridden, and the drain seeks,
    fetches and commits through aiokafka's consumer in faust's consumer thread
    (`_thread.call_thread`, aiokafka's fetcher and subscription state).
    pyproject.toml pins both packages to the minor versions they were written
    against and tests/test_faust_pins.py fails when what they rely on changes.
    Rebalances go through faust's public signals (`on_partitions_revoked`,
    `on_partitions_assigned`), see build_app.
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

    async def perform_seek(self) -> None:
        """faust seeks every partition to Kafka's committed offset after a rebalance; here a partition is read
        from its SQL fence instead, so this only makes the drain position every assigned partition again."""
        reads: PartitionReads | None = getattr(self.app, "reads", None)
        if reads is not None:
            reads.forget(set(reads.readings), None)

    async def _commit(self, offsets: Mapping[TP, int]) -> bool:
        # Never past the SQL fence, only partitions assigned at the moment of the commit
        # (checked in aiokafka's thread: a rebalance between a check here and faust's
        # own commit crashed the worker), and a refusal is a hint lost, not an error.
        sink: BatchSink | None = getattr(self.app, "batch_sink", None)
        fences = sink.fences if sink is not None else {}
        clamped = {tp: min(o, fences[tp.partition]) for tp, o in offsets.items() if tp.partition in fences}
        reads: PartitionReads | None = getattr(self.app, "reads", None)
        if not clamped or reads is None or not reads.positions.mark:
            return False
        consumer, mark = self._thread._ensure_consumer(), commit_metadata_for(reads.positions.mark)
        return bool(await self._thread.call_thread(_commit_in_thread, consumer, clamped, mark))

    async def commit_fences(self, fences: dict[int, int]) -> bool:
        topic = self.app.reads.topic  # type: ignore[attr-defined]
        return await self._commit({TP(topic, p): offset for p, offset in fences.items()})

    async def _drain_messages(self, fetcher: Any) -> None:
        app: WindowsApp = self.app  # type: ignore[assignment]
        sink, reads = app.batch_sink, app.reads
        max_records = app.conf.broker_max_poll_records or 10_000
        try:
            while not (self.should_stop or fetcher.should_stop):
                if not self.flow_active:  # a rebalance under way: faust resumes the flow after it
                    app.kafka.fetching(False)
                    await reads.watch()  # a rebalance that Kafka's absence holds up is said too
                    await sink.idle()
                    await asyncio.sleep(0.05)
                    continue
                await reads.position(self)
                await reads.watch()
                wanted = reads.fetchable(self)
                if not wanted:
                    app.kafka.fetching(False)
                    await sink.idle()
                    await asyncio.sleep(0.2)
                    continue
                records, assignment, step, lost, positions, polled, watched = await self._thread.call_thread(
                    _fetch_in_thread, self._thread._ensure_consumer(), wanted, 0.2, max_records, reads.steps
                )
                app.kafka.fetching(watched)
                if watched:
                    app.kafka.fetched(any(records.values()), polled)
                if lost:
                    log.info("partitions %s: position out of range or unknown; positioning again", sorted(lost))
                    reads.forget(lost, "out_of_range")
                if self.should_stop:
                    await sink.idle()
                    continue
                # No await between accepting and adding: the rebalance handlers (on the
                # event loop) cannot run in between.
                batch = reads.accept(records, assignment, step, positions)
                if batch:
                    await sink.add(batch)
                else:
                    await sink.idle()
        except asyncio.CancelledError:
            # faust cancels the drain only to stop the worker. Ending normally rather
            # than re-raising: faust treats a cancelled fetcher during a rebalance as a
            # crash to restart, and its restart path fails when the worker is stopping
            # (a SIGTERM that lands mid-rebalance exited 1 instead of 0).
            await sink.drain_on_shutdown(batch_budget(app.shutdown_budget))
            return
        except REFUSALS as exc:
            log.critical("%s", exc)
            app.refusal = exc
            await self.crash(exc)
            raise
        except Exception as exc:
            # Not a database or broker outage (those are retried inside the batch):
            # a bug. Crash the worker, loudly, so it is restarted and reads again from
            # the fences, rather than stay in the group holding partitions it never reads.
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

    batch_sink: BatchSink
    reads: PartitionReads
    ownership: Ownership
    shutdown_budget: float
    shutdown_watchdog: ShutdownWatchdog
    kafka: KafkaReach
    refusal: BaseException | None = None  # what stopped the worker with exit status 2
    start_message: str = "started"
    heartbeat: float = 0.0  # time.monotonic() of the event loop's last turn (see `live`)
    joined: bool = False  # has had an assignment (possibly empty) since it started

    def live(self) -> str | None:
        """/healthz: the event loop turns (a timer beats every second)."""
        silent = time.monotonic() - self.heartbeat
        return None if silent < LOOP_STALL_SECONDS else f"event loop silent for {silent:.0f}s"

    def ready(self) -> str | None:
        """/readyz: joined the group, hears from Kafka, its partitions positioned, the database not failing."""
        if self.refusal is not None:
            return f"refused: {self.refusal}"
        unreachable = self.kafka.problem()
        if unreachable is not None:
            return unreachable
        if not self.joined:
            return "not yet joined the consumer group"
        if self.reads.problem is not None:
            return self.reads.problem
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
    engine: Engine | None = None,
    owner: Owner | None = None,
    kafka: KafkaReach | None = None,
    rebuild: Rebuild | None = None,
) -> WindowsApp:
    """The worker; `engine` and `owner` (the role claimed) as start-up found them (made here, and claimed at the
    first assignment, when not given); `kafka`, the reach its log filter reports to (run's); `rebuild`, the rebuild
    whose shadow tables it fills under the rebuild's own group (skillstats/rebuild/), instead of the live tables."""
    group = settings.windows_group if rebuild is None else rebuild.group_id
    app = WindowsApp(
        group,
        broker=f"kafka://{settings.kafka_bootstrap}",
        key_serializer="raw",
        value_serializer="raw",
        store="memory://",
        web_enabled=False,
        topic_disable_leader=True,
        # Never a position of Kafka's choosing: an out-of-range fetch is reported to
        # the drain, which positions the partition at its fence (or the log start).
        consumer_auto_offset_reset="none",
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
    app.shutdown_budget = shutdown_budget
    app.shutdown_watchdog = ShutdownWatchdog("windows", shutdown_budget)
    app.heartbeat = time.monotonic()
    app.kafka = kafka or KafkaReach(settings.kafka_bootstrap)
    watch_kafka(group, app.kafka)
    # Registered with faust's conductor so the consumer subscribes to it; no agent
    # iterates it, the batch drain above reads it.
    app.topics.add(app.topic(settings.topic, key_type=bytes, value_type=bytes))
    if engine is None:
        from skillstats.sinks.db import open_engine
        from skillstats.sinks.migrate import require_current

        engine = open_engine(settings.database_url)
        require_current(engine)
    if rebuild is None:
        sink: WindowsSink = WindowsSink(engine, group, settings.topic)
        positions = Positions(settings, WINDOWS, sink)
        dead_letters: DeadLetters | NotParked = DeadLetters(settings, group)
    else:
        sink = RebuildSink(engine, group, settings.topic, rebuild.id, rebuild.owned(engine))
        positions = Positions(settings, REBUILD, sink)
        dead_letters = NotParked()
    positions.owner = sink.owner = owner
    app.ownership = Ownership()
    pipeline = WindowsPipeline(sink, dead_letters, positions, app.ownership)  # type: ignore[arg-type]

    async def commit(fences: dict[int, int]) -> bool:
        return await app.consumer.commit_fences(fences)  # type: ignore[attr-defined]

    app.batch_sink = BatchSink(pipeline, max_pending=batch_size, commit=commit)
    app.reads = PartitionReads(app, positions, app.batch_sink, pipeline.metrics)
    app.batch_sink.on_behind = app.reads.on_behind
    app.start_message = (
        f"skillstats windows: group {group} reads topic {settings.topic} from "
        f"{settings.kafka_bootstrap} and writes daily and hourly counts to {redact_url(settings.database_url)}"
    )
    if rebuild is not None:
        app.start_message += (
            f": rebuild {rebuild.id}, into {' and '.join(sink.tables[i].name for i in (1, 0))}, "
            f"{sink.owned.describe()}"  # type: ignore[attr-defined]
        )

    @app.on_partitions_revoked.connect
    async def settle_on_revoke(_app: Any, revoked: set[TP], **_: Any) -> None:
        partitions = {tp.partition for tp in revoked if tp.topic == settings.topic}
        app.ownership.owned = app.ownership.owned - partitions
        app.reads.forget(partitions, None)
        # Let the batch in the database finish first (bounded): the next owner then starts
        # from its fences. Then wait for any parking under way (bounded too): once the lock
        # is free, no parcel of a revoked partition is being sent, nor can one be.
        await app.batch_sink.settle(shutdown_budget)
        loop = asyncio.get_running_loop()
        taken = await loop.run_in_executor(None, functools.partial(app.ownership.parking.acquire, timeout=5.0))
        if taken:
            app.ownership.parking.release()
        else:
            log.warning(
                "a batch was still parking invalid records of revoked partitions after 5s (the DLQ is slow or "
                "away); the next owner may park some of them again (dlq replay publishes one copy per record)"
            )

    @app.on_partitions_assigned.connect
    async def on_assigned(_app: Any, assigned: set[TP], **_: Any) -> None:
        partitions = {tp.partition for tp in assigned if tp.topic == settings.topic}
        log.info("assigned partitions %s of %s", sorted(partitions) or "none", settings.topic)
        app.kafka.heard()  # the group's coordinator answered
        app.joined = True
        pipeline.metrics.assigned(len(partitions))
        app.ownership.owned = frozenset(partitions)
        # A new assignment starts every partition over from its fence (aiokafka would
        # start it from Kafka's committed offset): what is pending is dropped and read again.
        app.reads.forget(set(app.reads.readings) | set(app.batch_sink.pending), None)
        pipeline.metrics.restarted("assigned", len(partitions))

    return app


# Third-party loggers speak at WARNING and above (INFO with --log-level debug): their
# INFO lines narrate every service starting and stopping.
_THIRD_PARTY_LOGGERS = ("faust", "mode", "aiokafka", "kafka")
# What every normal start or rebalance logs above INFO, though nothing is wrong.
_ROUTINE = (
    "GroupCoordinatorNotAvailable",  # aiokafka, the first start of a new group
    "Heartbeat failed for group",  # aiokafka, while a rebalance is under way
    "OffsetCommit failed for group",  # aiokafka, a commit that raced a rebalance (the fence holds the truth)
)
# What says nothing to an operator at all: shown with --log-level debug only.
_NOISE = (
    "Missing sensor state for rebalance",  # faust, every start: a rebalance its sensor did not see begin
)


class RoutineAtInfo(logging.Filter):
    """Shows the routine messages above as what they are, INFO (and so not at all above INFO), and the noise at
    DEBUG."""

    def __init__(self, shown_level: int) -> None:
        super().__init__()
        self.shown_level = shown_level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.INFO and any(text in record.getMessage() for text in _NOISE):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return self.shown_level <= logging.DEBUG
        if record.levelno > logging.INFO and any(text in record.getMessage() for text in _ROUTINE):
            record.levelno, record.levelname = logging.INFO, "INFO"
            return self.shown_level <= logging.INFO
        return True


def logging_config(level: str, secrets: list[str], kafka: KafkaReach | None = None) -> dict[str, Any]:
    """Plain lines on stdout (no colour codes, no spinner), secrets masked, routine noise at INFO, aiokafka's
    connection lines handed to `kafka` (KafkaClientNoise)."""
    number = logging.getLevelName(level.upper())
    filters: dict[str, Any] = {}
    if kafka is not None:  # first: it sees aiokafka's lines as they were logged
        filters["kafka"] = {"()": KafkaClientNoise, "reach": kafka, "shown_level": number}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {
            **filters,
            "routine": {"()": RoutineAtInfo, "shown_level": number},
            "mask": {"()": MaskSecrets, "secrets": secrets},
        },
        "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
        "handlers": {
            "default": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stdout",
                "formatter": "plain",
                "filters": [*filters, "routine", "mask"],
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
    metrics_host: str = METRICS_HOST,
    metrics_port: int = 0,
    **options: Any,
) -> None:
    """Run the worker until SIGTERM/SIGINT (never returns; exits the process); metrics_port 0: none; with
    `rebuild` (in `options`), that rebuild's worker.

    Until Kafka and the database answer, it waits (capped backoff, a line per
    attempt) with /healthz 200 and /readyz 503; a setting that cannot work (no
    such topic, another group's database, a replaced topic) exits 2 at once.
    """
    kafka = KafkaReach(settings.kafka_bootstrap)
    logging.config.dictConfig(logging_config(log_level, settings.secrets(), kafka))
    if NATIVE_MISSING:
        log.warning("%s", NATIVE_MISSING)
    starting = Starting("windows")
    if metrics_port:
        serve(metrics_host, metrics_port, Probes(starting.live, starting.ready))
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        rebuild = options.get("rebuild")
        role, group = (WINDOWS, settings.windows_group) if rebuild is None else (REBUILD, rebuild.group_id)
        ready = wait_for_dependencies(settings, role, group, starting, stop)
    except REFUSALS as exc:
        print(f"skillstats windows: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if ready is None:  # stopped while waiting
        raise SystemExit(0)
    for number, handler in previous.items():
        signal.signal(number, handler)
    engine, owner = ready
    app = build_app(settings, engine=engine, owner=owner, kafka=kafka, **options)
    starting.delegate(app.live, app.ready)
    # glibc's thresholds fixed before the first fetch: RSS follows what the worker holds (skillstats/allocator.py).
    log.info("%s", fix_thresholds().line())
    # aiokafka allocates GC-tracked objects per record (the record and its header
    # list), so at the default threshold (700) the cyclic collector ran every few
    # hundred records and cost ~15% of throughput. Almost nothing here forms cycles;
    # refcounting frees it. The first generation's threshold counts tracked objects
    # allocated and not yet freed, and a batch in the database plus the next one
    # pending keep about four per record alive: at a fixed 100,000, every batch of
    # 50,000 set off a collection that walked the live batches and found nothing
    # (24 of them over a 1,000,000-event backfill, 0.36-0.45 CPU s). 1,000,000 is
    # twenty per record of a default batch, above what batches keep alive, and
    # fixed (a larger --batch-size collects more often, never holds more garbage).
    # The cycles that do form hold little, but for a failed statement's (a batch's
    # parameters, through the exception's traceback): the sink's retry collects
    # those each time (sinks/recovery.py). freeze() keeps the import-time heap out
    # of the full collections.
    gc.freeze()
    gc.set_threshold(COLLECTOR_THRESHOLD, 50, 100)
    worker = faust.Worker(
        app, loglevel=log_level, quiet=True, logging_config=logging_config(log_level, settings.secrets(), kafka)
    )
    worker.spinner = None  # a service's log is a file, not a terminal
    try:
        worker.execute_from_commandline()
    finally:
        # faust says "Stopping..." of every service; this says the process is done.
        log.info("skillstats windows: stopped%s", " (refused: exit 2)" if app.refusal is not None else "")
        if app.refusal is not None:
            print(f"skillstats windows: {app.refusal}", file=sys.stderr)
            raise SystemExit(2)
