"""streams/aiokafka_records.py against aiokafka itself: the same records and the same position after every call.

`WholeBatches` takes a partition's fetched records a record batch at a time where aiokafka's
`FetchResult.getall` takes them one by one through its generator; the two must hand on the same records (control
batches, aborted transactions and records below the position skipped) and leave the partition's position at the
same offset after every call, for any log a broker can serve and any sequence of calls. Both run here over the
same bytes: generated partitions of plain, transactional and control batches, compressed or not, with records
compacted away (inside a batch, its tail, all of it), fetched from anywhere in the first batch and read in calls
of any size, a seek in between; and legacy message sets (v0, v1), whose compressed wrappers are read whole from
inside them. A unit test on aiokafka's own record classes (end to end on a broker: the windows e2e, poison (an
aborted transaction) and scaling tests).
"""

from __future__ import annotations

import asyncio
import gc
import struct
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka.consumer.fetcher import READ_COMMITTED, READ_UNCOMMITTED, FetchResult, PartitionRecords
from aiokafka.consumer.subscription_state import Assignment
from aiokafka.errors import CorruptRecordException
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.legacy_records import LegacyRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.record.util import calc_crc32c
from aiokafka.structs import TopicPartition
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skillstats import contract
from skillstats.streams import aiokafka_records
from skillstats.streams.aiokafka_records import KeptBytes, RecordsAsRead

TP = TopicPartition("stats", 4)
_ATTRIBUTES, _LAST_OFFSET_DELTA, _CRC, _MAX_TIMESTAMP = 21, 23, 17, 35  # a v2 batch's header, by byte offset
_CONTROL = 0x20


@dataclass(frozen=True)
class BatchSpec:
    records: int  # as the producer wrote them, offset deltas 0..records-1
    kept: frozenset[int]  # the deltas left after compaction
    producer: int | None  # a transactional producer's id, or None
    control: bool  # a transaction marker (commit or abort) of `producer`
    abort: bool
    compression: int  # 0 none, 1 gzip, 2 snappy, 3 lz4, 4 zstd
    append_time: bool = False  # LOG_APPEND_TIME: every record's timestamp is the batch's max timestamp


def _batch(spec: BatchSpec, base: int) -> bytes:
    """One v2 record batch at `base`, as a broker would serve it."""
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0 if spec.control else spec.compression,
        is_transactional=int(spec.producer is not None),
        producer_id=-1 if spec.producer is None else spec.producer,
        producer_epoch=-1 if spec.producer is None else 0,
        base_sequence=-1 if spec.producer is None else 0,
        batch_size=1 << 20,
    )
    if spec.control:  # a control record: key version 0, type 0 abort / 1 commit
        builder.append(
            0, timestamp=1_700_000_000_000, key=struct.pack(">hh", 0, 0 if spec.abort else 1), value=b"", headers=[]
        )
    else:
        for delta in sorted(spec.kept):
            headers = [("replayed-from", b"t/0@%d" % delta), ("ü", None)][: 2 - delta % 3] if delta % 3 < 2 else []
            key = None if delta % 5 == 4 else b"skill-%d" % delta * (1 + delta % 2 * 30)
            value = None if delta % 7 == 6 else b'{"n": %d}' % (base + delta)
            builder.append(delta, timestamp=1_700_000_000_000 + delta, key=key, value=value, headers=headers)
    data = bytearray(builder.build())
    struct.pack_into(">q", data, 0, base)
    last_delta = 0 if spec.control else spec.records - 1  # compaction keeps the batch's last offset
    struct.pack_into(">i", data, _LAST_OFFSET_DELTA, last_delta)
    (attributes,) = struct.unpack_from(">h", data, _ATTRIBUTES)
    struct.pack_into(">h", data, _ATTRIBUTES, attributes | (_CONTROL if spec.control else 0) | spec.append_time << 3)
    if spec.append_time:
        struct.pack_into(">q", data, _MAX_TIMESTAMP, 1_800_000_000_000 + base)
    struct.pack_into(">I", data, _CRC, calc_crc32c(bytes(data[_ATTRIBUTES:])))
    return bytes(data)


@st.composite
def batch_specs(draw: Any) -> BatchSpec:
    producer = draw(st.sampled_from([None, None, 7, 8]))
    control = producer is not None and draw(st.booleans())
    records = 1 if control else draw(st.integers(1, 6))
    kept = frozenset(range(records)) if control else frozenset(draw(st.sets(st.integers(0, records - 1))))
    compression = draw(st.sampled_from([0, 1, 2, 3, 4]))
    if not kept and compression == 2:  # aiokafka cannot read its own empty snappy batch (a broker writes none)
        compression = 0
    return BatchSpec(records, kept, producer, control, draw(st.booleans()), compression, draw(st.booleans()))


