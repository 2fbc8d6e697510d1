"""Units of `skillstats ingest` without a broker: the idempotency store's states, and the publisher thread's
handling of requests that are gone or already answered (the review's findings, each with its sequence)."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update

from skillstats.config import Settings
from skillstats.ingest.idempotency import Answered, Claimed, IdempotencyStore, InProgress
from skillstats.ingest.transactions import TransactionalPublisher, Unavailable, _Submission
from skillstats.retry import Outage
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.schema import ingest_requests


@pytest.fixture
def store(tmp_path: Path) -> IdempotencyStore:
    engine = open_engine(f"sqlite:///{tmp_path / 'keys.db'}")
    upgrade(engine)
    return IdempotencyStore(engine, ttl=timedelta(hours=1), lease=timedelta(seconds=60))


def expire(store: IdempotencyStore, key: str) -> None:
    with store.engine.begin() as connection:
        connection.execute(
            update(ingest_requests).where(ingest_requests.c.key == key).values(expires_at=ingest_requests.c.claimed_at)
        )


def test_a_key_claimed_again_after_it_expired_has_none_of_its_old_answer(store: IdempotencyStore) -> None:
    """202 for K, K expires (not yet purged), K is sent again and that request publishes nothing (400/503): a
    retry must be a new claim, never the old 202 for events that were not published."""
    first = store.claim("t:K", "body-1")
    assert isinstance(first, Claimed)
    assert store.answered(first, 202, '{"accepted": 3}')
    expire(store, "t:K")
    again = store.claim("t:K", "body-2")
    assert isinstance(again, Claimed)
    assert isinstance(store.claim("t:K", "body-2"), InProgress)  # in flight: not the old answer either
    store.release(again)
    assert isinstance(store.claim("t:K", "body-2"), Claimed)


def test_an_answer_kept_after_the_claim_was_taken_over_says_so(store: IdempotencyStore) -> None:
    first = store.claim("t:L", "body")
    assert isinstance(first, Claimed)
    with store.engine.begin() as connection:  # its lease ran out and another request took the key over
        connection.execute(update(ingest_requests).values(claimed_at=first.claimed_at - timedelta(minutes=5)))
    second = store.claim("t:L", "body")
    assert isinstance(second, Claimed) and second.claimed_at != first.claimed_at
    assert store.answered(first, 202, "{}") is False
    assert store.answered(second, 202, '{"accepted": 1}') is True
    assert store.claim("t:L", "body") == Answered(202, '{"accepted": 1}')


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
