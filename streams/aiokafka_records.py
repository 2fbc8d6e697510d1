"""aiokafka's fetched records handed to the windows worker's drain as aiokafka read them, a record batch at a time.

aiokafka keeps each partition's answer to a fetch in its Fetcher's `_records`
(an OrderedDict of FetchResult), and `fetched_records` takes them out through
`FetchResult.getall`: a Python loop that pulls one record at a time out of a
generator (`PartitionRecords._unpack_records`), and for each one builds a
ConsumerRecord, a dataclass of eleven fields filled in Python, appends it and
checks the count. The worker reads five fields of each record once, and at a
hundred thousand records a second that per-record Python was the largest
single share of its CPU outside SQL (docs/performance.md, "Records as aiokafka
read them" and "Whole record batches").

So `RecordsAsRead`, set as the Fetcher's `_records`, gives each FetchResult
added to it (the one place aiokafka adds them, by item assignment) its own
`getall` (`WholeBatches`) when no deserializer is configured (faust configures
none). It hands on the records aiokafka's C reader made (`DefaultRecord`, or a
legacy format's record: the same `offset`, `timestamp`, `key`, `value` and
`headers`, the FetchedRecord protocol of sinks/pipeline.py) and takes each
record batch whole, with one C-level loop over it, rather than record by
record through a generator.

What it must keep exactly is aiokafka's: which records are handed on (control
batches and a read_committed consumer's aborted transactions skipped, records
below the position skipped) and where the partition's position stands after
every call (past skipped batches and compacted-away tails, checked against
the assignment before every call). `_record_batches` is aiokafka 0.14's
`_unpack_records` with the per-record yield replaced by a list per batch, on
the same PartitionRecords state (`next_fetch_offset`, the aborted producers);
pyproject.toml pins aiokafka to that minor version, tests/test_faust_pins.py
fails when the code it was copied from changes, and
tests/test_aiokafka_records.py holds the two to the same records and the same
position after every call, for generated partitions of plain, transactional,
aborted, control and compacted batches, and of legacy message sets, read in
calls of any size. What it
costs: a copy of twenty lines of a library's private logic, to be re-read at
each aiokafka upgrade.
"""

from __future__ import annotations

import collections
import sys
import weakref
from collections.abc import Iterator
from typing import Any

from aiokafka import errors as kafka_errors
from aiokafka.consumer.fetcher import READ_COMMITTED

from skillstats.contract import native


def _record_batches(records: Any) -> Iterator[list[Any]]:
    """aiokafka's `PartitionRecords._unpack_records` a record batch at a time: each batch's records from the
    position on, as aiokafka read them, in a list; `records.next_fetch_offset` kept as aiokafka keeps it.

    The caller moves `next_fetch_offset` past the records it takes (`WholeBatches.getall`); resumed, this moves
    it past the rest of the batch just handed on (a compacted-away tail), as aiokafka's generator does when it
    is asked for the record after a batch's last.
    """
    tp = records._tp
    memory = records._records
    while memory.has_next():
        batch = memory.next_batch()
        if records._check_crcs and not batch.validate_crc():
            raise kafka_errors.CorruptRecordException(f"Invalid CRC - {tp}")
        if records._isolation_level == READ_COMMITTED and batch.producer_id is not None:
            records._consume_aborted_up_to(batch.base_offset)
            if batch.is_control_batch and records._contains_abort_marker(batch):
                records._aborted_producers.discard(batch.producer_id)
            if batch.is_transactional and batch.producer_id in records._aborted_producers:
                records.next_fetch_offset = batch.next_offset
                continue
        if batch.is_control_batch:
            records.next_fetch_offset = batch.next_offset
            continue
        taken, past = _records_from(batch, records.next_fetch_offset), batch.next_offset
        del batch  # its uncompressed bytes: the records own theirs, and a cut batch waits here for the next call
        if taken:
            yield taken
        records.next_fetch_offset = past


def _records_from(batch: Any, position: int) -> list[Any]:
    """The batch's records that aiokafka hands on: each one at or past the position as it stands at it (the
    position given, then one past the last record kept; a compressed legacy message set starts below the
    position, and Kafka writes offsets rising, so that is the first records of a batch at most)."""
    if native is not None:
        return native.records_from(batch, position)  # type: ignore[no-any-return]
    kept = []
    for record in batch:
        if record.offset >= position:
            kept.append(record)
            position = record.offset + 1
    return kept


class WholeBatches:
    """`getall` of one FetchResult, a record batch at a time: aiokafka's `FetchResult.getall` (0.14) with
    `_record_batches` for its per-record loop; a batch cut by `max_records` is finished at the next call.

    Nothing here may form a reference cycle: the worker runs the cyclic collector rarely (sinks/pipeline.py,
    COLLECTOR_THRESHOLD), and a cycle through a FetchResult would keep its fetched bytes (up to a fetch's
    4 MiB per partition) until then. So this holds the FetchResult, whose `getall` it is, weakly, and drops
    the generator aiokafka made for the per-record path (its frame holds the PartitionRecords that holds it;
    aiokafka breaks that cycle only at the generator's end, which this never asks for). A `getone` after
    this, which nothing here calls, fails with a TypeError rather than skip the records held for the next call.
    """

    def __init__(self, result: Any) -> None:
        self._result = weakref.ref(result)
        self._records = result._partition_records
        self._records._records_iterator = None
        self._batches = _record_batches(self._records)
        self._left: list[Any] = []

    def getall(self, max_records: int | None = None) -> list[Any]:
        result = self._result()
        if result is None or not result.check_assignment(result._topic_partition) or not result.has_more():
            return []
        # aiokafka's loop appends a record before it compares the count: at least one, whatever the limit.
        room = sys.maxsize if max_records is None else max(max_records, 1)
        taken: list[Any] = []
        while room > 0:
            if not self._left:
                batch = next(self._batches, None)
                if batch is None:
                    result._update_position()
                    result._partition_records = None
                    return taken
                self._left = batch
            if len(self._left) <= room:
                part, self._left = self._left, []
            else:
                part, self._left = self._left[:room], self._left[room:]
            taken += part
            room -= len(part)
            self._records.next_fetch_offset = part[-1].offset + 1
        result._update_position()
        return taken


class RecordsAsRead(collections.OrderedDict):  # type: ignore[type-arg]
    """aiokafka's buffer of fetched partitions (its Fetcher's `_records`): every FetchResult added to it hands on
    its records through `WholeBatches`, where no deserializer is configured (one would want ConsumerRecords)."""

    def __setitem__(self, tp: Any, result: Any) -> None:
        records = getattr(result, "_partition_records", None)
        if records is not None and records._key_deserializer is None and records._value_deserializer is None:
            result.getall = WholeBatches(result).getall
        super().__setitem__(tp, result)
