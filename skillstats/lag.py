"""Consumer lag in records and in seconds, for both groups, and the always-on exporter that serves it.

Lag in records is the log end offset minus the group's committed offset. Lag in
seconds is the age of the oldest record the group has not consumed: the record
at its committed offset is READ and its timestamp taken. Interpolating a time
from offset rates (what kafka-lag-exporter does) invents an age that no record
has, wrong exactly when it matters: after a burst, or when the stream stops.
Reading costs one small fetch per partition with lag per scrape interval; the
exporter caches it, so scrapes stay cheap whatever Prometheus' cadence.

Both groups are measured from outside, not by the consumers: the docsync group
has no members between runs (a CronJob), so only an always-on exporter sees
how old its backlog is getting. A group's position is its SQL fence, where it
reads from (docs/contract.md): Kafka's committed offset only stands in while
the database cannot be read. Both groups commit to Kafka up to their fences
after each SQL commit, but a commit can trail (one that timed out is retried
only when the partition gets new records) or run ahead (a database restored
from a backup, an admin's offset reset), and neither is where the group reads.

Where the group has no fence for a partition it starts at the log's start, so
that is where its lag is measured from; a missing committed offset is reported
as missing, never as -1. A fence below the log start means retention deleted
records the group never applied (`records_lost_to_retention`); the oldest
record it can still read is at the log start. Offsets already passed that way
are counted in SQL (`skillstats_consumer_offsets_lost_total`), and whether the
topic is still the one the counts belong to (its Kafka id against the one the
database recorded, sinks/identity.py) is `skillstats_topic_identity_mismatch`.

A building rebuild's group (`skillstats rebuild start`) is measured beside
them, with role `rebuild`: the database says which group that is, so its series
appear from the measurement after the database thread read it, and go at the
swap or drop. Its lag starts at the day it recomputes from, by design as old as
the retention it reads: SkillstatsRetentionNear leaves that role out, while
records lost to retention under it still alert (its swap would refuse them).

A record at the committed offset may be a transaction marker or part of an
aborted transaction; the read is read_committed like the groups, so the oldest
record measured is the oldest the group would be handed. When nothing
deliverable is left (only markers) the lag in seconds is 0. An open
transaction holds a read_committed consumer at its first record, and every
record after it waits too: that first record, read uncommitted, is the age.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import (
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    ConsumerGroupTopicPartitions,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, ConfigResource, OffsetSpec, ResourceType
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.exc import OperationalError, ProgrammingError

from skillstats.config import FIRST_ANSWER_S, Settings, redact_url
from skillstats.kafka import KafkaRefused, RefusalWatch, TopicIds, TopicMissing, cluster_metadata, while_moving
from skillstats.rebuild.state import building
from skillstats.sinks.fences import PartitionFences
from skillstats.sinks.identity import DOCSYNC, REBUILD, WINDOWS, Owner, owners  # the `role` label: rules match roles
from skillstats.sinks.recovery import describe
from skillstats.sinks.schema import docsync_runs, rebuilds

log = logging.getLogger(__name__)


@dataclass
class TopicOffsets:
    name: str
    partitions: dict[int, tuple[int, int]]  # partition -> (log start offset, log end offset)
    retention_ms: int | None  # None: no time retention


@dataclass
class PartitionLag:
    partition: int
    log_start: int
    log_end: int
    committed: int | None  # Kafka's committed offset; None: the group never committed this partition
    applied: int | None  # the group's SQL fence (next offset not applied), when the database was read
    lag_records: int
    oldest_pending_ms: int | None  # Kafka timestamp of the oldest unconsumed record; None if none or unknown
    lag_seconds: float | None  # None: unknown (the record could not be read in time)

    @property
    def lost_to_retention(self) -> int:
        """Offsets retention deleted before the group applied them (0 when none, or when it never started)."""
        position = self.applied if self.applied is not None else self.committed
        return max(0, self.log_start - position) if position is not None else 0


@dataclass
class GroupLag:
    group: str
    role: str
    state: str  # Kafka's group state: STABLE, EMPTY, PREPARING_REBALANCE, DEAD (never seen), ...
    members: int
    partitions: list[PartitionLag] = field(default_factory=list)

    @property
    def lag_records(self) -> int:
        return sum(p.lag_records for p in self.partitions)

    @property
    def lag_seconds(self) -> float | None:
        known = [p.lag_seconds for p in self.partitions if p.lag_seconds is not None]
        return max(known, default=0.0) if len(known) == len(self.partitions) else None


@dataclass
class LagSnapshot:
    measured_at: float  # epoch seconds
    topic: TopicOffsets
    dlq: TopicOffsets | None
    groups: list[GroupLag]
    topic_id: str | None = None  # the events topic's Kafka id now


NOTHING_PENDING = -1  # oldest_pending: the partition has no record to hand over from there


class LagProbe:
    """Long-lived Kafka clients that measure lag; every call bounded by `timeout` seconds."""

    def __init__(self, settings: Settings, timeout: float = FIRST_ANSWER_S) -> None:
        self.settings = settings
        self.timeout = timeout
        self.refusals = RefusalWatch()
        self.admin = AdminClient(settings.kafka_config(error_cb=self.refusals))
        self.topic_ids = TopicIds(settings, timeout)
        # Assign-only readers (never subscribe, never commit): they join no group. One
        # reads what the groups are handed; the other looks past an open transaction.
        # Made at first use: closing a consumer that never reached a broker takes
        # seconds, which a command told a wrong address should not spend.
        self._readers: dict[str, Consumer] = {}

    @property
    def reader(self) -> Consumer:
        """What the groups are handed (read_committed)."""
        return self._reader("read_committed")

    @property
    def uncommitted_reader(self) -> Consumer:
        """What lies past an open transaction (read_uncommitted)."""
        return self._reader("read_uncommitted")

    def _reader(self, isolation: str) -> Consumer:
        if isolation not in self._readers:
            self._readers[isolation] = self._new_reader(isolation)
        return self._readers[isolation]

    def _new_reader(self, isolation: str) -> Consumer:
        return Consumer(
            self.settings.kafka_config(
                **{
                    "group.id": "skillstats-lag-probe",
                    "enable.auto.commit": False,
                    "enable.partition.eof": True,
                    "isolation.level": isolation,
                    # Retention may delete the record between listing and reading: then
                    # the oldest is the new log start, not the end.
                    "auto.offset.reset": "earliest",
                    "max.partition.fetch.bytes": 65536,
                    "fetch.max.bytes": 1048576,
                    "queued.max.messages.kbytes": 1024,
                }
            )
        )

    def close(self) -> None:
        for consumer in self._readers.values():
            consumer.close()
        self._readers.clear()

    def measure(
        self, groups: Iterable[tuple[str, str]], applied: Mapping[str, Mapping[int, int]] | None = None
    ) -> LagSnapshot:
        """Both topics and every group; `applied`: group -> its SQL fences, where known."""
        now = time.time()
        topic = self.topic_offsets(self.settings.topic)
        try:
            dlq: TopicOffsets | None = self.topic_offsets(self.settings.dlq_topic, retention=False)
        except LookupError:
            dlq = None
        seen: dict[tuple[int, int], int] = {}  # (partition, position) -> oldest pending, across groups
        measured = [self.group_lag(group, role, topic, now, seen, (applied or {}).get(group)) for group, role in groups]
        return LagSnapshot(now, topic, dlq, measured, self.topic_ids.get(self.settings.topic))

    def topic_offsets(self, name: str, *, retention: bool = True) -> TopicOffsets:
        metadata = cluster_metadata(self.admin, self.refusals, self.settings, self.timeout, name).topics.get(name)
        if metadata is None or metadata.error is not None:
            raise TopicMissing(self.settings, name)
        partitions = sorted(metadata.partitions)
        starts = self._list_offsets(name, partitions, OffsetSpec.earliest())
        ends = self._list_offsets(name, partitions, OffsetSpec.latest())
        return TopicOffsets(
            name, {p: (starts[p], ends[p]) for p in partitions}, self._retention_ms(name) if retention else None
        )

    def _list_offsets(self, topic: str, partitions: list[int], spec: OffsetSpec) -> dict[int, int]:
        def ask() -> dict[int, int]:
            futures = self.admin.list_offsets(
                {TopicPartition(topic, p): spec for p in partitions}, request_timeout=self.timeout
            )
            return {tp.partition: future.result(self.timeout).offset for tp, future in futures.items()}

        return while_moving(ask, self.timeout)

    def _retention_ms(self, topic: str) -> int | None:
        resource = ConfigResource(ResourceType.TOPIC, topic)
        configs = self.admin.describe_configs([resource], request_timeout=self.timeout)[resource].result(self.timeout)
        entry = configs.get("retention.ms")
        value = int(entry.value) if entry is not None and entry.value is not None else -1
        return value if value >= 0 else None

    def group_lag(
        self,
        group: str,
        role: str,
        topic: TopicOffsets,
        now: float,
        seen: dict[tuple[int, int], int],
        applied: Mapping[int, int] | None = None,
    ) -> GroupLag:
        try:
            description = while_moving(
                lambda: self.admin.describe_consumer_groups([group], request_timeout=self.timeout)[group].result(
                    self.timeout
                ),
                self.timeout,
            )
            state = description.state.name if description.state is not None else "UNKNOWN"
            members = len(description.members)
        except KafkaException as exc:  # a group that never existed is "dead", not an outage
            if not exc.args or exc.args[0].code() != KafkaError.GROUP_ID_NOT_FOUND:
                raise
            state, members = "DEAD", 0
        committed = self._committed(group, topic)
        positions: dict[int, int] = {}
        result = GroupLag(group, role, state, members)
        for partition, (start, end) in sorted(topic.partitions.items()):
            at = committed.get(partition)
            fence = applied.get(partition) if applied is not None else None
            # The fence is where the group reads from; without the database, the commit
            # stands in (it follows the fence, and trails or leads it only for a while).
            if applied is not None:
                known: int | None = fence
            else:
                known = at
            position = min(max(known if known is not None else start, start), end)
            positions[partition] = position
            result.partitions.append(PartitionLag(partition, start, end, at, fence, end - position, None, 0.0))
        wanted = {p: o for p, o in positions.items() if o < topic.partitions[p][1] and (p, o) not in seen}
        ends = {p: topic.partitions[p][1] for p in wanted}
        seen.update({(p, wanted[p]): ts for p, ts in self.oldest_pending(topic.name, wanted, ends).items()})
        for lag in result.partitions:
            if lag.lag_records == 0:
                continue
            oldest = seen.get((lag.partition, positions[lag.partition]))
            if oldest is None:
                lag.lag_seconds = None  # not read in time, or no timestamp: unknown, not zero
            elif oldest != NOTHING_PENDING:
                lag.oldest_pending_ms = oldest
                lag.lag_seconds = max(0.0, now - oldest / 1000)
        return result

    def _committed(self, group: str, topic: TopicOffsets) -> dict[int, int]:
        request = ConsumerGroupTopicPartitions(group, [TopicPartition(topic.name, p) for p in topic.partitions])
        answer = while_moving(
            lambda: self.admin.list_consumer_group_offsets([request], request_timeout=self.timeout)[group].result(
                self.timeout
            ),
            self.timeout,
        )
        return {tp.partition: tp.offset for tp in answer.topic_partitions if tp.offset >= 0 and tp.error is None}

    def oldest_pending(self, topic: str, positions: Mapping[int, int], ends: Mapping[int, int]) -> dict[int, int]:
        """Timestamp (ms) of the oldest record not consumed in each partition, from `positions`.

        NOTHING_PENDING where only transaction markers or aborted records are left
        below `ends`; a partition missing from the result could not be measured in
        time. A read_committed reader stops at the last stable offset: when that is
        below the end, an open transaction holds everything after it back, and its
        first record (read uncommitted) is the oldest the group is waiting for.
        """
        committed_view, stopped = self._first_records(self.reader, topic, positions)
        held = {p: at for p, at in stopped.items() if at < ends[p]}
        open_view, _ = self._first_records(self.uncommitted_reader, topic, {p: positions[p] for p in held})
        found: dict[int, int] = {p: NOTHING_PENDING for p in stopped if p not in held}
        found.update(committed_view)
        found.update({p: ts for p, ts in open_view.items() if p in held})
        return found

    def _first_records(
        self, reader: Consumer, topic: str, positions: Mapping[int, int]
    ) -> tuple[dict[int, int], dict[int, int]]:
        """(partition -> timestamp of the first record from its position, partition -> offset it ended at)."""
        timestamps: dict[int, int] = {}
        ended: dict[int, int] = {}
        if not positions:
            return timestamps, ended
        assignment = [TopicPartition(topic, p, o) for p, o in positions.items()]
        reader.assign(assignment)
        reader.resume(assignment)  # a pause outlives the assignment it was made in
        deadline = time.monotonic() + self.timeout
        done: set[int] = set()
        try:
            while len(done) < len(positions) and time.monotonic() < deadline:
                for message in reader.consume(len(positions), timeout=0.2):
                    partition = message.partition()
                    if partition in done or partition not in positions:
                        continue
                    error = message.error()
                    if error is not None:
                        if error.code() == KafkaError._PARTITION_EOF:
                            ended[partition] = message.offset()
                            done.add(partition)
                            continue
                        raise RuntimeError(f"reading {topic} partition {partition}: {error}")
                    kind, timestamp = message.timestamp()
                    if kind != TIMESTAMP_NOT_AVAILABLE:
                        timestamps[partition] = timestamp
                    done.add(partition)
                    reader.pause([TopicPartition(topic, partition)])
        finally:
            reader.unassign()
        return timestamps, ended


def measure_lag(
    settings: Settings,
    timeout: float = FIRST_ANSWER_S,
    applied: Mapping[str, Mapping[int, int]] | None = None,
    rebuild_group: str | None = None,
) -> LagSnapshot:
    """One measurement of both groups, and of a building rebuild's (what `skillstats status` shows); `applied`:
    group -> SQL fences."""
    probe = LagProbe(settings, timeout)
    try:
        return probe.measure(groups_of(settings, rebuild_group), applied)
    finally:
        probe.close()


def groups_of(settings: Settings, rebuild_group: str | None = None) -> list[tuple[str, str]]:
    """(group, role) of every group measured: the two configured ones, and a building rebuild's when there is one
    (role `rebuild`: its lag starts at the day it recomputes from, so the rules tell it from the live groups)."""
    groups = [(settings.windows_group, WINDOWS), (settings.docsync_group, DOCSYNC)]
    if rebuild_group is not None:
        groups.append((rebuild_group, REBUILD))
    return groups


def rebuild_group(engine: Any, topic: str) -> str | None:
    """The group of the rebuild building from `topic` (skillstats/rebuild/), None when there is none, or when the
    schema has no rebuilds yet (the exporter reads a database its migrations may not have reached)."""
    try:
        rebuild = building(engine)
    except (OperationalError, ProgrammingError) as exc:
        if rebuilds.name not in str(exc):  # SQLite: "no such table: ..."; PostgreSQL: relation "..." does not exist
            raise
        return None
    return rebuild.group_id if rebuild is not None and rebuild.topic == topic else None


def last_docsync_success(engine: Any, group: str) -> datetime | None:
    """When the group's last drain that did not fail finished (UTC), from the runs table."""
    with engine.connect() as connection:
        finished = connection.execute(
            select(func.max(docsync_runs.c.finished_at)).where(
                docsync_runs.c.group_id == group,
                docsync_runs.c.finished_at.is_not(None),
                docsync_runs.c.stopped_reason != "error",
            )
        ).scalar()
    return finished.replace(tzinfo=UTC) if finished is not None else None


