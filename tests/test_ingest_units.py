"""Units of `skillstats ingest` without a broker: the idempotency store's states (claims, leases, renewals,
take-overs, late answers), the tokens, and the publisher thread's handling of requests that are gone or already
answered (the reviews' findings, each with its sequence)."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from skillstats.config import Settings
from skillstats.ingest.idempotency import Answered, Claimed, IdempotencyStore, InProgress, Stale, requests
from skillstats.ingest.tokens import TokenFile
from skillstats.ingest.transactions import TransactionalPublisher, Unavailable, _Submission
from skillstats.retry import Outage
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade


@pytest.fixture
def store(tmp_path: Path) -> IdempotencyStore:
    engine = open_engine(f"sqlite:///{tmp_path / 'keys.db'}")
    upgrade(engine)
    return IdempotencyStore(engine, ttl=timedelta(hours=1), lease=timedelta(seconds=60))


def expire(store: IdempotencyStore, key: str) -> None:
    with store.engine.begin() as connection:
        connection.execute(update(requests).where(requests.c.key == key).values(expires_at=requests.c.claimed_at))


def test_a_key_claimed_again_after_it_expired_has_none_of_its_old_answer(store: IdempotencyStore) -> None:
    """202 for K, K expires (not yet purged), K is sent again and that request publishes nothing (400/503): a
    retry must be a new claim, never the old 202 for events that were not published."""
    first = store.claim("t:K", "body-1")
    assert isinstance(first, Claimed)
    assert store.answered(first, 202, '{"accepted": 3}') == "own"
    expire(store, "t:K")
    again = store.claim("t:K", "body-2")
    assert isinstance(again, Claimed)
    assert isinstance(store.claim("t:K", "body-2"), InProgress)  # in flight: not the old answer either
    store.release(again)
    assert isinstance(store.claim("t:K", "body-2"), Claimed)


class Clock:
    """The store's clock (`now_utc_naive`), moved on by the test: a lease runs out without waiting for it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = datetime(2026, 12, 1, 12, 0, 0)
        monkeypatch.setattr("skillstats.ingest.idempotency.now_utc_naive", lambda: self.now)

    def advance(self, by: timedelta) -> None:
        self.now += by


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    return Clock(monkeypatch)


def lapse(store: IdempotencyStore, clock: Clock) -> None:
    """As if the claimant had stopped renewing: a whole lease passes."""
    clock.advance(store.lease + timedelta(seconds=1))


def test_a_late_commit_keeps_its_answer_after_its_key_was_taken_over(store: IdempotencyStore, clock: Clock) -> None:
    """The claim's lease ran out (its process could not renew it), another request found no receipt and took the
    key over; then the first commit is confirmed after all. Its answer is kept (both may have published: said
    as "late"), and the key is answered from it, never published a third time."""
    first = store.claim("t:L", "body")
    assert isinstance(first, Claimed)
    assert isinstance(store.claim("t:L", "body"), InProgress)
    lapse(store, clock)
    stale = store.claim("t:L", "body")
    assert isinstance(stale, Stale) and stale.claimed_at == first.claimed_at
    second = store.take_over(stale)
    assert second is not None and second.claimed_at != first.claimed_at and second.expires_at == first.expires_at
    assert store.answered(first, 202, '{"accepted": 1}') == "late"
    assert store.answered(second, 202, '{"accepted": 1}') == "answered"
    assert store.claim("t:L", "body") == Answered(202, '{"accepted": 1}')


def test_a_late_commit_keeps_its_answer_after_the_take_over_gave_the_key_back(
    store: IdempotencyStore, clock: Clock
) -> None:
    """What issue 27 saw on one replica: the request that took the key over was answered 503 and gave the key
    back; the late commit then could not keep its answer, and the next retry published again."""
    first = store.claim("t:G", "body")
    assert isinstance(first, Claimed)
    lapse(store, clock)
    stale = store.claim("t:G", "body")
    assert isinstance(stale, Stale)
    second = store.take_over(stale)
    assert second is not None
    store.release(second)  # its own transaction aborted: 503
    assert store.answered(first, 202, '{"accepted": 2}') == "late"
    assert store.claim("t:G", "body") == Answered(202, '{"accepted": 2}')


