"""The windows worker reads each partition from its SQL fence only (streams/windows.py), unit tests with fakes.

aiokafka and faust are faked here; the same paths run for real in
tests/test_positions.py (the fault suite) and every worker test. What is
checked: records reach a batch only from a read positioned at the fence and
fetched after that seek, in the same assignment; anything else is dropped and
the partition positioned again; a commit that races a rebalance is a hint lost,
never a crash.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from aiokafka.errors import CommitFailedError, IllegalStateError
from aiokafka.structs import TopicPartition
from faust.types import TP

from skillstats.kafka import RawRecord
from skillstats.streams.windows import PartitionReads, Reading, _commit_in_thread, _seek_in_thread


@dataclass
class FakeSink:
    dropped: list[set[int]] = field(default_factory=list)

    def drop(self, partitions: set[int]) -> int:
        self.dropped.append(set(partitions))
        return 0


class FakeMetrics:
    def __init__(self) -> None:
        self.restarts: list[tuple[str, int]] = []

    def restarted(self, reason: str, partitions: int) -> None:
        self.restarts.append((reason, partitions))


def reads() -> tuple[PartitionReads, FakeSink, FakeMetrics]:
    sink, metrics = FakeSink(), FakeMetrics()
    positions = SimpleNamespace(fences=SimpleNamespace(topic="t"))
    return PartitionReads(None, positions, sink, metrics), sink, metrics  # type: ignore[arg-type]


def fetched(partition: int, offsets: range) -> list[RawRecord]:
    return [RawRecord(partition, o, b"k", b"v") for o in offsets]


def test_records_continue_their_read_from_the_fence() -> None:
    partition_reads, _sink, _metrics = reads()
    assignment = object()
    partition_reads.readings[0] = Reading(since=100, assignment=assignment, step=5, next=100)
    first = partition_reads.accept({TP("t", 0): fetched(0, range(100, 110))}, assignment, 6, {0: 110})
    assert [(since, len(records), until) for since, records, until in first.values()] == [(100, 10, None)]
    # A gap (transaction markers at 110, 111) is covered by the read: the next batch starts at 110.
    second = partition_reads.accept({TP("t", 0): fetched(0, range(112, 120))}, assignment, 7)
    assert second[0][0] == 110
    assert partition_reads.readings[0].next == 120
    # The read passes markers after its last record: the batch vouches for them, with or without records.
    third = partition_reads.accept({}, assignment, 8, {0: 122})
    assert third == {0: (120, [], 122)} and partition_reads.readings[0].next == 122
    fourth = partition_reads.accept({TP("t", 0): fetched(0, range(122, 125))}, assignment, 9, {0: 127})
    assert fourth[0][0] == 122 and fourth[0][2] == 127
    # A position from another assignment, or from before the seek, vouches for nothing.
    assert partition_reads.accept({}, object(), 10, {0: 200}) == {}
    assert partition_reads.accept({}, assignment, 1, {0: 200}) == {}


def test_records_fetched_before_the_seek_or_in_another_assignment_are_dropped() -> None:
    partition_reads, sink, metrics = reads()
    assignment = object()
    partition_reads.readings[0] = Reading(since=100, assignment=assignment, step=5, next=100)
    partition_reads.readings[1] = Reading(since=0, assignment=assignment, step=5, next=0)
    partition_reads.readings[2] = Reading(since=7, assignment=assignment, step=5, next=7)
    batch = partition_reads.accept(
        {
            TP("t", 0): fetched(0, range(500, 510)),  # drained before the seek (step 4 < 5): from Kafka's commit
            TP("t", 3): fetched(3, range(0, 5)),  # a partition never positioned
        },
        assignment,
        4,
    )
    assert batch == {}
    other = partition_reads.accept({TP("t", 1): fetched(1, range(800, 810))}, object(), 9)  # a new assignment
    assert other == {}
    assert set(partition_reads.readings) == {2}  # positioned again at their fences before the next fetch
    assert {0, 3} in sink.dropped and {1} in sink.dropped
    assert ("stale", 1) in metrics.restarts


def test_a_seek_counts_only_the_partitions_still_assigned() -> None:
    assignment = object()

    class Consumer:
        _subscription = SimpleNamespace(subscription=SimpleNamespace(assignment=assignment))
        sought: list[tuple[Any, int]] = []

        def seek(self, tp: TopicPartition, offset: int) -> None:
            if tp.partition == 1:
                raise IllegalStateError("No current assignment for partition")
            self.sought.append((tp, offset))

    steps = itertools.count(10)
    result = asyncio.run(_seek_in_thread(Consumer(), {TP("t", 0): 5, TP("t", 1): 9}, steps))
    assert result == (assignment, 10, {TP("t", 0)})
    assert Consumer.sought == [(TopicPartition("t", 0), 5)]


def test_a_commit_that_races_a_rebalance_is_a_hint_lost_not_a_crash() -> None:
    class Consumer:
        def __init__(self, error: BaseException | None) -> None:
            self.error = error
            self.committed: list[dict[Any, Any]] = []

        def assignment(self) -> set[TopicPartition]:
            return {TopicPartition("t", 0)}

        async def commit(self, offsets: dict[Any, Any]) -> None:
            if self.error is not None:
                raise self.error
            self.committed.append(offsets)

    fine = Consumer(None)
    assert asyncio.run(_commit_in_thread(fine, {TP("t", 0): 10, TP("t", 1): 20}, "mark")) is True
    assert [{tp.partition: o.offset for tp, o in c.items()} for c in fine.committed] == [{0: 10}]  # 1 left
    assert [o.metadata for c in fine.committed for o in c.values()] == ["mark"]  # as given: the caller adds the NUL
    for error in (IllegalStateError("Partitions not assigned"), CommitFailedError("already rebalanced")):
        assert asyncio.run(_commit_in_thread(Consumer(error), {TP("t", 0): 10}, "mark")) is False
    assert asyncio.run(_commit_in_thread(fine, {TP("t", 5): 1}, "mark")) is False  # nothing assigned to commit
