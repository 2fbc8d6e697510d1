"""aiokafka's fetched records handed to the windows worker's drain as columns, read a record batch at a time.

aiokafka keeps each partition's answer to a fetch in its Fetcher's `_records`
(an OrderedDict of FetchResult), and `fetched_records` takes them out through
`FetchResult.getall`: a Python loop that pulls one record at a time out of a
generator (`PartitionRecords._unpack_records`) over records its C reader made
one object each, and builds a ConsumerRecord of each. The worker reads five
fields of each record once, and at a hundred thousand records a second that
per-record work was the largest single share of its CPU outside SQL
(docs/performance.md: "Records as aiokafka read them", "Whole record batches",
"Record batches read into columns").

So `install` sets a RecordsAsRead as the Fetcher's `_records`: each FetchResult
added to it (the one place aiokafka adds them, by item assignment) gets its own
`getall` (`WholeBatches`) when no deserializer is configured (faust configures
none), which hands on RecordColumns (sinks/pipeline.py): each batch's offsets,
timestamps, keys, values and headers as five lists. A v2 batch's records are
read into them from its bytes by one C function (`native.batch_columns`), after
aiokafka's own codec decompressed them; legacy message sets, and any batch whose
bytes are not at hand, through aiokafka's records. aiokafka's reader does not
give its bytes back, so `install` also makes the fetcher build its reader as a
`KeptBytes` (aiokafka's MemoryRecords, and the bytes), by the name the fetcher's
module calls it by.

What it must keep exactly is aiokafka's: which records are handed on (control
batches and a read_committed consumer's aborted transactions skipped, records
below the position skipped), what each one holds, what is refused as corrupt,
and where the partition's position stands after every call (past skipped
batches and compacted-away tails, checked against the assignment before every
call). `_record_batches` is aiokafka 0.14's `_unpack_records` with the per-record
yield replaced by columns per batch, on the same PartitionRecords state
(`next_fetch_offset`, the aborted producers); pyproject.toml pins aiokafka to that
minor version, tests/test_faust_pins.py fails when the code it was copied from
changes, and tests/test_aiokafka_records.py holds the two to the same records,
the same refusals and the same position after every call, for generated
partitions of plain, transactional, aborted, control and compacted batches in
every codec, of broker-time batches, of legacy message sets, and of batches
whose records do not read under a good CRC, read in calls of any size. What it
costs: a copy of twenty lines of a library's private logic, a reader of
Kafka's record format in C (the fields aiokafka's reads, in its order), and the
fetcher's module name for its reader taken over, all to be re-read at each
aiokafka upgrade.
"""

from __future__ import annotations

import collections
import struct
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from aiokafka import codec
from aiokafka import errors as kafka_errors
from aiokafka.consumer import fetcher as aiokafka_fetcher
from aiokafka.consumer.fetcher import READ_COMMITTED
from aiokafka.record.default_records import DefaultRecordBatch
from aiokafka.record.memory_records import MemoryRecords

from skillstats.contract import native
from skillstats.sinks.pipeline import RecordColumns


class KeptBytes:
    """aiokafka's MemoryRecords, and the bytes it reads: aiokafka's reader keeps them out of reach, and
    `_record_batches` reads a v2 batch's records from them. Everything aiokafka asks of it is its own reader's."""

    __slots__ = ("_reader", "data")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._reader = MemoryRecords(data)

    def size_in_bytes(self) -> int:
        return self._reader.size_in_bytes()

    def has_next(self) -> bool:
        return self._reader.has_next()

    def next_batch(self) -> Any:
        return self._reader.next_batch()


def install(fetcher: Any) -> None:
    """Make `fetcher` hand on its records as read: its buffer of fetched partitions a RecordsAsRead, and the
    record sets it reads from then on KeptBytes (aiokafka's fetcher makes one per partition per fetch answer, by
    the module's name `MemoryRecords`; a FetchResult made before, or a reader without its bytes, is read through
    aiokafka's records, as before)."""
    aiokafka_fetcher.MemoryRecords = KeptBytes  # type: ignore[misc]
    if type(fetcher._records) is not RecordsAsRead:
        fetcher._records = RecordsAsRead(fetcher._records)


_BATCH_LENGTH = struct.Struct(">qi")  # a batch's base offset and the length of the rest of it
_RECORD_COUNT = struct.Struct(">i")
_RECORD_COUNT_AT, _RECORDS_AT = 57, 61  # in a v2 batch (magic 2), after its 61-byte header
_LOG_APPEND_TIME = 1  # a v2 batch's timestamp type: the broker's time, the batch's max timestamp for each record
# aiokafka's DefaultRecordBatch._maybe_uncompress, by codec: whether it is installed, and how it is read.
_DECOMPRESS: dict[int, tuple[Callable[[], bool], Callable[[memoryview], bytes]]] = {
    DefaultRecordBatch.CODEC_GZIP: (codec.has_gzip, codec.gzip_decode),
    DefaultRecordBatch.CODEC_SNAPPY: (codec.has_snappy, lambda data: codec.snappy_decode(data.tobytes())),
    DefaultRecordBatch.CODEC_LZ4: (codec.has_lz4, lambda data: codec.lz4_decode(data.tobytes())),
    DefaultRecordBatch.CODEC_ZSTD: (codec.has_zstd, lambda data: codec.zstd_decode(data.tobytes())),
}


