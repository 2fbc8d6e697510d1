"""The sink's invariant (sinks/batch.py) against an independent model, over arbitrary consumer behaviour.

Hypothesis plays one or more consumers of a partitioned log, with any mix of:
fetching the next records, seeking back to any offset at or below the fence
(what a rebalance or a restart does), dropping what is fetched but unapplied
(a revoke), and applying what is pending as one batch, so batches hold
duplicates, replays, and two spans of a partition (200-299, then 100-399).
The logs have gaps (transaction markers). After any such history, and a last
consumer reading from the fence to the end, SQL must hold the fold of every
record exactly once: the expectation is computed here from the log alone,
restating docs/contract.md, kinds without the production code.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete, select

from skillstats.contract import StatEvent
from skillstats.sinks.batch import ConsumedRecord, PartitionBatch, by_partition
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.schema import partition_fences, skill_daily_stats, skill_hourly_stats
from skillstats.sinks.windows import WindowsSink

HOUR = 3_600_000
BASE = 1_764_460_800_000  # a UTC midnight
# docs/contract.md, kinds restated: (downloads, installs) per kind; None is an invalid (parked) record.
COUNTS = {"download": (1, 0), "install_new": (0, 1), "install_reactivate": (0, 0), None: (0, 0)}

Log = dict[int, list[tuple[int, ConsumedRecord]]]  # partition -> [(offset, record)], offsets rising


@st.composite
def logs(draw: st.DrawFn) -> Log:
    result: Log = {}
    for partition in range(draw(st.integers(1, 3))):
        offset = draw(st.integers(0, 3))
        entries = []
        for _ in range(draw(st.integers(0, 25))):
            kind = draw(st.sampled_from(list(COUNTS)))
            skill = draw(st.sampled_from(["sk_a", "sk_b", "sk_c"]))
            at = BASE + draw(st.sampled_from([-HOUR, 0, HOUR, 25 * HOUR])) + draw(st.integers(0, HOUR - 1))
            event = None if kind is None else StatEvent(f"e{partition}-{offset}", skill, kind, at)
            entries.append((offset, ConsumedRecord(partition, offset, event)))
            offset += 1 + draw(st.sampled_from([0, 0, 0, 1, 2]))  # sometimes a gap: a transaction marker
        result[partition] = entries
    return result


def expected(log: Log) -> tuple[Counter[tuple[str, object]], Counter[tuple[str, object]]]:
    daily: Counter[tuple[str, object]] = Counter()
    hourly: Counter[tuple[str, object]] = Counter()
    for entries in log.values():
        for _offset, record in entries:
            if record.event is None:
                continue
            downloads, installs = COUNTS[record.event.kind]
            at = datetime(1970, 1, 1) + timedelta(milliseconds=record.event.occurred_at)
            for counter, bucket in ((daily, at.date()), (hourly, at.replace(minute=0, second=0, microsecond=0))):
                counter[(record.event.skill_id, bucket, "d")] += downloads
                counter[(record.event.skill_id, bucket, "i")] += installs
    return +daily, +hourly


def actual(sink: WindowsSink) -> tuple[Counter[tuple[str, object]], Counter[tuple[str, object]]]:
    daily: Counter[tuple[str, object]] = Counter()
    hourly: Counter[tuple[str, object]] = Counter()
    with sink.engine.connect() as connection:
        for table, counter, column in (
            (skill_daily_stats, daily, skill_daily_stats.c.day),
            (skill_hourly_stats, hourly, skill_hourly_stats.c.hour),
        ):
            for skill, bucket, downloads, installs in connection.execute(
                select(table.c.skill_id, column, table.c.downloads, table.c.installs)
            ):
                bucket = bucket.date() if table is skill_daily_stats and isinstance(bucket, datetime) else bucket
                counter[(skill, bucket, "d")] += downloads
                counter[(skill, bucket, "i")] += installs
    return +daily, +hourly


class Consumer:
    """One consumer's view: a position per partition and what it fetched but has not applied."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.position = {p: 0 for p in log}
        self.pending: list[ConsumedRecord] = []

    def fetch(self, partition: int, count: int) -> None:
        entries = [r for o, r in self.log[partition] if o >= self.position[partition]][:count]
        self.pending.extend(entries)
        if entries:
            self.position[partition] = entries[-1].offset + 1

    def seek(self, partition: int, offset: int) -> None:
        self.position[partition] = offset


