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
fence moves to one past the highest offset applied.

And no record is jumped over: each partition's records come with `since`, the
offset the consumer's read of them started from (the fence it was positioned
at, or where its previous batch ended): it handed over every record it could
deliver from `since` on. Offsets missing above the fence are then absent from
the log as read (transaction markers, aborted records under read_committed)
and counted (`ApplyOutcome.undelivered`). A partition whose records do not
cover the offsets from its fence (the read started above it) is not applied at
all: the fence stays, and the partition is reported `behind` (fence, since) so
the consumer reads it again from the fence. That is what a database gone back
in time looks like from here (a restored backup, a failover to a replica that
lost its tail), and also a position taken from anywhere but the fence (Kafka's
committed offset, an admin's offset reset). Only the consumer may move a fence
over offsets it never read, explicitly, when retention deleted them
(`PartitionFences.begin_reading`). tests/test_sink_properties.py checks the
invariant against an independent model over arbitrary interleavings, positions
and restores.

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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import msgspec
from sqlalchemy import Connection

from skillstats.contract import StatEvent, decode_many
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
    # Offsets the fences moved over that held no record the consumer was handed
    # (transaction markers, aborted records): legitimate, counted, not logged.
    undelivered: int = 0
    # Partitions not applied because their records' read started above the fence:
    # partition -> (the fence, the offset the read started at). Read again from the fence.
    behind: dict[int, tuple[int, int]] = field(default_factory=dict)
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
        self.undelivered += other.undelivered
        self.behind.update(other.behind)
        for mine, theirs in (
            (self.applied_kinds, other.applied_kinds),
            (self.replayed_kinds, other.replayed_kinds),
            (self.rows_upserted, other.rows_upserted),
        ):
            for name, count in theirs.items():
                mine[name] = mine.get(name, 0) + count
        for partition, next_offset in other.next_offsets.items():
            self.next_offsets[partition] = max(next_offset, self.next_offsets.get(partition, 0))


class DecodedOnUse(Sequence["StatEvent | None"]):
    """A partition's events as `decode_many` makes them from its records, decoded on first use.

    What a fold that read the records themselves leaves in a PartitionBatch
    (`FencedSink.fold_at_decode`): the usual batch never asks for its events,
    so none is built; the record-by-record paths (a replay, a repeat, a
    rejected record, a batch folded again without a revoked partition) ask,
    and get the very events a decode of the same records gives, since a
    record's verdict is a function of the record alone. The columns are the
    batch's own, which nothing changes once it is handed over.
    """

    __slots__ = ("_events", "_keys", "_length", "_timestamps", "_values")

    def __init__(
        self, keys: Sequence[bytes | None], values: Sequence[bytes | None], timestamps: Sequence[int | None]
    ) -> None:
        if not len(keys) == len(values) == len(timestamps):
            raise ValueError("keys, values and timestamps must be of one length")
        self._keys, self._values, self._timestamps = keys, values, timestamps
        self._length = len(keys)
        self._events: list[StatEvent | None] | None = None

    @property
    def events(self) -> list[StatEvent | None]:
        if self._events is None:
            if not len(self._keys) == len(self._values) == len(self._timestamps) == self._length:
                raise RuntimeError("a batch's record columns changed after they were handed over")
            self._events = decode_many(self._keys, self._values, self._timestamps)[0]
        return self._events

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: Any) -> Any:
        return self.events[index]

    def __iter__(self) -> Iterator[StatEvent | None]:
        return iter(self.events)


class PartitionBatch(msgspec.Struct, frozen=True, gc=False):
    """One partition's records of a batch, in the order they were handed over, as two columns.

    Columns rather than a ConsumedRecord per record: the usual batch is checked
    and folded with a few C-level passes over them (offsets rising, the valid
    events), and the per-record objects are made only when a batch needs the
    record-by-record path (a replay, a repeat, a rejected record).

    `since` is where the read that handed these records over started: every
    record the log could deliver from `since` up to the last offset here is here
    (or in an earlier entry of the same read). `until` extends that claim past
    the last offset (an entry cut out of a longer read, see split_in_two); by
    default the claim ends one past the last offset. See the module docstring.
    """

    partition: int
    offsets: list[int]
    # None: counts nothing, moves the fence (an invalid record, parked); a list, or DecodedOnUse
    events: Sequence[StatEvent | None]
    since: int
    until: int | None = None

    def covers_to(self) -> int:
        """One past the last offset this entry's read vouches for (an entry may vouch with no records left)."""
        last = max(self.offsets) + 1 if self.offsets else self.since
        return last if self.until is None else max(last, self.until)


