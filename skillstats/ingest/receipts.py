"""Receipts: the Kafka transaction of a keyed request also records its answer, as the evidence a take-over reads.

Why: a keyed request's answer reaches SQL after its transaction committed, and
some crash always falls between the two (SIGKILL, the OOM killer, a node lost).
Its claim is then left with no answer, and the request used to be published
again once the claim's lease ran out: counted twice (issue 27 measured 88 daily
rows counted twice in one run of four retrying clients and eight SIGKILLs). Now
every keyed request's transaction also writes one small record to
`<topic>.ingest-receipts`, ingest's own topic: keyed by the claim's key, holding
the answer and the key's lifetime (its `expires_at`, which names one use of a
key). It commits with the events or not at all. A request that finds a claim
stale (idempotency.py) reads the key's partition of that topic,
`read_committed`, from the stale claim's time up to the end the partition had
when it looked: a receipt of this lifetime there is the answer, and nothing is
published again; none, and the key is taken over and published.

Why a receipt not found means nothing was committed:
- The stale claim's process stopped renewing its lease a lease ago (the publish
  timeout twice plus 40 s): whatever it produced is in the log by then.
- Reading `read_committed` up to the end taken *before* reading (the high
  watermark, uncommitted records included) cannot pass a transaction that is
  still open: the last stable offset waits for it, so an open transaction is
  waited for (up to `--publish-timeout`, then `503` and nothing published),
  never taken for an aborted one.
- An aborted transaction (a restart under the same transactional id aborts its
  predecessor's at once; the broker aborts any other after the transaction
  timeout, which the lease outlasts) is never handed to a `read_committed`
  reader, so its request is published again, rightly.
- A zombie producer of the same transactional id is fenced by its successor's
  `init_transactions`: it can commit nothing later.

Why the topic read must be the one written to: a receipts topic deleted, or
deleted and created again under its name (by an operator or a tool, or on another
cluster failed over to), has lost what it held, and "no receipt" then says
nothing. Kafka gives each topic it creates an id of its own, and a claim keeps the
id this process last read (`receipts_topic`, migration 0012; read when the topic
is ensured, again at most a minute later while publishing, and by a request that
finds none known). A take-over reads the id before and after its read: changed in
between, it cannot tell (`503`); a topic missing that the claim named, the same.
A receipt found is the answer whichever topic holds it (the transaction wrote it
there). None found, and a topic other than the claim's: `ReceiptsLost`, nothing
is published and the request is told its outcome cannot be known (`409`, no
Retry-After: the same key gets the same answer until it expires; a new key
publishes the events again, the caller's decision).

What the id does not catch: receipts lost while the topic keeps its id (a
cluster restored from a snapshot or volume backup keeps its topics' ids, as do an
unclean leader election and `kafka-delete-records`); a claim made with the id
unknown (NULL: a row of an older version, Kafka not answering the id since the
process started, or a cluster that gives no topic ids: Kafka before 2.8), judged
as before; and a broker whose metadata lags a deletion
by the moment the take-over asks it. The other way, it can refuse what could have
been published: a claim made in the minute after the topic was created again
under a running process (or by an older version taking a newer claim over) names
an old id, and if its process dies before its transaction commits, its retry is
told `409`.

The read starts at the stale claim's time less a minute: the receipt's record
timestamp is the request's validation time, taken on the same process's clock
after the claim, so no earlier record can be it (the minute absorbs a clock
stepped back). The receipt's partition is a function of the key over a fixed
`RECEIPT_PARTITIONS`, never of the topic's partition count, so that adding
partitions to the topic cannot hide a receipt.

What it costs: one record of about 200 bytes per keyed request inside its
transaction, and up to `RECEIPT_PARTITIONS` more partitions in the commit's
markers; a topic (compacted, and deleted after `--idempotency-hours` + 1 h, so
a receipt outlives its key); a take-over reads the receipts of its partition
written since the stale claim (kept per partition in memory, so the retries of
every request one crash cut off share one read, and a later take-over reads
only what was written since). One reader per process, one read at a time.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import orjson
from confluent_kafka import Consumer, IsolationLevel, KafkaError, KafkaException, TopicCollection, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

from skillstats.config import Settings
from skillstats.ingest.idempotency import Claimed, Stale
from skillstats.kafka import ensure_topics, topic_configs, while_moving

log = logging.getLogger(__name__)
T = TypeVar("T")

RECEIPT_PARTITIONS = 6
SCAN_MARGIN = timedelta(minutes=1)
# Past this many receipts of a partition in memory (a read over hours of traffic), only the key asked about
# is kept, and a read for another key starts again.
_MAX_KEPT = 200_000
# How old the receipts topic's id a claim names may be while the publisher runs (read again at most this often),
# and how soon a reading that failed or found no topic is tried again.
TOPIC_ID_FRESH_S = 60.0
TOPIC_ID_RETRY_S = 5.0
# The id of a topic on a cluster that keeps none (Kafka before 2.8): the same for every topic, so it names nothing.
_NO_TOPIC_ID = "AAAAAAAAAAAAAAAAAAAAAA"
_UNKNOWN_TOPIC = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError._UNKNOWN_PARTITION})


class ReceiptsUnknown(Exception):
    """Kafka could not tell in time whether a receipt was committed: publish nothing, answer 503."""


class ReceiptsLost(Exception):
    """The receipts topic the stale claim was made against is gone (deleted, or deleted and created again): no
    receipt in the topic now says nothing of whether the claim's transaction committed. Publish nothing; the
    request's outcome cannot be known."""