def test_a_renewed_claim_is_in_flight_and_is_not_taken_over(store: IdempotencyStore, clock: Clock) -> None:
    """A request waiting on its commit renews its claim: past the lease of its claim it is still in flight (409).
    A request that found it stale before a renewal landed cannot take it over (compare-and-set on the renewal)."""
    first = store.claim("t:R", "body")
    assert isinstance(first, Claimed)
    lapse(store, clock)
    stale = store.claim("t:R", "body")
    assert isinstance(stale, Stale)
    assert store.renew(first)  # the claimant was alive after all
    assert isinstance(store.claim("t:R", "body"), InProgress)
    assert store.take_over(stale) is None
    assert store.settle(stale, 202, '{"accepted": 1}')  # a committed receipt's answer is kept whoever renews
    assert store.renew(first) is False  # answered: nothing left to renew
    assert store.claim("t:R", "body") == Answered(202, '{"accepted": 1}')


def test_purge_keeps_an_expired_key_whose_request_still_renews(store: IdempotencyStore, clock: Clock) -> None:
    claim = store.claim("t:P", "body")
    assert isinstance(claim, Claimed)
    clock.advance(store.ttl)  # expired, but its request is still waiting on its commit, renewing
    assert store.renew(claim)
    assert store.purge() == 0
    assert isinstance(store.claim("t:P", "body"), InProgress)  # not a new request while the first may commit
    lapse(store, clock)
    assert store.purge() == 1


def test_a_token_that_is_not_utf8_is_refused_not_a_crash(tmp_path: Path) -> None:
    """aiohttp hands over a header that is not UTF-8 as lone surrogates; encoding them used to raise (a 500)."""
    (tmp_path / "tokens").write_text("good\n")
    tokens = TokenFile(tmp_path / "tokens")
    header = b"Bearer \xff\xfegood".decode("utf-8", "surrogateescape")
    assert tokens.allows(header) is False
    assert tokens.allows("Bearer good") is True
    assert TokenFile.scope(header) == TokenFile.scope(header) != TokenFile.scope("Bearer good")


def publisher_without_kafka(outcome: BaseException | None) -> TransactionalPublisher:
    """The publisher's batch logic, without its thread or a producer: `_transaction` gives `outcome`."""
    publisher = TransactionalPublisher.__new__(TransactionalPublisher)
    publisher.settings = Settings(kafka_bootstrap="127.0.0.1:1", database_url="sqlite://")
    publisher.transactions = {"committed": 0, "aborted": 0, "unknown": 0}
    publisher.kafka_problem = None
    publisher._outage = Outage(logging.getLogger("test"))
    published: list[int] = []

    def transaction(batch: list[_Submission], _deadline: float) -> None:
        published.extend(len(s.records) for s in batch)
        if outcome is not None:
            raise outcome

    publisher._transaction = transaction  # type: ignore[method-assign]
    publisher.published = published  # type: ignore[attr-defined]
    return publisher


def submission(records: int, deadline: float = 1e18) -> _Submission:
    return _Submission([(b"k", b"v")] * records, 0, deadline, Future())


@pytest.mark.parametrize("outcome", [None, Unavailable("broker away")])
def test_a_request_whose_waiter_is_gone_is_not_published_and_the_others_are_answered(
    outcome: BaseException | None,
) -> None:
    """A request cancelled before its batch ran (its handler gone) is left out, and settling the rest never
    raises (an InvalidStateError there used to end the publisher's thread: every later request hung)."""
    publisher = publisher_without_kafka(outcome)
    gone, kept, late = submission(2), submission(3), submission(5, deadline=0)
    assert gone.future.cancel()
    publisher._publish([gone, kept, late])
    assert publisher.published == [3]  # type: ignore[attr-defined]
    assert gone.future.cancelled()
    assert isinstance(late.future.exception(), Unavailable)
    if outcome is None:
        assert kept.future.result() is None and publisher.transactions["committed"] == 1
    else:
        assert isinstance(kept.future.exception(), Unavailable) and publisher.transactions["aborted"] == 1