# ---------------------------------------------------------------------- the exporter

Family = GaugeMetricFamily | CounterMetricFamily
_G, _C = GaugeMetricFamily, CounterMetricFamily
_PARTITION = ["group", "role", "topic", "partition"]
# name -> (type, help, labels): every metric the exporter serves.
EXPORTED: dict[str, tuple[type[Family], str, list[str]]] = {
    "skillstats_lag_exporter_up": (_G, "1 when the last measurement reached Kafka, 0 when it did not", []),
    "skillstats_lag_exporter_database_up": (_G, "1 when the last read of the database succeeded", []),
    "skillstats_lag_exporter_last_success_timestamp_seconds": (_G, "When Kafka was last measured (0: never)", []),
    "skillstats_lag_exporter_measure_seconds": (_G, "How long the last measurement took", []),
    "skillstats_lag_exporter_measurements": (
        _C,
        "Kafka measurements the exporter made, by result: ok, failed (Kafka unreachable or a request timed out)",
        ["result"],
    ),
    "skillstats_kafka_log_start_offset": (_G, "First offset still in the log", ["topic", "partition"]),
    "skillstats_kafka_log_end_offset": (_G, "Next offset to be written (high watermark)", ["topic", "partition"]),
    "skillstats_kafka_topic_retention_seconds": (_G, "The topic's retention.ms (absent: unlimited)", ["topic"]),
    "skillstats_dlq_records": (_C, "Records ever written to the DLQ topic (sum of its end offsets)", ["topic"]),
    "skillstats_consumer_committed_offset": (_G, "The group's committed offset (absent when it has none)", _PARTITION),
    "skillstats_consumer_has_committed_offset": (_G, "1 when the group committed this partition, else 0", _PARTITION),
    "skillstats_consumer_applied_offset": (_G, "The group's SQL fence: the next offset not applied", _PARTITION),
    "skillstats_consumer_lag_records": (_G, "Records from the group's position to the log end", _PARTITION),
    "skillstats_consumer_lag_seconds": (
        _G,
        "Age of the oldest record the group has not consumed (read, not interpolated); 0 when caught up",
        _PARTITION,
    ),
    "skillstats_consumer_records_lost_to_retention": (
        _G,
        "Offsets between the group's position and the log start: deleted before the group read them",
        _PARTITION,
    ),
    "skillstats_consumer_offsets_lost": (
        _C,
        "Offsets the group's fence was moved over because retention deleted them before they were applied (SQL)",
        _PARTITION,
    ),
    "skillstats_topic_identity_mismatch": (
        _G,
        "1 when the database says the group's tables belong to another group, or to a topic other than this one "
        "(by its Kafka id): its consumers refuse to run (skillstats status says why)",
        ["group", "role", "topic"],
    ),
    "skillstats_consumer_group_members": (_G, "Members of the consumer group", ["group", "role"]),
    "skillstats_consumer_group_state": (_G, "1 for the group's current state", ["group", "role", "state"]),
    "skillstats_docsync_last_success_timestamp_seconds": (
        _G,
        "When the last docsync drain that did not fail finished (from skillstats_docsync_runs)",
        ["group"],
    ),
}