def _record_batches(records: Any) -> Iterator[RecordColumns]:
    """aiokafka's `PartitionRecords._unpack_records` a record batch at a time: each batch's records from the
    position on, as aiokafka read them, in columns; `records.next_fetch_offset` kept as aiokafka keeps it.

    The caller moves `next_fetch_offset` past the records it takes (`WholeBatches.getall`); resumed, this moves
    it past the rest of the batch just handed on (a compacted-away tail), as aiokafka's generator does when it
    is asked for the record after a batch's last.
    """
    tp = records._tp
    memory = records._records
    data = memoryview(memory.data) if type(memory) is KeptBytes else None
    at = 0  # where the next batch aiokafka's reader hands out starts in `data`
    while memory.has_next():
        batch = memory.next_batch()
        raw = None
        if data is not None:  # every batch, legacy ones too: its offset, its length, then the rest
            base, length = _BATCH_LENGTH.unpack_from(data, at)
            raw, at = data[at : at + _BATCH_LENGTH.size + length], at + _BATCH_LENGTH.size + length
            if type(batch) is not DefaultRecordBatch or len(raw) < _RECORDS_AT:  # short: aiokafka refuses it
                raw = None
            elif base != batch.base_offset:  # not the framing read here (aiokafka 0.14's): its records from now on
                raw = data = None
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
        taken, past = _columns_from(batch, raw, records.next_fetch_offset, tp), batch.next_offset
        del batch, raw  # its bytes: a cut batch's columns wait here for the next call
        if taken:
            yield taken
        records.next_fetch_offset = past


def _columns_from(batch: Any, raw: memoryview | None, position: int, tp: Any) -> RecordColumns:
    """The batch's records that aiokafka hands on, as columns: each one at or past the position as it stands at
    it (the position given, then one past the last record kept; a compressed legacy message set starts below
    the position, and Kafka writes offsets rising, so that is the first records of a batch at most).

    A v2 batch whose bytes are at hand is read by `native.batch_columns`, decompressed as aiokafka does; the
    rest (legacy message sets, a codec not installed, no C module) through aiokafka's records, as it reads them.
    """
    columns = RecordColumns()
    compression = batch.compression_type if raw is not None else None
    decompress = _DECOMPRESS.get(compression) if compression else None  # type: ignore[arg-type]
    if native is not None and (compression == DefaultRecordBatch.CODEC_NONE or (decompress and decompress[0]())):
        assert raw is not None
        count = _RECORD_COUNT.unpack_from(raw, _RECORD_COUNT_AT)[0]
        records = raw[_RECORDS_AT:] if decompress is None else decompress[1](raw[_RECORDS_AT:])
        append_time = batch.max_timestamp if batch.timestamp_type == _LOG_APPEND_TIME else None
        try:
            native.batch_columns(
                records, count, batch.base_offset, batch.first_timestamp, append_time, position, columns.columns
            )
        except UnicodeDecodeError:  # a header key that is no UTF-8: aiokafka's C reader raises it as it is
            raise
        except ValueError as exc:
            raise kafka_errors.CorruptRecordException(f"{exc} - {tp}") from None
        return columns
    for record in batch:
        if record.offset >= position:
            columns.extend((record,))
            position = record.offset + 1
    return columns


class WholeBatches:
    """`getall` of one FetchResult, a record batch at a time: aiokafka's `FetchResult.getall` (0.14) with
    `_record_batches` for its per-record loop; a batch cut by `max_records` is finished at the next call.

    Nothing here may form a reference cycle: the worker runs the cyclic collector rarely (sinks/pipeline.py,
    COLLECTOR_THRESHOLD), and a cycle through a FetchResult would keep its fetched bytes (up to a fetch's
    4 MiB per partition) until then. So this holds the FetchResult, whose `getall` it is, weakly, and drops
    the generator aiokafka made for the per-record path (its frame holds the PartitionRecords that holds it;
    aiokafka breaks that cycle only at the generator's end, which this never asks for). A `getone` after
    this, which nothing here calls, fails with a TypeError rather than skip the records held for the next call.

    A record batch whose records do not read is refused by the call that reaches it, whole: aiokafka would hand
    on its records before the bad one first, a record at a time. Either way the worker stops at that batch,
    every time it reads it, and counts nothing of it twice.
    """

    def __init__(self, result: Any) -> None:
        self._result = weakref.ref(result)
        self._records = result._partition_records
        self._records._records_iterator = None
        self._batches = _record_batches(self._records)
        self._left = RecordColumns()

    def getall(self, max_records: int | None = None) -> RecordColumns:
        result = self._result()
        taken = RecordColumns()
        if result is None or not result.check_assignment(result._topic_partition) or not result.has_more():
            return taken
        # aiokafka's loop appends a record before it compares the count: at least one, whatever the limit.
        room = sys.maxsize if max_records is None else max(max_records, 1)
        while room > 0:
            if not self._left:
                batch = next(self._batches, None)
                if batch is None:
                    result._update_position()
                    result._partition_records = None
                    return taken
                self._left = batch
            if len(self._left) <= room:
                part, self._left = self._left, RecordColumns()
            else:
                part, self._left = self._left[:room], self._left[room:]
            if taken:
                taken.extend(part)
            else:
                taken = part
            room -= len(part)
            self._records.next_fetch_offset = part.offsets[-1] + 1
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
