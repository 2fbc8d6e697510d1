"""Parking once across kill -9 at every point of a batch, the database's rejections included (unit test).

The DLQ is a fake kept in memory (one partition); the sink is real SQLite. A
batch of ten records holds an invalid one (parked before the transaction) and
one the database rejects (isolated by halving, then parked). The worker is
"killed" right after parking, and after each SQL commit in turn; every replay
starts from the fence, as a restarted worker does. Whatever the kill point,
each record is parked exactly once and the valid ones are counted once.
"""

from __future__ import annotations

import sqlite3
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest
from sqlalchemy import select

from skillstats.dlq import H_TIMESTAMP, DeadLetters, Parcel, park_headers
from skillstats.retry import Backoff
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.pipeline import Ownership, WindowsPipeline
from skillstats.sinks.schema import rejected_records, skill_daily_stats
from skillstats.sinks.windows import WindowsSink

AT = 1_764_460_800_000


@dataclass
class Fetched:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int | None = AT
    headers: tuple[tuple[str, bytes | None], ...] = ()


class MemoryDlq(DeadLetters):
    """DeadLetters over a list instead of a topic: what it reads back is what it sent."""

    def __init__(self, log: list[tuple[int, int]]) -> None:
        self.source_topic, self.topic, self.group, self.timeout = "t", "t.dlq", "g", 1.0
        self.limit = 1 << 20
        self._backoff = Backoff(base=0.001)
        self.log = log

    def _partition_count(self) -> int:
        return 1

    @property
    def _reader(self) -> Any:
        log = self.log

        class Reader:
            def get_watermark_offsets(self, _tp: Any, timeout: float = 0) -> tuple[int, int]:
                return 0, len(log)

        return Reader()

    def _read_parked(
        self, starts: Mapping[int, int], ends: Mapping[int, int]
    ) -> dict[tuple[int, int], tuple[int, int]]:
        return {self.log[at]: (0, at) for at in range(starts.get(0, 0), ends.get(0, 0))}

    def _send(self, parcels: Sequence[Parcel], target: Mapping[int, int], stop: threading.Event | None) -> None:
        self.log.extend((p.record.partition, p.record.offset) for p in parcels)


class Killed(BaseException):
    """kill -9: nothing after it runs."""


class DyingSink(WindowsSink):
    """Rejects skill "REJECT" like a CHECK constraint would, and dies after `commits_left` commits."""

    commits_left: int | None = None

    def write(self, connection: Any, folded: Any, now: Any) -> dict[str, int]:
        if any(row[0] == "REJECT" for row in folded[0]):  # the hourly rows: (skill id, hour, downloads, installs)
            raise sqlite3.IntegrityError("CHECK constraint failed: simulated")
        return super().write(connection, folded, now)

    def apply(self, batch: Any, dlq_marks: Any = None, since: Any = None, rejected: Any = ()) -> Any:
        if self.commits_left == 0:
            raise Killed()
        outcome = super().apply(batch, dlq_marks, since, rejected)
        if self.commits_left is not None:
            self.commits_left -= 1
        return outcome


def batch() -> list[Fetched]:
    records = []
    for offset in range(10):
        skill = "REJECT" if offset == 2 else "sk"
        value = orjson.dumps(
            {"v": 1, "event_id": f"e{offset}", "skill_id": skill, "kind": "download", "occurred_at": AT}
        )
        records.append(Fetched(0, offset, skill.encode(), value))
    records[8] = Fetched(0, 8, b"sk", b"not json")
    return records


@pytest.mark.parametrize("kills", [[0], [1], [2], [3], [0, 1], [1, 1], [0, 2, 1], [1, 1, 1, 1]])
def test_each_record_is_parked_once_whatever_the_kill_points(tmp_path: Path, kills: list[int]) -> None:
    engine = open_engine(f"sqlite:///{tmp_path}/m.db")
    upgrade(engine)
    sink = DyingSink(engine, "g", "t")
    dlq: list[tuple[int, int]] = []
    for commits_before_kill in [*kills, None]:
        sink.commits_left = commits_before_kill
        fence = sink.fences().get(0, 0)
        try:
            # A restarted worker reads from the fence, as it is positioned there.
            WindowsPipeline(sink, MemoryDlq(dlq)).process({0: [r for r in batch() if r.offset >= fence]}, {0: fence})
        except Killed:
            continue
    assert Counter(dlq) == {(0, 2): 1, (0, 8): 1}
    assert sink.fences() == {0: 10}
    with engine.connect() as connection:  # the refused record is recorded as skipped, once
        assert connection.execute(select(rejected_records.c.partition, rejected_records.c.offset)).all() == [(0, 2)]
    with engine.connect() as connection:
        assert connection.execute(select(skill_daily_stats.c.downloads)).scalar() == 8


def test_a_partition_revoked_before_its_batch_parks_is_left_whole_to_its_next_owner(tmp_path: Path) -> None:
    """The revoke shrinks the owned set before it waits for any parking under way: a batch that has not parked
    yet parks nothing of a revoked partition and applies none of it (its invalid records are the next owner's
    to park, once), while the partitions it still owns go on."""
    engine = open_engine(f"sqlite:///{tmp_path}/o.db")
    upgrade(engine)
    sink = DyingSink(engine, "g", "t")
    dlq: list[tuple[int, int]] = []
    ownership = Ownership()
    ownership.owned = frozenset({1})  # partition 0 was revoked while the batch was fetched
    mine = [Fetched(1, r.offset, r.key, r.value) for r in batch()]
    outcome = WindowsPipeline(sink, MemoryDlq(dlq), None, ownership).process({0: batch(), 1: mine}, {0: 0, 1: 0})
    assert Counter(dlq) == {(1, 8): 1, (1, 2): 1}  # partition 1's: the invalid record, the refused one
    assert 0 not in sink.fences() and outcome.next_offsets.get(1) == 10
    ownership.owned = frozenset({0, 1})  # the partition comes back (to this worker, as its next owner)
    WindowsPipeline(sink, MemoryDlq(dlq), None, ownership).process({0: batch()}, {0: 0})
    assert Counter(dlq) == {(1, 8): 1, (1, 2): 1, (0, 8): 1, (0, 2): 1}
    assert sink.fences() == {0: 10, 1: 10}


def test_every_parcel_keeps_its_source_records_timestamp(tmp_path: Path) -> None:
    """A record the database refused is parked with its Kafka timestamp like an invalid one: a replay keeps it."""
    engine = open_engine(f"sqlite:///{tmp_path}/m.db")
    upgrade(engine)
    sent: list[Parcel] = []

    class Keeping(MemoryDlq):
        def _send(self, parcels: Sequence[Parcel], target: Mapping[int, int], stop: threading.Event | None) -> None:
            sent.extend(parcels)
            super()._send(parcels, target, stop)

    records = [Fetched(r.partition, r.offset, r.key, r.value, AT + r.offset) for r in batch()]
    WindowsPipeline(DyingSink(engine, "g", "t"), Keeping([])).process({0: records}, {0: 0})
    assert sorted((p.reason, p.timestamp) for p in sent) == [("malformed", AT + 8), ("rejected_by_database", AT + 2)]
    assert all(dict(park_headers(p, "t", "g", 0))[H_TIMESTAMP] == str(p.timestamp).encode() for p in sent)
