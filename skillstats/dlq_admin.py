"""The operators' side of the dead-letter topic: read what was parked, and replay it (`skillstats dlq`).

Parking is skillstats/dlq.py; this module reads the DLQ and brings records
back, for when the cause is gone: a contract widened to accept what was
refused, a database fixed that had refused a record.

A replay must never make a record count twice, and nothing a publisher can
write may change what it does. So a record's identity is its *root*: the
source record it was first parked from, (topic, partition, offset), never a
header and never an address in the DLQ (a record parked twice, by a worker cut
off in a rebalance, has two parcels and one root). SQL
(`skillstats_dlq_replays`, unique per root and replay number) says how many
times a root was replayed and where each copy landed in the events topic (the
copy's position, written once the broker acknowledged it). A parcel whose
source is such a copy position is a copy that was parked again; its root is the
copy's root. While every published copy of a root came back parked, none was
counted. A root is replayed:

- the first time, when selected;
- again only with `--again`, and only when every earlier copy came back parked
  (a copy that did not come back was counted, or is on its way, or its
  position was never recorded: a further copy could count twice, so not even
  `--again` sends one);
- once per replay, however many of its parcels the selection holds;
- only if today's contract accepts it (a copy of a record still invalid would
  be parked again; `--force` sends it anyway).

A record the windows group's database refused (`rejected_by_database`) is
valid, and docsync counted it: a copy on the events topic would count twice
there. It is added to the windows tables directly instead, in one transaction
with its replay row, so it counts exactly once in each group.

The rows are committed before anything is published, so a replay that dies
half-way leaves its roots recorded as replayed, never sent twice: at worst a
copy is missing and the operator sees it. Two replays at once cannot both
publish a root: each row carries the root's replay number, unique per root. A
copy keeps the source record's Kafka timestamp (validity depends on it).
Headers on copies (`skillstats.replayed_from`, `skillstats.replayed_reason`)
tell a reader where a copy came from; neither consumer nor this module trusts
them.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from sqlalchemy import insert, select, update
from sqlalchemy.exc import IntegrityError

from skillstats.config import FIRST_ANSWER_S, Settings
from skillstats.contract import StatEvent
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
from skillstats.sinks.recovery import describe
from skillstats.sinks.schema import dlq_replays, rejected_records
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
    timeout: float = FIRST_ANSWER_S,
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
    settings: Settings, ends: Mapping[int, tuple[int, int]], limit: int = 5, timeout: float = FIRST_ANSWER_S
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


Root = tuple[str, int, int]  # the source record a parcel is of: (topic, partition, offset)


@dataclass
class ReplayPlan:
    """What a replay of a selection would do: roots to publish or apply, and roots left out with why."""

    publish: list[ParkedRecord] = field(default_factory=list)  # one parcel per root (its payload is the record's)
    roots: dict[Root, ParkedRecord] = field(default_factory=dict)  # root -> parcel to publish or apply
    numbers: dict[Root, int] = field(default_factory=dict)  # root -> this replay's number
    direct: list[Root] = field(default_factory=list)  # roots applied to the windows tables, not published
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (root as text, why)


@dataclass
class ReplayBook:
    """What SQL says was replayed: copies published per root, and where each acknowledged copy landed."""

    published: dict[Root, int] = field(default_factory=dict)
    copies: dict[tuple[int, int], Root] = field(default_factory=dict)  # (partition, offset) in the events topic
    refused: set[Root] = field(default_factory=set)  # records the windows group's fence passed as refused


def label(root: Root) -> str:
    return f"{root[0]}:{root[1]}:{root[2]}"


def root_of(record: ParkedRecord, book: ReplayBook, topic: str) -> Root | None:
    """The source record the parcel is of: a recorded copy's root, else its own source; None when unknown."""
    if record.source_partition is None or record.source_offset is None:
        return None
    if record.source_topic == topic:
        copied = book.copies.get((record.source_partition, record.source_offset))
        if copied is not None:
            return copied
    return (record.source_topic, record.source_partition, record.source_offset)


