"""The replay ledger against kill and restore (skillstats/dlq_admin.py): no record gets a copy that counts twice.

SQL's replay rows go back with a restored database; the ledger (a Kafka topic,
its entries committed in the same transaction as their copies) does not. The
property test below runs the real decision (`merge_ledger`, `book_of`,
`plan_replay`) over arbitrary sequences of replays (with or without `--again`,
killed before the transaction commits or before SQL recorded where the copy
landed), database backups and restores to any of them, windows workers reading
from the restored fence, parcels another database parks of our copies, and a
record parked twice; Kafka's part (what a committed transaction leaves, what a
read_committed worker does with it) is modelled in a few lines. Beside it: how
the ledger completes SQL (positions only for the topic as it is now), parcels of
another database, and a replay whose transaction was aborted or whose commit
Kafka did not confirm (a fake producer, real SQL on both databases).
"""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from skillstats.config import Settings
from skillstats.contract import make_event
from skillstats.dlq_admin import (
    CopyPublisher,
    LedgerEntry,
    ParkedRecord,
    ReplayAborted,
    ReplayRow,
    book_of,
    ledger_topic,
    merge_ledger,
    plan_replay,
    record_ledger,
    replay,
)
from skillstats.publisher import PublishError
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.schema import dlq_replays

SETTINGS = Settings(topic="events", dlq_topic="events.dlq")
EVENT = make_event("sk_1", "download", 1_700_000_000_000)
ROOT = ("events", 3, 105)
TOPIC_ID = "topic-id-now"
OURS, THEIRS = "mark-of-this-database", "mark-of-another-database"


def parcel(dlq_offset: int, source: tuple[int, int], database: str = OURS) -> ParkedRecord:
    """A parcel at DLQ 0:dlq_offset of events/source (the root itself, or a copy of it)."""
    return ParkedRecord(
        0,
        dlq_offset,
        "unknown_kind",
        "why",
        "windows",
        "events",
        source[0],
        source[1],
        1_000,
        None,
        False,
        EVENT.occurred_at,
        EVENT.key,
        EVENT.encode(),
        database,
    )


def entry(number: int, copy: tuple[int, int] | None, topic_id: str | None = TOPIC_ID) -> LedgerEntry:
    return LedgerEntry(ROOT, number, 0, 0, "unknown_kind", copy, topic_id)


def test_the_ledger_adds_what_sql_forgot_and_positions_only_of_the_topic_as_it_is() -> None:
    rows = [ReplayRow(ROOT, 1, 0, 0, None)]
    ledger = [entry(1, (3, 900)), entry(2, (3, 950)), entry(3, (3, 990), topic_id="a-recreated-topic's")]
    missing, fill = merge_ledger(rows, ledger, TOPIC_ID)
    assert fill == [entry(1, (3, 900))]  # where replay 1 landed, which SQL never recorded
    assert missing == [entry(2, (3, 950)), entry(3, None, "a-recreated-topic's")]  # replayed, never where
    assert merge_ledger(rows, ledger, None) == ([entry(2, None), entry(3, None, "a-recreated-topic's")], [])
    book = book_of(rows, ledger, TOPIC_ID)
    assert book.published == {ROOT: 3} and book.copies == {(3, 900): ROOT, (3, 950): ROOT}
    assert book.next_number(ROOT) == 4
    # Numbers past a gap (a restored database that lost replay 1 but kept 2): never one used before.
    assert book_of([ReplayRow(ROOT, 2, 0, 0, None)]).next_number(ROOT) == 3


def test_a_copy_another_database_parked_did_not_come_back_for_this_one() -> None:
    """Its worker's verdict is its own (an older contract, its own database): ours may have counted the copy."""
    ledger = [entry(1, (3, 900))]
    original = parcel(0, (3, 105))
    for database, replayed in ((THEIRS, False), (OURS, True), (None, True)):
        parked = [original, parcel(1, (3, 900), database)]  # type: ignore[arg-type]
        plan = plan_replay(SETTINGS, parked, parked, book_of([], ledger, TOPIC_ID, database=OURS), again=True)
        assert bool(plan.publish) is replayed, plan.skipped


