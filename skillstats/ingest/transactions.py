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
`commit_transaction`) is retried, past the request's own deadline, until it is
known: answering `503` for a transaction that did commit is the one way this
could double count. Only a fatal error (the producer fenced by another process
with the same transactional id, mid-commit) leaves the outcome unknown; such a
request is answered `500` with `"outcome": "unknown"` (docs/contract.md, HTTP).

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
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

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
    """A thread that publishes submitted records in transactions; `submit` returns a Future per request."""

    def __init__(
        self,
        settings: Settings,
        transactional_id: str,
        publish_timeout: float,
        max_records: int = 100_000,
        receipts: Receipts | None = None,
    ) -> None:
        self.settings = settings
        self.transactional_id = transactional_id
        self.publish_timeout = publish_timeout
        self.max_records = max_records
        self.receipts = receipts
        self._receipts_ready = False
        self.kafka_problem: str | None = "not connected to Kafka yet"
        self.transactions = {"committed": 0, "aborted": 0, "unknown": 0}
        self._queue: queue.Queue[_Submission | None] = queue.Queue()
        self._producer: Producer | None = None
        self._refusals = RefusalWatch()
        self._outage = Outage(log)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ingest-transactions", daemon=True)
        self._thread.start()

    def submit(
        self,
        records: Sequence[tuple[bytes, bytes]],
        timestamp_ms: int,
        receipt: tuple[int, bytes, bytes] | None = None,
    ) -> Future[None]:
        """Publish these (key, value) records with this CreateTime, all or none, and with them the request's
        receipt (partition, key, value) when it has one; the Future says which."""
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
        self._stopping.set()
        self._queue.put(None)
        self._thread.join(timeout)
        producer = self._producer
        if producer is not None and not self._thread.is_alive():
            producer.flush(0)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        idle_since = time.monotonic() - 5.0  # check Kafka at once: readiness should not wait for a request
        while True:
            try:
                first = self._queue.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() - idle_since >= 5.0:
                    self._check_kafka()
                    idle_since = time.monotonic()
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
            idle_since = time.monotonic()

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
        try:
            self._transaction(live, deadline)
        except OutcomeUnknown as exc:
            self.transactions["unknown"] += 1
            for submission in live:
                _settle(submission, exc)
            return
        except Exception as exc:
            self.transactions["aborted"] += 1
            problem = str(exc) or type(exc).__name__
            self._outage.failed(f"publishing to Kafka at {self.settings.kafka_bootstrap}", problem, 0.0)
            self.kafka_problem = problem
            for submission in live:
                _settle(submission, Unavailable(problem))
            return
        self.transactions["committed"] += 1
        self._outage.recovered(f"publishing to Kafka at {self.settings.kafka_bootstrap} works again")
        self.kafka_problem = None
        for submission in live:
            _settle(submission, None)

    def _ensure_producer(self, deadline: float) -> Producer:
        if self.receipts is not None and not self._receipts_ready:
            self.receipts.ensure_topic(max(0.5, deadline - time.monotonic()))
            self._receipts_ready = True
        if self._producer is None:
            self._refusals = RefusalWatch()
            producer = Producer(
                producer_config(
                    self.settings,
                    **{
                        "transactional.id": self.transactional_id,
                        "transaction.timeout.ms": transaction_timeout_ms(self.publish_timeout),
                        "linger.ms": 2,
                        "error_cb": self._refusals,
                    },
                )
            )
            try:
                # Fences an earlier process with this id and aborts what it left open.
                producer.init_transactions(max(0.5, deadline - time.monotonic()))
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

    def _drop_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            producer.flush(0)

    def _transaction(self, batch: list[_Submission], deadline: float) -> None:
        """Commit every record of `batch` in one transaction, or raise: Unavailable-worthy, or OutcomeUnknown."""
        try:
            producer = self._ensure_producer(deadline)
        except Exception:
            self._drop_producer()
            raise
        try:
            producer.begin_transaction()
        except Exception:  # a fatal producer (fenced, or an error of a previous transaction): start anew
            self._drop_producer()
            raise
        try:
            for submission in batch:
                for key, value in submission.records:
                    self._produce(producer, self.settings.topic, None, key, value, submission.timestamp_ms, deadline)
                if submission.receipt is not None and self.receipts is not None:
                    partition, key, value = submission.receipt
                    self._produce(
                        producer, self.receipts.topic, partition, key, value, submission.timestamp_ms, deadline
                    )
        except BaseException:
            self._abort(producer)
            raise
        self._commit(producer, deadline)

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
                producer.produce(topic, value=value, key=key, timestamp=timestamp_ms, **where)
                return
            except BufferError:  # librdkafka's queue is full: let it drain, within the deadline
                if time.monotonic() >= deadline:
                    raise TimeoutError("the producer's queue stayed full past --publish-timeout") from None
                producer.poll(0.05)

    def _commit(self, producer: Producer, deadline: float) -> None:
        # Within the request's deadline an error may still abort the transaction cleanly: 503. A retriable
        # error means the outcome is not known yet: ask again until it is, whatever the deadline says.
        while True:
            try:
                producer.commit_transaction(max(0.5, deadline - time.monotonic()))
                return
            except KafkaException as exc:
                error: KafkaError = exc.args[0]
                if error.txn_requires_abort():
                    self._abort(producer)
                    raise Unavailable(f"transaction aborted: {error.str()}") from None
                if error.retriable():
                    if time.monotonic() >= deadline:
                        log.warning("commit not confirmed by the deadline; asking again: %s", error.str())
                        deadline = time.monotonic() + self.publish_timeout
                    continue
                self._drop_producer()
                if error.fatal():
                    raise OutcomeUnknown(f"the producer failed mid-commit: {error.str()}") from None
                raise OutcomeUnknown(f"commit failed: {error.str()}") from None

    def _abort(self, producer: Producer) -> None:
        try:
            producer.abort_transaction(self.publish_timeout)
        except Exception as exc:  # not even that: a new producer (its init_transactions aborts for us)
            log.warning("abort failed (%s); the next transaction starts a new producer", exc)
            self._drop_producer()

    def _check_kafka(self) -> None:
        """While idle: whether Kafka answers, so that readiness says so before the next request finds out."""
        try:
            producer = self._ensure_producer(time.monotonic() + 5.0)
            producer.list_topics(self.settings.topic, timeout=5.0)
        except ReceiptsProblem as exc:  # Kafka answers, but keyed requests could not be published once-only
            self._drop_producer()
            self.kafka_problem = str(exc)
            self._outage.failed(f"the receipts topic on {self.settings.kafka_bootstrap}", str(exc), 5.0)
            return
        except Exception as exc:
            self._drop_producer()
            self.kafka_problem = f"Kafka at {self.settings.kafka_bootstrap} does not answer: {exc}"
            self._outage.failed(f"reaching Kafka at {self.settings.kafka_bootstrap}", str(exc), 5.0)
            return
        if self.kafka_problem is not None:
            self._outage.recovered(f"Kafka at {self.settings.kafka_bootstrap} answers")
        self.kafka_problem = None


def _settle(submission: _Submission, outcome: BaseException | None) -> None:
    """Tell the request its outcome; never raises, so one settled Future cannot stop the thread."""
    try:
        if outcome is None:
            submission.future.set_result(None)
        else:
            submission.future.set_exception(outcome)
    except Exception:  # InvalidStateError: already settled (cannot happen once running, but never fatal)
        log.exception("a request's outcome could not be set")
