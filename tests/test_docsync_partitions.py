"""docsync on logs that are not one tidy murmur2-keyed topic (docs/contract.md), on real Kafka, SQLite, PostgreSQL.

One skill's events spread over several partitions (another partitioner, a
partition-count increase), a topic written by a transactional producer (commit
and abort markers, aborted records, an open transaction), and a topic recreated
under the fences. Expectations come from tests.test_docsync's independent
restatement of docs/contract.md, kinds, never from the production code.
"""

from __future__ import annotations

import random
import time
import uuid
from collections import defaultdict

from confluent_kafka import Consumer, KafkaError, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewPartitions
from sqlalchemy import select

from skillstats.config import Settings
from skillstats.contract import make_event
from skillstats.kafka import committed_offsets, end_offsets, partition_count
from skillstats.sinks.db import open_engine
from skillstats.sinks.schema import docsync_runs
from skillstats.workload import Record
from tests.helpers import (
    actual_docstats,
    expected_docstats,
    fences,
    forget_topic_ids,
    publish,
    recreate_topic,
    run_docsync,
    seed_registry,
    wait_until,
)
from tests.test_publish import cli

SKILLS = [f"sk_multi_{i:02d}" for i in range(24)]
# Most skills have an owner, some none, and every sixth has no row (deleted: skipped, counted).
ROWS: dict[str, str | None] = {
    skill: (None if i % 6 == 4 else f"owner_{i % 5}") for i, skill in enumerate(SKILLS) if i % 6 != 5
}
KINDS = ("download", "download", "download", "install_new", "install_reactivate", "install_deactivate", "install_clear")


def events(count: int, seed: int) -> list[Record]:
    """Valid events of every counting kind over SKILLS, in SKILLS order round-robin (each skill gets some)."""
    rng = random.Random(seed)
    now = int(time.time() * 1000)
    records = []
    for i in range(count):
        skill = SKILLS[i % len(SKILLS)]
        kind = rng.choice(KINDS)
        extra = {}
        if kind == "install_clear":
            extra = {"delta_all_time": rng.randint(-3, 3), "delta_current": rng.randint(-3, 3)}
        event = make_event(skill, kind, now - rng.randrange(86_400_000), **extra)
        records.append(Record(event.key, event.encode(), True))
    return records


class Sent:
    """Which partitions each skill's records were delivered to (from the delivery reports)."""

    def __init__(self) -> None:
        self.partitions: dict[bytes, set[int]] = defaultdict(set)
        self.errors: list[str] = []

    def __call__(self, error: KafkaError | None, message: Message) -> None:
        if error is not None:
            self.errors.append(str(error))
        else:
            self.partitions[message.key()].add(message.partition())


