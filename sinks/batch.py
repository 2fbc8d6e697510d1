"""Applying a batch of consumed records behind the fences (docs/contract.md, exactly once).

A batch is folded into per-key deltas and written together with each
partition's next offset in ONE transaction, after the fence rows are locked.

The invariant, for ANY sequence of batches a consumer hands over, in any
order, from any number of writers at once:

    after a transaction commits, partition p's fence is F_p and the counts in
    SQL are the fold of exactly one copy of every record of p with an offset
    below F_p that some writer handed over at or above the fence of its time.

So a record is counted at most once, whatever the batches hold: duplicates,
replays below the fence, one batch holding two spans of a partition (200-299
and then 100-399 after a rebalance seeks back), offsets in any order. Each
record at or above the fence counts once (the first copy of its offset) and the
fence moves to one past the highest offset applied. Offsets the batch skips
over above the fence are taken as absent (retention deleted them, or they are
transaction markers) and logged: the consumer side guarantees it never skips a
record it still holds (pending records of a partition that moves to another
consumer are dropped, and the new owner reads them again from the committed
offset, which is never past the fence; a partition that stays keeps them).
tests/test_sink_properties.py checks the invariant against an independent model
over arbitrary interleavings.

The fold made outside the transaction (while the previous batch commits) is
used only when the batch is in the common shape: each partition's offsets
strictly rising and starting at or above its fence. Anything else is re-folded
inside the transaction from the records that are new.
"""

from __future__ import annotations

import itertools
import logging
import operator
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
from sqlalchemy import Connection

from skillstats.contract import StatEvent
from skillstats.sinks.fences import DlqMark, PartitionFences
from skillstats.sinks.upserts import now_utc_naive

log = logging.getLogger(__name__)


class ConsumedRecord(msgspec.Struct, frozen=True, gc=False):
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
    # Valid events by kind (invalid records count in `applied`/`replayed` only).
    applied_kinds: dict[str, int] = field(default_factory=dict)
    replayed_kinds: dict[str, int] = field(default_factory=dict)
    # Rows each table's upserts wrote (a row touched by two batches counts twice).
    rows_upserted: dict[str, int] = field(default_factory=dict)

    def merge(self, other: ApplyOutcome) -> None:
        self.applied += other.applied
        self.replayed += other.replayed
        self.parked += other.parked
        self.retries += other.retries
        for mine, theirs in (
            (self.applied_kinds, other.applied_kinds),
            (self.replayed_kinds, other.replayed_kinds),
            (self.rows_upserted, other.rows_upserted),
        ):
            for name, count in theirs.items():
                mine[name] = mine.get(name, 0) + count
        for partition, next_offset in other.next_offsets.items():
            self.next_offsets[partition] = max(next_offset, self.next_offsets.get(partition, 0))


class PartitionBatch(msgspec.Struct, frozen=True, gc=False):
    """One partition's records of a batch, in the order they were handed over, as two columns.

    Columns rather than a ConsumedRecord per record: the usual batch is checked
    and folded with a few C-level passes over them (offsets rising, the valid
    events), and the per-record objects are made only when a batch needs the
    record-by-record path (a replay, a repeat, a rejected record).
    """

    partition: int
    offsets: list[int]
    events: list[StatEvent | None]  # None: counts nothing, moves the fence (an invalid record, parked)


def by_partition(records: Sequence[ConsumedRecord]) -> list[PartitionBatch]:
    """Records regrouped per partition, each partition's in the order given (all the fences care about)."""
    parts: dict[int, PartitionBatch] = {}
    for record in records:
        part = parts.get(record.partition)
        if part is None:
            part = parts[record.partition] = PartitionBatch(record.partition, [], [])
        part.offsets.append(record.offset)
        part.events.append(record.event)
    return list(parts.values())


class Prepared:
    """A batch folded ahead of its transaction."""

    __slots__ = ("_records", "count", "end", "folded", "kinds", "lowest", "parts", "rising")

    def __init__(
        self,
        parts: Sequence[PartitionBatch],
        lowest: dict[int, int],
        end: dict[int, int],
        rising: bool,
        folded: Any,
        kinds: dict[str, int],
    ) -> None:
        self.parts = parts
        self.count = sum(len(part.offsets) for part in parts)
        self.lowest = lowest  # partition -> lowest offset in the batch
        self.end = end  # partition -> one past the highest offset in the batch
        self.rising = rising  # every partition's offsets strictly rising in batch order
        self.folded = folded  # the fold of every valid event, when `rising`
        self.kinds = kinds  # valid events by kind
        self._records: list[ConsumedRecord] | None = None

    @property
    def records(self) -> list[ConsumedRecord]:
        """The batch record by record (partition after partition), made on first use."""
        if self._records is None:
            self._records = [
                ConsumedRecord(part.partition, offset, event)
                for part in self.parts
                for offset, event in zip(part.offsets, part.events, strict=True)
            ]
        return self._records