def by_partition(records: Sequence[ConsumedRecord], since: Mapping[int, int] | None = None) -> list[PartitionBatch]:
    """Records regrouped per partition, each partition's in the order given (all the fences care about).

    `since`: per partition, where the read of its records started; by default its
    lowest offset here (the records claim nothing about the offsets below them).
    """
    parts: dict[int, tuple[list[int], list[StatEvent | None]]] = {}
    for record in records:
        columns = parts.get(record.partition)
        if columns is None:
            columns = parts[record.partition] = ([], [])
        columns[0].append(record.offset)
        columns[1].append(record.event)
    return [
        PartitionBatch(p, offsets, events, (since or {}).get(p, min(offsets))) for p, (offsets, events) in parts.items()
    ]


class Prepared:
    """A batch folded ahead of its transaction."""

    __slots__ = ("_records", "count", "counts", "end", "folded", "kinds", "lowest", "parts", "reads", "rising")

    def __init__(
        self,
        parts: Sequence[PartitionBatch],
        lowest: dict[int, int],
        end: dict[int, int],
        rising: bool,
        folded: Any,
        kinds: dict[str, int],
        reads: dict[int, list[tuple[int, int]]],
        counts: dict[int, int],
    ) -> None:
        self.parts = parts
        self.count = sum(len(part.offsets) for part in parts)
        self.lowest = lowest  # partition -> lowest offset in the batch
        self.end = end  # partition -> one past the highest offset the batch's reads vouch for
        self.rising = rising  # every partition's offsets strictly rising in batch order
        self.folded = folded  # the fold of every valid event, when `rising`
        self.kinds = kinds  # valid events by kind
        self.reads = reads  # partition -> [since, end) of each entry, sorted: what the reads covered
        self.counts = counts  # partition -> records in the batch
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

    def covered_from(self, partition: int, fence: int) -> bool:
        """Whether the reads of `partition` cover every offset from `fence` to the batch's end (no hole)."""
        reach = fence
        for since, end in self.reads[partition]:  # sorted by since
            if since > reach:
                return False
            reach = max(reach, end)
        return True

    def since(self, partition: int) -> int:
        return self.reads[partition][0][0]


def canonical(parts: Sequence[PartitionBatch]) -> list[PartitionBatch]:
    """Each entry's records in offset order, one copy of each (partition, offset) (the first wins), entries that
    end up empty left out: the form a batch is split in. Each entry keeps what it covered (`until`), so the
    batch claims neither more nor less than before."""
    seen: set[tuple[int, int]] = set()
    result = []
    for part in parts:
        kept = {}
        for offset, event in zip(part.offsets, part.events, strict=True):
            if (part.partition, offset) not in seen and offset not in kept:
                kept[offset] = event
        seen.update((part.partition, offset) for offset in kept)
        if kept or part.covers_to() > part.since:
            offsets = sorted(kept)
            events = [kept[o] for o in offsets]
            result.append(PartitionBatch(part.partition, offsets, events, part.since, part.covers_to()))
    return result


