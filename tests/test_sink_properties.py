"""The sink's invariant (sinks/batch.py) against an independent model, over arbitrary consumer behaviour.

Hypothesis plays one or more consumers of a partitioned log, with any mix of:
fetching the next records, seeking back to any offset at or below the fence
(what a rebalance or a restart does), dropping what is fetched but unapplied
(a revoke), and applying what is pending as one batch, so batches hold
duplicates, replays, and two spans of a partition (200-299, then 100-399).
Positions come from anywhere (a Kafka commit ahead of the fence or behind it,
an admin's offset reset), and the database goes back to any earlier state (a
backup restored, a replica that lost its tail) while the consumers go on. The
logs have gaps (transaction markers). After any such history, and a last
consumer reading from the fence to the end, SQL must hold the fold of every
record exactly once: nothing counted twice, nothing jumped over. The
expectation is computed here from the log alone, restating docs/contract.md,
kinds without the production code.
"""

from __future__ import annotations

import itertools
import sqlite3
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, delete, insert, select

from skillstats.contract import StatEvent
from skillstats.retry import Backoff
from skillstats.sinks.batch import ApplyOutcome, ConsumedRecord, PartitionBatch, canonical, split_in_two
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.pipeline import decode_columns
from skillstats.sinks.recovery import apply_with_recovery
from skillstats.sinks.schema import partition_fences, skill_daily_stats, skill_hourly_stats
from skillstats.sinks.windows import WindowsSink

HOUR = 3_600_000
BASE = 1_764_460_800_000  # a UTC midnight
# docs/contract.md, kinds restated: (downloads, installs) per kind; None is an invalid (parked) record.
COUNTS = {"download": (1, 0), "install_new": (0, 1), "install_reactivate": (0, 0), None: (0, 0)}

# partition -> [(offset, record)], offsets rising; a None record is a transaction marker (never handed over)
Log = dict[int, list[tuple[int, ConsumedRecord | None]]]
# A skill the database refuses (as a CHECK constraint would): its records are isolated by
# halving the batch (sinks/recovery.py, over gaps and overlapping reads alike) and parked.
REFUSED = "sk_refused"


class RefusingSink(WindowsSink):
    def write(self, connection: Any, folded: Any, now: Any) -> dict[str, int]:
        if any(row[0] == REFUSED for row in folded[0]):  # the hourly rows: (skill id, hour, downloads, installs)
            raise sqlite3.IntegrityError("CHECK constraint failed: simulated")
        return super().write(connection, folded, now)


@st.composite
def logs(draw: st.DrawFn) -> Log:
    result: Log = {}
    for partition in range(draw(st.integers(1, 3))):
        offset = draw(st.integers(0, 3))
        entries = []
        for _ in range(draw(st.integers(0, 25))):
            kind = draw(st.sampled_from(list(COUNTS)))
            skill = draw(st.sampled_from(["sk_a", "sk_b", "sk_c", "sk_a", "sk_b", "sk_c", REFUSED]))
            at = BASE + draw(st.sampled_from([-HOUR, 0, HOUR, 25 * HOUR])) + draw(st.integers(0, HOUR - 1))
            event = None if kind is None else StatEvent(f"e{partition}-{offset}", skill, kind, at)
            entries.append((offset, ConsumedRecord(partition, offset, event)))
            offset += 1 + draw(st.sampled_from([0, 0, 0, 1, 2]))  # sometimes a gap: a transaction marker
        for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):  # markers at the end: nothing after them
            entries.append((offset, None))
            offset += 1
        result[partition] = entries
    return result


def log_end(entries: list[tuple[int, ConsumedRecord | None]]) -> int:
    return entries[-1][0] + 1 if entries else 0