class ReceiptsProblem(Exception):
    """The receipts topic cannot be used as it is (missing and not creatable, too few partitions, too short a
    retention): keyed requests cannot be published once-only, so the server is not ready."""


@dataclass(frozen=True)
class Receipt:
    status: int
    response: str


@dataclass
class _Span:
    """Offsets [low, high) of one partition read to the end, and the newest receipt per key read there (of the
    key `only` alone, once there were too many to keep)."""

    low: int
    high: int
    found: dict[bytes, bytes] = field(default_factory=dict)
    only: bytes | None = None


def _until(deadline: float, call: Callable[[float], T]) -> T:
    """`call(seconds left)`, asked again while Kafka says a leader is moving (skillstats.kafka.while_moving), until
    `deadline`."""
    return while_moving(lambda: call(max(0.5, deadline - time.monotonic())), max(0.0, deadline - time.monotonic()))


def _answer(future: Future[T], timeout: float) -> T:
    """An admin client's answer; a future whose own wait runs out (not librdkafka's) raises KafkaException
    _TIMED_OUT, which every caller already handles as Kafka not telling in time, never a bare TimeoutError."""
    try:
        return future.result(timeout=timeout)
    except TimeoutError:
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, f"no answer in {timeout:.1f} s")) from None


def receipts_topic(settings: Settings) -> str:
    return f"{settings.topic}.ingest-receipts"


def receipt_partition(key: bytes) -> int:
    return zlib.crc32(key) % RECEIPT_PARTITIONS


def _epoch_ms(moment: datetime) -> int:
    return int(moment.replace(tzinfo=UTC).timestamp() * 1000)