@st.composite
def partitions(draw: Any) -> tuple[bytes, int, list[tuple[int, int]], int]:
    """A partition's fetched bytes, where the fetch started, the aborted transactions the broker listed with it,
    and the isolation level."""
    specs = draw(st.lists(batch_specs(), min_size=1, max_size=8))
    base = draw(st.integers(0, 1000))
    data, bases = b"", []
    for spec in specs:
        bases.append(base)
        data += _batch(spec, base)
        base += spec.records
    fetch_offset = draw(st.integers(bases[0], bases[0] + specs[0].records))
    aborted = draw(st.lists(st.tuples(st.sampled_from([7, 8]), st.sampled_from(bases)), max_size=3))
    return data, fetch_offset, aborted, draw(st.sampled_from([READ_COMMITTED, READ_UNCOMMITTED]))


def _result(
    data: bytes, fetch_offset: int, aborted: list[tuple[int, int]], isolation: int, kept: bool = False
) -> FetchResult:
    """A FetchResult as aiokafka's fetcher makes it: with its bytes kept (`kept`) as it does once `install`ed."""
    assignment = Assignment({TP})
    assignment.state_value(TP).seek(fetch_offset)
    reader = KeptBytes(data) if kept else MemoryRecords(data)
    records = PartitionRecords(TP, reader, list(aborted), fetch_offset, None, None, True, isolation)
    return FetchResult(TP, assignment=assignment, partition_records=records, backoff=0)


def _seen(records: Sequence[Any]) -> list[tuple[Any, ...]]:
    return [(r.offset, r.timestamp, r.key, r.value, tuple(r.headers)) for r in records]


def _reads(result: FetchResult, calls: list[int | None], seek: tuple[int, int] | None) -> list[tuple[Any, ...]]:
    """Every call's records, and the position and whether records are left after it, until none are left."""
    state = result._assignment.state_value(TP)
    reads = []
    for index in range(64):
        if seek is not None and index == seek[0]:
            state.seek(seek[1])
        taken = result.getall(calls[index % len(calls)])
        reads.append((_seen(taken), state.position, result.has_more()))
        if not result.has_more():
            return reads
    raise AssertionError("the partition's records were never all taken")


async def _both(
    data: bytes, fetch_offset: int, aborted: list[tuple[int, int]], isolation: int, kept: bool = True, **read: Any
) -> Any:
    theirs = _result(data, fetch_offset, aborted, isolation)
    ours = _result(data, fetch_offset, aborted, isolation, kept)
    buffer = RecordsAsRead()
    buffer[TP] = ours
    assert buffer[TP] is ours and "getall" in vars(ours)  # the batch-at-a-time reader is in place
    return _reads(theirs, **read), _reads(ours, **read)


@pytest.fixture(params=["native", "python", "unkept"])
def paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """`_columns_from`'s paths: the batch's bytes read in C, aiokafka's records read in Python (no C module), and
    those without the batch's bytes (a FetchResult made before `install`)."""
    if request.param != "python":
        if contract.native is None:
            pytest.skip(f"{contract.NATIVE_MISSING} (tests/test_native.py fails for that)")
    else:
        monkeypatch.setattr(aiokafka_records, "native", None)
    return str(request.param)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    partition=partitions(),
    calls=st.lists(st.one_of(st.none(), st.integers(0, 9)), min_size=1, max_size=4),
    seek=st.one_of(st.none(), st.tuples(st.integers(0, 4), st.integers(0, 1100))),
)
def test_whole_batches_hand_on_what_aiokafka_does_and_leave_the_same_position(
    paths: str, partition: tuple[bytes, int, list[tuple[int, int]], int], calls: list[int | None], seek: Any
) -> None:
    data, fetch_offset, aborted, isolation = partition
    theirs, ours = asyncio.run(
        _both(data, fetch_offset, aborted, isolation, kept=paths != "unkept", calls=calls, seek=seek)
    )
    assert ours == theirs


