"""The records of many requests, published in one Kafka transaction: all of a request, or none of it.

Why transactions, when the Python `Publisher` needs none: an HTTP client that
got no `202` will send its request again. With a plain idempotent producer a
request whose records were half acknowledged when its time ran out (a broker
restarting, a full queue) would leave those records published, and librdkafka
would go on delivering the rest after the `503`: the retry would count them
twice. Inside a transaction, records count for the consumers (both groups read
`read_committed`) only when it commits; a transaction aborted, or left open by
a process that died, counts nowhere. So `202` means committed, and `503` means
nothing of the request will ever be counted, and a retry is always safe.

Group commit: one producer, one transaction at a time (Kafka allows no more per
transactional id), so the records of every request waiting when a transaction
begins go into it together, up to `max_records`. A single-event request waits
for at most the transaction in flight and its own; a burst of requests costs one
commit, not one each. The price of sharing: when a transaction fails, every
request in it gets `503` (and sends again).

The transactional id is stable per process slot (`skillstats-ingest-<instance>`,
the pod's name, or host and port): a restarted process's `init_transactions`
fences its predecessor and aborts whatever that left open, at once. A process
that is never restarted under the same id (a pod replaced under a new name)
leaves its open transaction to the broker's `transaction.timeout.ms`, which
this sets short (publish timeout + 10 s): until then read_committed consumers
wait at its first record, delayed, never wrong.

A commit whose outcome librdkafka reports as unknown (a retriable error from
`commit_transaction` once every record was acknowledged: the commit itself was
asked for) is retried, past the request's own deadline, until it is known:
answering `503` for a transaction that did commit is the one way this could
double count. Only a fatal error (the producer fenced by another process with
the same transactional id, mid-commit) leaves the outcome unknown; such a
request is answered `500` with `"outcome": "unknown"` (docs/contract.md, HTTP).

Kafka going away (issue 28): a request in flight is answered `503` at its
deadline, one `--publish-timeout` after it was handed over. Its records not
acknowledged then, no commit was asked for, and none will be: the producer is
dropped, never aborted (an abort waits on the broker that is gone), and the
next producer's `init_transactions` aborts the transaction on the broker. A
failed transaction always costs a new producer: one whose records timed out
may hold sequence numbers the broker refuses ("skipped sequence numbers") once
it is back. Readiness says Kafka is away as soon as librdkafka does (its
`_ALL_BROKERS_DOWN`, served while idle every half second), or once a
transaction has waited longer than the publish timeout; it comes back with the
first check that Kafka answers (every second while it is away, every 5 s
otherwise).

A keyed request's submission carries its receipt (receipts.py), produced in the
same transaction as its events, so that whether it committed can be read back
from Kafka by a request that takes its key over after a crash. Kafka refuses a
transaction timeout above the broker's `transaction.max.timeout.ms` (15 min by
default): `--publish-timeout` + 10 s must stay below it, or `init_transactions`
fails and every request is answered 503; `transaction_limit_ms` reads the limit
so that the command line can refuse such a timeout at start.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from skillstats.config import Settings
from skillstats.ingest.receipts import Receipts, ReceiptsProblem
from skillstats.kafka import RefusalWatch
from skillstats.publisher import producer_config
from skillstats.retry import Outage

log = logging.getLogger(__name__)

# A transaction may stay open this much longer than --publish-timeout (the broker aborts it after that).
TRANSACTION_MARGIN_S = 10.0
# Kafka's default transaction.max.timeout.ms: assumed where the broker's own cannot be read.
KAFKA_DEFAULT_TRANSACTION_MAX_MS = 900_000


def transaction_timeout_ms(publish_timeout: float) -> int:
    return int((publish_timeout + TRANSACTION_MARGIN_S) * 1000)


def transaction_limit_ms(settings: Settings, timeout: float) -> int | None:
    """The broker's `transaction.max.timeout.ms` (the smallest, asking each broker), or None when it cannot be
    read (Kafka away, or DescribeConfigs not allowed)."""
    admin = AdminClient(settings.kafka_config())
    try:
        brokers = admin.list_topics(timeout=timeout).brokers
        resources = [ConfigResource(ResourceType.BROKER, str(broker)) for broker in sorted(brokers)]
        limits = []
        for future in admin.describe_configs(resources, request_timeout=timeout).values():
            entry = future.result(timeout).get("transaction.max.timeout.ms")
            if entry is not None and entry.value is not None:
                limits.append(int(entry.value))
        return min(limits) if limits else None
    except (KafkaException, ValueError) as exc:
        log.debug("transaction.max.timeout.ms not read: %s", exc)
        return None


class Unavailable(Exception):
    """Nothing of the request was published, and nothing will be: answer 503, the client may send again."""


class OutcomeUnknown(Exception):
    """The transaction may or may not have committed (the producer was fenced mid-commit): answer 500."""


@dataclass
class _Submission:
    records: Sequence[tuple[bytes, bytes]]
    timestamp_ms: int
    deadline: float
    future: Future[None] = field(default_factory=Future)
    receipt: tuple[int, bytes, bytes] | None = None  # (partition, key, value) in the receipts topic


class TransactionalPublisher:
    """A thread that publishes submitted records in transactions; `submit` returns a Future per request.

    `kafka_problem` (read by /readyz from any thread) says why it cannot publish now, or None; `on_outcome`
    is told each transaction's outcome (`committed`, `aborted`, `unknown`), for the metrics.
    """

    def __init__(
        self,
        settings: Settings,
        transactional_id: str,
        publish_timeout: float,
        max_records: int = 100_000,
        receipts: Receipts | None = None,
        start: bool = True,
    ) -> None:
        self.settings = settings
        self.transactional_id = transactional_id
        self.publish_timeout = publish_timeout
        self.max_records = max_records
        self.receipts = receipts
        self.on_outcome: Callable[[str], None] | None = None
        self._receipts_ready = False
        self._problem: str | None = f"Kafka at {settings.kafka_bootstrap}: not connected yet"
        self._away: str | None = None  # librdkafka said no broker answers; cleared by the next success
        self._busy_since: float | None = None  # when the transaction in progress began
        self.transactions = {"committed": 0, "aborted": 0, "unknown": 0}
        self._queue: queue.Queue[_Submission | None] = queue.Queue()
        self._producer: Producer | None = None
        self._undelivered = 0  # records of the transaction in progress without a delivery report (_delivered)
        self._refusals = RefusalWatch()
        self._outage = Outage(log)
        self._stopping = threading.Event()
        self._lifecycle = threading.Lock()  # start() and close() from different threads, one at a time
        self._thread = threading.Thread(target=self._run, name="ingest-transactions", daemon=True)
        if start:
            self.start()

    def start(self) -> None:
        """Begin talking to Kafka (at construction unless `start=False`: the command line checks its settings
        against the broker first, so that a refused setting exits in one line rather than a failing publisher's
        log). Until then requests wait in the queue, and are answered 503 at their deadline."""
        with self._lifecycle:
            if self._thread.ident is None and not self._stopping.is_set():
                self._thread.start()

    @property
    def kafka_problem(self) -> str | None:
        """Why this process cannot publish now (for /readyz), or None."""
        bootstrap = self.settings.kafka_bootstrap
        if self._away is not None:
            return f"Kafka at {bootstrap} is away: {self._away}"
        began = self._busy_since
        if began is not None and time.monotonic() - began > self.publish_timeout:
            return f"Kafka at {bootstrap} has not confirmed a transaction for {time.monotonic() - began:.0f} s"
        return self._problem

    def submit(
        self,
        records: Sequence[tuple[bytes, bytes]],
        timestamp_ms: int,
        receipt: tuple[int, bytes, bytes] | None = None,
    ) -> Future[None]:
        """Publish these (key, value) records with this CreateTime, all or none, and with them the request's
        receipt (partition, key, value) when it has one; the Future says which. A caller that gives up on a
        Future still pending may `cancel()` it: a cancelled submission is never published."""
        if receipt is not None and self.receipts is None:
            raise ValueError("a receipt for a publisher with no receipts topic")
        submission = _Submission(records, timestamp_ms, time.monotonic() + self.publish_timeout, receipt=receipt)
        if self._stopping.is_set():
            submission.future.set_exception(Unavailable("shutting down"))
        else:
            self._queue.put(submission)
        return submission.future

    def queued_records(self) -> int:
        """Records waiting in librdkafka's queue (a gauge: how far the producer is behind)."""
        producer = self._producer
        return len(producer) if producer is not None else 0

    def close(self, timeout: float) -> None:
        """Publish what was submitted (within `timeout`), then stop; later submissions are refused."""
        with self._lifecycle:
            self._stopping.set()
            started = self._thread.ident is not None
        if not started:  # nothing was published: whatever waits is told so
            while True:
                try:
                    waiting = self._queue.get_nowait()
                except queue.Empty:
                    return
                if waiting is not None and waiting.future.set_running_or_notify_cancel():
                    _settle(waiting, Unavailable("shutting down"))
        self._queue.put(None)
        self._thread.join(timeout)
        producer = self._producer
        if producer is not None and not self._thread.is_alive():
            producer.flush(0)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        next_check = time.monotonic()  # check Kafka at once: readiness should not wait for a request
        while True:
            try:
                first = self._queue.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                self._serve_callbacks()
                if time.monotonic() >= next_check:
                    self._check_kafka()
                    next_check = time.monotonic() + self._check_interval()
                continue
            if first is None:
                if self._queue.empty():
                    return
                continue
            batch, size = [first], len(first.records)
            while size < self.max_records:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)  # stop after this batch and whatever is still queued
                    break
                batch.append(more)
                size += len(more.records)
            self._publish(batch)
            next_check = time.monotonic() + self._check_interval()

    def _check_interval(self) -> float:
        """Every 5 s while Kafka answers; every second while it does not, so that readiness comes back soon."""
        return CHECK_EVERY_S if self._problem is None and self._away is None else RECHECK_AWAY_S

    def _serve_callbacks(self) -> None:
        """While idle, let librdkafka tell (error_cb) that no broker answers: readiness says so at once."""
        producer = self._producer
        if producer is not None:
            producer.poll(0)

    def _on_error(self, error: KafkaError) -> None:
        """The producer's error_cb, called in this thread from poll, flush and commit_transaction."""
        self._refusals(error)
        if error.code() == KafkaError._ALL_BROKERS_DOWN and self._away is None:
            self._away = error.str()
            self._outage.failed(f"publishing to Kafka at {self.settings.kafka_bootstrap}", _AWAY, RECHECK_AWAY_S)

    def _count(self, outcome: str) -> None:
        self.transactions[outcome] += 1
        if self.on_outcome is not None:
            self.on_outcome(outcome)

    def _publish(self, batch: list[_Submission]) -> None:
        now = time.monotonic()
        live = []
        for submission in batch:
            # A request whose waiter is gone (its Future cancelled) is not published: nobody would be told.
            if not submission.future.set_running_or_notify_cancel():
                continue
            if submission.deadline <= now:
                _settle(submission, Unavailable("not published within --publish-timeout"))
            else:
                live.append(submission)
        if not live:
            return
        deadline = min(s.deadline for s in live)
        self._busy_since = now
        try:
            self._transaction(live, deadline)
        except OutcomeUnknown as exc:
            self._count("unknown")
            for submission in live:
                _settle(submission, exc)
            return
        except Exception as exc:
            self._count("aborted")
            problem = str(exc) or type(exc).__name__
            for submission in live:  # answered first: nothing below waits on Kafka
                _settle(submission, Unavailable(problem))
            self._failed(problem, exc)
            return
        finally:
            self._busy_since = None
        self._count("committed")
        self._ok()
        for submission in live:
            _settle(submission, None)

    def _failed(self, problem: str, exc: BaseException) -> None:
        self._problem = f"Kafka at {self.settings.kafka_bootstrap}: {problem}"
        self._outage.failed(f"publishing to Kafka at {self.settings.kafka_bootstrap}", self._reason(exc), 0.0)

    def _ok(self) -> None:
        self._outage.recovered(f"publishing to Kafka at {self.settings.kafka_bootstrap} works again")
        self._problem = self._away = None

    def _reason(self, exc: BaseException) -> str:
        """What the log says failed: one wording per kind of failure, so that an outage whose errors vary in
        their details (a timeout here, a transport failure there) is one WARNING, not one per variant."""
        if self._away is not None:
            return _AWAY
        error = exc.args[0] if isinstance(exc, KafkaException) and exc.args else None
        if isinstance(exc, (TimeoutError, _Late)) or (
            isinstance(error, KafkaError) and (error.retriable() or error.code() in _NO_ANSWER)
        ):
            return "no answer in time"
        return (str(exc) or type(exc).__name__).splitlines()[0]

    def _ensure_producer(self, deadline: float) -> Producer:
        if self.receipts is not None and not self._receipts_ready:
            self.receipts.ensure_topic(max(0.5, deadline - time.monotonic()))
            self._receipts_ready = True
        elif self.receipts is not None:  # the id claims name, at most a minute old (receipts.py)
            self.receipts.refresh_topic_id(TOPIC_ID_WAIT_S)  # off the batch's deadline: kept short
        if self._producer is None:
            self._refusals = RefusalWatch()
            producer = Producer(
                producer_config(
                    self.settings,
                    **{
                        "transactional.id": self.transactional_id,
                        "transaction.timeout.ms": transaction_timeout_ms(self.publish_timeout),
                        "linger.ms": 2,
                        "error_cb": self._on_error,
                    },
                )
            )
            try:
                self._init_transactions(producer, deadline)
            except KafkaException as exc:
                self._refusals.raise_if_refused(self.settings)
                error = exc.args[0] if exc.args else None
                if isinstance(error, KafkaError) and error.code() == KafkaError.INVALID_TRANSACTION_TIMEOUT:
                    raise RuntimeError(
                        f"the broker refuses a transaction timeout of {transaction_timeout_ms(self.publish_timeout)} "
                        f"ms (--publish-timeout + {TRANSACTION_MARGIN_S:g} s): its transaction.max.timeout.ms is "
                        f"lower; lower --publish-timeout or raise that limit"
                    ) from None
                raise
            except Exception:
                self._refusals.raise_if_refused(self.settings)
                raise
            self._producer = producer
        return self._producer

    def _init_transactions(self, producer: Producer, deadline: float) -> None:
        """`init_transactions` (which fences an earlier process with this id and aborts what it left open), in
        slices of a second resumed until `deadline`: librdkafka serves error_cb only between calls, so a refusal
        or no broker answering is known within a second instead of at the deadline."""
        while True:
            try:
                producer.init_transactions(max(0.2, min(1.0, deadline - time.monotonic())))
                return
            except KafkaException as exc:
                producer.poll(0)
                self._refusals.raise_if_refused(self.settings)
                error = exc.args[0] if exc.args else None
                if not (isinstance(error, KafkaError) and error.retriable()):
                    raise
                if time.monotonic() >= deadline:  # said plainly, not as librdkafka's "retry call to resume"
                    raise TimeoutError(f"no answer from Kafka in time ({self._away or error.str()})") from None

    def _drop_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.flush(0)

    def _transaction(self, batch: list[_Submission], deadline: float) -> None:
        """Commit every record of `batch` in one transaction, or raise: Unavailable-worthy, or OutcomeUnknown.

        A transaction that fails is never aborted here: its producer is dropped, and the next one's
        `init_transactions` (at the next check, within a second while Kafka is away, or the next request) aborts
        it on the broker and fences this one. An abort would wait on a broker that may be gone, before the
        requests could be answered (they were answered a publish timeout late), and a producer whose records
        timed out may keep sequence numbers the broker no longer takes (the first transaction after an outage
        failed with "skipped sequence numbers"). What it costs: the transaction stays open (read_committed
        consumers wait at its first record) until that `init_transactions`, and a new producer per failure.
        """
        try:
            producer = self._ensure_producer(deadline)
            producer.begin_transaction()
            self._undelivered = 0
            for submission in batch:
                for key, value in submission.records:
                    self._produce(producer, self.settings.topic, None, key, value, submission.timestamp_ms, deadline)
                if submission.receipt is not None and self.receipts is not None:
                    partition, key, value = submission.receipt
                    self._produce(
                        producer, self.receipts.topic, partition, key, value, submission.timestamp_ms, deadline
                    )
            self._commit(producer, deadline)
        except OutcomeUnknown:
            raise
        except BaseException:
            self._drop_producer()
            raise

    def _produce(
        self,
        producer: Producer,
        topic: str,
        partition: int | None,
        key: bytes,
        value: bytes,
        timestamp_ms: int,
        deadline: float,
    ) -> None:
        where = {} if partition is None else {"partition": partition}
        while True:
            try:
                producer.produce(
                    topic, value=value, key=key, timestamp=timestamp_ms, on_delivery=self._delivered, **where
                )
                self._undelivered += 1
                return
            except BufferError:  # librdkafka's queue is full: let it drain, within the deadline
                if time.monotonic() >= deadline:
                    raise TimeoutError("the producer's queue stayed full past --publish-timeout") from None
                producer.poll(0.05)

    def _delivered(self, _error: KafkaError | None, _message: Any) -> None:
        """A delivery report, ok or not: librdkafka serves these (inside `commit_transaction`'s flush too) before
        it can ask for the commit, so records without one prove that no commit was asked for."""
        self._undelivered -= 1

    def _commit(self, producer: Producer, deadline: float) -> None:
        """Commit within the request's deadline, or raise Unavailable when the transaction cannot commit any more.

        `commit_transaction` first waits for every record's delivery report, and only then asks the broker to
        commit (EndTxn). A retriable error with records still without a report (counted by `_delivered`, not by
        `len(producer)`, which also counts log and error events queued for the application and so can stay
        above 0 after EndTxn was sent) is therefore the flush timing out: no commit was asked for, and past the
        deadline none will be (the producer is dropped): 503, within the one publish timeout the contract gives.
        Once an attempt ends with every report in, an EndTxn may have been sent and its answer lost: from then on
        the outcome is asked for again until it is known, whatever the deadline says (a 503 for a transaction
        that did commit is the one way this could double count).
        """
        commit_may_be_sent = False
        while True:
            try:
                producer.commit_transaction(max(0.5, deadline - time.monotonic()))
                return
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if error.txn_requires_abort():
                    raise Unavailable(f"transaction aborted: {error.str()}") from None
                if error.retriable():
                    commit_may_be_sent = commit_may_be_sent or self._undelivered <= 0
                    if not commit_may_be_sent:  # still flushing: no commit asked for yet
                        if time.monotonic() >= deadline:
                            raise _Late(
                                f"Kafka did not acknowledge the records within --publish-timeout "
                                f"({self.publish_timeout:g} s): {error.str()}"
                            ) from None
                        continue
                    if time.monotonic() >= deadline:
                        self._outage.failed(
                            f"publishing to Kafka at {self.settings.kafka_bootstrap}",
                            "a commit's outcome not known by its deadline; asking again",
                            self.publish_timeout,
                        )
                        deadline = time.monotonic() + self.publish_timeout
                    continue
                self._drop_producer()
                if error.fatal():
                    raise OutcomeUnknown(f"the producer failed mid-commit: {error.str()}") from None
                raise OutcomeUnknown(f"commit failed: {error.str()}") from None

    def _check_kafka(self) -> None:
        """While idle: whether Kafka answers, so that readiness says so before the next request finds out."""
        bootstrap = self.settings.kafka_bootstrap
        try:
            producer = self._ensure_producer(time.monotonic() + CHECK_TIMEOUT_S)
            producer.list_topics(self.settings.topic, timeout=CHECK_TIMEOUT_S)
        except ReceiptsProblem as exc:  # Kafka answers, but keyed requests could not be published once-only
            self._drop_producer()
            self._problem = str(exc)
            self._outage.failed(f"the receipts topic on {bootstrap}", str(exc), RECHECK_AWAY_S)
            return
        except Exception as exc:
            self._drop_producer()
            self._problem = f"Kafka at {bootstrap} does not answer: {exc}"
            self._outage.failed(f"publishing to Kafka at {bootstrap}", self._reason(exc), RECHECK_AWAY_S)
            return
        self._ok()


class _Late(Unavailable):
    """The records were not acknowledged by the request's deadline, and no commit was asked for."""


# The thread's rhythm: how long it waits for a request before serving librdkafka's callbacks, how often it asks
# Kafka while idle (and while Kafka is away), and how long such a check may take.
IDLE_POLL_S = 0.5
CHECK_EVERY_S = 5.0
RECHECK_AWAY_S = 1.0
CHECK_TIMEOUT_S = 5.0
TOPIC_ID_WAIT_S = 1.0  # the receipts topic's id read before a transaction, when due (receipts.py)
_AWAY = "no broker answers"
_NO_ANSWER = frozenset({KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN})


def _settle(submission: _Submission, outcome: BaseException | None) -> None:
    """Tell the request its outcome; never raises, so one settled Future cannot stop the thread."""
    try:
        if outcome is None:
            submission.future.set_result(None)
        else:
            submission.future.set_exception(outcome)
    except Exception:  # InvalidStateError: already settled (cannot happen once running, but never fatal)
        log.exception("a request's outcome could not be set")
