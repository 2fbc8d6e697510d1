"""The dead-letter topic: what a parked record carries, and parking it safely (SPEC §6)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from skillstats.config import Settings
from skillstats.kafka import Headers, RawRecord
from skillstats.publisher import Publisher, PublishError
from skillstats.retry import Backoff

log = logging.getLogger(__name__)

# Not a SPEC §2 reason: the record is valid, but the database refused it (for
# example PostgreSQL rejects a NUL character inside a TEXT skill id).
REJECTED_BY_DATABASE = "rejected_by_database"

H_REASON = "skillstats.reason"
H_MESSAGE = "skillstats.message"
H_TOPIC = "skillstats.source.topic"
H_PARTITION = "skillstats.source.partition"
H_OFFSET = "skillstats.source.offset"
H_PARKED_AT = "skillstats.parked_at"
H_GROUP = "skillstats.group"


@dataclass(frozen=True, slots=True)
class Parcel:
    """A record on its way to the DLQ, and why."""

    record: RawRecord
    reason: str
    message: str


def park_headers(parcel: Parcel, source_topic: str, group: str, parked_at_ms: int) -> Headers:
    return [
        (H_REASON, parcel.reason.encode()),
        (H_MESSAGE, parcel.message[:1000].encode()),
        (H_TOPIC, source_topic.encode()),
        (H_PARTITION, str(parcel.record.partition).encode()),
        (H_OFFSET, str(parcel.record.offset).encode()),
        (H_PARKED_AT, str(parked_at_ms).encode()),
        (H_GROUP, group.encode()),
    ]


class DeadLetters:
    """Parks records in the DLQ topic and returns only once the broker has acknowledged them."""

    def __init__(self, settings: Settings, group: str, *, flush_timeout: float = 30.0) -> None:
        self.source_topic = settings.topic
        self.group = group
        self._publisher = Publisher(settings, topic=settings.dlq_topic, flush_timeout=flush_timeout)
        self._backoff = Backoff(base=0.5)

    def park(self, parcels: Sequence[Parcel], stop: threading.Event | None = None) -> None:
        """Send and confirm; a broker outage is retried (capped backoff) until it ends or `stop` is set."""
        if not parcels:
            return
        attempt = 0
        while True:
            now_ms = int(time.time() * 1000)
            for parcel in parcels:
                self._publisher.send_raw(
                    parcel.record.key, parcel.record.value, park_headers(parcel, self.source_topic, self.group, now_ms)
                )
            try:
                self._publisher.flush()
                return
            except PublishError as exc:
                # Resending the whole set can duplicate the ones that did land; a duplicate
                # parked record is visible and harmless, a lost one is neither.
                log.warning("could not park %d record(s) in the DLQ, retry %d: %s", len(parcels), attempt + 1, exc)
                if self._backoff.sleep(attempt, stop):
                    raise
                attempt += 1