def _legacy_set(magic: int, codec: int, base: int, count: int) -> bytes:
    """A legacy (v0 or v1) message set at `base`: one plain message, or a gzip wrapper of `count` messages (v1's
    inner offsets relative to the wrapper's, which carries the last), read whole even from inside it."""
    builder = LegacyRecordBatchBuilder(magic=magic, compression_type=codec, batch_size=1 << 20)
    for i in range(count):
        offset = i if magic == 1 and codec else base + i
        timestamp = 1_700_000_000_000 + i if magic else None
        builder.append(offset, timestamp=timestamp, key=b"k%d" % i, value=b"v%d" % (base + i))
    data = bytearray(builder.build())
    if codec:
        struct.pack_into(">q", data, 0, base + count - 1)
    return bytes(data)


@st.composite
def legacy_partitions(draw: Any) -> tuple[bytes, int]:
    """A partition in a legacy format, gaps (compacted offsets) between its message sets, and where the fetch
    started: anywhere inside the first set."""
    magic = draw(st.sampled_from([0, 1]))
    sets = draw(
        st.lists(st.tuples(st.sampled_from([0, 1]), st.integers(1, 6), st.integers(0, 2)), min_size=1, max_size=6)
    )
    data, base, first = b"", draw(st.integers(0, 500)), None
    for codec, count, gap in sets:
        count = count if codec else 1  # an uncompressed legacy message is one record
        first = base if first is None else first
        data += _legacy_set(magic, codec, base, count)
        base += count + gap
    first_count = sets[0][1] if sets[0][0] else 1
    return data, draw(st.integers(first, first + first_count - 1))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    partition=legacy_partitions(),
    calls=st.lists(st.one_of(st.none(), st.integers(0, 5)), min_size=1, max_size=3),
    seek=st.one_of(st.none(), st.tuples(st.integers(0, 4), st.integers(0, 600))),
    isolation=st.sampled_from([READ_COMMITTED, READ_UNCOMMITTED]),
)
def test_legacy_message_sets_are_read_as_aiokafka_reads_them(
    paths: str, partition: tuple[bytes, int], calls: list[int | None], seek: Any, isolation: int
) -> None:
    """Legacy formats (a broker before 4.0 may still serve them): a compressed wrapper's messages below the
    fetch position are skipped, the rest handed on, as aiokafka does."""
    data, fetch_offset = partition
    theirs, ours = asyncio.run(_both(data, fetch_offset, [], isolation, kept=paths != "unkept", calls=calls, seek=seek))
    assert ours == theirs
    assert all(record[0] >= fetch_offset for record in ours[0][0])


def test_the_generated_logs_reach_every_case() -> None:
    """The cases the property above is for, on one log: records below the fetch offset, a compacted tail (the
    position passes it), a batch compacted empty, an aborted transaction, a committed one, and a cut batch."""
    specs = [
        BatchSpec(4, frozenset({0, 1, 2}), None, False, False, 3),  # 100-103, fetched from 101, tail 103 gone
        BatchSpec(3, frozenset(), None, False, False, 0),  # 104-106, all compacted away
        BatchSpec(2, frozenset({0, 1}), 7, False, False, 1),  # 107-108, aborted below
        BatchSpec(1, frozenset({0}), 7, True, True, 0),  # 109, the abort marker
        BatchSpec(3, frozenset({0, 1, 2}), 8, False, False, 0),  # 110-112, committed below
        BatchSpec(1, frozenset({0}), 8, True, False, 0),  # 113, the commit marker
        BatchSpec(5, frozenset({0, 1, 2, 3, 4}), None, False, False, 3),  # 114-118
    ]
    data, base = b"", 100
    for spec in specs:
        data += _batch(spec, base)
        base += spec.records
    theirs, ours = asyncio.run(_both(data, 101, [(7, 107)], READ_COMMITTED, calls=[3], seek=None))
    assert ours == theirs
    offsets = [[record[0] for record in taken] for taken, _, _ in ours]
    assert offsets == [[101, 102, 110], [111, 112, 114], [115, 116, 117], [118]]
    assert [position for _, position, _ in ours] == [111, 115, 118, 119]


def test_a_corrupt_batch_is_raised_as_aiokafka_raises_it_and_the_partition_read_again() -> None:
    """A batch whose CRC fails raises CorruptRecordException from the call that reaches it; the records taken
    before it in that call are not handed on, and the next call drops the partition's records (its position
    is where the last call that returned left it), so the fetcher reads them again."""
    first = _batch(BatchSpec(2, frozenset({0, 1}), None, False, False, 0), 10)
    broken = bytearray(_batch(BatchSpec(2, frozenset({0, 1}), None, False, False, 0), 12))
    broken[-1] ^= 0xFF

    async def read(ours: bool) -> tuple[Any, ...]:
        result = _result(first + bytes(broken), 10, [], READ_COMMITTED, kept=ours)
        if ours:
            RecordsAsRead()[TP] = result
        with pytest.raises(CorruptRecordException):
            result.getall(None)
        state = result._assignment.state_value(TP)
        return state.position, list(result.getall(None)), result.has_more()

    async def both() -> tuple[Any, Any]:
        return await read(False), await read(True)

    theirs, ours = asyncio.run(both())
    assert ours == theirs == (10, [], False)


