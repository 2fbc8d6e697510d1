"""The windows worker's batching between fetch and SQL (unit tests; fakes for faust and the pipeline)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from faust.types import TP

from skillstats.kafka import RawRecord
from skillstats.sinks.batch import ApplyOutcome
from skillstats.streams.windows import BatchSink


@dataclass
class FakePipeline:
    """Records each batch it is given; the first one waits until released (a slow transaction)."""

    release: threading.Event = field(default_factory=threading.Event)
    batches: list[list[tuple[int, int]]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def process(self, fetched: dict[int, list[RawRecord]]) -> ApplyOutcome:
        if not self.batches:
            self.release.wait(10)
        assert all(r.partition == p for p, rs in fetched.items() for r in rs)
        raws = [r for rs in fetched.values() for r in rs]
        self.batches.append([(r.partition, r.offset) for r in raws])
        ends: dict[int, int] = {}
        for r in raws:
            ends[r.partition] = max(ends.get(r.partition, 0), r.offset + 1)
        return ApplyOutcome(applied=len(raws), next_offsets=ends)


class FakeConsumer:
    def __init__(self) -> None:
        self.commits: list[dict[TP, int]] = []

    async def _commit(self, offsets: dict[TP, int]) -> bool:
        self.commits.append(dict(offsets))
        return True


@dataclass
class FakeApp:
    consumer: FakeConsumer = field(default_factory=FakeConsumer)
    sql_fences: dict[TP, int] = field(default_factory=dict)


def records(partition: int, offsets: range) -> list[RawRecord]:
    return [RawRecord(partition, o, b"k", b"v") for o in offsets]


def test_records_of_a_partition_that_moved_never_meet_their_refetch_in_one_batch() -> None:
    async def scenario() -> FakePipeline:
        pipeline = FakePipeline()
        sink = BatchSink(FakeApp(), pipeline, "t", max_pending=10_000)  # type: ignore[arg-type]
        await sink.add({0: records(0, range(100, 200))})  # in the database, slowly
        await sink.add({0: records(0, range(200, 300)), 1: records(1, range(0, 50))})  # pending
        # Partition 0 goes to another consumer (its pending records are dropped) and
        # later comes back; the consumer starts from the committed offset, 100.
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


def test_commits_follow_the_applied_batches() -> None:
    async def scenario() -> tuple[FakeApp, Any]:
        app = FakeApp()
        pipeline = FakePipeline()
        pipeline.release.set()
        sink = BatchSink(app, pipeline, "t", max_pending=10_000)  # type: ignore[arg-type]
        await sink.add({3: records(3, range(0, 10))})
        while sink.in_flight is not None:
            await asyncio.sleep(0.01)
            await sink.idle()
        return app, sink

    app, _sink = asyncio.run(scenario())
    assert app.consumer.commits == [{TP("t", 3): 10}]
    assert app.sql_fences == {TP("t", 3): 10}