def expected(log: Log) -> tuple[Counter[tuple[str, object]], Counter[tuple[str, object]]]:
    daily: Counter[tuple[str, object]] = Counter()
    hourly: Counter[tuple[str, object]] = Counter()
    for entries in log.values():
        for _offset, record in entries:
            if record is None or record.event is None or record.event.skill_id == REFUSED:
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
    """One consumer's view: a position per partition and what it fetched but has not applied.

    Each fetch reads on from the position and says so: its entry's `since` is
    the position it started at, whatever put the consumer there (the fence, a
    Kafka commit ahead of it or behind it, an admin's offset reset). That is the
    one thing a consumer must tell the truth about; where it is positioned is
    not trusted.
    """

    def __init__(self, log: Log) -> None:
        self.log = log
        self.position = {p: 0 for p in log}
        self.pending: list[PartitionBatch] = []

    def fetch(self, partition: int, count: int) -> None:
        """Up to `count` records from the position; markers on the way are passed, as a consumer passes them,
        and the entry vouches for them (`until`: where the consumer stands after the fetch)."""
        start = self.position[partition]
        taken: list[ConsumedRecord] = []
        position = start
        for offset, record in self.log[partition]:
            if offset < start:
                continue
            if record is not None:
                if len(taken) == count:
                    break
                taken.append(record)
            position = offset + 1
        if taken or position > start:
            events = [r.event for r in taken]
            self.pending.append(PartitionBatch(partition, [r.offset for r in taken], events, start, position))
            self.position[partition] = position

    def seek(self, partition: int, offset: int) -> None:
        self.position[partition] = offset

    def forget(self, partition: int) -> None:
        self.pending = [part for part in self.pending if part.partition != partition]


class Recoded(NamedTuple):
    """A batch as the worker's decode hands it over: each entry's records read from their bytes into the sink's
    `fold_at_decode` (the events DecodedOnUse, built only if a record-by-record path asks)."""

    parts: list[PartitionBatch]
    folded: Any


def recoded(sink: WindowsSink, batch: list[PartitionBatch]) -> Recoded | None:
    """`batch` written as the records a publisher sends (a parked record's as a value that is not JSON) and
    decoded as sinks/pipeline.py decodes a read; None where the sink has no fold at the decode (no C module)."""
    fold = sink.fold_at_decode()
    if fold is None:
        return None
    parts = []
    for part in batch:
        keys = [b"x" if e is None else e.skill_id.encode() for e in part.events]
        values = [b"not json" if e is None else e.encode() for e in part.events]
        events, _invalid, _newest = decode_columns(keys, values, [None] * len(keys), fold)
        parts.append(PartitionBatch(part.partition, part.offsets, events, part.since, part.until))
    return Recoded(parts, fold)