@dataclass
class Database:
    """What a backup holds: the replay rows, the windows counts of copies, and the windows fence over them."""

    rows: list[ReplayRow] = field(default_factory=list)
    counted: set[int] = field(default_factory=set)  # indexes into Kafka.copies
    fence: int = 0  # copies below it were read by the windows group


@dataclass
class Kafka:
    """What no restore touches: committed copies, the ledger, the DLQ."""

    copies: list[tuple[int, int]] = field(default_factory=list)
    ledger: list[LedgerEntry] = field(default_factory=list)
    parked: list[ParkedRecord] = field(default_factory=lambda: [parcel(0, (3, 105))])
    parked_copies: set[int] = field(default_factory=set)  # by this database's workers


class World:
    def __init__(self, valid: bool) -> None:
        self.valid = valid  # the record is valid today (a copy counts), or still invalid (forced: parked again)
        self.db = Database()
        self.kafka = Kafka()
        self.backups = [deepcopy(self.db)]

    def replay(self, again: bool, kill: str | None) -> None:
        """`skillstats dlq replay` (--all): fence earlier replays, read the ledger and complete SQL from it,
        decide, record, publish in a transaction with the ledger entry, record where the copy landed."""
        missing, fill = merge_ledger(self.db.rows, self.kafka.ledger, TOPIC_ID)
        filled = {(e.root, e.number): e.copy for e in fill}
        self.db.rows = [replace(r, copy=filled.get((r.root, r.number), r.copy)) for r in self.db.rows] + [
            ReplayRow(e.root, e.number, e.dlq_partition, e.dlq_offset, e.copy) for e in missing
        ]
        book = book_of(self.db.rows, self.kafka.ledger, TOPIC_ID, database=OURS)
        parked = self.kafka.parked
        plan = plan_replay(SETTINGS, parked, parked, book, again=again, force=True)
        if not plan.publish:
            return
        assert list(plan.roots) == [ROOT], "a copy parked again was taken for a record of its own"
        number, record = plan.numbers[ROOT], plan.roots[ROOT]
        # What --again promises: every earlier copy came back parked, by this database (none of them counted).
        assert set(range(len(self.kafka.copies))) <= self.kafka.parked_copies, "a copy that may count was replayed"
        self.db.rows.append(ReplayRow(ROOT, number, record.dlq_partition, record.dlq_offset, None))
        if kill == "before the commit":
            return  # never committed: neither the copy nor its entry is ever read
        copy = (3, 1_000 + len(self.kafka.copies))
        self.kafka.copies.append(copy)
        self.kafka.ledger.append(
            LedgerEntry(ROOT, number, record.dlq_partition, record.dlq_offset, "r", copy, TOPIC_ID)
        )
        if kill == "before recording where it landed":
            return
        self.db.rows[-1] = replace(self.db.rows[-1], copy=copy)

    def work(self) -> None:
        """The windows worker reads from its fence: a copy counts if the record is valid, else it is parked once."""
        for index in range(self.db.fence, len(self.kafka.copies)):
            if self.valid:
                self.db.counted.add(index)
            elif index not in self.kafka.parked_copies:
                self.kafka.parked_copies.add(index)
                self.kafka.parked.append(parcel(len(self.kafka.parked), self.kafka.copies[index]))
        self.db.fence = len(self.kafka.copies)

    def foreign(self) -> None:
        """Another database's worker parks our newest copy (its verdict, not ours)."""
        if self.kafka.copies:
            self.kafka.parked.append(parcel(len(self.kafka.parked), self.kafka.copies[-1], THEIRS))

    def zombie(self) -> None:
        """The original record parked a second time (a worker cut off in a rebalance)."""
        self.kafka.parked.append(parcel(len(self.kafka.parked), (3, 105)))


OPERATIONS = st.one_of(
    st.tuples(
        st.just("replay"),
        st.booleans(),
        st.sampled_from([None, "before the commit", "before recording where it landed"]),
    ),
    st.tuples(st.just("backup")),
    st.tuples(st.just("restore"), st.integers(0, 30)),
    st.tuples(st.just("work")),
    st.tuples(st.just("foreign")),
    st.tuples(st.just("zombie")),
)


