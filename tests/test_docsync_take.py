"""docsync's reading, message by message: the C path (skillstats._native.take_run) against `MessageTaker.take`.

`MessageTaker.take_all` hands the ordinary messages of a consume() call to C and the rest (errors, a partition's
end of file, the snapshot's last offset and past it) to `take`. Whatever librdkafka can hand a drain, in any order:
messages of partitions not assigned or already finished, copies below a partition's next offset after a seek,
offsets past the snapshot end, EOF and out-of-range events, errors, missing timestamps, null keys and values, both
paths must leave the same columns, the same counts and next offsets, the same partitions finished (in the same
order, with the same offsets reached) and raise at the same message. Fakes stand in for librdkafka's messages; the
drains in tests/test_docsync*.py run the same code against a real broker.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from typing import Any

import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME, TIMESTAMP_LOG_APPEND_TIME, TIMESTAMP_NOT_AVAILABLE, KafkaError
from hypothesis import given
from hypothesis import strategies as st

from skillstats.sinks.docstats import PartitionDeltas
from skillstats.streams import docsync
from skillstats.streams.docsync import DrainSummary, MessageTaker
from tests.test_contract import PROPERTY

pytestmark = pytest.mark.skipif(docsync.native_take_run is None, reason="skillstats._native is not built")


@dataclass(frozen=True)
class FakeError:
    code_: int

    def code(self) -> int:
        return self.code_

    def str(self) -> str:
        return f"error {self.code_}"


@dataclass(frozen=True)
class FakeMessage:
    """What MessageTaker reads of a confluent_kafka.Message."""

    partition_: int | None
    offset_: int
    key_: bytes | None = b"k"
    value_: bytes | None = b"v"
    stamp: tuple[int, int] = (TIMESTAMP_CREATE_TIME, 1)
    error_: FakeError | None = None

    def error(self) -> FakeError | None:
        return self.error_

    def partition(self) -> int | None:
        return self.partition_

    def offset(self) -> int:
        return self.offset_

    def timestamp(self) -> tuple[int, int]:
        return self.stamp

    def key(self) -> bytes | None:
        return self.key_

    def value(self) -> bytes | None:
        return self.value_


PARTITIONS = range(4)
ERRORS = [KafkaError._PARTITION_EOF, KafkaError._AUTO_OFFSET_RESET, KafkaError._TRANSPORT]

messages = st.builds(
    FakeMessage,
    st.one_of(st.sampled_from(PARTITIONS), st.just(None)),  # None: librdkafka's unassigned partition
    st.integers(-1, 9),
    st.one_of(st.none(), st.binary(max_size=3)),
    st.one_of(st.none(), st.binary(max_size=3)),
    st.tuples(
        st.sampled_from([TIMESTAMP_NOT_AVAILABLE, TIMESTAMP_CREATE_TIME, TIMESTAMP_LOG_APPEND_TIME]),
        st.integers(-1, 2**40),
    ),
    st.one_of(st.none(), st.none(), st.none(), st.builds(FakeError, st.sampled_from(ERRORS))),
)


@dataclass
class Drain:
    """One drain's state as docsync._read keeps it, and the finish() it runs (without the consumer's pause)."""

    parts: dict[int, PartitionDeltas]
    finished: set[int]
    ends: dict[int, int]
    finishes: list[tuple[int, int | None]]
    summary: DrainSummary

    def finish(self, partition: int, reached: int | None) -> None:
        self.finishes.append((partition, reached))
        part = self.parts[partition]
        if reached is not None:
            part.next_offset = max(part.next_offset, min(reached, self.ends.get(partition, 0)))
        self.finished.add(partition)

    def taker(self, native: bool) -> MessageTaker:
        taker = MessageTaker("events", self.parts, self.finished, self.ends, self.summary, self.finish)
        if not native:
            taker.native = None
        return taker

    def seen(self) -> Any:
        return (
            {p: (part.events, part.next_offset) for p, part in self.parts.items()},
            sorted(self.finished),
            self.finishes,
            self.summary.events_read,
        )


drains = st.builds(
    lambda assigned, starts, finished, ends: Drain(
        {p: PartitionDeltas(p, starts[p], starts[p]) for p in assigned},
        {p for p in finished if p in assigned},
        ends,
        [],
        DrainSummary(),
    ),
    st.sets(st.sampled_from(PARTITIONS), min_size=1),
    st.fixed_dictionaries({p: st.integers(0, 6) for p in PARTITIONS}),
    st.sets(st.sampled_from(PARTITIONS), max_size=2),
    st.dictionaries(st.sampled_from(PARTITIONS), st.integers(0, 8), min_size=len(PARTITIONS) - 1),
)


def run(drain: Drain, calls: list[list[FakeMessage]], native: bool) -> Any:
    """Each consume() call's messages through take_all; what each call handed over, and the state at the end."""
    taker = drain.taker(native)
    handed, raised = [], None
    for batch in calls:
        try:
            taker.take_all(list(batch))
        except RuntimeError as exc:
            raised = str(exc)
        handed.append({p: columns[1:] for p, columns in taker.taken.items()})
        taker.taken.clear()  # what add_taken() does once it has decoded them
        if raised is not None:
            break
    return drain.seen(), handed, raised