def in_offset_order(records: Sequence[ConsumedRecord]) -> list[ConsumedRecord]:
    """One copy of each (partition, offset), sorted: the canonical form of a batch, for splitting it."""
    unique = {(r.partition, r.offset): r for r in reversed(records)}  # the first copy wins
    return [unique[key] for key in sorted(unique)]


class FencedSink(PartitionFences, ABC):
    """Applies batches of consumed records behind the fences."""

    @abstractmethod
    def fold(self, events: list[StatEvent]) -> Any:
        """Reduce events to per-row deltas (no I/O: it may run outside the transaction)."""

    @abstractmethod
    def write(self, connection: Connection, folded: Any, now: datetime) -> dict[str, int]:
        """Add what `fold` made to the sink's tables, inside the batch's transaction; rows written per table."""

    def prepare(self, batch: Sequence[ConsumedRecord] | Sequence[PartitionBatch]) -> Prepared:
        """Fold a batch ahead of its transaction (in another thread, while the previous one commits).

        Takes records or per-partition columns; a partition may appear in several
        PartitionBatch entries, and its offsets may come in any order: only a batch
        whose every partition's offsets strictly rise is folded here (the usual case),
        any other is folded in the transaction from what is new (`apply`).
        """
        parts = batch if batch and isinstance(batch[0], PartitionBatch) else by_partition(batch)  # type: ignore[arg-type]
        lowest: dict[int, int] = {}
        end: dict[int, int] = {}
        rising = True
        valid: list[StatEvent] = []
        for part in parts:
            offsets = part.offsets
            if len(part.events) != len(offsets):
                raise ValueError(f"partition {part.partition}: {len(offsets)} offsets but {len(part.events)} events")
            if not offsets:
                continue
            partition = part.partition
            low, high = min(offsets), max(offsets)
            if rising and (
                not all(map(operator.lt, offsets, itertools.islice(offsets, 1, None)))
                or (partition in end and offsets[0] < end[partition])
            ):
                rising = False
            lowest[partition] = min(low, lowest.get(partition, low))
            end[partition] = max(high + 1, end.get(partition, 0))
            valid.extend(filter(None, part.events))
        kinds = dict(Counter(map(operator.attrgetter("kind"), valid)))
        return Prepared(parts, lowest, end, rising, self.fold(valid) if rising else None, kinds)

    def apply(
        self,
        batch: Sequence[ConsumedRecord] | Sequence[PartitionBatch] | Prepared,
        dlq_marks: Mapping[int, tuple[DlqMark | None, DlqMark]] | None = None,
    ) -> ApplyOutcome:
        """Apply one batch in one transaction; a record below its fence, or seen before in the batch, is skipped."""
        prepared = batch if isinstance(batch, Prepared) else self.prepare(batch)
        outcome = ApplyOutcome()
        if not prepared.count and not dlq_marks:
            return outcome
        now = now_utc_naive()
        with self.engine.begin() as connection:
            locked = self.lock(connection, [*prepared.end, *(dlq_marks or ())], now)
            fences = {p: row.next_offset for p, row in locked.items()}
            if prepared.rising and all(low >= fences[p] for p, low in prepared.lowest.items()):
                # The usual case: nothing in the batch was applied before and nothing
                # repeats, so the fold made outside the transaction is the one to write.
                folded = prepared.folded
                advanced = dict(prepared.end)
                outcome.applied = prepared.count
                outcome.applied_kinds = dict(prepared.kinds)
                fresh_lowest = prepared.lowest
            else:
                fresh: list[StatEvent] = []
                seen: set[tuple[int, int]] = set()
                advanced = {}
                fresh_lowest = {}
                for record in prepared.records:
                    key = (record.partition, record.offset)
                    event = record.event
                    if record.offset < fences[record.partition] or key in seen:
                        outcome.replayed += 1
                        if event is not None:
                            replayed = outcome.replayed_kinds
                            replayed[event.kind] = replayed.get(event.kind, 0) + 1
                        continue
                    seen.add(key)
                    outcome.applied += 1
                    p = record.partition
                    advanced[p] = max(advanced.get(p, 0), record.offset + 1)
                    fresh_lowest[p] = min(fresh_lowest.get(p, record.offset), record.offset)
                    if event is not None:
                        fresh.append(event)
                        applied = outcome.applied_kinds
                        applied[event.kind] = applied.get(event.kind, 0) + 1
                folded = self.fold(fresh)
            for partition, low in fresh_lowest.items():
                if low > fences[partition]:
                    log.warning(
                        "%s partition %d: offsets %d..%d were never handed to %s (deleted by retention, or "
                        "transaction markers)",
                        self.topic,
                        partition,
                        fences[partition],
                        low - 1,
                        self.group_id,
                    )
            outcome.rows_upserted = self.write(connection, folded, now)
            self.advance(connection, locked, advanced, now, dlq_marks)
        outcome.next_offsets = {p: max(fences[p], advanced.get(p, 0)) for p in fences}
        return outcome
