"""The operators' side of the dead-letter topic: read what was parked, and replay it (`skillstats dlq`).

Parking is skillstats/dlq.py; this module only reads the DLQ and publishes
copies back to the events topic. A replay is for when the cause is gone: a
contract fixed to accept what was refused, a database restored that had
refused a record. Each replayed copy carries the header
`skillstats.replayed_from` (DLQ topic, partition, offset); a copy that is
still invalid is parked again with that header kept, and such a record is
not replayed again unless asked (`--again`), so nothing loops.

Replays are recorded in SQL (`skillstats_dlq_replays`), and a selection that
holds a record replayed before is refused unless `--again`: a replay is a new
record in the events topic and counts again. The rows are written in the
same transaction that waits for the broker's acknowledgement of the copies,
so a failed publish leaves no row. (A crash after the acknowledgement and
before the commit leaves the copies without rows: `dlq list` shows no replay,
and a second replay would count them twice. The window is the commit.)
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition
from sqlalchemy import insert, select

from skillstats.config import Settings
from skillstats.dlq import (
    H_GROUP,
    H_MESSAGE,
    H_OFFSET,
    H_PARKED_AT,
    H_PARTITION,
    H_REASON,
    H_REPLAYED_FROM,
    H_TOPIC,
    H_TRUNCATED,
)
from skillstats.publisher import Publisher
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
    replayed_from: str | None  # set when this parcel is a replayed copy that was parked again
    truncated: bool
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
        key,
        value,
    )


def read_parked(settings: Settings, ranges: Mapping[int, tuple[int, int]], timeout: float = 10.0) -> list[ParkedRecord]:
    """The parcels in `ranges` (DLQ partition -> [start, end) offsets), in DLQ order.

    The deadline is on progress, not on the whole read: a long read that keeps
    moving finishes, a stuck one raises after `timeout`.
    """
    todo = {d: end for d, (start, end) in ranges.items() if end > start}
    found: list[ParkedRecord] = []
    if not todo:
        return found
    reader = Consumer(
        settings.kafka_config(
            **{"group.id": "skillstats-dlq-reader", "enable.auto.commit": False, "enable.partition.eof": True}
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
                    found.append(_parse(d, at, message.key(), message.value(), message.headers() or ()))
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


def select_parked(
    parked: Sequence[ParkedRecord],
    *,
    reasons: Sequence[str] = (),
    since_ms: int | None = None,
    sources: Sequence[tuple[int, int]] = (),
) -> list[ParkedRecord]:
    """The parcels that match every filter given (reason any of, parked at or after, source partition:offset)."""
    wanted_sources = set(sources)
    return [
        r
        for r in parked
        if (not reasons or r.reason in reasons)
        and (since_ms is None or (r.parked_at_ms or 0) >= since_ms)
        and (not wanted_sources or (r.source_partition, r.source_offset) in wanted_sources)
    ]


def counts_by_reason(parked: Iterable[ParkedRecord]) -> dict[str, int]:
    return dict(Counter(r.reason for r in parked).most_common())


def replayed_before(engine: Any, topic: str, addresses: Iterable[tuple[int, int]]) -> set[tuple[int, int]]:
    wanted = set(addresses)
    with engine.connect() as connection:
        rows = connection.execute(
            select(dlq_replays.c.dlq_partition, dlq_replays.c.dlq_offset).where(dlq_replays.c.dlq_topic == topic)
        )
        return {(p, o) for p, o in rows if (p, o) in wanted}


class ReplayRefused(Exception):
    """The selection cannot be replayed as asked (the message says why and what to do)."""


def replay(
    settings: Settings, engine: Any, selection: Sequence[ParkedRecord], *, again: bool, timeout: float = 30.0
) -> int:
    """Publish copies of the selected parcels to the events topic; returns how many the broker acknowledged."""
    if not again:
        before = replayed_before(engine, settings.dlq_topic, (r.address for r in selection))
        failed_again = [r for r in selection if r.replayed_from]
        if before:
            shown = ", ".join(f"{p}:{o}" for p, o in sorted(before)[:10])
            raise ReplayRefused(
                f"{len(before)} of the selected parked record(s) were replayed before (DLQ partition:offset {shown}"
                f"{' ...' if len(before) > 10 else ''}); a replay counts them again. Give --again to replay anyway."
            )
        if failed_again:
            raise ReplayRefused(
                f"{len(failed_again)} of the selected record(s) are replayed copies that were parked again (still "
                f"invalid); replaying them would only park them once more. Give --again if the cause is fixed now."
            )
    truncated = [r for r in selection if r.truncated]
    if truncated:
        raise ReplayRefused(
            f"{len(truncated)} selected record(s) were parked truncated; their full value is only in the source "
            f"topic ({truncated[0].source_topic} partition {truncated[0].source_partition} offset "
            f"{truncated[0].source_offset}): leave them out of the selection"
        )
    now = now_utc_naive()
    with engine.begin() as connection:
        if selection:
            connection.execute(
                insert(dlq_replays),
                [
                    {
                        "dlq_topic": settings.dlq_topic,
                        "dlq_partition": r.dlq_partition,
                        "dlq_offset": r.dlq_offset,
                        "source_partition": r.source_partition,
                        "source_offset": r.source_offset,
                        "replayed_at": now,
                    }
                    for r in selection
                ],
            )
        # The copies are acknowledged before the rows commit: a failed publish rolls them back.
        with Publisher(settings, flush_timeout=timeout) as publisher:
            for r in selection:
                origin = f"{settings.dlq_topic}:{r.dlq_partition}:{r.dlq_offset}".encode()
                publisher.send_raw(r.key, r.value, headers=[(H_REPLAYED_FROM, origin)])
        return publisher.delivered
