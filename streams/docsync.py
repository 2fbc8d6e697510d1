"""Consumer group `skillstats-docsync`: the slow, bounded drain into `skills` and `user_skill_stats`.

A plain confluent-kafka consumer, run as a Kubernetes CronJob (one drain, then
exit) or with `--every` as a long-running loop. One drain: claim the docsync
role (the database must name this group and this topic, by its Kafka id:
sinks/identity.py), check that no SQL fence is past its partition's log end (a
recreated topic or a database restored from elsewhere must stop the drain
loudly, not make it skip records as "already applied"), snapshot the end
offsets, refuse to go on while `skills` has no row at all (every event would be
skipped for good: exit status 2 unless --allow-empty-registry), read every
assigned partition from its SQL fence (skillstats/positions.py;
never from Kafka's committed offset) up to that snapshot (or until a budget runs
out), fold per skill, check the topic's id again, then apply each partition's
deltas once, in chunked transactions that also move the fences, and commit the
same offsets to Kafka after each SQL commit (a hint for lag tools). A partition
the database refuses for good (a registry constraint rejecting a skill's delta)
is held back at its fence while every other partition is applied
(sinks/docstats.py); the run then ends in error (exit status 1), naming the
partition, its offset and the database's error, and the next run tries it
again. Nothing is
written before the reading is done: a drain killed while reading leaves no trace
but its run row. Record headers are never read: a verdict on a record, and
whether it counts, depend on its key, value and timestamp only.

When is a partition read? Not when the next offset reaches the snapshot's high
watermark: a transactional producer leaves commit and abort markers, and aborted
records, that a read_committed consumer is never handed, so a partition ending
in a marker would never "reach" its end, and an open transaction stops the
consumer at the last stable offset, below the high watermark, until it ends. The
drain goes by what the consumer really reached instead: a partition-EOF event at
offset e (everything below e was handed over, or was never deliverable), or a
record at or past the snapshot end, says the partition has nothing more now; the
partition's next offset then moves up to min(e, snapshot end), so the fence and
the Kafka commit pass the trailing markers and the next drain does not wait on
them again. (`Consumer.position()` is no help here: it stops after the last
record handed over, before the markers, and some librdkafka 2.x versions
advance it by two after an EOF in batch consume.)
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Consumer, KafkaError, Message, TopicPartition
from sqlalchemy import insert, update

from skillstats.config import Settings, redact_url
from skillstats.contract import NATIVE_MISSING, native
from skillstats.kafka import KafkaUnreachable, TopicMissing
from skillstats.metrics import METRICS_HOST, Probes, docsync_held, drain_finished, serve
from skillstats.positions import Positions
from skillstats.retry import Backoff
from skillstats.shutdown import DEFAULT_BUDGET_S, ShutdownWatchdog
from skillstats.sinks.docstats import DocStatsSink, EmptyRegistry, HeldPartition, PartitionDeltas, held_error
from skillstats.sinks.fences import FenceAheadOfLog, check_within_log
from skillstats.sinks.identity import DOCSYNC, IdentityMismatch
from skillstats.sinks.recovery import describe, is_data_error
from skillstats.sinks.schema import docsync_runs, skills, user_skill_stats
from skillstats.sinks.upserts import now_utc_naive
from skillstats.startup import Starting, wait_for_dependencies

log = logging.getLogger(__name__)

# skillstats/_native.c: MessageTaker.take for the ordinary messages, in C; None without the C module.
native_take_run: Callable[..., int] | None = native.take_run if native is not None else None

CAUGHT_UP, BUDGET, ERROR = "caught_up", "budget", "error"
# An operator's decision or a setting to fix, not a failure to retry: the drain stops with
# exit status 2 and the message says what to do (docs/contract.md).
REFUSALS = (EmptyRegistry, FenceAheadOfLog, IdentityMismatch, TopicMissing)


@dataclass
class DrainSummary:
    run_id: int | None = None
    events_read: int = 0
    skills_updated: int = 0
    owners_updated: int = 0
    unknown_skill_events: int = 0
    invalid_skipped: int = 0
    partitions_applied: int = 0
    duration_seconds: float = 0.0
    stopped_reason: str = CAUGHT_UP
    error: str | None = None
    refused: bool = False  # the error is one of REFUSALS: exit status 2
    records_lost_to_retention: int = 0  # offsets a fence was moved over (deleted before they were applied)
    lost_partitions: list[int] = field(default_factory=list)
    applied_kinds: dict[str, int] = field(default_factory=dict)  # valid events of the partitions applied, by kind
    invalid_reasons: dict[str, int] = field(default_factory=dict)  # of the partitions applied
    # Partitions whose deltas the database refused: not applied, fences unmoved; the run ends in error.
    held_back: list[HeldPartition] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.stopped_reason != ERROR

    def describe(self) -> str:
        lines = [
            f"docsync run {self.run_id}: {self.stopped_reason} after {self.duration_seconds:.1f}s",
            f"  events read           {self.events_read}",
            f"  skills updated        {self.skills_updated}",
            f"  owners updated        {self.owners_updated}",
            f"  events, unknown skill {self.unknown_skill_events}",
            f"  invalid, skipped      {self.invalid_skipped}",
            f"  partitions applied    {self.partitions_applied}",
        ]
        if self.unknown_skill_events:
            # The seed's rule for deleted skills; a surprise when the skills rows are
            # simply not created yet, so said in words every time it happens.
            lines.append(
                f"  note: {self.unknown_skill_events:,} events were for skills with no row in `skills`; they are "
                f"skipped for good (their daily and hourly counts are kept). Create the skills rows before the "
                f"first drain."
            )
        if self.lost_partitions:
            lines.append(f"  left to another drain {sorted(self.lost_partitions)}")
        for held in sorted(self.held_back, key=lambda h: h.partition):
            lines.append(
                f"  HELD BACK             partition {held.partition} at offset {held.offset} (read to "
                f"{held.read_to}), refused by the database: {held.error}"
            )
        if self.records_lost_to_retention:
            lines.append(f"  LOST to retention     {self.records_lost_to_retention} (deleted before they were applied)")
        if self.error:
            # The held partitions' own lines are above; the error's first line says the rest.
            lines.append(f"  error                 {self.error.splitlines()[0] if self.held_back else self.error}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


Columns = tuple[PartitionDeltas, list[bytes | None], list[bytes | None], list[int | None]]


class MessageTaker:
    """What a drain reads, message by message: each record below the snapshot end into its partition's columns.

    `taken` holds, per partition, what the messages of one consume() call handed over, to be decoded and folded in
    one call per partition (PartitionDeltas.add_records) before the next consume(): a revocation is only ever
    served inside consume(), so a partition's records reach its deltas before it can be revoked, and revoked ones
    are dropped whole. `finish(partition, reached)` says a partition has nothing more to read now.

    `take_all` hands the ordinary messages (no error, in a partition being read, below the snapshot's last
    offset) to skillstats._native.take_run, which does what `take` does for them in C, and `take` the rest: the
    Python loop was about 1 CPU second per million messages, several times what reading them costs.
    tests/test_docsync_take.py checks both paths leave the same columns, deltas and finished partitions.
    """

    def __init__(
        self,
        topic: str,
        parts: dict[int, PartitionDeltas],
        finished: set[int],
        ends: dict[int, int],
        summary: DrainSummary,
        finish: Callable[[int, int | None], None],
    ) -> None:
        self.topic = topic
        self.parts = parts
        self.finished = finished
        self.ends = ends
        self.summary = summary
        self.finish = finish
        self.taken: dict[int, Columns] = {}
        self.native = native_take_run

    def take_all(self, messages: list[Message]) -> None:
        take_run = self.native
        index, count = 0, len(messages)
        while index < count:
            if take_run is not None:
                index = take_run(
                    messages,
                    index,
                    self.parts,
                    self.finished,
                    self.ends,
                    self.taken,
                    self.summary,
                    TIMESTAMP_NOT_AVAILABLE,
                )
                if index == count:
                    break
            self.take(messages[index])
            index += 1

    def take(self, message: Message) -> None:
        partition = message.partition()
        part = self.parts.get(partition)
        error = message.error()
        if error is not None:
            if error.code() == KafkaError._AUTO_OFFSET_RESET and part is not None:
                # The position left the log: retention moved the log start past it while
                # this drain read (what lies between is lost; the next drain's positioning
                # counts it and moves the fence), or the log was cut or replaced (the topic
                # id check before applying, or the next drain's fence check, stops it).
                # What was read up to here is applied; nothing more of it now.
                log.warning("%s partition %d: position out of range (%s)", self.topic, partition, error.str())
                if partition not in self.finished:
                    self.finish(partition, None)
                return
            if error.code() != KafkaError._PARTITION_EOF:
                raise RuntimeError(f"Kafka: {error}")
            if part is not None and partition not in self.finished:
                self.finish(partition, message.offset())
            return
        if part is None or partition in self.finished:
            return  # revoked meanwhile, or already read to the snapshot
        offset = message.offset()
        end = self.ends.get(partition, 0)
        if offset >= end:
            self.finish(partition, offset)  # past the snapshot: everything below it was handed over
            return
        if offset < part.next_offset:
            return  # handed over twice (librdkafka after a seek): the first copy counted
        ts_type, ts = message.timestamp()
        columns = self.taken.setdefault(partition, (part, [], [], []))  # emptied after every consume()
        columns[1].append(message.key())
        columns[2].append(message.value())
        columns[3].append(ts if ts_type != TIMESTAMP_NOT_AVAILABLE else None)
        part.events += 1
        part.next_offset = offset + 1
        self.summary.events_read += 1
        if offset + 1 >= end:
            self.finish(partition, None)

    def add_taken(self) -> None:
        """Decode and fold what the last consume() call handed over, per partition."""
        for part, keys, values, stamps in self.taken.values():
            part.add_records(keys, values, stamps)
        self.taken.clear()


@dataclass
class DrainBudget:
    max_events: int | None = None
    max_seconds: float | None = None
    chunk_partitions: int = 4  # partitions per SQL transaction, halved on database errors
    max_attempts: int = 6  # per chunk and run, before the run gives up with an error
    backoff: Backoff = field(default_factory=Backoff)


class DocSync:
    """One consumer, one drain at a time; `stop` (SIGTERM) ends the reading early."""

    def __init__(
        self,
        settings: Settings,
        budget: DrainBudget | None = None,
        stop: threading.Event | None = None,
        engine: Any = None,
        *,
        allow_empty_registry: bool = False,
    ) -> None:
        from skillstats.sinks.db import open_engine
        from skillstats.sinks.migrate import require_current

        self.settings = settings
        self.budget = budget or DrainBudget()
        self.stop = stop or threading.Event()
        if engine is None:
            engine = open_engine(settings.database_url)
            require_current(engine)
        self.engine = engine
        # An empty `skills` table refuses the drain (EmptyRegistry) unless this says it is meant.
        self.allow_empty_registry = allow_empty_registry
        self.sink = DocStatsSink(self.engine, settings.docsync_group, settings.topic)
        self.positions = Positions(settings, DOCSYNC, self.sink)

    def drain(self) -> DrainSummary:
        started = time.monotonic()
        summary = DrainSummary()
        summary.run_id = self._open_run()
        try:
            self.positions.claim()
            ends = self._snapshot()
            # After the claim and the fence check (their refusals say more), before anything is read.
            # Only with something to read: a fresh deployment's drains over an empty topic refuse nothing.
            fences = self.sink.fences()
            waiting = any(end > fences.get(p, 0) for p, end in ends.items())
            if waiting and not self.allow_empty_registry and self.sink.registry_is_empty():
                raise EmptyRegistry(redact_url(self.engine.url.render_as_string(hide_password=False)))
            consumer, parts = self._read(summary, started, ends)
            # The topic the records came from is still the one claimed: a topic recreated
            # while this drain read must not be counted against the old one's fences.
            try:
                self.positions.verify_topic()
            except Exception:
                consumer.close()
                raise
            self._apply(consumer, parts, summary)
        except REFUSALS as exc:
            # An operator's decision or a setting to fix, not a bug: the message says what
            # to do, and a traceback would bury it.
            log.error("%s", exc)
            summary.stopped_reason = ERROR
            summary.refused = True
            summary.error = f"{type(exc).__name__}: {exc}"
        except KafkaUnreachable as exc:
            log.error("%s", exc)
            summary.stopped_reason = ERROR
            summary.error = f"{type(exc).__name__}: {exc}"
        except Exception as exc:
            log.exception("docsync drain failed")
            summary.stopped_reason = ERROR
            summary.error = f"{type(exc).__name__}: {exc}"[:2000]
        if summary.held_back:
            # Everything else that could be applied was: the run still fails, so that a CronJob, the
            # run row and the stale-drain alert say that some partition does not move.
            summary.stopped_reason = ERROR
            held = held_error(summary.held_back)
            summary.error = held if summary.error is None else f"{summary.error}\n{held}"
        summary.duration_seconds = time.monotonic() - started
        self._close_run(summary)
        return summary

    # ------------------------------------------------------------------ reading

    def _snapshot(self) -> dict[int, int]:
        """The end offsets this drain reads up to, once no fence is past them (else FenceAheadOfLog).

        The ends are the high watermarks; a partition an open transaction holds
        below its end is finished at the last stable offset by the EOF the consumer
        reports there (see the module docstring). The fences are read first: a
        fence only ever moves to an offset at or below such an end as it was then,
        and those never go down, so a fence read first can be past an end read
        after it only if the log is not the one the database counted. (Read the
        other way round, another drain applying in between could raise a false
        alarm.)

        A fenced partition the metadata does not list (a broker's metadata trailing a
        partition increase) is asked about again before its fence is called ahead of
        the log (Positions.log_bounds): that refusal needs an operator, stale metadata
        only a moment.
        """
        fences = self.sink.fences()
        logs = self.positions.log_bounds(p for p, fence in fences.items() if fence > 0)
        ends = {p: high for p, (_low, high) in logs.items()}
        check_within_log(self.settings.docsync_group, self.settings.topic, fences, ends)
        return ends

    def _read(
        self, summary: DrainSummary, started: float, ends: dict[int, int]
    ) -> tuple[Consumer, dict[int, PartitionDeltas]]:
        topic = self.settings.topic
        group = self.settings.docsync_group
        parts: dict[int, PartitionDeltas] = {}
        finished: set[int] = set()  # assigned partitions with nothing more to read below the snapshot
        assigned = threading.Event()  # holds an assignment now (cleared while a rebalance is under way)
        assigned_once = threading.Event()
        consumer = Consumer(
            self.settings.kafka_config(
                **{
                    "group.id": group,
                    "enable.auto.commit": False,
                    # Never a position of librdkafka's choosing: each partition is
                    # positioned at its fence (or the log start), and a position out of
                    # range is reported and handled here (see take()).
                    "auto.offset.reset": "error",
                    # librdkafka's default, said out loud: records of aborted and open
                    # transactions are never counted.
                    "isolation.level": "read_committed",
                    # How a partition whose last offsets are transaction markers, or which
                    # an open transaction holds below its high watermark, is known to be read.
                    "enable.partition.eof": True,
                }
            )
        )

        def finish(c: Consumer, partition: int, reached: int | None = None) -> None:
            """Nothing more to read in `partition` now; everything below `reached` was handed over.

            The next offset moves up to `reached` (capped at the snapshot end: records
            past it are the next drain's), which passes transaction markers and aborted
            records no record offset would ever pass. Pausing stops fetching what this
            drain would throw away.
            """
            part = parts[partition]
            if reached is not None:
                part.next_offset = max(part.next_offset, min(reached, ends.get(partition, 0)))
            finished.add(partition)
            c.pause([TopicPartition(topic, partition)])

        def on_assign(c: Consumer, assignment: list[TopicPartition]) -> None:
            # The SQL fence, not Kafka's committed offset, says where to read from: a fence
            # below the log start is moved up to it (those records were lost to retention),
            # a partition without one starts at the log start (skillstats/positions.py).
            starts = self.positions.starts(tp.partition for tp in assignment)
            positioned = []
            for tp in assignment:
                if tp.partition not in starts:
                    continue
                start = starts[tp.partition]
                if start.lost is not None:
                    summary.records_lost_to_retention += start.lost[1] - start.lost[0]
                parts[tp.partition] = PartitionDeltas(tp.partition, start.offset, start.offset)
                positioned.append(TopicPartition(topic, tp.partition, start.offset))
            c.assign(positioned)
            # A pause outlives a revocation: a partition this drain finished (and paused)
            # before a rebalance and gets back after it must be read again from its fence.
            c.resume(positioned)
            for tp in positioned:
                # Empty, or already read to the snapshot (a partition added after it has end 0;
                # a fence past it was moved by a later drain): done now. Its EOF event may
                # never come, or come before anything here would look for it.
                if parts[tp.partition].start >= ends.get(tp.partition, 0):
                    finish(c, tp.partition)
            assigned_once.set()
            assigned.set()
            log.info("assigned partitions %s", sorted(tp.partition for tp in assignment))

        def on_revoke(c: Consumer, revoked: list[TopicPartition]) -> None:
            # What was read from them is dropped: the next owner reads it again from
            # the fence, which nothing has moved yet.
            assigned.clear()
            for tp in revoked:
                parts.pop(tp.partition, None)
                finished.discard(tp.partition)
            c.unassign()

        taker = MessageTaker(topic, parts, finished, ends, summary, lambda p, reached: finish(consumer, p, reached))

        consumer.subscribe([topic], on_assign=on_assign, on_revoke=on_revoke)
        reason = CAUGHT_UP
        try:
            deadline_assign = time.monotonic() + 60
            while True:
                if assigned.is_set() and finished.issuperset(parts):
                    break
                if self.stop.is_set():
                    reason = BUDGET
                    break
                budget = self.budget
                if budget.max_seconds is not None and time.monotonic() - started >= budget.max_seconds:
                    reason = BUDGET
                    break
                want = 5000
                if budget.max_events is not None:
                    want = min(want, budget.max_events - summary.events_read)
                    if want <= 0:
                        reason = BUDGET
                        break
                if not assigned_once.is_set() and time.monotonic() > deadline_assign:
                    raise RuntimeError("no partitions were assigned within 60 s; is the group stuck rebalancing?")
                try:
                    taker.take_all(consumer.consume(want, timeout=0.5))
                finally:
                    taker.add_taken()
            summary.stopped_reason = reason
            return consumer, parts
        except Exception:
            consumer.close()
            raise

    # ------------------------------------------------------------------ applying

    def _apply(self, consumer: Consumer, parts: dict[int, PartitionDeltas], summary: DrainSummary) -> None:
        """Apply the read partitions, a chunk per transaction, their Kafka commits after each SQL commit.

        A database error is retried with backoff and a halved chunk, `max_attempts`
        per run. A data error (the database refusing the deltas themselves: no retry
        cures it) is not: the chunk is applied again at once, partition by partition
        (sinks/docstats.py, one_by_one), so that a partition refused for good is held
        back alone and every other one moves.
        """
        try:
            todo = sorted((p for p in parts.values() if p.next_offset > p.start), key=lambda p: p.partition)
            summary.invalid_skipped = sum(p.invalid for p in parts.values())
            chunk = max(1, self.budget.chunk_partitions)
            attempt = 0
            one_by_one = False  # the next attempt applies its chunk partition by partition
            while todo:
                if self.stop.is_set():
                    # SIGTERM: what was applied is committed; the rest is read again next drain.
                    log.info("stopping: %d read partition(s) left for the next drain", len(todo))
                    summary.stopped_reason = BUDGET
                    break
                batch = todo[:chunk]
                try:
                    outcome = self.sink.apply_partitions(batch, one_by_one=one_by_one)
                except Exception as exc:
                    if is_data_error(exc) and not one_by_one:
                        # Nothing of the chunk was applied (one transaction). Applied one by one, the
                        # partitions the database takes move and the one it refuses is held back.
                        log.warning(
                            "the database refused the deltas of partitions %s (%s): applying them one by one",
                            [p.partition for p in batch],
                            describe(exc),
                        )
                        one_by_one = True
                        continue
                    attempt += 1
                    if attempt >= self.budget.max_attempts:
                        raise
                    # As the seed did: wait, and try a smaller transaction next time.
                    chunk = max(1, chunk // 2)
                    log.warning(
                        "database error applying partitions %s on %s (attempt %d, next chunk %d): %s",
                        [p.partition for p in batch],
                        redact_url(self.engine.url.render_as_string(hide_password=False)),
                        attempt,
                        chunk,
                        describe(exc),
                    )
                    self.budget.backoff.sleep(attempt - 1, self.stop)  # SIGTERM ends the wait (and the loop)
                    continue
                one_by_one = False
                todo = todo[len(batch) :]
                summary.skills_updated += outcome.skills_updated
                summary.owners_updated += outcome.owners_updated
                summary.unknown_skill_events += outcome.unknown_skill_events
                summary.partitions_applied += outcome.partitions
                summary.lost_partitions += outcome.lost_to_another_writer
                summary.held_back += outcome.held
                for held in outcome.held:
                    log.error(
                        "%s partition %d: the database refused its deltas, so it is held back at offset %d (read "
                        "to %d; nothing of it applied) while the other partitions are applied; the next drain "
                        "tries it again. Fix the row or the constraint: %s",
                        self.settings.topic,
                        held.partition,
                        held.offset,
                        held.read_to,
                        held.error,
                    )
                not_applied = set(outcome.lost_to_another_writer) | {h.partition for h in outcome.held}
                applied = [p for p in batch if p.partition not in not_applied]
                for part in applied:  # counted once: a partition not applied is read again next drain
                    for kind, count in part.kinds.items():
                        summary.applied_kinds[kind] = summary.applied_kinds.get(kind, 0) + count
                    for reason, count in part.invalid_reasons.items():
                        summary.invalid_reasons[reason] = summary.invalid_reasons.get(reason, 0) + count
                self._commit(consumer, applied)
        finally:
            consumer.close()

    def _commit(self, consumer: Consumer, applied: list[PartitionDeltas]) -> None:
        """Kafka's committed offsets follow the fences (for lag and pruning); SQL stays the truth."""
        if not applied:
            return
        # Each with this database's mark: which database counts the group (skillstats/positions.py).
        mark = self.positions.mark
        offsets = [TopicPartition(self.settings.topic, p.partition, p.next_offset, metadata=mark) for p in applied]
        try:
            consumer.commit(offsets=offsets, asynchronous=False)
        except Exception as exc:
            log.warning("Kafka commit after the SQL commit failed (the fence holds the truth): %s", exc)

    # ------------------------------------------------------------------ run records

    def _open_run(self) -> int:
        with self.engine.begin() as connection:
            result = connection.execute(
                insert(docsync_runs).values(
                    group_id=self.settings.docsync_group,
                    started_at=now_utc_naive(),
                    host=socket.gethostname(),
                    pid=os.getpid(),
                )
            )
            return int(result.inserted_primary_key[0])

    def _close_run(self, summary: DrainSummary) -> None:
        try:
            with self.engine.begin() as connection:
                connection.execute(
                    update(docsync_runs)
                    .where(docsync_runs.c.id == summary.run_id)
                    .values(
                        finished_at=now_utc_naive(),
                        events_read=summary.events_read,
                        skills_updated=summary.skills_updated,
                        unknown_skill_events=summary.unknown_skill_events,
                        invalid_skipped=summary.invalid_skipped,
                        stopped_reason=summary.stopped_reason,
                        last_error=summary.error,
                    )
                )
        except Exception as exc:
            log.error("could not record the end of docsync run %s: %s", summary.run_id, exc)


def parse_interval(text: str) -> float:
    """'30s', '15m', '6h' or '1d' in seconds. A unit is required: a bare '6' meant six
    seconds to the code and six hours to the person who typed it."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    cleaned = text.strip().lower()
    if cleaned[-1:] not in units:
        raise ValueError(f"give the interval with a unit: {text!r} is not one of e.g. 30s, 15m, 6h, 1d")
    try:
        value = float(cleaned[:-1]) * units[cleaned[-1]]
    except ValueError as exc:
        raise ValueError(f"not an interval: {text!r} (e.g. 30s, 15m, 6h, 1d)") from exc
    if not value > 0 or value == float("inf"):
        raise ValueError(f"the interval must be positive and finite: {text!r}")
    return value


def run(
    settings: Settings,
    budget: DrainBudget,
    *,
    every: float | None,
    emit: Callable[[DrainSummary], Any],
    metrics_host: str = METRICS_HOST,
    metrics_port: int = 0,
    shutdown_budget: float = DEFAULT_BUDGET_S,
    allow_empty_registry: bool = False,
) -> int:
    """One drain (exit status 0; 1 if it failed; 2 if it was refused), or one per `every` seconds until SIGTERM.

    A drain against an empty `skills` table is refused (exit 2, nothing read or
    applied: sinks/docstats.py, EmptyRegistry) unless `allow_empty_registry`.

    SIGTERM stops the reading, lets the chunk being applied commit, leaves the
    rest for the next drain (it reads them again from the fences), and exits
    within `shutdown_budget` seconds, or with status 3 (skillstats/shutdown.py).

    With `every`, the process is long-running: until Kafka and the database
    answer it waits (a line per attempt, /readyz 503), and metrics are served.
    A single drain serves none (a CronJob's pod lives too briefly to be scraped:
    the lag-exporter reports the last successful run from SQL instead).
    """
    # SIGTERM and SIGINT are taken by a thread of their own (sigwait), not by a Python
    # signal handler: those run in the main thread only between bytecodes, so a main
    # thread blocked inside the database driver (a lock wait) would hold off the
    # shutdown watchdog itself. Blocked first, so every thread started later inherits it.
    stopping = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stopping)
    stop = threading.Event()
    watchdog = ShutdownWatchdog("docsync", shutdown_budget)

    def on_signals() -> None:
        while True:
            signal.sigwait(stopping)
            stop.set()
            watchdog.start()

    # Listening before anything can block (opening the database at start-up included).
    threading.Thread(target=on_signals, name="docsync-signals", daemon=True).start()
    if NATIVE_MISSING:
        log.warning("%s", NATIVE_MISSING)
    last: list[DrainSummary] = []
    starting = Starting("docsync")
    if every is not None and metrics_port:
        serve(metrics_host, metrics_port, Probes(starting.live, starting.ready))
    engine = None
    if every is not None:
        try:
            ready = wait_for_dependencies(settings, DOCSYNC, settings.docsync_group, starting, stop)
        except REFUSALS as exc:
            print(f"skillstats docsync: {exc}", file=sys.stderr)
            return 2
        if ready is None:
            return 0
        engine = ready[0]
    sync = DocSync(settings, budget, stop, engine, allow_empty_registry=allow_empty_registry)

    def ready_now() -> str | None:
        if last and not last[-1].ok:
            return f"the last drain failed: {last[-1].error}"
        return None

    starting.delegate(lambda: None, ready_now)
    while True:
        began = time.monotonic()
        summary = sync.drain()
        last[:] = [summary]
        drain_finished(
            settings.docsync_group,
            summary.stopped_reason,
            summary.duration_seconds,
            summary.applied_kinds,
            summary.invalid_reasons,
            summary.unknown_skill_events,
            {skills.name: summary.skills_updated, user_skill_stats.name: summary.owners_updated},
        )
        if summary.held_back or summary.ok:
            # Replaced by each drain that got to apply (a drain failing before that knows nothing new).
            docsync_held(settings.docsync_group, {h.partition: h.offset for h in summary.held_back})
        emit(summary)
        if summary.refused:
            return 2
        if every is None or sync.stop.is_set():
            return 0 if summary.ok else 1
        if sync.stop.wait(max(0.0, every - (time.monotonic() - began))):
            return 0