def shaped(
    batch: list[PartitionBatch], how: int, sink: WindowsSink
) -> list[ConsumedRecord] | list[PartitionBatch] | Recoded:
    """The same batch in each form a sink accepts: records, per-partition columns, or columns cut in pieces;
    and, for one `how` in four, as the worker's decode hands it over (`recoded`).

    Records claim coverage from their lowest offset per partition (by_partition),
    so that form is given only when it claims exactly what the entries do; the
    pieces form keeps each entry's records in order but hands them in up to three
    pieces, each covering on from where the one before ended, interleaved with
    the other partitions' (a caller may legally do that): the sink must reach
    the same verdicts.
    """
    if how % 4 == 3:
        as_decoded = recoded(sink, batch)
        if as_decoded is not None:
            return as_decoded
    one_read_each = len({part.partition for part in batch}) == len(batch)
    exact = all(
        part.offsets and part.since == part.offsets[0] and part.covers_to() == part.offsets[-1] + 1 for part in batch
    )
    if how % 3 == 0 and one_read_each and exact:
        return [
            ConsumedRecord(part.partition, o, e)
            for part in batch
            for o, e in zip(part.offsets, part.events, strict=True)
        ]
    if how % 3 in (0, 1):
        return batch
    pieces: list[list[PartitionBatch]] = []
    for part in batch:
        n = len(part.offsets)
        if n < 2:
            pieces.append([part])
            continue
        cuts = sorted({0, n // 3, (2 * n) // 3, n})
        pieces.append(
            [
                PartitionBatch(
                    part.partition,
                    part.offsets[a:b],
                    part.events[a:b],
                    part.since if a == 0 else part.offsets[a - 1] + 1,
                    part.until if b == n else None,  # the last piece vouches for the markers after it
                )
                for a, b in itertools.pairwise(cuts)
            ]
        )
    return [piece for round_ in itertools.zip_longest(*pieces) for piece in round_ if piece is not None]


actions = st.lists(
    st.tuples(
        st.sampled_from(
            ["fetch", "fetch", "fetch", "seek", "seek_keep", "seek_anywhere", "apply", "apply_react", "drop", "restore"]
        ),
        st.integers(0, 1),  # which consumer
        st.integers(0, 2),  # partition
        st.integers(0, 30),  # count, how far from the fence to seek, or which earlier state to restore
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
# Offsets 2 and 3 are transaction markers: a read from 2 covers them, a position at 4 does not.
WITH_MARKERS: Log = {
    0: [
        *((o, ConsumedRecord(0, o, StatEvent(f"e{o}", "sk_a", "download", BASE))) for o in (0, 1, 4, 5, 6)),
        (7, None),  # a trailing marker: the fence passes it once a read covers it
    ]
}
WITH_REFUSED: Log = {
    0: [
        (o, ConsumedRecord(0, o, None if skill is None else StatEvent(f"e{o}", skill, "download", BASE + o)))
        for o, skill in enumerate(["sk_a", REFUSED, None, "sk_b", "sk_a"])
    ]
}
TABLES = (skill_daily_stats, skill_hourly_stats, partition_fences)
State = dict[str, list[dict[str, object]]]


def snapshot(sink: WindowsSink) -> State:
    with sink.engine.connect() as connection:
        return {table.name: [dict(row._mapping) for row in connection.execute(select(table))] for table in TABLES}


def restore(sink: WindowsSink, state: State) -> None:
    """The database as it was at `state` (a backup restored, a replica that lost its tail): counts and fences alike."""
    with sink.engine.begin() as connection:
        for table in TABLES:
            connection.execute(delete(table))
            if state[table.name]:
                connection.execute(insert(table), state[table.name])


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


def apply(sink: WindowsSink, batch: list[ConsumedRecord] | list[PartitionBatch] | Recoded) -> ApplyOutcome:
    """As the worker applies a batch: refused records isolated and parked (here: dropped, as if parked)."""
    if isinstance(batch, Recoded):
        prepared = sink.prepare(batch.parts, folded_at_decode=batch.folded)
    else:
        prepared = sink.prepare(batch)
    return apply_with_recovery(sink, prepared, lambda _record, _exc: None, backoff=Backoff(base=0.0001))


def test_any_consumer_history_counts_every_record_once(engine_url: str) -> None:
    engine = open_engine(engine_url)
    upgrade(engine)
    sink = RefusingSink(engine, "g", "t")
    examples = 250 if engine_url.startswith("sqlite") else 50

    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(log=logs(), history=actions)
    # The production case, always tried: records fetched before a rebalance stay
    # pending while the consumer seeks back and fetches them again behind them.
    @example(log=SIX_DOWNLOADS, history=refetched(pending=2, refetch=9, shape=0))
    # The same, handed as columns (4, 4, 5: a repeat next to itself) and as pieces
    # (4 | 5 | 4, 5: a repeat only across two entries of one partition).
    @example(log=SIX_DOWNLOADS, history=refetched(pending=1, refetch=9, shape=1))
    @example(log=SIX_DOWNLOADS, history=refetched(pending=2, refetch=2, shape=2))
    # As the worker's decode hands batches over (folded from the bytes): the usual batch, one that repeats
    # offsets (its events then decoded after all), and one with a record the database refuses (halved).
    @example(
        log=SIX_DOWNLOADS, history=[("fetch", 0, 0, 4), ("apply", 0, 0, 3), ("fetch", 0, 0, 9), ("apply", 0, 0, 7)]
    )
    @example(log=SIX_DOWNLOADS, history=refetched(pending=2, refetch=9, shape=3))
    @example(log=WITH_REFUSED, history=[("fetch", 0, 0, 9), ("apply", 0, 0, 3)])
    # A consumer positioned past the fence (Kafka's commit ahead of a restored database):
    # its records must not move the fence over the ones it never read.
    @example(log=SIX_DOWNLOADS, history=[("seek_anywhere", 0, 0, 3), ("fetch", 0, 0, 9), ("apply", 0, 0, 1)])
    # The database goes back to before the last batch while the consumer reads on.
    @example(
        log=SIX_DOWNLOADS,
        history=[
            ("fetch", 0, 0, 3),
            ("apply", 0, 0, 1),
            ("fetch", 0, 0, 3),
            ("apply", 0, 0, 1),
            ("restore", 0, 0, 1),
            ("fetch", 0, 0, 3),
            ("apply_react", 0, 0, 1),
        ],
    )
    # A read covering the markers moves the fence over them; a position past them is no read of them.
    @example(
        log=WITH_MARKERS,
        history=[
            ("fetch", 0, 0, 2),
            ("apply", 0, 0, 1),
            ("seek_anywhere", 0, 0, 2),
            ("fetch", 0, 0, 9),
            ("apply", 0, 0, 1),
        ],
    )
    def check(log: Log, history: list[tuple[str, int, int, int]]) -> None:
        with engine.begin() as connection:
            for table in TABLES:
                connection.execute(delete(table))
        states = [snapshot(sink)]
        consumers = [Consumer(log), Consumer(log)]
        ends = {p: log_end(entries) for p, entries in log.items()}
        for action, who, partition, amount in history:
            consumer = consumers[who]
            partition %= len(log)
            fence = sink.fences().get(partition, 0)
            if action == "fetch":
                consumer.fetch(partition, amount)
            elif action == "seek":
                # A rebalance or restart as the worker does it: at or below the fence, what
                # was fetched but not applied dropped.
                consumer.forget(partition)
                consumer.seek(partition, max(0, fence - amount))
            elif action == "seek_keep":
                # The same seek with the fetched records kept (stale records ahead of
                # the re-fetched ones: the batch then repeats offsets above the fence).
                consumer.seek(partition, max(0, fence - amount))
            elif action == "seek_anywhere":
                # A position from anywhere: Kafka's commit ahead of a restored fence, an
                # admin's reset to the end, to the start, past the end.
                consumer.seek(partition, max(0, fence + amount - 10 if amount > 10 else fence + amount))
            elif action == "drop":
                consumer.pending = []
                for p in log:
                    consumer.seek(p, max(0, sink.fences().get(p, 0) - amount))
            elif action == "restore":
                restore(sink, states[amount % len(states)])
            elif consumer.pending:
                batch, consumer.pending = consumer.pending, []
                outcome = apply(sink, shaped(batch, amount, sink))
                states.append(snapshot(sink))
                if action == "apply_react":
                    # As the worker does with what the sink refused: read it again from the fence.
                    for p, (behind_fence, _since) in outcome.behind.items():
                        consumer.forget(p)
                        consumer.seek(p, behind_fence)
        # In-flight batches of both consumers land last, in either order, then a last
        # owner reads every partition from its fence to the end.
        for consumer in consumers:
            if consumer.pending:
                apply(sink, consumer.pending)
        last = Consumer(log)
        for p in log:
            last.seek(p, sink.fences().get(p, 0))
            last.fetch(p, 1000)
        if last.pending:
            assert not apply(sink, last.pending).behind  # read from the fence: never refused
        assert actual(sink) == expected(log)
        assert {p: n for p, n in sink.fences().items() if ends.get(p)} == {p: n for p, n in ends.items() if n}

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


@st.composite
def read_batches(draw: st.DrawFn) -> list[PartitionBatch]:
    """Entries as reads hand them over: each from a `since`, rising offsets at or above it, gaps anywhere,
    several reads of one partition overlapping or not (holes between them included)."""
    parts = []
    for _ in range(draw(st.integers(1, 6))):
        partition = draw(st.integers(0, 2))
        since = draw(st.integers(0, 20))
        offset = since + draw(st.integers(0, 3))
        offsets = []
        for _ in range(draw(st.integers(1, 8))):
            offsets.append(offset)
            offset += 1 + draw(st.sampled_from([0, 0, 1, 3]))
        events = [draw(st.sampled_from([None, StatEvent("e", "sk", "download", BASE)])) for _ in offsets]
        parts.append(PartitionBatch(partition, offsets, events, since))
    return parts


@settings(max_examples=500, deadline=None)
@given(parts=read_batches(), fence=st.integers(0, 30))
def test_a_batch_cut_in_two_claims_exactly_what_it_did(parts: list[PartitionBatch], fence: int) -> None:
    """What the database-error path relies on (sinks/recovery.py): applied lower half first, the two halves of a
    batch cover, from any fence, exactly what the batch covered, and hold each of its records once."""
    sink = WindowsSink(create_engine("sqlite://"), "g", "t")  # folding only: the engine is never connected
    whole = canonical(parts)
    if sum(len(part.offsets) for part in whole) < 2:
        return
    lower, upper = split_in_two(whole)
    keys = sorted((part.partition, o) for part in whole for o in part.offsets)
    assert sorted((part.partition, o) for half in (lower, upper) for part in half for o in part.offsets) == keys
    assert max((part.partition, max(part.offsets)) for part in lower if part.offsets) < min(
        (part.partition, min(part.offsets)) for part in upper if part.offsets
    )
    before, first, second = sink.prepare(whole), sink.prepare(lower), sink.prepare(upper)
    for partition in before.end:
        covered = before.covered_from(partition, fence)
        after_first = fence
        if partition in first.end:
            if not first.covered_from(partition, fence):
                assert not covered
                continue
            after_first = max(fence, first.end[partition])
        halves = partition not in second.end or second.covered_from(partition, after_first)
        assert halves == covered, (partition, fence)
