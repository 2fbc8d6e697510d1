"""Publishing stat events: the Python API services call, on confluent-kafka.

Delivery is confirmed, not hoped for: `flush()` returns only when the broker
has acknowledged every record sent so far (acks=all, idempotent), and raises
with the count still unconfirmed when its time budget runs out, so a caller
can never mistake "queued in librdkafka" for "published".
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from types import TracebackType

from confluent_kafka import KafkaError, Message, Producer

from skillstats.config import Settings
from skillstats.contract import StatEvent
from skillstats.kafka import KafkaRefused, RefusalWatch

Headers = Sequence[tuple[str, bytes]]


class PublishError(RuntimeError):
    """Some records were not confirmed by the broker."""

    def __init__(self, message: str, unconfirmed: int) -> None:
        super().__init__(message)
        self.unconfirmed = unconfirmed


def producer_config(settings: Settings, **extra: object) -> dict[str, object]:
    return settings.kafka_config(
        **{
            "enable.idempotence": True,
            "acks": "all",
            # docs/contract.md, validity: Java-client compatible partitioning, so a key lands on the
            # same partition whichever language published it.
            "partitioner": "murmur2_random",
            "linger.ms": 10,
            "compression.type": "lz4",
            **extra,
        }
    )


class Publisher:
    """Sends events keyed by skill id; use as a context manager or call `flush()`."""

    def __init__(self, settings: Settings, *, topic: str | None = None, flush_timeout: float = 30.0) -> None:
        self.topic = topic or settings.topic
        self.flush_timeout = flush_timeout
        self.delivered = 0
        self._pending = 0
        self._errors: list[str] = []
        self._settings = settings
        self._refusals = RefusalWatch()
        self._producer = Producer(producer_config(settings, error_cb=self._refusals))

    def _on_delivery(self, err: KafkaError | None, _msg: Message) -> None:
        self._pending -= 1
        if err is None:
            self.delivered += 1
            self._refusals.reason = None  # a broker took a record: whatever was refused, this was not
        elif len(self._errors) < 20:
            self._errors.append(str(err))
        else:
            self._errors[-1] = f"... and more ({err})"

    def send_raw(
        self, key: bytes | None, value: bytes | None, headers: Headers | None = None, topic: str | None = None
    ) -> None:
        """Send one record as given (no validation): for replays and for tests of bad input."""
        deadline = None
        while True:
            try:
                self._producer.produce(
                    topic or self.topic,
                    value=value,
                    key=key,
                    headers=list(headers or ()),
                    on_delivery=self._on_delivery,
                )
                break
            except BufferError:
                # librdkafka's local queue is full: serve delivery reports until it drains,
                # for as long as a flush would wait (a broker away, credentials revoked).
                deadline = deadline or time.monotonic() + self.flush_timeout
                self._producer.poll(0.05)
                if time.monotonic() >= deadline:
                    self._raise_unconfirmed(len(self._producer), self.flush_timeout)
        self._pending += 1
        self._producer.poll(0)

    def send(self, event: StatEvent) -> None:
        self.send_raw(event.key, event.encode())

    def send_all(self, events: Iterable[StatEvent]) -> None:
        for event in events:
            self.send(event)

    def flush(self, timeout: float | None = None) -> int:
        """Wait until every record sent is acknowledged; returns how many were delivered in all.

        Raises PublishError when the budget runs out first, and at once when a broker
        refuses our credentials or TLS (librdkafka would retry that for ever).
        """
        budget = self.flush_timeout if timeout is None else timeout
        deadline = time.monotonic() + budget
        while remaining := self._producer.flush(max(0.0, min(1.0, deadline - time.monotonic()))):
            if self._refusals.reason is not None or time.monotonic() >= deadline:
                self._raise_unconfirmed(remaining, budget)
        if self._errors:
            errors, self._errors = self._errors, []
            raise PublishError(f"broker rejected record(s): {'; '.join(errors)}", len(errors))
        return self.delivered

    def _raise_unconfirmed(self, remaining: int, budget: float) -> None:
        # The records stay queued in librdkafka and may yet be delivered by a later flush
        # (the same publisher, the broker back): "not confirmed", never "not sent".
        if self._refusals.reason is not None:
            cause = f"not confirmed: {KafkaRefused(self._settings, self._refusals.reason)}"
        else:
            where = self._settings.kafka_bootstrap
            cause = f"not confirmed by the broker within {budget:g}s; is Kafka reachable at {where}?"
        raise PublishError(f"{remaining} record(s) {cause}", remaining)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.flush()
        else:
            # Give what was sent a chance to land, but do not mask the original error.
            self._producer.flush(min(self.flush_timeout, 5.0))
