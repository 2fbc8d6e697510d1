"""The windows worker's batching between fetch and SQL (sinks/pipeline.py; unit tests, the pipeline faked)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from skillstats.sinks.batch import ApplyOutcome
from skillstats.sinks.pipeline import BatchSink, ColumnRecord


@dataclass
class FakePipeline:
    """Records each batch it is given; the first one waits until released (a slow transaction)."""

    release: threading.Event = field(default_factory=threading.Event)
    batches: list[list[tuple[int, int]]] = field(default_factory=list)
    since: list[dict[int, int]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def process(
        self, fetched: dict[int, list[ColumnRecord]], since: dict[int, int], until: dict[int, int] | None = None
    ) -> ApplyOutcome:
        if not self.batches:
            self.release.wait(10)
        assert set(since) == set(fetched) and all(since[p] <= rs[0].offset for p, rs in fetched.items())
        self.since.append(dict(since))
        assert all(r.key == b"%d" % p for p, rs in fetched.items() for r in rs)  # each partition's own
        raws = [(p, r.offset) for p, rs in fetched.items() for r in rs]
        self.batches.append(raws)
        ends: dict[int, int] = {}
        for p, offset in raws:
            ends[p] = max(ends.get(p, 0), offset + 1)
        return ApplyOutcome(applied=len(raws), next_offsets=ends)


class FakeCommits:
    def __init__(self) -> None:
        self.commits: list[dict[int, int]] = []

    async def __call__(self, fences: dict[int, int]) -> bool:
        self.commits.append(dict(fences))
        return True


def records(partition: int, offsets: range) -> tuple[int, list[ColumnRecord], None]:
    """A fetch of `partition`: its records (their key its number), read on from the first of them."""
    return offsets.start, [ColumnRecord(o, 1_700_000_000_000, b"%d" % partition, b"v", ()) for o in offsets], None


def test_records_of_a_partition_that_moved_never_meet_their_refetch_in_one_batch() -> None:
    async def scenario() -> FakePipeline:
        pipeline = FakePipeline()
        sink = BatchSink(pipeline, max_pending=10_000, commit=FakeCommits())  # type: ignore[arg-type]
        await sink.add({0: records(0, range(100, 200))})  # in the database, slowly
        await sink.add({0: records(0, range(200, 300)), 1: records(1, range(0, 50))})  # pending
        # Partition 0 goes to another consumer (its pending records are dropped) and
        # later comes back; the consumer starts from its fence, 100.
        assert sink.drop({0}) == 100
        await sink.add({0: records(0, range(100, 400))})
        pipeline.release.set()
        while len(pipeline.batches) < 2:
            await asyncio.sleep(0.01)
            await sink.idle()
        while sink.in_flight is not None:
            await asyncio.sleep(0.01)
            await sink.idle()
        return pipeline

    pipeline = asyncio.run(scenario())
    first, second = pipeline.batches
    assert first == [(0, o) for o in range(100, 200)]
    # Partition 1 kept its pending records; partition 0 holds the re-fetch only, once.
    assert sorted(second) == sorted([(1, o) for o in range(50)] + [(0, o) for o in range(100, 400)])
    assert len(second) == len(set(second))
    # Each partition's batch says where its read started: the first fetch it holds.
    assert pipeline.since == [{0: 100}, {1: 0, 0: 100}]


def test_commits_follow_the_applied_batches() -> None:
    async def scenario() -> tuple[FakeCommits, Any]:
        commits = FakeCommits()
        pipeline = FakePipeline()
        pipeline.release.set()
        sink = BatchSink(pipeline, max_pending=10_000, commit=commits)  # type: ignore[arg-type]
        await sink.add({3: records(3, range(0, 10))})
        while sink.in_flight is not None:
            await asyncio.sleep(0.01)
            await sink.idle()
        return commits, sink

    commits, sink = asyncio.run(scenario())
    assert commits.commits == [{3: 10}]
    assert sink.fences == {3: 10}
