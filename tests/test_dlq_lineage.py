"""Whose parcels a group recognises as its own: every group that wrote the same tables (skillstats/dlq.py).

A parcel names the group that parked it, and, from this version on, the
database whose counts skip it (`skillstats.database`: the windows role's claim
mark, which `fences takeover` and `fences reset` keep). A worker reading the DLQ
back from its marks (a batch replayed after kill -9) recognises a parcel by that
mark, so a renamed group does not park again what its predecessor parked before
it died; a parcel without one (parked by an older version) by its group name,
as before. Real Kafka (the DLQ topic of each test), real SQLite, the real
takeover; the worker's kill is simulated between parking and its commit.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace

import pytest
from confluent_kafka import Producer

from skillstats.config import Settings
from skillstats.dlq import H_DATABASE, H_GROUP, H_OFFSET, H_PARTITION, DeadLetters, Parcel, own_parcel, park_headers
from skillstats.dlq_admin import plan_replay, read_parked, replay_book
from skillstats.kafka import RawRecord, watermarks
from skillstats.sinks.db import open_engine
from skillstats.sinks.identity import WINDOWS, Owner, claim, take_over
from skillstats.sinks.pipeline import WindowsPipeline
from skillstats.sinks.upserts import now_utc_naive
from tests.helpers import read_records
from tests.test_dlq_marks import AT, DyingSink, Fetched, Killed, batch


def parcels_in_dlq(settings: Settings) -> Counter[tuple[int, int]]:
    """(source partition, source offset) -> how many parcels of it the DLQ topic holds."""
    return Counter(
        (int(r.headers[H_PARTITION]), int(r.headers[H_OFFSET])) for r in read_records(settings, settings.dlq_topic)
    )


def records(base: int) -> list[Fetched]:
    """Ten records of partition 0 from `base`: the third one the database refuses, the ninth not JSON."""
    return [Fetched(0, base + r.offset, r.key, r.value) for r in batch()]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_renamed_group_recognises_what_its_predecessor_parked_before_it_died(settings: Settings) -> None:
    """OLD applies a batch (parcels, fence and DLQ mark committed), parks the next batch's invalid record and
    dies before its commit; the operator hands OLD's fences to NEW (`fences takeover`), and NEW reads that
    batch again from the fence. Each record is parked once, and the replay tools under NEW's settings take
    OLD's parcels for what they are: the parcels of the records NEW's tables skipped."""
    old, new = settings.windows_group, f"{settings.windows_group}-v2"
    engine = open_engine(settings.database_url)
    claim(engine, Owner(WINDOWS, old, settings.topic, None), now_utc_naive())
    sink = DyingSink(engine, old, settings.topic)
    parking = DeadLetters(settings, old, timeout=10)
    try:
        WindowsPipeline(sink, parking).process({0: records(0)}, {0: 0})
        sink.commits_left = 0  # the next batch parks, then kill -9 before its transaction
        with pytest.raises(Killed):
            WindowsPipeline(sink, parking).process({0: records(10)}, {0: 10})
    finally:
        parking.close()
    assert sink.fences() == {0: 10}
    assert parcels_in_dlq(settings) == {(0, 2): 1, (0, 8): 1, (0, 18): 1}

    take_over(engine, WINDOWS, old, new, now_utc_naive())
    renamed = replace(settings, windows_group=new)
    sink = DyingSink(engine, new, settings.topic)
    parking = DeadLetters(renamed, new, timeout=10)
    try:
        fence = sink.fences()[0]
        WindowsPipeline(sink, parking).process({0: [r for r in records(10) if r.offset >= fence]}, {0: fence})
    finally:
        parking.close()
    assert sink.fences() == {0: 20}
    assert parcels_in_dlq(settings) == {(0, 2): 1, (0, 8): 1, (0, 18): 1, (0, 12): 1}, "a record parked twice"

    # `dlq list` and `dlq replay` under NEW's settings: every parcel, OLD's included, is of NEW's tables.
    parked = read_parked(renamed, watermarks(renamed, renamed.dlq_topic))
    assert Counter(r.group for r in parked) == {old: 3, new: 1}
    plan = plan_replay(renamed, parked, parked, replay_book(engine, renamed.topic), again=False, force=True)
    assert sorted(plan.roots) == [(settings.topic, 0, offset) for offset in (2, 8, 12, 18)]
    assert sorted(plan.direct) == [(settings.topic, 0, 2), (settings.topic, 0, 12)]  # refused: proven skipped
    engine.dispose()


def park_as(settings: Settings, group: str, database: str | None, partition: int, offset: int) -> None:
    parcel = Parcel(RawRecord(partition, offset, b"sk", b"not json"), "malformed", "by hand", None, AT)
    producer = Producer({"bootstrap.servers": settings.kafka_bootstrap})
    headers = park_headers(parcel, settings.topic, group, int(time.time() * 1000), database)
    producer.produce(settings.dlq_topic, key=b"sk", value=b"not json", partition=0, headers=headers)
    assert producer.flush(30) == 0


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_another_databases_parcel_is_not_this_groups_even_under_the_same_group_name(settings: Settings) -> None:
    """A deployment with a database of its own parks into the same DLQ under the same group name: its
    parcel is its verdict, not this database's, so the worker parks the record itself. A parcel with no
    mark (an older version's) goes by its group name, as before."""
    group = settings.windows_group
    engine = open_engine(settings.database_url)
    claim(engine, Owner(WINDOWS, group, settings.topic, None), now_utc_naive())
    park_as(settings, group, "another-database", 0, 8)  # the invalid record of batch()
    park_as(settings, group, None, 0, 2)  # the refused one, by an older version of this group
    sink = DyingSink(engine, group, settings.topic)
    parking = DeadLetters(settings, group, timeout=10)
    try:
        WindowsPipeline(sink, parking).process({0: batch()}, {0: 0})
    finally:
        parking.close()
    records = read_records(settings, settings.dlq_topic)
    assert parcels_in_dlq(settings) == {(0, 8): 2, (0, 2): 1}
    mine = [r for r in records if r.headers.get(H_DATABASE) not in (None, b"another-database")]
    assert [(r.headers[H_GROUP], r.headers[H_OFFSET]) for r in mine] == [(group.encode(), b"8")]
    engine.dispose()


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({H_GROUP: b"old", H_DATABASE: b"m1"}, True),  # a predecessor's, same database
        ({H_GROUP: b"new", H_DATABASE: b"m2"}, False),  # another database's, same name
        ({H_GROUP: b"new"}, True),  # an older version's, this group
        ({H_GROUP: b"old"}, False),  # an older version's, another group: nothing says it is ours
        ({H_DATABASE: b"m1"}, True),
    ],
)
def test_a_parcel_is_recognised_by_its_database_mark_else_by_its_group(headers: dict, expected: bool) -> None:
    assert own_parcel(headers, "new", "m1") is expected
    if H_DATABASE not in headers:  # without a mark of its own the worker goes by name only
        assert own_parcel(headers, "new", None) is expected
