"""What a rebuild asks of the log: where a day's records begin, and the records between two positions.

Both read committed records only, as both groups do, and decode them with the
contract's own `decode_many` on the record's key, value and Kafka timestamp: the
verdict on a record is the one every consumer reaches.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Consumer, KafkaError, TopicPartition

from skillstats.config import FIRST_ANSWER_S, Settings
from skillstats.contract import StatEvent, decode_many
from skillstats.dlq import H_REPLAYED_FROM
from skillstats.kafka import watermarks

# The contract's bound on how far an event's occurred_at may run ahead of its record's Kafka timestamp.
FUTURE_SKEW_MS = 600_000


@dataclass(frozen=True, slots=True)
class LoggedEvent:
    partition: int
    offset: int
    event: StatEvent


def _reader(settings: Settings) -> Consumer:
    return Consumer(
        settings.kafka_config(
            **{
                "group.id": "skillstats-rebuild-reader",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "isolation.level": "read_committed",
                "auto.offset.reset": "error",
            }
        )
    )


def offsets_at(settings: Settings, topic: str, at_ms: int, ends: Mapping[int, int]) -> dict[int, int]:
    """Per partition, the first offset whose record's timestamp is at or after `at_ms` (its log end when none is):
    every record below it has an earlier timestamp (Kafka's ListOffsets by time)."""
    reader = _reader(settings)
    try:
        asked = [TopicPartition(topic, p, at_ms) for p in sorted(ends)]
        found = reader.offsets_for_times(asked, timeout=FIRST_ANSWER_S)
        result = {}
        for tp in found:
            if tp.error is not None:
                raise RuntimeError(f"{topic} [{tp.partition}]: offsets by time: {tp.error}")
            result[tp.partition] = tp.offset if tp.offset >= 0 else ends[tp.partition]
        return result
    finally:
        reader.close()


def parked_sources(settings: Settings, topic: str, group: str, database: str | None) -> set[tuple[int, int]]:
    """The records of `topic` the group writing the windows tables of the database marked `database` has parked in
    the DLQ (every parcel the DLQ still holds), as (partition, offset)."""
    from skillstats.dlq_admin import read_parked

    logs = watermarks(settings, settings.dlq_topic)
    parcels = read_parked(settings, logs, keep_payload=lambda _parcel: False)
    return {
        (parcel.source_partition, parcel.source_offset)
        for parcel in parcels
        if parcel.source_topic == topic
        and parcel.source_partition is not None
        and parcel.source_offset is not None
        and (
            parcel.database == database
            if parcel.database is not None and database is not None
            else parcel.group == group
        )
    }


def first_timestamps(
    settings: Settings, topic: str, starts: Mapping[int, int], ends: Mapping[int, int]
) -> dict[int, int]:
    """Per partition with records, the Kafka timestamp of its first record at or after `starts` (-1: none said) that
    is not a DLQ replay's copy (a copy keeps its source record's timestamp, older than the records around it)."""
    todo = {p: s for p, s in starts.items() if ends.get(p, 0) > s}
    found: dict[int, int] = {}
    if not todo:
        return found
    reader = _reader(settings)
    try:
        reader.assign([TopicPartition(topic, p, s) for p, s in todo.items()])
        deadline = time.monotonic() + 3 * FIRST_ANSWER_S
        while set(todo) - set(found) and time.monotonic() < deadline:
            for message in reader.consume(100, timeout=0.2):
                error = message.error()
                p = message.partition()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        todo.pop(p, None)
                        continue
                    raise RuntimeError(f"reading {topic} [{p}]: {error}")
                if p not in found and not any(name == H_REPLAYED_FROM for name, _v in message.headers() or ()):
                    kind, stamp = message.timestamp()
                    found[p] = stamp if kind != TIMESTAMP_NOT_AVAILABLE else -1
        missing = set(todo) - set(found)
        if missing:
            raise TimeoutError(f"reading the first records of {topic} partitions {sorted(missing)} timed out")
        return found
    finally:
        reader.close()


def read_between(
    settings: Settings, topic: str, spans: Mapping[int, tuple[int, int]], timeout: float = 30.0
) -> list[LoggedEvent]:
    """The valid events of the records in [first, end) of each partition (`spans`: partition -> (first, end)).

    The ends are positions a group reached, so the log holds everything below them (transaction markers and
    aborted records are passed over, as the groups pass them). The deadline is on progress: a long read that
    keeps moving finishes, a stuck one raises after `timeout`."""
    todo = {p: (a, b) for p, (a, b) in spans.items() if b > a}
    events: list[LoggedEvent] = []
    if not todo:
        return events
    reader = _reader(settings)
    try:
        reader.assign([TopicPartition(topic, p, a) for p, (a, _b) in todo.items()])
        deadline = time.monotonic() + timeout
        reached = {p: a for p, (a, _b) in todo.items()}
        while todo:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic} partitions {sorted(todo)} made no progress for {timeout:g}s")
            messages = reader.consume(10_000, timeout=0.2)
            keys, values, stamps, where = [], [], [], []
            for message in messages:
                error = message.error()
                p = message.partition()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF and p in todo:
                        position = message.offset()
                        if position >= todo[p][1]:
                            todo.pop(p)
                            continue
                        raise RuntimeError(
                            f"{topic} [{p}] ends at {position}, below {todo[p][1]}, a position a group reached: "
                            f"the log is not the one the fences were taken on"
                        )
                    if error.code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(f"reading {topic} [{p}]: {error}")
                    continue
                if p not in todo:
                    continue
                deadline = time.monotonic() + timeout
                offset = message.offset()
                first, end = todo[p]
                if first <= offset < end:
                    kind, stamp = message.timestamp()
                    keys.append(message.key())
                    values.append(message.value())
                    stamps.append(stamp if kind != TIMESTAMP_NOT_AVAILABLE else None)
                    where.append((p, offset))
                if offset + 1 >= end:
                    todo.pop(p)
            if keys:
                decoded, _invalid = decode_many(keys, values, stamps)
                events.extend(
                    LoggedEvent(p, o, event) for (p, o), event in zip(where, decoded, strict=True) if event is not None
                )
            # Past markers: the read's position says how far it has come even when no record is handed over
            # (progress too: a long run of aborted records is not a stall).
            if todo:
                for tp in reader.position([TopicPartition(topic, p) for p in todo]):
                    if tp.offset > reached.get(tp.partition, -1):
                        reached[tp.partition] = tp.offset
                        deadline = time.monotonic() + timeout
                    if tp.offset >= 0 and tp.offset >= todo[tp.partition][1]:
                        todo.pop(tp.partition, None)
        return events
    finally:
        reader.close()