@PROPERTY
@given(drains, st.lists(st.lists(messages, max_size=30), max_size=4))
def test_the_c_path_takes_what_take_takes(drain: Drain, calls: list[list[FakeMessage]]) -> None:
    assert run(copy.deepcopy(drain), calls, native=True) == run(copy.deepcopy(drain), calls, native=False)


def test_a_run_of_ordinary_messages_is_taken_in_c_up_to_the_snapshots_last_offset() -> None:
    drain = Drain({0: PartitionDeltas(0, 0, 0), 1: PartitionDeltas(1, 5, 5)}, set(), {0: 4, 1: 9}, [], DrainSummary())
    taker = drain.taker(native=True)
    batch = [FakeMessage(0, 0), FakeMessage(1, 4), FakeMessage(1, 5), FakeMessage(0, 1), FakeMessage(0, 2)]
    batch.append(FakeMessage(0, 3, stamp=(TIMESTAMP_NOT_AVAILABLE, 7)))  # the snapshot's last offset: take()'s
    assert docsync.native_take_run is not None
    stop = docsync.native_take_run(
        batch, 0, drain.parts, drain.finished, drain.ends, taker.taken, drain.summary, TIMESTAMP_NOT_AVAILABLE
    )
    assert (stop, drain.summary.events_read) == (5, 4)  # offset 4 of partition 1 is below its next offset: passed over
    assert (drain.parts[0].events, drain.parts[0].next_offset) == (3, 3)
    assert (drain.parts[1].events, drain.parts[1].next_offset) == (1, 6)
    taker.take_all(batch[stop:])
    assert drain.finishes == [(0, None)] and drain.parts[0].next_offset == 4
    assert taker.taken[0][1:] == ([b"k"] * 4, [b"v"] * 4, [1, 1, 1, None])


def test_a_message_that_fails_midway_leaves_the_columns_and_counts_agreeing() -> None:
    class Failing(FakeMessage):
        def value(self) -> bytes | None:
            raise ValueError("no value")

    drain = Drain({0: PartitionDeltas(0, 0, 0)}, set(), {0: 10}, [], DrainSummary())
    taker = drain.taker(native=True)
    batch: list[FakeMessage] = [FakeMessage(0, 0), FakeMessage(0, 1), Failing(0, 2), FakeMessage(0, 3)]
    references = [sys.getrefcount(message) for message in batch]
    with pytest.raises(ValueError, match="no value"):
        taker.take_all(batch)
    assert (drain.parts[0].events, drain.parts[0].next_offset, drain.summary.events_read) == (2, 2, 2)
    assert [len(column) for column in taker.taken[0][1:]] == [2, 2, 2]
    assert [sys.getrefcount(message) for message in batch] == references


def test_a_message_of_another_shape_is_refused() -> None:
    drain = Drain({0: PartitionDeltas(0, 0, 0)}, set(), {0: 10}, [], DrainSummary())
    taker = drain.taker(native=True)
    with pytest.raises(TypeError, match="timestamp"):
        taker.take_all([FakeMessage(0, 0, stamp=(1, 2, 3))])  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        taker.take_all([object()])  # type: ignore[list-item]
    assert drain.parts[0].events == 0 and taker.taken == {}