@pytest.mark.parametrize("calls", [[], [5], [5, 5], [None]], ids=["unread", "cut", "cut-twice", "all"])
def test_a_partitions_fetched_records_are_freed_without_the_cyclic_collector(calls: list[int | None]) -> None:
    """The worker runs the cyclic collector rarely (a threshold of a million), so a FetchResult must be freed
    by its reference count alone, read or not, whole or cut: a cycle would hold its fetched bytes (up to 4 MiB
    a partition) until a collection, fetch after fetch."""
    data = b"".join(_batch(BatchSpec(4, frozenset(range(4)), None, False, False, 3), base) for base in (0, 4, 8))

    async def read_and_drop() -> list[weakref.ref[Any]]:
        result = _result(data, 0, [], READ_COMMITTED, kept=True)
        RecordsAsRead()[TP] = result
        held = [weakref.ref(result), weakref.ref(result._partition_records)]
        for max_records in calls:
            result.getall(max_records)
        del result
        return held

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        held = asyncio.run(read_and_drop())
        assert [ref() for ref in held] == [None, None]
    finally:
        if was_enabled:
            gc.enable()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    spec=batch_specs().filter(lambda spec: not spec.control and spec.kept),
    edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=3),
    cut=st.integers(-3, 3),
    miscount=st.integers(-1, 1),
)
def test_a_batch_that_reads_wrong_inside_a_good_crc_is_refused_as_aiokafka_refuses_it(
    paths: str, spec: BatchSpec, edits: list[tuple[int, int]], cut: int, miscount: int
) -> None:
    """A producer's bug, not a transfer's (the CRC holds): records whose bytes do not read (a field past the
    end, a length that does not match, bytes left over, a count that is wrong) raise where aiokafka raises,
    and what aiokafka reads is read the same."""
    plain = BatchSpec(spec.records, spec.kept, spec.producer, False, False, 0, spec.append_time)
    data = bytearray(_batch(plain, 40))
    records_at = 61
    for at, byte in edits:
        data[records_at + at % (len(data) - records_at)] = byte
    if cut > 0:
        data += bytes(cut)
    elif cut < 0:
        del data[cut:]
    struct.pack_into(">i", data, 8, len(data) - 12)
    struct.pack_into(">i", data, 57, struct.unpack_from(">i", data, 57)[0] + miscount)
    struct.pack_into(">I", data, _CRC, calc_crc32c(bytes(data[_ATTRIBUTES:])))

    def read(ours: bool) -> Any:
        async def go() -> Any:
            result = _result(bytes(data), 40, [], READ_UNCOMMITTED, kept=ours and paths != "unkept")
            if ours:
                RecordsAsRead()[TP] = result
            return _seen(result.getall(None))

        try:
            return asyncio.run(go())
        except Exception as exc:  # which exception aiokafka raises is what is compared
            return type(exc)

    theirs, ours = read(False), read(True)
    assert ours == theirs  # the same records, or the same exception's class


def test_a_batch_shorter_than_its_header_is_refused_as_aiokafka_refuses_it() -> None:
    """aiokafka's reader lets a batch of any length past the log overhead through, and refuses one shorter than
    a v2 header when it reads it (its CRC made to hold): so does this, with the same exception."""
    short = bytearray(struct.pack(">qiibIhiq", 5, 0, 0, 2, 0, 0, 0, 1_700_000_000_000))  # 41 bytes, cut short
    struct.pack_into(">i", short, 8, len(short) - 12)
    struct.pack_into(">I", short, _CRC, calc_crc32c(bytes(short[_ATTRIBUTES:])))
    data = bytes(short) + _batch(BatchSpec(2, frozenset({0, 1}), None, False, False, 0), 6)

    async def read(ours: bool) -> Any:
        result = _result(data, 5, [], READ_UNCOMMITTED, kept=ours)
        if ours:
            RecordsAsRead()[TP] = result
        with pytest.raises(CorruptRecordException):
            result.getall(None)
        return result._assignment.state_value(TP).position

    async def both() -> tuple[Any, Any]:
        return await read(False), await read(True)

    assert asyncio.run(both()) == (5, 5)