@settings(max_examples=300, deadline=None)
@given(valid=st.booleans(), operations=st.lists(OPERATIONS, max_size=30))
def test_no_sequence_of_replays_kills_and_restores_counts_a_record_twice(valid: bool, operations: list) -> None:
    world = World(valid)
    for operation in operations:
        name = operation[0]
        if name == "replay":
            world.replay(operation[1], operation[2])
        elif name == "backup":
            world.backups.append(deepcopy(world.db))
        elif name == "restore":
            world.db = deepcopy(world.backups[operation[1] % len(world.backups)])
        else:
            getattr(world, name)()
        assert len(world.db.counted) <= 1
    world.work()  # the consumers catch up on whatever the last restore left above their fences
    assert len(world.db.counted) <= 1
    if valid:
        assert len(world.kafka.copies) <= 1  # a valid record never gets a second copy


class FakeProducer:
    """A transactional producer whose copies are refused (`refuse`) or whose commit fails with `commit_error`."""

    def __init__(self, refuse: bool = False, commit_error: KafkaError | None = None) -> None:
        self.refuse, self.commit_error = refuse, commit_error
        self.calls: list[str] = []
        self._pending: list[Any] = []

    def begin_transaction(self) -> None:
        self.calls.append("begin")

    def produce(self, topic: str, key: Any = None, value: Any = None, on_delivery: Any = None, **_: Any) -> None:
        self.calls.append(f"produce {topic}")
        if on_delivery is not None:
            self._pending.append((on_delivery, len(self._pending)))

    def poll(self, _timeout: float) -> int:
        return 0

    def flush(self, _timeout: float) -> int:
        for callback, offset in self._pending:
            message = type("M", (), {"partition": lambda self: 3, "offset": lambda self, o=offset: 1_000 + o})()
            callback(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE) if self.refuse else None, message)
        self._pending.clear()
        return 0

    def commit_transaction(self, _timeout: float) -> None:
        self.calls.append("commit")
        if self.commit_error is not None:
            raise KafkaException(self.commit_error)

    def abort_transaction(self, _timeout: float) -> None:
        self.calls.append("abort")


def fake_publisher(producer: FakeProducer) -> CopyPublisher:
    publisher = CopyPublisher.__new__(CopyPublisher)
    publisher.settings, publisher.timeout, publisher.ledger = SETTINGS, 1.0, ledger_topic(SETTINGS)
    publisher._producer = producer  # type: ignore[assignment]
    return publisher


def rows_in(engine: Any) -> list[tuple[Any, ...]]:
    with engine.connect() as connection:
        return [tuple(r) for r in connection.execute(select(dlq_replays.c.source_offset, dlq_replays.c.copy_offset))]


def test_copies_whose_transaction_was_aborted_are_not_recorded_as_replayed(database_url: str) -> None:
    """None of them can count, so their rows go again and the same replay can be run again; a commit whose
    outcome Kafka did not tell keeps them (the ledger tells the next replay where they landed if it committed)."""
    engine = open_engine(database_url)
    upgrade(engine)
    original = parcel(0, (3, 105))
    plan = plan_replay(SETTINGS, [original], [original], book_of([]), again=False)
    refused = FakeProducer(refuse=True)
    with pytest.raises(ReplayAborted, match="nothing was recorded either"):
        replay(SETTINGS, engine, plan, fake_publisher(refused), TOPIC_ID)
    assert rows_in(engine) == [] and refused.calls[-1] == "abort" and "commit" not in refused.calls
    fenced = FakeProducer(commit_error=KafkaError(KafkaError._FENCED, "fenced by a newer replay", fatal=True))
    with pytest.raises(PublishError, match="did not say whether"):
        replay(SETTINGS, engine, plan, fake_publisher(fenced), TOPIC_ID)
    assert rows_in(engine) == [(105, None)]
    assert fenced.calls == ["begin", "produce events", "produce events.dlq.replays", "commit"]
    # The transaction did commit after all: the next replay learns where the copy landed from its entry.
    ledger = [LedgerEntry(ROOT, 1, 0, 0, "unknown_kind", (3, 1_000), TOPIC_ID)]
    assert record_ledger(engine, SETTINGS, ledger, TOPIC_ID) == 1
    assert rows_in(engine) == [(105, 1_000)]
    engine.dispose()
