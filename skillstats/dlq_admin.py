"""The operators' side of the dead-letter topic: read what was parked, and replay it (`skillstats dlq`).

Parking is skillstats/dlq.py; this module reads the DLQ and publishes copies
back to the events topic, for when the cause is gone: a contract widened to
accept what was refused, a database restored that had refused a record.

A replay must never make a record count twice. Every copy names its *root*,
the first parcel of that record (`skillstats.replayed_from`), and a copy that
is still invalid is parked again with that name kept. So for each root the
DLQ tells how many of its copies were parked again, and SQL
(`skillstats_dlq_replays`) how many were published; while every published copy
came back parked, none was counted. A root is replayed:

- the first time, when selected;
- again only with `--again`, and only when every earlier copy was parked
  again (a copy that did not come back was counted, or is on its way: a
  further copy would count twice, so not even `--again` sends one);
- once per replay, however many of its parcels (the original, copies parked
  again) the selection holds.

The rows are committed before anything is published, so a replay that dies
half-way leaves its roots recorded as replayed, never sent twice: at worst a
copy is missing and the operator sees it (the row says replayed, no copy came
back, the count did not move). Two replays at once cannot both publish a root:
each row carries the root's replay number, unique per root. A copy keeps the
source record's Kafka timestamp (validity depends on it) and carries its
root's reason, so docsync, which counted the original of a record the windows
group's database refused, skips such a copy.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from sqlalchemy import insert, select
from sqlalchemy.exc import IntegrityError

from skillstats.config import Settings
from skillstats.dlq import (
    H_GROUP,
    H_MESSAGE,
    H_OFFSET,
    H_PARKED_AT,
    H_PARTITION,
    H_REASON,
    H_REPLAYED_FROM,
    H_REPLAYED_REASON,
    H_TIMESTAMP,
    H_TOPIC,
    H_TRUNCATED,
)
from skillstats.publisher import PublishError, producer_config
from skillstats.sinks.schema import dlq_replays
from skillstats.sinks.upserts import now_utc_naive


@dataclass(frozen=True)
class ParkedRecord:
    """A parcel as read back from the DLQ topic."""

    dlq_partition: int
    dlq_offset: int
    reason: str
    message: str
    group: str
    source_topic: str
    source_partition: int | None
    source_offset: int | None
    parked_at_ms: int | None
    replayed_from: str | None  # set when this parcel is a replayed copy that was parked again: its root
    truncated: bool
    timestamp_ms: int | None  # the source record's Kafka timestamp
    key: bytes | None = field(default=None, repr=False)
    value: bytes | None = field(default=None, repr=False)

    @property
    def address(self) -> tuple[int, int]:
        return (self.dlq_partition, self.dlq_offset)

    def summary(self) -> dict[str, Any]:
        """JSON-friendly, without the payload."""
        return {
            "dlq_partition": self.dlq_partition,
            "dlq_offset": self.dlq_offset,
            "reason": self.reason,
            "message": self.message,
            "group": self.group,
            "source_topic": self.source_topic,
            "source_partition": self.source_partition,
            "source_offset": self.source_offset,
            "parked_at_ms": self.parked_at_ms,
            "replayed_from": self.replayed_from,
            "truncated": self.truncated,
            "timestamp_ms": self.timestamp_ms,
        }


def _parse(partition: int, offset: int, key: bytes | None, value: bytes | None, raw: Iterable[Any]) -> ParkedRecord:
    headers = {k: v.decode(errors="replace") for k, v in raw or () if v is not None}

    def number(name: str) -> int | None:
        text = headers.get(name, "")
        return int(text) if text.lstrip("-").isdigit() else None

    return ParkedRecord(
        partition,
        offset,
        headers.get(H_REASON, "?"),
        headers.get(H_MESSAGE, ""),
        headers.get(H_GROUP, "?"),
        headers.get(H_TOPIC, "?"),
        number(H_PARTITION),
        number(H_OFFSET),
        number(H_PARKED_AT),
        headers.get(H_REPLAYED_FROM),
        headers.get(H_TRUNCATED) == "true",
        number(H_TIMESTAMP),
        key,
        value,
    )


def read_parked(
    settings: Settings,
    ranges: Mapping[int, tuple[int, int]],
    timeout: float = 10.0,
    keep_payload: Callable[[ParkedRecord], bool] | None = None,
) -> list[ParkedRecord]:
    """The parcels in `ranges` (DLQ partition -> [start, end) offsets), in DLQ order.

    Keys and values (up to 8 MiB each) are kept only for the parcels
    `keep_payload` accepts (all when it is None): a listing holds summaries.

    The deadline is on progress, not on the whole read: a long read that keeps
    moving finishes, a stuck one raises after `timeout`.
    """
    todo = {d: end for d, (start, end) in ranges.items() if end > start}
    found: list[ParkedRecord] = []
    if not todo:
        return found
    reader = Consumer(
        settings.kafka_config(
            **{
                "group.id": "skillstats-dlq-reader",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                # Retention may delete the first offsets while this reads: go on from the log start.
                "auto.offset.reset": "earliest",
            }
        )
    )
    try:
        reader.assign([TopicPartition(settings.dlq_topic, d, ranges[d][0]) for d in todo])
        deadline = time.monotonic() + timeout
        while todo:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {settings.dlq_topic} made no progress for {timeout:g}s")
            for message in reader.consume(500, timeout=0.2):
                d = message.partition()
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        todo.pop(d, None)
                        continue
                    raise RuntimeError(f"reading {settings.dlq_topic}: {error}")
                deadline = time.monotonic() + timeout
                at = message.offset()
                if d in todo and at < todo[d]:
                    parcel = _parse(d, at, message.key(), message.value(), message.headers() or ())
                    if keep_payload is not None and not keep_payload(parcel):
                        parcel = replace(parcel, key=None, value=None)
                    found.append(parcel)
                if at + 1 >= todo.get(d, 0):
                    todo.pop(d, None)
    finally:
        reader.close()
    found.sort(key=lambda r: r.address)
    return found


def newest_parked(
    settings: Settings, ends: Mapping[int, tuple[int, int]], limit: int = 5, timeout: float = 10.0
) -> list[ParkedRecord]:
    """The `limit` most recently parked records, newest first; `ends`: DLQ partition -> (log start, log end)."""
    ranges = {d: (max(start, end - limit), end) for d, (start, end) in ends.items()}
    found = read_parked(settings, ranges, timeout)
    found.sort(key=lambda r: (r.parked_at_ms or 0, r.dlq_partition, r.dlq_offset), reverse=True)
    return found[:limit]


@dataclass(frozen=True)
class Selection:
    """Filters; a parcel matches when it passes every one given (reason any of, parked at or after, source p:o)."""

    reasons: Sequence[str] = ()
    since_ms: int | None = None
    sources: Sequence[tuple[int, int]] = ()

    def __call__(self, r: ParkedRecord) -> bool:
        return (
            (not self.reasons or r.reason in self.reasons)
            and (self.since_ms is None or (r.parked_at_ms or 0) >= self.since_ms)
            and (not self.sources or (r.source_partition, r.source_offset) in self.sources)
        )


def counts_by_reason(parked: Iterable[ParkedRecord]) -> dict[str, int]:
    return dict(Counter(r.reason for r in parked).most_common())


@dataclass
class ReplayPlan:
    """What a replay of a selection would do: roots to publish, and roots left out with why."""

    publish: list[ParkedRecord] = field(default_factory=list)  # one parcel per root (its payload is the record's)
    roots: dict[tuple[int, int], ParkedRecord] = field(default_factory=dict)  # root address -> parcel to publish
    numbers: dict[tuple[int, int], int] = field(default_factory=dict)  # root address -> this replay's number
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (root as text, why)


def root_of(record: ParkedRecord, topic: str) -> tuple[int, int] | None:
    """The DLQ address of the record's first parcel; None when it names another DLQ topic."""
    if record.replayed_from is None:
        return record.address
    name, _, rest = record.replayed_from.rpartition(":")
    topic_name, _, partition = name.rpartition(":")
    if topic_name != topic or not partition.isdigit() or not rest.isdigit():
        return None
    return (int(partition), int(rest))