def split_in_two(parts: Sequence[PartitionBatch]) -> tuple[list[PartitionBatch], list[PartitionBatch]]:
    """A canonical batch cut in two at its middle record in (partition, offset) order: applied lower half first,
    each partition's fence moves only over what is in SQL.

    The entries of the partition the cut falls in are cut at c, one past that
    partition's last record in the lower half: the lower pieces keep their `since`
    and cover up to c at most, the upper ones start covering at max(since, c), so
    the two halves together claim to cover exactly what the batch did, and no
    more. A piece may be left with no records and still vouch for its offsets.
    """
    keys = sorted((part.partition, offset) for part in parts for offset in part.offsets)
    cut_partition, cut_offset = keys[len(keys) // 2]  # keys[0] stays below: neither half is empty
    below = [offset for partition, offset in keys if partition == cut_partition and offset < cut_offset]
    cut = below[-1] + 1 if below else None
    lower: list[PartitionBatch] = []
    upper: list[PartitionBatch] = []
    for part in parts:
        if part.partition != cut_partition or cut is None:
            (lower if part.partition < cut_partition else upper).append(part)
            continue
        low = [(o, e) for o, e in zip(part.offsets, part.events, strict=True) if o < cut]
        high = [(o, e) for o, e in zip(part.offsets, part.events, strict=True) if o >= cut]
        end = part.covers_to()
        if low or part.since < min(end, cut):
            offsets, events = [o for o, _e in low], [e for _o, e in low]
            lower.append(PartitionBatch(part.partition, offsets, events, part.since, min(end, cut)))
        if high or end > max(part.since, cut):
            offsets, events = [o for o, _e in high], [e for _o, e in high]
            upper.append(PartitionBatch(part.partition, offsets, events, max(part.since, cut), end))
    return lower, upper


class FencedSink(PartitionFences, ABC):
    """Applies batches of consumed records behind the fences."""

    @abstractmethod
    def fold(self, events: list[StatEvent]) -> Any:
        """Reduce events to per-row deltas (no I/O: it may run outside the transaction)."""

    @abstractmethod
    def write(self, connection: Connection, folded: Any, now: datetime) -> dict[str, int]:
        """Add what `fold` made to the sink's tables, inside the batch's transaction; rows written per table."""

    def fold_at_decode(self) -> Any:
        """A fold for the decode to hand a batch's records to as it reads them (sinks/pipeline.py `decode_batch`:
        the usual records go in as bytes, with no event built, the rest as their events; its partitions' events
        are then DecodedOnUse), or None: this sink folds the events (`fold`), the default. `fold_decoded`
        makes of it what `fold` would make of the batch's valid events; `kinds()` counts them by kind."""
        return None

    def fold_decoded(self, folded_at_decode: Any) -> Any:
        """What `fold` makes of the valid events of the batch `folded_at_decode` (from `fold_at_decode`) took."""
        raise NotImplementedError(f"{type(self).__name__} folds events, not records at their decode")

    def prepare(
        self,
        batch: Sequence[ConsumedRecord] | Sequence[PartitionBatch],
        since: Mapping[int, int] | None = None,
        folded_at_decode: Any = None,
    ) -> Prepared:
        """Fold a batch ahead of its transaction (in another thread, while the previous one commits).

        Takes records (with `since` per partition, see `by_partition`) or
        per-partition columns; a partition may appear in several PartitionBatch
        entries, and its offsets may come in any order: only a batch whose every
        partition's offsets strictly rise is folded here (the usual case), any other
        is folded in the transaction from what is new (`apply`).

        `folded_at_decode`: the `fold_at_decode` the decode of exactly these
        entries filled, whose rows and kinds stand for their valid events'.
        """
        if batch and isinstance(batch[0], PartitionBatch):
            parts: Sequence[PartitionBatch] = batch  # type: ignore[assignment]
        else:
            parts = by_partition(batch, since)  # type: ignore[arg-type]
        return self.prepare_parts(parts, folded_at_decode)

    def prepare_parts(self, parts: Sequence[PartitionBatch], folded_at_decode: Any = None) -> Prepared:
        lowest: dict[int, int] = {}
        end: dict[int, int] = {}
        reads: dict[int, list[tuple[int, int]]] = {}
        counts: dict[int, int] = {}
        rising = True
        valid: list[StatEvent] = []
        for part in parts:
            offsets = part.offsets
            if len(part.events) != len(offsets):
                raise ValueError(f"partition {part.partition}: {len(offsets)} offsets but {len(part.events)} events")
            partition = part.partition
            if not offsets:
                if part.covers_to() > part.since:  # vouches for offsets without records (markers, a split's piece)
                    reads.setdefault(partition, []).append((part.since, part.covers_to()))
                    end[partition] = max(part.covers_to(), end.get(partition, 0))
                continue
            low = min(offsets)
            if part.since > low:
                raise ValueError(f"partition {partition}: a read since {part.since} handed over offset {low}")
            if rising and (
                not all(map(operator.lt, offsets, itertools.islice(offsets, 1, None)))
                or (partition in end and offsets[0] < end[partition])
            ):
                rising = False
            lowest[partition] = min(low, lowest.get(partition, low))
            end[partition] = max(part.covers_to(), end.get(partition, 0))
            reads.setdefault(partition, []).append((part.since, part.covers_to()))
            counts[partition] = counts.get(partition, 0) + len(offsets)
            if folded_at_decode is None:
                valid.extend(filter(None, part.events))
        for spans in reads.values():
            spans.sort()
        if folded_at_decode is not None:  # no event asked for: the decode folded the records
            handed = sum(len(part.offsets) for part in parts)
            if folded_at_decode.handed() != handed:  # it must be the decode of exactly these entries
                raise ValueError(
                    f"a fold made at the decode of {folded_at_decode.handed()} records for a batch of {handed}"
                )
            kinds = folded_at_decode.kinds()
            folded = self.fold_decoded(folded_at_decode) if rising else None
        else:
            kinds = dict(Counter(map(operator.attrgetter("kind"), valid)))
            folded = self.fold(valid) if rising else None
        return Prepared(parts, lowest, end, rising, folded, kinds, reads, counts)

    def apply(
        self,
        batch: Sequence[ConsumedRecord] | Sequence[PartitionBatch] | Prepared,
        dlq_marks: Mapping[int, tuple[DlqMark | None, DlqMark]] | None = None,
        since: Mapping[int, int] | None = None,
        rejected: Sequence[tuple[int, int]] = (),
    ) -> ApplyOutcome:
        """Apply one batch in one transaction; a record below its fence, or seen before in the batch, is skipped.

        A partition whose reads do not cover the offsets from its fence is left out
        whole and reported in `behind` (see the module docstring); so is one without
        a fence row whose reads start above 0 (the row was lost with a database's
        last transactions: the consumer reads it again from where it starts).
        `rejected`: (partition, offset) of records the database refused, parked,
        recorded as skipped in this transaction when it passes them.
        """
        prepared = batch if isinstance(batch, Prepared) else self.prepare(batch, since)
        outcome = ApplyOutcome()
        if not prepared.end and not dlq_marks:
            return outcome
        now = now_utc_naive()
        with self.engine.begin() as connection:
            # A missing fence row is created (at 0) only where the reads start at 0.
            unknown = {p for p in prepared.end if prepared.since(p) > 0}
            locked = self.lock(connection, [*prepared.end, *(dlq_marks or ())], now, create_none_of=unknown)
            self.check_owner(connection)
            fences = {p: row.next_offset for p, row in locked.items()}
            behind = {p for p in prepared.end if p not in fences or not prepared.covered_from(p, fences[p])}
            if behind:
                for p in sorted(behind):
                    outcome.behind[p] = (fences.get(p, -1), prepared.since(p))
                # Rare (a store gone back in time): the rest is folded again without them.
                prepared = self.prepare_parts([part for part in prepared.parts if part.partition not in behind])
                dlq_marks = {p: m for p, m in (dlq_marks or {}).items() if p not in behind} or None
            if prepared.rising and all(low >= fences[p] for p, low in prepared.lowest.items()):
                # The usual case: nothing in the batch was applied before and nothing
                # repeats, so the fold made outside the transaction is the one to write.
                folded = prepared.folded
                advanced = dict(prepared.end)
                outcome.applied = prepared.count
                outcome.applied_kinds = dict(prepared.kinds)
                applied_in = prepared.counts
            else:
                fresh: list[StatEvent] = []
                seen: set[tuple[int, int]] = set()
                advanced = {}
                applied_in = {}
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
                    applied_in[p] = applied_in.get(p, 0) + 1
                    if event is not None:
                        fresh.append(event)
                        applied = outcome.applied_kinds
                        applied[event.kind] = applied.get(event.kind, 0) + 1
                folded = self.fold(fresh)
                # The reads cover everything from each fence to its batch end (checked above):
                # offsets there that no record took (markers, aborted records) are passed too.
                for p, end in prepared.end.items():
                    advanced[p] = max(advanced.get(p, 0), end)
            # Offsets the fences pass that held nothing the reads handed over: markers
            # and aborted records (the reads covered them, so nothing was jumped over).
            outcome.undelivered = sum(
                advanced[p] - fences[p] - applied_in.get(p, 0) for p in advanced if advanced[p] > fences[p]
            )
            outcome.rows_upserted = self.write(connection, folded, now)
            self.advance(connection, locked, advanced, now, dlq_marks)
            passed = [(p, o) for p, o in rejected if p in fences and fences[p] <= o < advanced.get(p, 0)]
            if passed:
                self.record_rejected(connection, passed, now)
        outcome.next_offsets = {p: max(fences[p], advanced.get(p, 0)) for p in fences}
        return outcome
