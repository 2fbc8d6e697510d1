"""The fenced transactional apply (SPEC §5) and its failure handling (SPEC §6).

A batch of consumed records is folded into per-key deltas and written together
with each partition's next offset in ONE transaction. The fence rows are locked
first, and a record below its partition's fence is skipped, so a batch that is
replayed (after a crash, a rebalance, or a second consumer reading the same
partition during one) counts nothing twice whichever order the writers commit
in. Kafka's committed offset is only ever a hint for where to resume reading.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, Table, and_, bindparam, select, update
from sqlalchemy.dialects import postgresql, sqlite

from skillstats.contract import EFFECTS, MS_PER_DAY, MS_PER_HOUR, StatEvent
from skillstats.retry import Backoff
from skillstats.sinks.db import is_transient
from skillstats.sinks.schema import partition_fences, skill_daily_stats, skill_hourly_stats

log = logging.getLogger(__name__)
_EPOCH = datetime(1970, 1, 1)
# Rows per multi-row upsert statement: well under SQLite's 32766 bound variables.
_UPSERT_CHUNK = 2000


@dataclass(frozen=True, slots=True)
class ConsumedRecord:
    """One consumed record reduced to what a sink needs.

    `event` is None for a record that counts nothing but must still move the fence
    past it: an invalid record already parked in the DLQ.
    """

    partition: int
    offset: int
    event: StatEvent | None


@dataclass(slots=True)
class ApplyOutcome:
    applied: int = 0
    replayed: int = 0
    parked: int = 0
    retries: int = 0
    next_offsets: dict[int, int] = field(default_factory=dict)

    def merge(self, other: ApplyOutcome) -> None:
        self.applied += other.applied
        self.replayed += other.replayed
        self.parked += other.parked
        self.retries += other.retries
        self.next_offsets.update(other.next_offsets)


def utc_naive(ms: int) -> datetime:
    """Event-time milliseconds as the naive-UTC datetime the schema stores."""
    return _EPOCH + timedelta(milliseconds=ms)


def now_utc_naive() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def upsert_adding(
    connection: Connection, table: Table, keys: Sequence[str], rows: list[dict[str, Any]], touched: str
) -> None:
    """INSERT ... ON CONFLICT DO UPDATE adding each non-key, non-`touched` column.

    Rows are written in key order: two transactions touching overlapping rows then
    lock them in the same order and cannot deadlock each other.
    """
    if not rows:
        return
    dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
    statement = dialect.insert(table)
    counters = [name for name in rows[0] if name not in keys and name != touched]
    statement = statement.on_conflict_do_update(
        index_elements=list(keys),
        set_={
            **{name: table.c[name] + statement.excluded[name] for name in counters},
            touched: statement.excluded[touched],
        },
    )
    rows.sort(key=lambda row: tuple(row[k] for k in keys))
    for start in range(0, len(rows), _UPSERT_CHUNK):
        connection.execute(statement, rows[start : start + _UPSERT_CHUNK])


class FencedSink(ABC):
    """Applies batches for one consumer group and topic behind per-partition fences."""

    def __init__(self, engine: Engine, group_id: str, topic: str) -> None:
        self.engine = engine
        self.group_id = group_id
        self.topic = topic

    @abstractmethod
    def write(self, connection: Connection, events: list[StatEvent], now: datetime) -> None:
        """Fold `events` (all new to this group) into the sink's tables."""

    def fences(self) -> dict[int, int]:
        """Next offset to apply, per partition this group has written."""
        with self.engine.connect() as connection:
            rows = connection.execute(
                select(partition_fences.c.partition, partition_fences.c.next_offset).where(self._mine())
            )
            return {partition: next_offset for partition, next_offset in rows}

    def _mine(self) -> Any:
        return and_(partition_fences.c.group_id == self.group_id, partition_fences.c.topic == self.topic)

    def _lock_fences(self, connection: Connection, partitions: Iterable[int], now: datetime) -> dict[int, int]:
        wanted = sorted(set(partitions))
        dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
        connection.execute(
            dialect.insert(partition_fences).on_conflict_do_nothing(),
            [
                {"group_id": self.group_id, "topic": self.topic, "partition": p, "next_offset": 0, "updated_at": now}
                for p in wanted
            ],
        )
        rows = connection.execute(
            select(partition_fences.c.partition, partition_fences.c.next_offset)
            .where(self._mine(), partition_fences.c.partition.in_(wanted))
            .order_by(partition_fences.c.partition)
            .with_for_update()
        )
        return {partition: next_offset for partition, next_offset in rows}

    def apply(self, records: Sequence[ConsumedRecord]) -> ApplyOutcome:
        """Apply one batch in one transaction; records at or below a fence are skipped."""
        outcome = ApplyOutcome()
        if not records:
            return outcome
        now = now_utc_naive()
        with self.engine.begin() as connection:
            fences = self._lock_fences(connection, (r.partition for r in records), now)
            fresh: list[StatEvent] = []
            advanced: dict[int, int] = {}
            for record in records:
                fence = advanced.get(record.partition, fences[record.partition])
                if record.offset < fence:
                    outcome.replayed += 1
                    continue
                if record.offset > fence and record.partition not in advanced:
                    log.warning(
                        "partition %d: offsets %d..%d were never applied by %s (deleted by retention?)",
                        record.partition,
                        fence,
                        record.offset - 1,
                        self.group_id,
                    )
                advanced[record.partition] = record.offset + 1
                outcome.applied += 1
                if record.event is not None:
                    fresh.append(record.event)
            self.write(connection, fresh, now)
            if advanced:
                connection.execute(
                    update(partition_fences)
                    .where(self._mine(), partition_fences.c.partition == bindparam("p"))
                    .values(next_offset=bindparam("n"), updated_at=now),
                    [{"p": p, "n": n} for p, n in sorted(advanced.items())],
                )
        outcome.next_offsets = {**fences, **advanced}
        return outcome