def plan_replay(
    settings: Settings,
    parked: Sequence[ParkedRecord],
    selection: Sequence[ParkedRecord],
    replays: Mapping[tuple[int, int], int],
    *,
    again: bool,
) -> ReplayPlan:
    """Decide, per root, whether the selection replays it (see the module docstring)."""
    plan = ReplayPlan()
    parked_copies = Counter(root_of(r, settings.dlq_topic) for r in parked if r.replayed_from is not None)
    for record in selection:
        root = root_of(record, settings.dlq_topic)
        label = f"{settings.dlq_topic}:{record.dlq_partition}:{record.dlq_offset}"
        if root is None:
            plan.skipped.append((label, f"a copy of a record of another DLQ topic ({record.replayed_from})"))
            continue
        if root in plan.roots:
            continue  # one copy per root and replay
        if record.source_topic != settings.topic:
            plan.skipped.append((label, f"parked from another topic ({record.source_topic})"))
            continue
        if record.truncated:
            plan.skipped.append(
                (
                    label,
                    f"parked truncated: the whole record is only in {record.source_topic} partition "
                    f"{record.source_partition} offset {record.source_offset}",
                )
            )
            continue
        if record.reason == "bad_timestamp" and record.timestamp_ms is None:
            plan.skipped.append((label, "its Kafka timestamp, which its validity depends on, was not kept"))
            continue
        published, came_back = replays.get(root, 0), parked_copies.get(root, 0)
        if published > came_back:
            plan.skipped.append(
                (
                    f"{settings.dlq_topic}:{root[0]}:{root[1]}",
                    "replayed before and the copy was not parked again: it "
                    "counted (or is on its way); another copy would count twice",
                )
            )
            continue
        if published and not again:
            plan.skipped.append(
                (
                    f"{settings.dlq_topic}:{root[0]}:{root[1]}",
                    "replayed before (its copies were parked again); --again to replay it once more",
                )
            )
            continue
        plan.roots[root] = record
        plan.numbers[root] = published + 1
        plan.publish.append(record)
    return plan