def plan_replay(
    settings: Settings,
    parked: Sequence[ParkedRecord],
    selection: Sequence[ParkedRecord],
    book: ReplayBook,
    *,
    again: bool,
    force: bool = False,
) -> ReplayPlan:
    """Decide, per root, whether the selection replays it (see the module docstring)."""
    from skillstats.contract import Invalid, decode
    from skillstats.dlq import REJECTED_BY_DATABASE

    plan = ReplayPlan()
    # Copies parked again, each once however many parcels it has (a copy parked twice came back once).
    came_back = Counter(
        book.copies[where]
        for where in {
            (r.source_partition, r.source_offset)
            for r in parked
            if r.source_topic == settings.topic and (r.source_partition, r.source_offset) in book.copies
        }
    )
    for record in selection:
        root = root_of(record, book, settings.topic)
        address = f"{settings.dlq_topic}:{record.dlq_partition}:{record.dlq_offset}"
        if root is None:
            plan.skipped.append((address, "its source partition and offset are not in its headers"))
            continue
        if root in plan.roots:
            continue  # one copy per root and replay
        if root[0] != settings.topic:
            plan.skipped.append((address, f"parked from another topic ({root[0]})"))
            continue
        if record.truncated:
            plan.skipped.append(
                (
                    address,
                    f"parked truncated: the whole record is only in {record.source_topic} partition "
                    f"{record.source_partition} offset {record.source_offset}",
                )
            )
            continue
        if record.reason == "bad_timestamp" and record.timestamp_ms is None:
            plan.skipped.append((address, "its Kafka timestamp, which its validity depends on, was not kept"))
            continue
        published, returned = book.published.get(root, 0), came_back.get(root, 0)
        if published > returned:
            plan.skipped.append(
                (
                    label(root),
                    "replayed before and the copy was not parked again: it counted (or is on its way, or where "
                    "it landed was never recorded); another copy could count twice",
                )
            )
            continue
        if published and not again:
            plan.skipped.append(
                (label(root), "replayed before (its copies were parked again); --again to replay it once more")
            )
            continue
        verdict = decode(record.key, record.value, record.timestamp_ms)
        if isinstance(verdict, Invalid) and not force:
            plan.skipped.append(
                (
                    label(root),
                    f"today's contract still refuses it ({verdict.reason.value}: {verdict.message[:120]}); a copy "
                    f"would be parked again. --force publishes it anyway",
                )
            )
            continue
        direct = record.reason == REJECTED_BY_DATABASE and not isinstance(verdict, Invalid)
        if direct and root not in book.refused and not force:
            plan.skipped.append(
                (
                    label(root),
                    "not recorded as skipped by the windows group (its transaction may not have committed, the "
                    "record read and counted again since, or it was parked by a version before this one): adding "
                    "it could count it twice. --force adds it anyway",
                )
            )
            continue
        plan.roots[root] = record
        plan.numbers[root] = published + 1
        if direct:
            plan.direct.append(root)
        else:
            plan.publish.append(record)
    return plan


def replay_book(engine: Any, topic: str) -> ReplayBook:
    """What skillstats_dlq_replays says of the events topic `topic`'s records."""
    book = ReplayBook()
    with engine.connect() as connection:
        rows = connection.execute(
            select(
                dlq_replays.c.source_topic,
                dlq_replays.c.source_partition,
                dlq_replays.c.source_offset,
                dlq_replays.c.copy_partition,
                dlq_replays.c.copy_offset,
            )
        )
        for source_topic, partition, offset, copy_partition, copy_offset in rows:
            if partition is None or offset is None:
                continue
            root = (source_topic or topic, partition, offset)  # rows from before revision 0005 name no topic
            book.published[root] = book.published.get(root, 0) + 1
            if copy_partition is not None and copy_offset is not None:
                book.copies[(copy_partition, copy_offset)] = root
        refused = connection.execute(
            select(rejected_records.c.topic, rejected_records.c.partition, rejected_records.c.offset)
        )
        book.refused = {(t, p, o) for t, p, o in refused}
    return book