class Receipts:
    """Writes (as records for the publisher's transactions) and reads the receipts of keyed requests."""

    def __init__(self, settings: Settings, ttl: timedelta) -> None:
        self.settings = settings
        self.ttl = ttl
        self.topic = receipts_topic(settings)
        self._lock = threading.Lock()
        self._admin_lock = threading.Lock()
        self._admin: AdminClient | None = None
        self._consumer: Consumer | None = None
        self._spans: dict[int, _Span] = {}
        self._spans_of: str | None = None  # the id of the topic the spans were read from
        self._topic_id: str | None = None  # the topic's id as last read (`known_topic_id`)
        self._topic_id_asked = -TOPIC_ID_FRESH_S  # when the reading kept there was asked for (monotonic)
        self._topic_id_due = 0.0  # when to read it again (monotonic)
        self._topic_id_reading = threading.Lock()
        self._topic_id_failing = False
        self._no_ids_said = False

    # ------------------------------------------------------------------ the topic

    def topic_config(self) -> dict[str, str]:
        retention = self.ttl + timedelta(hours=1)
        return {
            # Compaction keeps one receipt per key; deletion forgets a key's receipt after the key itself.
            "cleanup.policy": "compact,delete",
            "retention.ms": str(int(retention.total_seconds() * 1000)),
            "segment.ms": str(3_600_000),  # retention and compaction act on closed segments: close one an hour
            "message.timestamp.type": "CreateTime",  # the scan's lower bound is the publisher's clock
        }

    def ensure_topic(self, timeout: float) -> None:
        """Create the topic if it is missing; raise ReceiptsProblem when it cannot serve."""
        try:
            report = ensure_topics(
                self.settings,
                {self.topic: RECEIPT_PARTITIONS},
                configs={self.topic: self.topic_config()},
                timeout=timeout,
            )[0]
        except KafkaException as exc:
            raise ReceiptsProblem(
                f"cannot create the receipts topic {self.topic} ({exc.args[0]}): create it ({RECEIPT_PARTITIONS} "
                f"partitions, cleanup.policy=compact,delete, retention.ms at least --idempotency-hours) or let "
                f"ingest's principal create it (docs/contract.md, HTTP)"
            ) from None
        if report.created:
            log.info("created the receipts topic %s (%d partitions)", self.topic, report.partitions)
        if report.partitions < RECEIPT_PARTITIONS:
            raise ReceiptsProblem(
                f"the receipts topic {self.topic} has {report.partitions} partition(s); it needs "
                f"{RECEIPT_PARTITIONS} (kafka-topics.sh --alter --topic {self.topic} --partitions "
                f"{RECEIPT_PARTITIONS})"
            )
        self.refresh_topic_id(timeout, now=True)
        try:
            retention = int(
                topic_configs(self.settings, self.topic, ("retention.ms",), timeout).get("retention.ms", -1)
            )
        except (KafkaException, ValueError) as exc:
            log.warning(
                "cannot read the retention of %s (%s); it must be at least --idempotency-hours", self.topic, exc
            )
            return
        wanted = int(self.ttl.total_seconds() * 1000)
        if 0 <= retention < wanted:
            raise ReceiptsProblem(
                f"the receipts topic {self.topic} keeps records {retention} ms, less than --idempotency-hours "
                f"({wanted} ms): a receipt would go before its key (kafka-configs.sh --alter --entity-type topics "
                f"--entity-name {self.topic} --add-config retention.ms={self.topic_config()['retention.ms']})"
            )

    # ------------------------------------------------------------------ the topic's identity

    def topic_id(self, timeout: float) -> str | None:
        """The id Kafka gave the receipts topic when it was created (a new one each time it is created), or None
        when the topic does not exist; KafkaException when Kafka does not tell within `timeout`."""
        admin = self._admin_client()
        future = admin.describe_topics(TopicCollection([self.topic]), request_timeout=timeout)[self.topic]
        try:
            return str(_answer(future, timeout).topic_id)
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            if isinstance(error, KafkaError) and error.code() in _UNKNOWN_TOPIC:
                return None
            raise

    def known_topic_id(self) -> str | None:
        """The topic's id as last read, for a claim to name (None: not read yet, or the cluster gives no ids)."""
        return self._topic_id

    def refresh_topic_id(self, timeout: float, now: bool = False) -> None:
        """Read the topic's id again when it is due (`now`: at once): TOPIC_ID_FRESH_S after the last reading, or
        TOPIC_ID_RETRY_S after one that failed or found no topic; a caller that finds a reading under way waits
        for it (up to `timeout`). Never raises: a failed reading, or one that finds the topic missing, keeps the
        last id (a stale id errs toward 409 and 503, never toward publishing again), and the publish that
        follows finds out for itself whether Kafka answers."""
        if not now and time.monotonic() < self._topic_id_due:
            return
        if not self._topic_id_reading.acquire(timeout=timeout):
            return
        try:
            asked = time.monotonic()
            if not now and asked < self._topic_id_due:  # read by another caller meanwhile
                return
            self._topic_id_due = asked + TOPIC_ID_RETRY_S
            try:
                found = self.topic_id(timeout)
            except Exception as exc:  # Kafka's errors, and any the client raises for what it was handed
                if not self._topic_id_failing:
                    log.warning(
                        "cannot read the id of %s (%s): claims name the last one read (%s) until it can",
                        self.topic,
                        exc,
                        self._topic_id or "none",
                    )
                self._topic_id_failing = True
                return
            if self._topic_id_failing:
                log.info("the id of %s is read again", self.topic)
            self._topic_id_failing = False
            if found is not None:
                self._keep_topic_id(found, asked)
        finally:
            self._topic_id_reading.release()

    def _keep_topic_id(self, found: str, asked: float) -> None:
        """Keep a reading of the id unless one asked for later was kept meanwhile (readings from two threads)."""
        if found == _NO_TOPIC_ID:
            if self._topic_id is None and not self._no_ids_said:
                log.warning(
                    "the cluster gives %s no topic id (a Kafka before 2.8?): a take-over cannot tell the topic was "
                    "created again, and reads it as before (docs/contract.md, HTTP)",
                    self.topic,
                )
                self._no_ids_said = True
            return
        with self._admin_lock:
            if asked < self._topic_id_asked:
                return
            self._topic_id, self._topic_id_asked = found, asked
            self._topic_id_due = asked + TOPIC_ID_FRESH_S

    # ------------------------------------------------------------------ writing

    def record(self, claim: Claimed, status: int, response: str) -> tuple[int, bytes, bytes]:
        """The receipt of `claim` as (partition, key, value), for its request's transaction."""
        key = claim.key.encode()
        value = orjson.dumps(
            {
                "v": 1,
                "expires_at": claim.expires_at.isoformat(),
                "claimed_at": claim.claimed_at.isoformat(),
                "status": status,
                "response": response,
            }
        )
        return receipt_partition(key), key, value

    # ------------------------------------------------------------------ reading

    def find(self, stale: Stale, timeout: float) -> Receipt | None:
        """The committed receipt of the stale claim's key and lifetime, or None when no transaction committed
        one (nor can any longer); ReceiptsUnknown when Kafka cannot tell within `timeout` (or the topic changed
        while it was read, or is missing though the claim named it); ReceiptsLost when none is found and the
        topic is not the one the claim named (see the module docstring)."""
        deadline = time.monotonic() + timeout
        key = stale.key.encode()
        partition = TopicPartition(self.topic, receipt_partition(key))
        claimed = stale.receipts_topic
        with self._lock:
            try:
                current = self._read_topic_id(deadline)
                if current is not None:
                    if current != self._spans_of:  # what was read of another topic is not this one's
                        self._spans, self._spans_of = {}, current
                    end = self._offset(partition, OffsetSpec.latest(), deadline)
                    start = self._offset(
                        partition, OffsetSpec.for_timestamp(_epoch_ms(stale.claimed_at - SCAN_MARGIN)), deadline
                    )
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                if not (isinstance(error, KafkaError) and error.code() in _UNKNOWN_TOPIC):
                    raise ReceiptsUnknown(f"cannot read the receipts topic {self.topic}: {exc}") from None
                current = None  # deleted since its id was read
            if current is None:
                if claimed is None:
                    log.warning("no receipts topic %s: no receipt was ever written there", self.topic)
                    return None
                raise ReceiptsUnknown(
                    f"the receipts topic {self.topic} does not exist, and the claim was made against the topic of "
                    f"id {claimed}"
                )
            if start < 0:  # no record as recent as the claim
                start = end
            span = self._spans.get(partition.partition)
            if span is None or not span.low <= start <= span.high or span.only not in (None, key):
                span = self._spans[partition.partition] = _Span(start, start)
            if span.high < end:
                self._read(partition, span, end, key, deadline)
            value = span.found.get(key)
            receipt = None if value is None else orjson.loads(value)
            if receipt is not None and receipt.get("expires_at") == stale.expires_at.isoformat():
                # Committed, whichever topic holds it: the transaction wrote it there.
                return Receipt(int(receipt["status"]), str(receipt["response"]))
            # None of this lifetime (none at all, or an earlier use of the key, which expired). That says nothing
            # was committed only of the topic the claim named, and only if this was that topic throughout.
            asked = time.monotonic()
            try:
                after = self._read_topic_id(deadline)
            except KafkaException as exc:
                raise ReceiptsUnknown(f"cannot read the id of the receipts topic {self.topic}: {exc}") from None
            if after != current:  # deleted, or created again, while it was read: what was read may be either's
                self._spans, self._spans_of = {}, None
                raise ReceiptsUnknown(f"the receipts topic {self.topic} was deleted or created again while read")
            self._keep_topic_id(current, asked)
        if claimed is not None and claimed != current:
            raise ReceiptsLost(
                f"the receipts topic {self.topic} was deleted or created again since the claim was made (its id "
                f"then {claimed}, now {current}): whether that request was published cannot be known"
            )
        return None

    def _read_topic_id(self, deadline: float) -> str | None:
        return _until(deadline, self.topic_id)

    def _admin_client(self) -> AdminClient:
        with self._admin_lock:
            if self._admin is None:
                self._admin = AdminClient(self.settings.kafka_config())
            return self._admin

    def _offset(self, partition: TopicPartition, spec: OffsetSpec, deadline: float) -> int:
        admin = self._admin_client()

        def offset(left: float) -> int:
            # Uncommitted records too: the end taken here must lie past any transaction still open.
            futures = admin.list_offsets(
                {partition: spec}, isolation_level=IsolationLevel.READ_UNCOMMITTED, request_timeout=left
            )
            return int(_answer(futures[partition], left).offset)

        return _until(deadline, offset)

    def _read(self, partition: TopicPartition, span: _Span, end: int, key: bytes, deadline: float) -> None:
        """Read `partition` read_committed from `span.high` until its position passes `end`."""
        consumer = self._reader()
        consumer.assign([TopicPartition(partition.topic, partition.partition, span.high)])
        try:
            while span.high < end:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ReceiptsUnknown(
                        f"{partition.topic} [{partition.partition}] not read up to offset {end} in time (at "
                        f"{span.high}): a transaction still open there, or Kafka slow"
                    )
                for message in consumer.consume(1000, min(left, 0.5)):
                    error = message.error()
                    if error is None:
                        found = message.key()
                        if message.partition() != partition.partition or found is None:
                            continue
                        if span.only is None or found == span.only:
                            span.found[found] = message.value() or b"{}"
                        if span.only is None and len(span.found) > _MAX_KEPT:
                            mine = span.found.get(key)
                            span.only, span.found = key, ({} if mine is None else {key: mine})
                    elif error.code() != KafkaError._PARTITION_EOF:
                        if error.fatal():
                            self._drop_reader()
                            raise ReceiptsUnknown(f"reading {partition.topic}: {error.str()}")
                        log.debug("reading %s: %s", partition.topic, error.str())
                # The position, not the offsets of the records handed over: it also passes aborted records and
                # transaction markers, and it belongs to this assignment alone.
                position = consumer.position([TopicPartition(partition.topic, partition.partition)])[0].offset
                if position >= 0:
                    span.high = max(span.high, position)
        finally:
            if self._consumer is not None:
                self._consumer.unassign()

    def _reader(self) -> Consumer:
        if self._consumer is None:
            self._consumer = Consumer(
                self.settings.kafka_config(
                    **{
                        "group.id": "skillstats-ingest-receipts",  # never joined, never committed: assign only
                        "enable.auto.commit": False,
                        "isolation.level": "read_committed",
                        "enable.partition.eof": True,
                        "auto.offset.reset": "earliest",
                    }
                )
            )
        return self._consumer

    def _drop_reader(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            consumer.close()

    def close(self) -> None:
        with self._lock:
            self._drop_reader()