def shaped(batch: list[ConsumedRecord], how: int) -> list[ConsumedRecord] | list[PartitionBatch]:
    """The same batch in each form a sink accepts: records, per-partition columns, or columns split in pieces.

    The pieces form keeps each partition's records in batch order but hands a
    partition in up to three entries, interleaved with the other partitions' (a
    caller may legally do that); the sink must reach the same verdicts.
    """
    if how % 3 == 0:
        return batch
    parts = by_partition(batch)
    if how % 3 == 1:
        return parts
    pieces: list[list[PartitionBatch]] = []
    for part in parts:
        n = len(part.offsets)
        cuts = sorted({0, n // 3, (2 * n) // 3, n})
        pieces.append(
            [PartitionBatch(part.partition, part.offsets[a:b], part.events[a:b]) for a, b in itertools.pairwise(cuts)]
        )
    return [piece for round_ in itertools.zip_longest(*pieces) for piece in round_ if piece is not None]


actions = st.lists(
    st.tuples(
        st.sampled_from(["fetch", "fetch", "fetch", "seek", "seek_keep", "apply", "drop"]),
        st.integers(0, 1),  # which consumer
        st.integers(0, 2),  # partition
        st.integers(0, 30),  # count, or how far below the fence to seek
    ),
    max_size=40,
)


@pytest.fixture(params=["sqlite", "postgresql"])
def engine_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('prop')}/p.db"
    else:
        from tests.conftest import _fresh_postgres_database

        yield from _fresh_postgres_database(request.getfixturevalue("postgres_admin_url"))


SIX_DOWNLOADS: Log = {0: [(o, ConsumedRecord(0, o, StatEvent(f"e{o}", "sk_a", "download", BASE))) for o in range(6)]}


def refetched(pending: int, refetch: int, shape: int) -> list[tuple[str, int, int, int]]:
    """Apply 0-3; fetch `pending` more; seek back to the fence keeping them; fetch `refetch`; apply in `shape`."""
    return [
        ("fetch", 0, 0, 4),
        ("apply", 0, 0, 0),
        ("fetch", 0, 0, pending),
        ("seek_keep", 0, 0, 0),
        ("fetch", 0, 0, refetch),
        ("apply", 0, 0, shape),
    ]


def test_any_consumer_history_counts_every_record_once(engine_url: str) -> None:
    engine = open_engine(engine_url)
    upgrade(engine)
    sink = WindowsSink(engine, "g", "t")
    examples = 200 if engine_url.startswith("sqlite") else 40

    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(log=logs(), history=actions)
    # The production case, always tried: records fetched before a rebalance stay
    # pending while the consumer seeks back and fetches them again behind them.
    @example(log=SIX_DOWNLOADS, history=refetched(pending=2, refetch=9, shape=0))
    # The same, handed as columns (4, 4, 5: a repeat next to itself) and as pieces
    # (4 | 5 | 4, 5: a repeat only across two entries of one partition).
    @example(log=SIX_DOWNLOADS, history=refetched(pending=1, refetch=9, shape=1))
    @example(log=SIX_DOWNLOADS, history=refetched(pending=2, refetch=2, shape=2))
    def check(log: Log, history: list[tuple[str, int, int, int]]) -> None:
        with engine.begin() as connection:
            for table in (skill_daily_stats, skill_hourly_stats, partition_fences):
                connection.execute(delete(table))
        consumers = [Consumer(log), Consumer(log)]
        for action, who, partition, amount in history:
            consumer = consumers[who]
            partition %= len(log)
            if action == "fetch":
                consumer.fetch(partition, amount)
            elif action == "seek":
                # A rebalance or restart resumes at or below the fence (Kafka's commit
                # is clamped to it), and drops what was fetched but not applied.
                consumer.pending = [r for r in consumer.pending if r.partition != partition]
                consumer.seek(partition, max(0, sink.fences().get(partition, 0) - amount))
            elif action == "seek_keep":
                # The same seek with the fetched records kept (stale records ahead of
                # the re-fetched ones: the batch then repeats offsets above the fence).
                consumer.seek(partition, max(0, sink.fences().get(partition, 0) - amount))
            elif action == "drop":
                consumer.pending = []
                for p in log:
                    consumer.seek(p, max(0, sink.fences().get(p, 0) - amount))
            elif consumer.pending:
                batch, consumer.pending = consumer.pending, []
                sink.apply(shaped(batch, amount))
        # In-flight batches of both consumers land last, in either order, then a last
        # owner reads every partition from its fence to the end.
        for consumer in consumers:
            if consumer.pending:
                sink.apply(consumer.pending)
        last = Consumer(log)
        for p in log:
            last.seek(p, sink.fences().get(p, 0))
            last.fetch(p, 1000)
        if last.pending:
            sink.apply(last.pending)
        assert actual(sink) == expected(log)
        ends = {p: entries[-1][0] + 1 for p, entries in log.items() if entries}
        assert {p: n for p, n in sink.fences().items() if p in ends} == ends

    check()
    engine.dispose()


def test_one_batch_with_two_spans_of_a_partition(tmp_path: object) -> None:
    """The case seen in production: 200-299 fetched before a rebalance, then 100-399 after faust seeks back."""
    engine = open_engine(f"sqlite:///{tmp_path}/s.db")
    upgrade(engine)
    sink = WindowsSink(engine, "g", "t")
    record = {o: ConsumedRecord(0, o, StatEvent(f"e{o}", "sk", "download", BASE)) for o in range(400)}
    sink.apply([record[o] for o in range(200)])
    outcome = sink.apply([record[o] for o in [*range(200, 300), *range(100, 400)]])
    assert (outcome.applied, outcome.replayed) == (200, 200)
    assert actual(sink)[0] == Counter({("sk", datetime(2025, 11, 30).date(), "d"): 400})
    assert sink.fences() == {0: 400}
