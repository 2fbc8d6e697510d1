"""Idempotency-Key: a request sent again is answered as the first was, and published once.

A request with the header claims its key in SQL before anything is published
(one row, the key its primary key, so two processes racing for a key cannot
both win); once its transaction committed, the row takes the answer, and the
same key with the same body is answered from it until it expires
(`--idempotency-hours`). A request that published nothing (refused as invalid,
or 503) gives its claim back, so sending it again is a new attempt.

A claim is a lease. The request renews it (`renewed_at`) while it waits on its
Kafka commit, however long that takes, so a live process keeps its keys: the
same key is answered `409` meanwhile, and a commit that comes late keeps its
answer. Only a process that stopped renewing (killed, its node lost, or cut off
from the database) lets its lease run out (the publish timeout twice plus 40 s
after the last renewal: by then every transaction it began is committed or
aborted by the broker). The next request with the key then finds the claim
`Stale`: its process may have died after Kafka committed and before the answer
reached this table. The commit itself is the evidence: the same transaction
wrote a receipt of the claim to a topic of ingest's own (receipts.py), which is
read before anything is published again. A receipt found is the answer (`settle`);
none, and the key is taken over (`take_over`) and published. Why not decide from
SQL alone: the answer's row cannot be written in Kafka's transaction, so some
crash always falls between the two; a record in the transaction cannot be
separated from it.

What it costs: a row update per lease quarter for a request waiting on its
commit (none in the usual case: a commit takes milliseconds), one more column
(migration 0008), and a Kafka read before a stale claim is taken over (a crash's
cost, not a request's).

What is left: a claimant alive but unable to reach the database for a whole
lease stops renewing while its transaction may still commit; if its commit
reaches Kafka only after another request read the receipts and took the key
over, both publish, and the late one logs an ERROR when it keeps its answer.
Clocks of replicas that differ by more than the lease's margin make the same
mistake (the lease is read from each process's own clock). A retry sent with
another token is another key (keys are scoped by the token).

The key is scoped by the caller's token (a digest of it), so two callers cannot
collide, and a key sent with a different body is refused (`422`) rather than
answered with the other body's result.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from sqlalchemy import Engine, and_, delete, insert, or_, select, update
from sqlalchemy.exc import IntegrityError

from skillstats.sinks.schema import ingest_requests
from skillstats.sinks.upserts import now_utc_naive

MAX_KEY_CHARS = 255


requests = ingest_requests


@dataclass(frozen=True)
class Claimed:
    """This request holds the key: publish (its receipt in the transaction), then `answered` or `release`.

    `expires_at` names the key's lifetime: it is set when the key is first claimed (or claimed again after it
    expired) and kept by a take-over, so a receipt of any claim of this lifetime is recognised by it."""

    key: str
    claimed_at: datetime
    expires_at: datetime
    digest: str
    receipts_topic: str | None = None  # the receipts topic's id when the claim was made (receipts.py)


@dataclass(frozen=True)
class Stale:
    """The key's last claim ran out of lease with no answer: its process stopped renewing, maybe after its
    transaction committed. Look for its receipt first (receipts.py): `settle` with it, or `take_over`."""

    key: str
    claimed_at: datetime
    renewed_at: datetime | None
    expires_at: datetime
    digest: str
    receipts_topic: str | None = None  # the receipts topic's id its claim was made against; None: not known


@dataclass(frozen=True)
class Answered:
    """Answered before: send this again."""

    status: int
    response: str


@dataclass(frozen=True)
class InProgress:
    """Another request with this key is in flight (its process keeps renewing the claim)."""

    retry_after: int


@dataclass(frozen=True)
class Mismatch:
    """The key was used with another body."""


# What became of a committed request's answer (`answered`): kept as its own claim's; kept though another
# request had taken the key over meanwhile (both may have published); the key already had an answer; or lost.
Kept = Literal["own", "late", "answered", "lost"]


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


class IdempotencyStore:
    def __init__(self, engine: Engine, ttl: timedelta, lease: timedelta) -> None:
        self.engine = engine
        self.ttl = ttl
        self.lease = lease
        # Often enough that two renewals can fail (a database blip) before the lease runs out.
        self.renew_every = lease / 4

    def claim(
        self, key: str, digest: str, receipts_topic: str | None = None
    ) -> Claimed | Stale | Answered | InProgress | Mismatch:
        """`receipts_topic`: the id of the receipts topic this request's receipt will be written to, as known now
        (receipts.py), kept with the claim so that a take-over can tell whether the topic it reads is that one."""
        now = now_utc_naive()
        row = {
            "key": key,
            "body_sha256": digest,
            "claimed_at": now,
            "expires_at": now + self.ttl,
            "lease_until": now + self.lease,
            "receipts_topic": receipts_topic,
        }
        try:
            with self.engine.begin() as connection:
                connection.execute(insert(requests).values(**row))
            return Claimed(key, now, now + self.ttl, digest, receipts_topic)
        except IntegrityError:
            pass
        with self.engine.begin() as connection:
            found = connection.execute(select(requests).where(requests.c.key == key).with_for_update()).one_or_none()
            if found is None:  # released or purged since: the next attempt claims it
                return InProgress(retry_after=1)
            # The claimant's own lease where it wrote one: a replica of a shorter lease must not end a longer one.
            # (The later of the two: a row renewed by a version that wrote no lease_until is judged as before.)
            judged_here = max(found.claimed_at, found.renewed_at or found.claimed_at) + self.lease
            lease_ends = judged_here if found.lease_until is None else max(found.lease_until, judged_here)
            in_flight = found.status is None and lease_ends > now
            if found.expires_at <= now and not in_flight and (found.status is not None or found.body_sha256 != digest):
                # Expired: a new request under an old key, with none of its answer. (Expired with no answer and
                # the same body is the same request retried late: its receipt is looked for first, as `Stale`.)
                connection.execute(
                    update(requests)
                    .where(requests.c.key == key)
                    .values(**row, status=None, response=None, renewed_at=None)
                )
                return Claimed(key, now, now + self.ttl, digest, receipts_topic)
            if found.body_sha256 != digest:
                return Mismatch()
            if found.status is not None:
                return Answered(found.status, found.response or "")
            if in_flight:
                left = (lease_ends - now).total_seconds()
                return InProgress(retry_after=max(1, int(left) + 1))
            return Stale(key, found.claimed_at, found.renewed_at, found.expires_at, digest, found.receipts_topic)

    def settle(self, stale: Stale, status: int, response: str) -> bool:
        """Keep the answer a receipt of this key's lifetime holds (its transaction committed); False when the
        key has an answer already, or is gone."""
        now = now_utc_naive()
        with self.engine.begin() as connection:
            kept = connection.execute(
                update(requests)
                .where(
                    requests.c.key == stale.key, requests.c.expires_at == stale.expires_at, requests.c.status.is_(None)
                )
                # A lifetime that ran out while the claim lay unanswered is renewed with its answer: the retries
                # that follow are answered, not taken for new requests.
                .values(status=status, response=response, expires_at=max(stale.expires_at, now + self.ttl))
            )
            return kept.rowcount == 1

    def take_over(self, stale: Stale, receipts_topic: str | None = None) -> Claimed | None:
        """Claim a stale key for this request (no receipt of it was committed), by compare-and-set on the claim
        and its last renewal: None when another request took it, or its claimant renewed after all.
        `receipts_topic`: as for `claim`, the topic this request's receipt will be written to."""
        now = now_utc_naive()
        renewed = (
            requests.c.renewed_at.is_(None) if stale.renewed_at is None else requests.c.renewed_at == stale.renewed_at
        )
        # A key whose lifetime ran out while its claim lay unanswered (no receipt of it found) starts a new one.
        expires_at = stale.expires_at if stale.expires_at > now else now + self.ttl
        with self.engine.begin() as connection:
            taken = connection.execute(
                update(requests)
                .where(
                    requests.c.key == stale.key,
                    requests.c.claimed_at == stale.claimed_at,
                    renewed,
                    requests.c.status.is_(None),
                )
                .values(
                    claimed_at=now,
                    renewed_at=None,
                    lease_until=now + self.lease,
                    expires_at=expires_at,
                    receipts_topic=receipts_topic,
                )
            )
        return Claimed(stale.key, now, expires_at, stale.digest, receipts_topic) if taken.rowcount == 1 else None

    def renew(self, claim: Claimed) -> bool:
        """Push the claim's lease on (its request still waits on its commit); False when it is no longer this
        request's."""
        with self.engine.begin() as connection:
            renewed = connection.execute(
                update(requests)
                .where(
                    requests.c.key == claim.key,
                    requests.c.claimed_at == claim.claimed_at,
                    requests.c.status.is_(None),
                )
                .values(renewed_at=(now := now_utc_naive()), lease_until=now + self.lease)
            )
            return renewed.rowcount == 1

    def answered(self, claim: Claimed, status: int, response: str) -> Kept:
        """Keep the answer of a committed request. A late commit keeps its answer whatever happened to the claim
        meanwhile (taken over, or given back by the request that took it over): the events are published, and
        the next retry must be answered, never published again."""
        mine = and_(requests.c.key == claim.key, requests.c.status.is_(None))
        with self.engine.begin() as connection:
            kept = connection.execute(
                update(requests)
                .where(mine, requests.c.claimed_at == claim.claimed_at)
                .values(status=status, response=response)
            )
            if kept.rowcount == 1:
                return "own"
            kept = connection.execute(
                update(requests)
                .where(mine, requests.c.expires_at == claim.expires_at)
                .values(status=status, response=response)
            )
            if kept.rowcount == 1:
                return "late"
            found = connection.execute(select(requests).where(requests.c.key == claim.key)).one_or_none()
            if found is not None:
                return "answered" if found.expires_at == claim.expires_at else "lost"
        try:  # given back by a take-over whose own attempt failed: this answer is the key's
            with self.engine.begin() as connection:
                connection.execute(
                    insert(requests).values(
                        key=claim.key,
                        body_sha256=claim.digest,
                        status=status,
                        response=response,
                        claimed_at=claim.claimed_at,
                        expires_at=claim.expires_at,
                    )
                )
            return "late"
        except IntegrityError:
            return "lost"

    def release(self, claim: Claimed) -> None:
        with self.engine.begin() as connection:
            connection.execute(
                delete(requests).where(
                    requests.c.key == claim.key,
                    requests.c.claimed_at == claim.claimed_at,
                    requests.c.status.is_(None),
                )
            )

    def purge(self) -> int:
        """Forget the keys that expired, but not a request still renewing its claim; how many."""
        now = now_utc_naive()
        cutoff = now - self.lease
        lapsed = or_(
            requests.c.lease_until <= now,
            and_(
                requests.c.lease_until.is_(None),
                requests.c.claimed_at <= cutoff,
                or_(requests.c.renewed_at.is_(None), requests.c.renewed_at <= cutoff),
            ),
        )
        with self.engine.begin() as connection:
            return connection.execute(
                delete(requests).where(requests.c.expires_at <= now, or_(requests.c.status.is_not(None), lapsed))
            ).rowcount
