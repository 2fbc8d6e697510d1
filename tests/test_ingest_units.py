"""Units of `skillstats ingest` without a broker: the idempotency store's states (claims, leases, renewals,
take-overs, late answers), the tokens, the publisher thread's handling of requests that are gone or already
answered and of commits that fail (the reviews' findings, each with its sequence), the log of refusals, and the
command line's budget and address."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException
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


def test_a_claim_names_the_receipts_topic_it_was_made_against_and_a_take_over_its_own(
    store: IdempotencyStore, clock: Clock
) -> None:
    """The receipts topic's id a claim was made with is what its `Stale` carries to the take-over's read
    (receipts.py compares it with the topic's id then); a take-over names the id it was made with, and a claim
    with the id unknown carries None (judged as before)."""
    first = store.claim("t:R", "body", "topic-id-1")
    assert isinstance(first, Claimed) and first.receipts_topic == "topic-id-1"
    lapse(store, clock)
    stale = store.claim("t:R", "body", "topic-id-2")
    assert isinstance(stale, Stale) and stale.receipts_topic == "topic-id-1"
    taken = store.take_over(stale, "topic-id-2")
    assert isinstance(taken, Claimed) and taken.receipts_topic == "topic-id-2"
    lapse(store, clock)
    again = store.claim("t:R", "body")
    assert isinstance(again, Stale) and again.receipts_topic == "topic-id-2"
    assert isinstance(store.take_over(again), Claimed)
    lapse(store, clock)
    unknown = store.claim("t:R", "body", "topic-id-3")
    assert isinstance(unknown, Stale) and unknown.receipts_topic is None


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
    publisher.on_outcome = None
    publisher._problem = publisher._away = publisher._busy_since = None
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


class Ticks:
    """A clock the test moves: the refusal log's minute passes without waiting for it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_refusals_are_logged_once_a_minute_per_client_and_reason(caplog: pytest.LogCaptureFixture) -> None:
    """A client failing every request is a line a minute per reason, saying how many more there were; a 409 (a
    retry while the first attempt is in flight: the API working) is said at INFO, the rest at WARNING."""
    from skillstats.ingest.refusals import RefusalLog

    clock = Ticks()
    refusals = RefusalLog(logging.getLogger("test.refusals"), clock=clock)
    caplog.set_level(logging.INFO, logger="test.refusals")
    for _ in range(100):
        refusals.refused(400, "malformed body", "10.0.0.1")
        refusals.refused(401, "unauthorized: not one of the tokens", "10.0.0.1")
    refusals.refused(400, "malformed body", "10.0.0.2")
    refusals.refused(409, "Idempotency-Key in flight", "10.0.0.2")
    clock.now += 61
    refusals.refused(400, "malformed body", "10.0.0.1")
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said == [
        ("WARNING", "refused a request from 10.0.0.1: 400 malformed body"),
        ("WARNING", "refused a request from 10.0.0.1: 401 unauthorized: not one of the tokens"),
        ("WARNING", "refused a request from 10.0.0.2: 400 malformed body"),
        ("INFO", "refused a request from 10.0.0.2: 409 Idempotency-Key in flight"),
        (
            "WARNING",
            "refused a request from 10.0.0.1: 400 malformed body; and 99 more like it since its last line 61 s ago",
        ),
    ]


def test_refusals_from_many_clients_are_bounded_in_lines_and_memory(caplog: pytest.LogCaptureFixture) -> None:
    """A scan from a thousand addresses: at most `most` lines a minute, the rest summed in one line the next
    minute, and at most `keys` clients remembered."""
    from skillstats.ingest.refusals import RefusalLog

    clock = Ticks()
    refusals = RefusalLog(logging.getLogger("test.refusals"), most=30, keys=100, clock=clock)
    caplog.set_level(logging.INFO, logger="test.refusals")
    for n in range(1000):
        refusals.refused(401, "unauthorized: no token", f"10.0.{n // 256}.{n % 256}")
    assert len(caplog.records) == 30
    clock.now += 60
    refusals.refused(401, "unauthorized: no token", "10.9.9.9")
    assert [r.getMessage() for r in caplog.records[30:]] == [
        "refused 970 more request(s) not logged one by one (over 30 lines a minute; "
        "skillstats_ingest_requests_total counts them all)",
        "refused a request from 10.9.9.9: 401 unauthorized: no token",
    ]
    remembering = RefusalLog(logging.getLogger("test.refusals"), most=10_000, keys=100, clock=clock)
    for n in range(1000):
        remembering.refused(401, "unauthorized: no token", f"10.0.{n // 256}.{n % 256}")
    assert len(remembering._seen) == 100


def test_ingest_has_its_own_shutdown_budget_and_listens_on_loopback_unless_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The other commands' SKILLSTATS_SHUTDOWN_BUDGET (10 s by default) made ingest refuse to start; ingest's own
    default is its least, a smaller budget of its own is refused saying what to set, and without --host it
    listens on 127.0.0.1 (it took every interface)."""
    import argparse

    from skillstats.cli.common import UsageError
    from skillstats.cli.ingest import _shutdown_budget, configure

    def parsed(*args: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        configure(parser)
        return parser.parse_args(list(args))

    for name in ("SKILLSTATS_INGEST_HOST", "SKILLSTATS_INGEST_SHUTDOWN_BUDGET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SKILLSTATS_SHUTDOWN_BUDGET", "10")
    assert _shutdown_budget(parsed()) == 22
    assert _shutdown_budget(parsed("--publish-timeout", "30")) == 42
    assert parsed().host == "127.0.0.1"
    monkeypatch.setenv("SKILLSTATS_INGEST_SHUTDOWN_BUDGET", "25")
    monkeypatch.setenv("SKILLSTATS_INGEST_HOST", "0.0.0.0")
    assert _shutdown_budget(parsed()) == 25 and parsed().host == "0.0.0.0"
    with pytest.raises(UsageError, match="set 22 or more"):
        _shutdown_budget(parsed("--shutdown-budget", "10"))


class FakeProducer:
    """A producer whose commit fails as librdkafka's does, `unacknowledged` records without a delivery report;
    its queue (len) also holds `events` (log lines, errors) that are no records."""

    def __init__(self, errors: list[KafkaError], unacknowledged: int, events: int = 0) -> None:
        self.errors = errors
        self.unacknowledged = unacknowledged
        self.events = events
        self.commits = 0
        self.aborts = 0

    def __len__(self) -> int:
        return self.unacknowledged + self.events

    def commit_transaction(self, _timeout: float) -> None:
        self.commits += 1
        if self.commits > 3 and self.unacknowledged:
            raise RuntimeError("asked to commit again past the deadline, with records not acknowledged")
        if self.errors:
            raise KafkaException(self.errors.pop(0))

    def abort_transaction(self, _timeout: float) -> None:
        self.aborts += 1

    def flush(self, _timeout: float) -> int:
        return 0


def committing(producer: FakeProducer) -> TransactionalPublisher:
    publisher = publisher_without_kafka(None)
    publisher.publish_timeout = 4.0
    publisher._producer = producer  # type: ignore[assignment]
    publisher._undelivered = producer.unacknowledged  # as _produce and _delivered count them
    return publisher


def test_a_commit_is_given_up_at_its_deadline_only_when_it_was_never_asked_for() -> None:
    """The broker gone while the records are unacknowledged: the flush times out (retriable), no commit was
    asked for, so past the deadline the request is answered 503 (it was asked again until the records' own
    timeout, twice the publish timeout), and the producer is dropped, not aborted (an abort waits on the gone
    broker; the next producer's init_transactions aborts the transaction). Every record acknowledged, though,
    the commit was asked for and its answer lost: a 503 for a transaction that did commit would count it twice,
    so it is asked again, past the deadline, until its outcome is known."""
    producer = FakeProducer([KafkaError(KafkaError._TIMED_OUT, "Failed to flush", retriable=True)] * 5, 1)
    publisher = committing(producer)
    with pytest.raises(Unavailable, match="did not acknowledge the records within --publish-timeout"):
        publisher._commit(producer, time.monotonic())  # type: ignore[arg-type]
    assert producer.commits == 1

    failed = FakeProducer([KafkaError(KafkaError._MSG_TIMED_OUT, "failed delivery", txn_requires_abort=True)], 1)
    publisher = committing(failed)
    with pytest.raises(Unavailable, match="transaction aborted"):
        publisher._commit(failed, time.monotonic() + 4)  # type: ignore[arg-type]
    assert failed.aborts == 0

    lost = FakeProducer([KafkaError(KafkaError._TIMED_OUT, "EndTxn timed out", retriable=True)] * 2, 0)
    publisher = committing(lost)
    publisher._commit(lost, time.monotonic())  # type: ignore[arg-type]
    assert lost.commits == 3

    # Review finding: librdkafka's queue length counts log lines and errors too (a broker dropping the link
    # queues "Disconnected" lines): every record delivered and the EndTxn sent, it must not pass for a flush.
    noisy = FakeProducer([KafkaError(KafkaError._TIMED_OUT, "EndTxn timed out", retriable=True)] * 2, 0, events=7)
    publisher = committing(noisy)
    publisher._commit(noisy, time.monotonic())  # type: ignore[arg-type]
    assert noisy.commits == 3


def test_a_replica_with_a_shorter_lease_does_not_end_a_longer_one(store: IdempotencyStore, clock: Clock) -> None:
    """Review finding: during a rolling change of --publish-timeout each replica judged other claims by its own
    lease; one of a shorter lease took over a key whose claimant was still within its own (and renewing), and
    both published. The claimant writes where its lease ends; every replica reads that."""
    long_lease = IdempotencyStore(store.engine, ttl=store.ttl, lease=store.lease * 5)
    first = long_lease.claim("t:S", "body")
    assert isinstance(first, Claimed)
    lapse(store, clock)  # past the short lease, well within the long one
    assert isinstance(store.claim("t:S", "body"), InProgress)
    clock.advance(long_lease.renew_every)
    assert long_lease.renew(first)
    clock.advance(long_lease.lease - timedelta(seconds=1))
    assert isinstance(store.claim("t:S", "body"), InProgress)  # still within the renewed long lease
    assert store.purge() == 0
    clock.advance(timedelta(seconds=2))
    assert isinstance(store.claim("t:S", "body"), Stale)  # the claimant stopped renewing: now it is stale


def test_an_unanswered_claim_past_its_lifetime_is_looked_up_not_published_again(
    store: IdempotencyStore, clock: Clock
) -> None:
    """Review finding: a claim whose process died after Kafka committed, retried only after the key expired, was
    claimed as a new request (published again) without its receipt being looked for. Now it is `Stale` (the
    receipt is read first); an answer found renews the lifetime, a take-over starts a new one."""
    first = store.claim("t:E", "body")
    assert isinstance(first, Claimed)
    clock.advance(store.ttl + store.lease)
    stale = store.claim("t:E", "body")
    assert isinstance(stale, Stale) and stale.expires_at == first.expires_at
    assert isinstance(store.claim("t:E", "other body"), Claimed)  # another body under an expired key: new

    second = store.claim("t:F", "body")
    assert isinstance(second, Claimed)
    clock.advance(store.ttl + store.lease)
    found = store.claim("t:F", "body")
    assert isinstance(found, Stale)
    assert store.settle(found, 202, '{"accepted": 1}')  # its receipt was found
    clock.advance(timedelta(minutes=5))
    assert store.claim("t:F", "body") == Answered(202, '{"accepted": 1}')  # not a new request

    third = store.claim("t:G2", "body")
    assert isinstance(third, Claimed)
    clock.advance(store.ttl + store.lease)
    stale = store.claim("t:G2", "body")
    assert isinstance(stale, Stale)
    taken = store.take_over(stale)  # no receipt: published by this request, under a new lifetime
    assert taken is not None and taken.expires_at > clock.now
    assert isinstance(store.claim("t:G2", "body"), InProgress)


def test_the_receipts_topic_id_is_read_when_due_and_a_failed_reading_keeps_the_last(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What a claim names (receipts.py): the id read when due, a reading that fails (Kafka away, or no answer in
    time) neither raises into the publish nor forgets the last id, and is tried again only after
    TOPIC_ID_RETRY_S, not at every batch; a topic found missing (or a cluster's all-zero id) does not replace the
    last id and is asked again as soon; and of two readings the one asked for later stands, whichever thread
    keeps it first."""
    from skillstats.ingest import receipts as module

    clock = [1000.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    receipts = module.Receipts(Settings(), timedelta(hours=1))
    answers: list[object] = ["id-A"]
    asked: list[float] = []

    def topic_id(_timeout: float) -> str | None:
        asked.append(clock[0])
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[return-value]

    monkeypatch.setattr(receipts, "topic_id", topic_id)
    receipts.refresh_topic_id(1.0)
    assert receipts.known_topic_id() == "id-A"
    clock[0] += module.TOPIC_ID_FRESH_S - 1
    receipts.refresh_topic_id(1.0)  # not due
    assert asked == [1000.0]
    clock[0] += 1
    answers.append(KafkaException(KafkaError(KafkaError._TIMED_OUT)))
    receipts.refresh_topic_id(1.0)  # due, fails: no exception, the last id kept
    assert receipts.known_topic_id() == "id-A" and len(asked) == 2
    receipts.refresh_topic_id(1.0)
    assert len(asked) == 2  # not at every batch while Kafka is away
    clock[0] += module.TOPIC_ID_RETRY_S
    answers.append(None)  # the topic missing: the last id kept, asked again as soon as after a failure
    receipts.refresh_topic_id(1.0)
    assert receipts.known_topic_id() == "id-A" and len(asked) == 3
    clock[0] += module.TOPIC_ID_RETRY_S
    answers.append(ValueError("what the client raises for what it was handed"))
    receipts.refresh_topic_id(1.0)  # nothing raised into the publish
    assert receipts.known_topic_id() == "id-A" and len(asked) == 4
    clock[0] += module.TOPIC_ID_RETRY_S
    answers.append("AAAAAAAAAAAAAAAAAAAAAA")  # a cluster that gives no ids: names nothing, not kept
    receipts.refresh_topic_id(1.0)
    assert receipts.known_topic_id() == "id-A"
    clock[0] += module.TOPIC_ID_RETRY_S
    answers.append("id-B")
    receipts.refresh_topic_id(1.0)
    assert receipts.known_topic_id() == "id-B"
    receipts._keep_topic_id("id-A", clock[0] - 1)  # a reading asked for before the one kept
    assert receipts.known_topic_id() == "id-B"
    answers.append("id-C")
    receipts.refresh_topic_id(1.0, now=True)
    assert receipts.known_topic_id() == "id-C"


def test_a_describe_that_outlasts_its_wait_is_a_kafka_error_not_a_timeout() -> None:
    """The future's own wait raises TimeoutError, which the publisher's handling of Kafka errors would not
    catch: `topic_id` says it as Kafka's _TIMED_OUT (against an address where nothing listens)."""
    from skillstats.ingest.receipts import Receipts

    receipts = Receipts(Settings(kafka_bootstrap="127.0.0.1:9"), timedelta(hours=1))
    with pytest.raises(KafkaException) as raised:
        receipts.topic_id(0.5)
    assert raised.value.args[0].code() in (KafkaError._TIMED_OUT, KafkaError._TRANSPORT)
    receipts.close()


def test_an_offset_lookup_that_outlasts_its_wait_is_receipts_unknown_not_a_timeout() -> None:
    """The same for the receipts' offsets: `find` says ReceiptsUnknown (the take-over's 503 with its reason),
    never a bare TimeoutError. The topic's id is taken as read, and the admin client's answer never comes (a
    future left pending, as librdkafka's is while a broker holds the request), so the future's own wait runs out."""
    from concurrent.futures import Future
    from datetime import UTC, datetime

    from skillstats.ingest.idempotency import Stale
    from skillstats.ingest.receipts import Receipts, ReceiptsUnknown

    class SilentAdmin:
        def list_offsets(self, requests: dict[object, object], **_: object) -> dict[object, Future[object]]:
            return {partition: Future() for partition in requests}

    receipts = Receipts(Settings(kafka_bootstrap="127.0.0.1:9"), timedelta(hours=1))
    receipts._admin = SilentAdmin()  # type: ignore[assignment]
    receipts._read_topic_id = lambda deadline: "id-A"  # type: ignore[method-assign]
    now = datetime.now(UTC).replace(tzinfo=None)
    stale = Stale(key="k", claimed_at=now, renewed_at=None, expires_at=now, digest="d", receipts_topic="id-A")
    with pytest.raises(ReceiptsUnknown, match="no answer"):
        receipts.find(stale, 1.0)
