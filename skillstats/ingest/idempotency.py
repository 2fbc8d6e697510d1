"""Idempotency-Key: a request sent again is answered as the first was, and published once.

A request with the header claims its key in SQL before anything is published
(one row, the key its primary key, so two processes racing for a key cannot
both win); once its transaction committed, the row takes the answer, and the
same key with the same body is answered from it until it expires
(`--idempotency-hours`). A request that published nothing (refused as invalid,
or 503) gives its claim back, so sending it again is a new attempt.

What is left, exactly: a process killed after Kafka committed the transaction
and before the answer reached this table leaves a claim with no answer. While
its lease lasts (the publish timeout plus Kafka's transaction timeout plus a
margin, so that the transaction is by then either committed or aborted by the
broker) the same key is answered `409` ("in progress"); once it has passed, the
request is published again, which counts it twice if that earlier transaction
had committed. tests/test_ingest.py shows it happen. The same gap, narrower than
without the header, exists for any retry of a request whose answer was lost.

The key is scoped by the caller's token (a digest of it), so two callers cannot
collide, and a key sent with a different body is refused (`422`) rather than
answered with the other body's result.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Engine, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from skillstats.sinks.schema import ingest_requests
from skillstats.sinks.upserts import now_utc_naive

MAX_KEY_CHARS = 255


@dataclass(frozen=True)
class Claimed:
    """This request holds the key: publish, then `answered` or `release`."""

    key: str
    claimed_at: datetime


@dataclass(frozen=True)
class Answered:
    """Answered before: send this again."""

    status: int
    response: str


@dataclass(frozen=True)
class InProgress:
    """Another request with this key is in flight (or was cut off; see the module's docstring)."""

    retry_after: int


@dataclass(frozen=True)
class Mismatch:
    """The key was used with another body."""


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


class IdempotencyStore:
    def __init__(self, engine: Engine, ttl: timedelta, lease: timedelta) -> None:
        self.engine = engine
        self.ttl = ttl
        self.lease = lease

    def claim(self, key: str, digest: str) -> Claimed | Answered | InProgress | Mismatch:
        now = now_utc_naive()
        row = {"key": key, "body_sha256": digest, "claimed_at": now, "expires_at": now + self.ttl}
        try:
            with self.engine.begin() as connection:
                connection.execute(insert(ingest_requests).values(**row))
            return Claimed(key, now)
        except IntegrityError:
            pass
        with self.engine.begin() as connection:
            found = connection.execute(
                select(ingest_requests).where(ingest_requests.c.key == key).with_for_update()
            ).one_or_none()
            if found is None:  # released or purged since: the next attempt claims it
                return InProgress(retry_after=1)
            if found.expires_at <= now:  # expired: a new request under an old key, with none of its answer
                connection.execute(
                    update(ingest_requests)
                    .where(ingest_requests.c.key == key)
                    .values(**row, status=None, response=None)
                )
                return Claimed(key, now)
            if found.body_sha256 != digest:
                return Mismatch()
            if found.status is not None:
                return Answered(found.status, found.response or "")
            if found.claimed_at + self.lease > now:
                left = (found.claimed_at + self.lease - now).total_seconds()
                return InProgress(retry_after=max(1, int(left) + 1))
            # The lease ran out with no answer: its process died (see above). Take it over, by compare-and-set.
            taken = connection.execute(
                update(ingest_requests)
                .where(ingest_requests.c.key == key, ingest_requests.c.claimed_at == found.claimed_at)
                .values(claimed_at=now)
            )
            return Claimed(key, now) if taken.rowcount == 1 else InProgress(retry_after=1)

    def answered(self, claim: Claimed, status: int, response: str) -> bool:
        """Keep the answer; False when the claim is no longer this request's (its lease ran out and another
        request took the key over: both may have published, the documented gap)."""
        with self.engine.begin() as connection:
            kept = connection.execute(
                update(ingest_requests)
                .where(ingest_requests.c.key == claim.key, ingest_requests.c.claimed_at == claim.claimed_at)
                .values(status=status, response=response)
            )
            return kept.rowcount == 1

    def release(self, claim: Claimed) -> None:
        with self.engine.begin() as connection:
            connection.execute(
                delete(ingest_requests).where(
                    ingest_requests.c.key == claim.key,
                    ingest_requests.c.claimed_at == claim.claimed_at,
                    ingest_requests.c.status.is_(None),
                )
            )

    def purge(self) -> int:
        """Forget the keys that expired; how many."""
        with self.engine.begin() as connection:
            return connection.execute(
                delete(ingest_requests).where(ingest_requests.c.expires_at <= now_utc_naive())
            ).rowcount