def produce(
    settings: Settings, records: list[Record], sent: Sent, *, partitions: list[int] | None = None, **config: object
) -> None:
    """Publish with a plain confluent-kafka Producer: to `partitions` explicitly, or by `config`'s partitioner.

    `events` cycles through SKILLS, so moving to the next partition after each full
    cycle sends every skill to each of `partitions` in turn.
    """
    producer = Producer(settings.kafka_config(**{"acks": "all", "enable.idempotence": True, **config}))
    for i, record in enumerate(records):
        where = {} if partitions is None else {"partition": partitions[(i // len(SKILLS)) % len(partitions)]}
        producer.produce(settings.topic, value=record.value, key=record.key, on_delivery=sent, **where)
    assert producer.flush(60) == 0, "records left undelivered"
    assert not sent.errors, sent.errors[:5]


def assert_exact(settings: Settings, records: list[Record]) -> None:
    want_skills, want_owners, _unknown = expected_docstats(records, ROWS)
    got_skills, got_owners = actual_docstats(settings)
    assert got_skills == want_skills
    assert got_owners == want_owners


def assert_fences_at_ends(settings: Settings) -> None:
    """Fences and Kafka's committed offsets both at the high watermarks: past the trailing transaction markers."""
    ends = {p: n for p, n in high_watermarks(settings).items() if n > 0}
    assert fences(settings, settings.docsync_group) == ends
    assert committed_offsets(settings, settings.docsync_group, settings.topic) == ends


def test_one_skill_through_several_partitions_adds_up(settings: Settings) -> None:
    seed_registry(settings, ROWS)
    sent = Sent()
    murmur2 = events(240, seed=1)
    crc32 = events(240, seed=2)
    explicit = events(12 * len(SKILLS), seed=3)
    assert publish(settings, murmur2) == len(murmur2)  # the project's Publisher: murmur2_random
    produce(settings, crc32, sent, partitioner="consistent_random")  # librdkafka's default, kcat's
    produce(settings, explicit, sent, partitions=list(range(12)))  # every skill in every partition
    first = murmur2 + crc32 + explicit
    # The premise: each skill's deltas arrive through many partitions, so four partitions
    # per SQL transaction (the default chunk) meet the same skill four times.
    assert all(len(sent.partitions[skill.encode()]) == 12 for skill in SKILLS)

    status, [summary] = run_docsync(settings)
    assert status == 0 and summary["stopped_reason"] == "caught_up", summary
    assert summary["events_read"] == len(first)
    assert summary["unknown_skill_events"] == sum(1 for r in first if (r.key or b"").decode() not in ROWS) > 0
    assert_exact(settings, first)

    # More partitions: murmur2 now sends keys elsewhere, and the new partitions get their share.
    admin = AdminClient(settings.kafka_config())
    for future in admin.create_partitions([NewPartitions(settings.topic, 16)]).values():
        future.result(30)
    wait_until(lambda: partition_count(settings, settings.topic) == 16, 30, "the topic to show 16 partitions")
    moved = events(240, seed=4)
    added = events(4 * len(SKILLS), seed=5)
    assert publish(settings, moved) == len(moved)
    produce(settings, added, sent, partitions=[12, 13, 14, 15])
    assert all(len(sent.partitions[skill.encode()]) == 16 for skill in SKILLS)

    status, [second] = run_docsync(settings)
    assert status == 0 and second["stopped_reason"] == "caught_up", second
    assert second["events_read"] == len(moved) + len(added)
    assert_exact(settings, first + moved + added)
    assert_fences_at_ends(settings)


def transactional(settings: Settings) -> Producer:
    producer = Producer(
        settings.kafka_config(
            **{"transactional.id": f"test-{uuid.uuid4().hex[:10]}", "partitioner": "murmur2_random", "acks": "all"}
        )
    )
    producer.init_transactions(30)
    return producer


def in_transaction(producer: Producer, topic: str, records: list[Record], *, commit: bool | None) -> None:
    """One transaction: committed (True), aborted (False), or left open with its records written (None)."""
    producer.begin_transaction()
    for record in records:
        producer.produce(topic, value=record.value, key=record.key)
    if commit is None:
        assert producer.flush(30) == 0
    elif commit:
        producer.commit_transaction(30)
    else:
        assert producer.flush(30) == 0  # on the log, then aborted: a gap of records never handed over
        producer.abort_transaction(30)


def test_transactional_topic_drains_to_caught_up(settings: Settings) -> None:
    seed_registry(settings, ROWS)
    committed, aborted, later = events(50, seed=11), events(20, seed=12), events(50, seed=13)
    producer = transactional(settings)
    in_transaction(producer, settings.topic, committed, commit=True)
    in_transaction(producer, settings.topic, aborted, commit=False)
    in_transaction(producer, settings.topic, later, commit=True)  # every partition written ends in a marker
    producer.flush(30)

    status, [summary] = run_docsync(settings, "--max-seconds", "120")
    assert status == 0, summary
    assert summary["stopped_reason"] == "caught_up", summary
    assert summary["duration_seconds"] < 60
    assert summary["events_read"] == 100
    assert_exact(settings, committed + later)  # the aborted twenty count for nothing
    assert_fences_at_ends(settings)

    status, [again] = run_docsync(settings, "--max-seconds", "120")
    assert status == 0 and (again["stopped_reason"], again["events_read"]) == ("caught_up", 0), again
    assert_exact(settings, committed + later)


def test_open_transaction_does_not_hold_the_drain(settings: Settings) -> None:
    seed_registry(settings, ROWS)
    before, pending = events(60, seed=21), events(30, seed=22)
    producer = transactional(settings)
    in_transaction(producer, settings.topic, before, commit=True)
    in_transaction(producer, settings.topic, pending, commit=None)  # read_committed stops below these
    written = high_watermarks(settings)
    stable = high_watermarks(settings, "read_committed")  # a read_committed ListOffsets: the last stable offsets
    assert any(stable[p] < end for p, end in written.items()), "the open transaction is on no partition"

    status, [summary] = run_docsync(settings, "--max-seconds", "120")
    assert status == 0 and summary["stopped_reason"] == "caught_up", summary
    assert summary["events_read"] == len(before)
    assert_exact(settings, before)
    # Held at the open transaction's first record, not moved past what it could not read.
    assert fences(settings, settings.docsync_group) == {p: n for p, n in stable.items() if n > 0}

    producer.commit_transaction(30)
    status, [after] = run_docsync(settings, "--max-seconds", "120")
    assert status == 0 and after["stopped_reason"] == "caught_up", after
    assert after["events_read"] == len(pending)  # resumed at the open transaction's first record
    assert_exact(settings, before + pending)
    assert_fences_at_ends(settings)


def high_watermarks(settings: Settings, isolation: str = "read_uncommitted") -> dict[int, int]:
    """Each partition's high watermark, open transactions included (read_committed: the last stable offsets)."""
    consumer = Consumer(settings.kafka_config(**{"group.id": "tests-watermarks", "isolation.level": isolation}))
    try:
        return {
            p: consumer.get_watermark_offsets(TopicPartition(settings.topic, p), timeout=10)[1]
            for p in range(partition_count(settings, settings.topic))
        }
    finally:
        consumer.close()


def test_fence_ahead_of_the_log_stops_the_drain_loudly(settings: Settings) -> None:
    """A recreated topic shorter than the fences, in a database migrated from before topic ids were kept
    (so only the fences can tell; with the id recorded, test_positions.py's refusal comes first)."""
    seed_registry(settings, ROWS)
    drained = events(600, seed=31)
    assert publish(settings, drained) == len(drained)
    status, [summary] = run_docsync(settings)
    assert status == 0 and summary["stopped_reason"] == "caught_up", summary
    stats_before = actual_docstats(settings)
    fences_before = fences(settings, settings.docsync_group)

    forget_topic_ids(settings)
    recreate_topic(settings, 12)
    fresh = events(24, seed=32)
    assert publish(settings, fresh) == len(fresh)
    ends = end_offsets(settings, settings.topic)
    ahead = {p: (f, ends.get(p, 0)) for p, f in fences_before.items() if f > ends.get(p, 0)}
    assert ahead, "the recreated topic is not shorter than the fences"

    result = cli(settings, "docsync")
    assert result.returncode == 2, result.stdout + result.stderr
    for output in (result.stdout, result.stderr):  # the summary, and the log line
        for p, (fence, end) in ahead.items():
            assert f"partition {p}: fence {fence} > log end {end}" in output, output
    assert "skillstats fences reset" in result.stdout
    assert actual_docstats(settings) == stats_before  # nothing of the new topic applied
    assert fences(settings, settings.docsync_group) == fences_before

    engine = open_engine(settings.database_url)
    try:
        with engine.connect() as connection:
            last = connection.execute(select(docsync_runs).order_by(docsync_runs.c.id.desc())).first()
    finally:
        engine.dispose()
    assert last is not None and last.stopped_reason == "error" and last.finished_at is not None
    assert last.last_error.startswith("FenceAheadOfLog: ")
    assert all(f"partition {p}: fence {f} > log end {e}" in last.last_error for p, (f, e) in ahead.items())