class ReplayRefused(Exception):
    """Nothing in the selection can be replayed (the message says why)."""


def replay(settings: Settings, engine: Any, plan: ReplayPlan, timeout: float = 30.0) -> int:
    """Apply the plan's direct roots, record the rest as replayed, publish one copy each and record where each
    landed; returns how many were applied or acknowledged.

    Raises PublishError when some copies were not acknowledged: they stay
    recorded (never sent twice), and the message says how to undo that.
    """
    from skillstats.contract import decode
    from skillstats.sinks.windows import WindowsSink

    now = now_utc_naive()

    def row(root: Root) -> dict[str, Any]:
        record = plan.roots[root]
        return {
            "dlq_topic": settings.dlq_topic,
            "dlq_partition": record.dlq_partition,
            "dlq_offset": record.dlq_offset,
            "replay_number": plan.numbers[root],
            "source_topic": root[0],
            "source_partition": root[1],
            "source_offset": root[2],
            "reason": record.reason,
            "replayed_at": now,
        }

    applied = 0
    concurrent = "another replay of the same records ran at the same time; nothing was published"
    if plan.direct:
        # Counted and recorded in one transaction: recorded means counted, once.
        sink = WindowsSink(engine, settings.windows_group, settings.topic)
        events = [decode(plan.roots[r].key, plan.roots[r].value, plan.roots[r].timestamp_ms) for r in plan.direct]
        with engine.begin() as connection:
            try:
                connection.execute(insert(dlq_replays), [row(root) for root in plan.direct])
            except IntegrityError:
                raise ReplayRefused(concurrent) from None
            try:
                sink.write(connection, sink.fold([e for e in events if isinstance(e, StatEvent)]), now)
            except Exception as exc:
                raise ReplayRefused(
                    f"the database still refuses {len(plan.direct)} record(s) ({describe(exc)}); nothing was added"
                ) from None
        applied = len(plan.direct)
    published = [root for root in plan.roots if root not in plan.direct]
    if published:
        try:
            with engine.begin() as connection:
                connection.execute(insert(dlq_replays), [row(root) for root in published])
        except IntegrityError:
            raise ReplayRefused(concurrent) from None
    acknowledged: dict[Root, tuple[int, int]] = {}
    failed: list[str] = []

    def delivered(err: KafkaError | None, message: Message, root: Root) -> None:
        if err is None:
            acknowledged[root] = (message.partition(), message.offset())
        else:
            failed.append(f"{label(root)} ({err})")

    producer = Producer(producer_config(settings))
    for root in (r for r in plan.roots if r not in plan.direct):
        record = plan.roots[root]
        headers = [
            (H_REPLAYED_FROM, f"{settings.dlq_topic}:{record.dlq_partition}:{record.dlq_offset}".encode()),
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
            failed.append(f"{label(root)} ({exc})")
        producer.poll(0)
    unsent = producer.flush(timeout)
    if acknowledged:
        # Where each copy landed: a parcel of it later is known as a copy parked again,
        # whatever its headers say.
        with engine.begin() as connection:
            for root, (partition, offset) in acknowledged.items():
                connection.execute(
                    update(dlq_replays)
                    .where(
                        dlq_replays.c.source_topic == root[0],
                        dlq_replays.c.source_partition == root[1],
                        dlq_replays.c.source_offset == root[2],
                        dlq_replays.c.replay_number == plan.numbers[root],
                    )
                    .values(copy_partition=partition, copy_offset=offset)
                )
    if failed or unsent:
        raise PublishError(
            f"{len(acknowledged)} cop(ies) acknowledged; not acknowledged: {len(failed) + unsent} "
            f"({'; '.join(failed[:5])}). They stay recorded as replayed, so no replay sends them twice; if the "
            f"broker surely has none of them, delete their rows from skillstats_dlq_replays and replay again.",
            len(failed) + unsent,
        )
    return applied + len(acknowledged)