class WindowsSink(FencedSink):
    """Per-(skill, UTC hour) and per-(skill, UTC day) counts by event time."""

    def write(self, connection: Connection, events: list[StatEvent], now: datetime) -> None:
        hourly: dict[tuple[str, int], list[int]] = {}
        daily: dict[tuple[str, int], list[int]] = {}
        for event in events:
            effect = EFFECTS[event.kind]
            if not effect.touches_windows:
                continue
            at = event.occurred_at
            for buckets, start in ((hourly, at - at % MS_PER_HOUR), (daily, at - at % MS_PER_DAY)):
                counts = buckets.get((event.skill_id, start))
                if counts is None:
                    buckets[(event.skill_id, start)] = [effect.window_downloads, effect.window_installs]
                else:
                    counts[0] += effect.window_downloads
                    counts[1] += effect.window_installs
        upsert_adding(
            connection,
            skill_hourly_stats,
            ("skill_id", "hour"),
            [
                {"skill_id": s, "hour": utc_naive(h), "downloads": d, "installs": i, "updated_at": now}
                for (s, h), (d, i) in hourly.items()
            ],
            "updated_at",
        )
        upsert_adding(
            connection,
            skill_daily_stats,
            ("skill_id", "day"),
            [
                {"skill_id": s, "day": utc_naive(day).date(), "downloads": d, "installs": i, "updated_at": now}
                for (s, day), (d, i) in daily.items()
            ],
            "updated_at",
        )


class Abandoned(RuntimeError):
    """Shutdown was requested while a batch was waiting to be retried; nothing of it is applied."""


ParkRejected = Callable[[ConsumedRecord, BaseException], None]


def apply_with_recovery(
    sink: FencedSink,
    records: Sequence[ConsumedRecord],
    park_rejected: ParkRejected,
    *,
    stop: threading.Event | None = None,
    backoff: Backoff | None = None,
    max_transient_retries: int | None = None,
) -> ApplyOutcome:
    """Apply a batch so that nothing is dropped and nothing is stuck (SPEC §6).

    Transient errors are retried with capped backoff (forever, unless bounded by
    `max_transient_retries`, or until `stop` is set). A batch the database rejects
    is halved until the offending record is alone; that record is handed to
    `park_rejected` (which must not return before it is safely parked) and the
    fence is moved past it.
    """
    backoff = backoff or Backoff()
    outcome = ApplyOutcome()
    pending: list[Sequence[ConsumedRecord]] = [records]
    attempt = 0
    while pending:
        chunk = pending.pop()
        try:
            outcome.merge(sink.apply(chunk))
            attempt = 0
        except Exception as exc:
            if is_transient(exc):
                if max_transient_retries is not None and attempt >= max_transient_retries:
                    raise
                log.warning("transient database error, retry %d: %s", attempt + 1, exc)
                outcome.retries += 1
                pending.append(chunk)
                if backoff.sleep(attempt, stop):
                    raise Abandoned("shutdown while retrying a batch") from exc
                attempt += 1
                continue
            if len(chunk) == 1:
                log.error(
                    "database rejected %s partition %d offset %d: %s",
                    sink.topic,
                    chunk[0].partition,
                    chunk[0].offset,
                    exc,
                )
                park_rejected(chunk[0], exc)
                outcome.parked += 1
                pending.append([ConsumedRecord(chunk[0].partition, chunk[0].offset, None)])
                continue
            # Halve in offset order: the first half holds the lower offsets of every
            # partition, so each half still advances its fences contiguously.
            middle = len(chunk) // 2
            pending.append(chunk[middle:])
            pending.append(chunk[:middle])
    return outcome