def _families() -> dict[str, Family]:
    return {name: kind(name, text, labels=labels) for name, (kind, text, labels) in EXPORTED.items()}


class LagExporter(Collector):
    """Measures every `interval` seconds in threads; a scrape returns the last measurement.

    Kafka and the database are read by two threads of their own, so a database
    that hangs cannot freeze the lag (and the reverse). A failed measurement
    keeps the last good one served for `keep_for` seconds (three intervals, at
    least a minute): one timed-out request must not make every lag series vanish
    and reset every alert's `for`. Past that, no lag series at all (a stale lag
    would look like the truth), and skillstats_lag_exporter_last_success_timestamp_seconds
    says since when. The lag in seconds is aged at scrape time, so a backlog
    nobody reads keeps getting older between measurements.

    Both threads start at once, whether or not Kafka answers: a broker that is
    away at start is an outage like any other, said once (WARNING) and once when
    it ends, and the database is read meanwhile. Credentials or TLS that Kafka
    refuses are not: no retry cures them, so the first refusal a measurement
    meets sets `refusal` and `stop`, and the command exits 1 with it.
    """

    def __init__(
        self,
        settings: Settings,
        interval: float = 15.0,
        timeout: float = 10.0,
        open_database: Callable[[], Any] | None = None,
    ) -> None:
        self.settings = settings
        self.interval = interval
        self.timeout = timeout
        self.keep_for = max(3 * interval, 60.0)
        self.open_database = open_database
        self.snapshot: LagSnapshot | None = None
        self.kafka_up = False
        self.database_up = False
        self.docsync_success: datetime | None = None
        self.applied: dict[str, dict[int, int]] = {}
        self.lost: dict[str, dict[int, int]] = {}
        self._database_failed = False
        self._kafka_failed_since: float | None = None  # epoch seconds; the outage's first failure
        self._kafka_failures = 0
        self.measurements = {"ok": 0, "failed": 0}
        self.refusal: KafkaRefused | None = None
        self.owners: dict[str, Owner] | None = None
        self.rebuild_group: str | None = None  # a building rebuild's group, as the database last said
        self.last_success = 0.0
        self.measure_seconds = 0.0
        self.loop_beat = time.monotonic()
        self.stop = threading.Event()
        self._probe: LagProbe | None = None
        self._engine: Any = None
        self._threads = [
            threading.Thread(target=self._loop, args=(self.refresh,), name="lag-kafka", daemon=True),
            threading.Thread(target=self._loop, args=(self.read_database,), name="lag-database", daemon=True),
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        self.stop.set()
        for thread in self._threads:
            if thread.is_alive():  # measured by hand (refresh, read_database), never started: nothing to join
                thread.join(self.timeout * 3)
        if self._probe is not None:
            self._probe.close()
        if self._engine is not None:
            self._engine.dispose()

    def live(self) -> str | None:
        """/healthz: Kafka measurements keep completing (each request is bounded, so a wedged one is a bug)."""
        silent = time.monotonic() - self.loop_beat
        limit = self.interval + 20 * self.timeout
        return None if silent < limit else f"no measurement has completed for {silent:.0f}s"

    def _loop(self, step: Callable[[], None]) -> None:
        while not self.stop.is_set():
            began = time.monotonic()
            step()
            self.stop.wait(max(0.0, self.interval - (time.monotonic() - began)))

    def refresh(self) -> None:
        """One Kafka measurement: the first said at INFO; an outage's first failure and its end at WARNING, once
        each, not once per interval."""
        began = time.monotonic()
        try:
            if self._probe is None:
                self._probe = LagProbe(self.settings, self.timeout)
            self.snapshot = self._probe.measure(groups_of(self.settings, self.rebuild_group), self.applied)
            first = self.last_success == 0.0
            self.last_success = time.time()
            where = (self.settings.topic, self.settings.kafka_bootstrap)
            if self._kafka_failed_since is not None:
                log.warning(
                    "measuring lag of %s on %s again, after %.0fs unreachable (%d failed measurement(s))",
                    *where,
                    self.last_success - self._kafka_failed_since,
                    self._kafka_failures,
                )
            elif first:
                log.info("measuring lag of %s on %s", *where)
            self._kafka_failed_since, self._kafka_failures = None, 0
            self.measurements["ok"] += 1
            self.kafka_up = True
        except KafkaRefused as exc:  # credentials or TLS: no retry cures it, the command stops (exit 1)
            self.refusal = exc
            self.kafka_up = False
            self.stop.set()
        except Exception as exc:
            if self._kafka_failed_since is None:
                self._kafka_failed_since = time.time()
                kept = f", the last measurement served until it is {self.keep_for:.0f}s old" if self.snapshot else ""
                log.warning(
                    "cannot measure lag on %s: %s; skillstats_lag_exporter_up 0%s, trying again every %gs",
                    self.settings.kafka_bootstrap,
                    exc,
                    kept,
                    self.interval,
                )
            self._kafka_failures += 1
            self.measurements["failed"] += 1
            self.kafka_up = False
            if self.snapshot is not None and time.time() - self.snapshot.measured_at > self.keep_for:
                self.snapshot = None
            if self._probe is not None:  # fresh clients next time: a wedged one is not reused
                self._probe.close()
                self._probe = None
        self.measure_seconds = time.monotonic() - began
        self.loop_beat = time.monotonic()

    def read_database(self) -> None:
        """The groups' SQL fences, offsets lost, the tables' owners and the last successful docsync run."""
        try:
            if self._engine is None:
                if self.open_database is None:
                    return
                self._engine = self.open_database()
            rebuilding = rebuild_group(self._engine, self.settings.topic)
            groups = groups_of(self.settings, rebuilding)
            fences = {group: PartitionFences(self._engine, group, self.settings.topic).fences() for group, _ in groups}
            self.docsync_success = last_docsync_success(self._engine, self.settings.docsync_group)
            self.lost = {
                group: PartitionFences(self._engine, group, self.settings.topic).offsets_lost() for group, _ in groups
            }
            self.owners = owners(self._engine)
            self.applied = fences
            self.rebuild_group = rebuilding
            if not self.database_up:
                again = " again" if self._database_failed else ""
                level = logging.WARNING if self._database_failed else logging.INFO
                log.log(
                    level, "reading fences and docsync runs from %s%s", redact_url(self.settings.database_url), again
                )
            self.database_up = True
            self._database_failed = False
        except Exception as exc:
            if not self._database_failed:  # the first failure of a streak, once
                log.warning(
                    "cannot read the database %s (fences, docsync runs): %s",
                    redact_url(self.settings.database_url),
                    describe(exc),
                )
            self._database_failed = True
            self.database_up = False

    def describe(self) -> Iterator[Family]:
        return iter(_families().values())

    def collect(self) -> Iterator[Family]:
        f = _families()
        f["skillstats_lag_exporter_up"].add_metric([], 1.0 if self.kafka_up else 0.0)
        f["skillstats_lag_exporter_database_up"].add_metric([], 1.0 if self.database_up else 0.0)
        f["skillstats_lag_exporter_last_success_timestamp_seconds"].add_metric([], self.last_success)
        f["skillstats_lag_exporter_measure_seconds"].add_metric([], self.measure_seconds)
        for result, count in self.measurements.items():
            f["skillstats_lag_exporter_measurements"].add_metric([result], count)
        if self.docsync_success is not None:
            f["skillstats_docsync_last_success_timestamp_seconds"].add_metric(
                [self.settings.docsync_group], self.docsync_success.timestamp()
            )
        snapshot = self.snapshot
        if snapshot is not None:
            for topic in (snapshot.topic, snapshot.dlq):
                if topic is None:
                    continue
                for partition, (start, end) in topic.partitions.items():
                    f["skillstats_kafka_log_start_offset"].add_metric([topic.name, str(partition)], start)
                    f["skillstats_kafka_log_end_offset"].add_metric([topic.name, str(partition)], end)
            if snapshot.topic.retention_ms is not None:
                f["skillstats_kafka_topic_retention_seconds"].add_metric(
                    [snapshot.topic.name], snapshot.topic.retention_ms / 1000
                )
            if snapshot.dlq is not None:
                f["skillstats_dlq_records"].add_metric(
                    [snapshot.dlq.name], sum(end for _start, end in snapshot.dlq.partitions.values())
                )
            now = time.time()
            for group in snapshot.groups:
                owner = self.owners.get(group.role) if self.owners is not None else None
                # A rebuild's group is read from the database: another one there means this measurement is older
                # than the rebuild's swap or drop, not that its tables belong to another group.
                stale = group.role == REBUILD and (owner is None or owner.group_id != group.group)
                if self.owners is not None and snapshot.topic_id is not None and not stale:
                    wrong = owner is not None and (
                        owner.group_id != group.group
                        or owner.topic != snapshot.topic.name
                        or (owner.topic_id is not None and owner.topic_id != snapshot.topic_id)
                    )
                    f["skillstats_topic_identity_mismatch"].add_metric(
                        [group.group, group.role, snapshot.topic.name], 1.0 if wrong else 0.0
                    )
                for partition, offsets in self.lost.get(group.group, {}).items():
                    f["skillstats_consumer_offsets_lost"].add_metric(
                        [group.group, group.role, snapshot.topic.name, str(partition)], offsets
                    )
                f["skillstats_consumer_group_members"].add_metric([group.group, group.role], group.members)
                f["skillstats_consumer_group_state"].add_metric([group.group, group.role, group.state], 1.0)
                for lag in group.partitions:
                    labels = [group.group, group.role, snapshot.topic.name, str(lag.partition)]
                    if lag.committed is not None:
                        f["skillstats_consumer_committed_offset"].add_metric(labels, lag.committed)
                    f["skillstats_consumer_has_committed_offset"].add_metric(labels, float(lag.committed is not None))
                    if lag.applied is not None:
                        f["skillstats_consumer_applied_offset"].add_metric(labels, lag.applied)
                    f["skillstats_consumer_lag_records"].add_metric(labels, lag.lag_records)
                    f["skillstats_consumer_records_lost_to_retention"].add_metric(labels, lag.lost_to_retention)
                    if lag.oldest_pending_ms is not None:
                        age: float | None = max(0.0, now - lag.oldest_pending_ms / 1000)
                    else:
                        age = lag.lag_seconds
                    if age is not None:
                        f["skillstats_consumer_lag_seconds"].add_metric(labels, age)
        return iter(f.values())