def replay_counts(engine: Any, topic: str) -> dict[tuple[int, int], int]:
    """Root address -> how many copies of it were published, from skillstats_dlq_replays."""
    with engine.connect() as connection:
        rows = connection.execute(
            select(dlq_replays.c.dlq_partition, dlq_replays.c.dlq_offset).where(dlq_replays.c.dlq_topic == topic)
        )
        return dict(Counter((p, o) for p, o in rows))


class ReplayRefused(Exception):
    """Nothing in the selection can be replayed (the message says why)."""


def replay(settings: Settings, engine: Any, plan: ReplayPlan, timeout: float = 30.0) -> int:
    """Record the plan's roots as replayed, then publish one copy each; returns how many the broker acknowledged.

    Raises PublishError when some copies were not acknowledged: they stay
    recorded (never sent twice), and the message says how to undo that.
    """
    now = now_utc_naive()
    try:
        with engine.begin() as connection:
            connection.execute(
                insert(dlq_replays),
                [
                    {
                        "dlq_topic": settings.dlq_topic,
                        "dlq_partition": root[0],
                        "dlq_offset": root[1],
                        "replay_number": plan.numbers[root],
                        "source_partition": record.source_partition,
                        "source_offset": record.source_offset,
                        "replayed_at": now,
                    }
                    for root, record in plan.roots.items()
                ],
            )
    except IntegrityError:
        raise ReplayRefused("another replay of the same records ran at the same time; nothing was published") from None
    acknowledged: list[tuple[int, int]] = []
    failed: list[str] = []

    def delivered(err: KafkaError | None, _message: Message, root: tuple[int, int]) -> None:
        if err is None:
            acknowledged.append(root)
        else:
            failed.append(f"{settings.dlq_topic}:{root[0]}:{root[1]} ({err})")

    producer = Producer(producer_config(settings))
    for root, record in plan.roots.items():
        headers = [
            (H_REPLAYED_FROM, f"{settings.dlq_topic}:{root[0]}:{root[1]}".encode()),
            (H_REPLAYED_REASON, record.reason.encode()),
        ]
        try:
            producer.produce(
                settings.topic,
                key=record.key,
                value=record.value,
                headers=headers,
                timestamp=record.timestamp_ms or 0,
                on_delivery=lambda err, msg, root=root: delivered(err, msg, root),
            )
        except (BufferError, KafkaException) as exc:
            failed.append(f"{settings.dlq_topic}:{root[0]}:{root[1]} ({exc})")
        producer.poll(0)
    unsent = producer.flush(timeout)
    if failed or unsent:
        raise PublishError(
            f"{len(acknowledged)} cop(ies) acknowledged; not acknowledged: {len(failed) + unsent} "
            f"({'; '.join(failed[:5])}). They stay recorded as replayed, so no replay sends them twice; if the "
            f"broker surely has none of them, delete their rows from skillstats_dlq_replays and replay again.",
            len(failed) + unsent,
        )
    return len(acknowledged)
