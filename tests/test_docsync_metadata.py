"""What Kafka's metadata says for a moment is not a refusal (real Kafka and SQLite, the metadata's answers altered).

A refusal (exit status 2: a topic that does not exist, a fence ahead of its log)
waits for an operator, so it must rest on what the cluster says for good, not on
one broker's answer while a topic is being created or its partitions added: a
topic whose leader is not elected yet (LEADER_NOT_AVAILABLE), a topic one broker
does not list yet or the controller does not know yet (UNKNOWN_TOPIC_OR_PART),
metadata that does not list partitions just added. A single local broker answers
those for milliseconds at most, so the answers are altered here, at the one place
every metadata request of skillstats goes through (skillstats.kafka.cluster_metadata,
TopicIds.request); everything else (the topic, the group, the database) is real.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewPartitions

from skillstats import kafka
from skillstats.config import Settings
from skillstats.contract import make_event
from skillstats.kafka import end_offsets, partition_count
from skillstats.streams.docsync import DocSync
from skillstats.workload import Record
from tests.helpers import actual_docstats, expected_docstats, fences, seed_registry, wait_until

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)

SKILLS = [f"sk_meta_{i:02d}" for i in range(16)]
ROWS: dict[str, str | None] = {skill: f"owner_{i % 3}" for i, skill in enumerate(SKILLS)}


def produce(settings: Settings, partitions: range, seed: int) -> list[Record]:
    """Two valid events of each skill to each of `partitions`, explicitly (whatever the partitioner)."""
    producer = Producer(settings.kafka_config(acks="all"))
    now = int(time.time() * 1000)
    records = []
    for partition in partitions:
        for i, skill in enumerate(SKILLS):
            kind = ("download", "install_new")[(i + seed) % 2]
            event = make_event(skill, kind, now - 1000)
            producer.produce(settings.topic, key=event.key, value=event.encode(), partition=partition)
            records.append(Record(event.key, event.encode(), True))
    assert producer.flush(60) == 0
    return records


class Answers:
    """Alters the first `count` metadata answers about the topic with `change` (None: all of them)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, topic: str, change: Callable[[Any], None], count: int | None):
        self.topic, self.change, self.count = topic, change, count
        self.altered = 0
        self.asked = 0
        real = kafka.cluster_metadata

        def altered(*args: Any, **kwargs: Any) -> Any:
            metadata = real(*args, **kwargs)
            if self.topic in metadata.topics:
                self.asked += 1
                if self.count is None or self.altered < self.count:
                    self.altered += 1
                    self.change(metadata)
            return metadata

        monkeypatch.setattr(kafka, "cluster_metadata", altered)


def assert_exact(settings: Settings, records: list[Record]) -> None:
    want_skills, want_owners, _unknown = expected_docstats(records, ROWS)
    assert actual_docstats(settings) == (want_skills, want_owners)


def leader_not_available(topic: str) -> Callable[[Any], None]:
    def change(metadata: Any) -> None:
        metadata.topics[topic].error = KafkaError(KafkaError.LEADER_NOT_AVAILABLE)
        metadata.topics[topic].partitions = {}

    return change


def not_listed(topic: str) -> Callable[[Any], None]:
    def change(metadata: Any) -> None:
        del metadata.topics[topic]

    return change


@pytest.mark.parametrize("answer", ["leader_not_available", "not_listed", "unknown_to_the_controller"])
def test_a_topic_being_created_is_asked_about_again_not_refused(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, answer: str
) -> None:
    seed_registry(settings, ROWS)
    records = produce(settings, range(12), seed=1)
    if answer == "unknown_to_the_controller":
        real_request = kafka.TopicIds.request
        unknown = [2]

        def request(self: kafka.TopicIds, topic: str) -> Future[Any]:
            if not unknown[0]:
                return real_request(self, topic)
            unknown[0] -= 1
            future: Future[Any] = Future()
            future.set_exception(KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)))
            return future

        monkeypatch.setattr(kafka.TopicIds, "request", request)
        summary = DocSync(settings).drain()
        assert not summary.refused and summary.stopped_reason == "caught_up", summary.error
        assert unknown == [0]
    else:
        change = leader_not_available if answer == "leader_not_available" else not_listed
        answers = Answers(monkeypatch, settings.topic, change(settings.topic), count=2)
        summary = DocSync(settings).drain()
        assert not summary.refused and summary.stopped_reason == "caught_up", summary.error
        assert answers.altered == 2 and answers.asked > 2
    assert summary.events_read == len(records)
    assert_exact(settings, records)


def test_a_topic_that_does_not_exist_is_still_refused(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    answers = Answers(monkeypatch, settings.topic, not_listed(settings.topic), count=None)
    summary = DocSync(settings).drain()
    assert summary.refused and (summary.error or "").startswith("TopicMissing: "), summary.error
    assert answers.asked > 1  # asked again before it was called missing


def test_a_fence_on_a_partition_stale_metadata_leaves_out_is_asked_again(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Partitions 12-15 added and drained; then a broker's metadata that does not list them yet would make their
    fences look ahead of the log (end 0): asked again, they are there, and the drain goes on. Listed by no
    answer at all, the fences are called ahead of the log, as before."""
    admin = AdminClient(settings.kafka_config())
    for future in admin.create_partitions([NewPartitions(settings.topic, 16)]).values():
        future.result(30)
    wait_until(lambda: partition_count(settings, settings.topic) == 16, 30, "the topic to show 16 partitions")
    seed_registry(settings, ROWS)
    first = produce(settings, range(16), seed=1)
    summary = DocSync(settings).drain()
    assert summary.stopped_reason == "caught_up", summary.error
    assert all(fences(settings, settings.docsync_group).get(p) for p in range(12, 16))
    second = produce(settings, range(16), seed=2)

    def before_the_increase(metadata: Any) -> None:
        for partition in range(12, 16):
            metadata.topics[settings.topic].partitions.pop(partition, None)

    # The claim's answer, the drain's snapshot's and the first one asked again: all stale.
    answers = Answers(monkeypatch, settings.topic, before_the_increase, count=3)
    with caplog.at_level(logging.WARNING, "skillstats.positions"):
        summary = DocSync(settings).drain()
    assert not summary.refused and summary.stopped_reason == "caught_up", summary.error
    assert answers.altered == 3
    assert summary.events_read == len(second)
    assert_exact(settings, first + second)
    ends = {p: n for p, n in end_offsets(settings, settings.topic).items() if n > 0}
    assert fences(settings, settings.docsync_group) == ends
    assert "the metadata lists no partition(s) [12, 13, 14, 15]" in caplog.text

    # Never listed: gone for good, as far as anyone can tell. Refused, nothing applied.
    produce(settings, range(16), seed=3)
    answers = Answers(monkeypatch, settings.topic, before_the_increase, count=None)
    summary = DocSync(settings).drain()
    assert summary.refused and (summary.error or "").startswith("FenceAheadOfLog: "), summary.error
    for partition in range(12, 16):
        assert f"partition {partition}: fence {ends[partition]} > log end 0" in (summary.error or "")
    assert answers.asked > 2
    assert_exact(settings, first + second)
