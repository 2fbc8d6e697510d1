"""Kafka plumbing shared by the consumers and the CLI: records, topics, offsets."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicCollection, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource, NewTopic, ResourceType

from skillstats.config import FIRST_ANSWER_S, Settings

log = logging.getLogger(__name__)
T = TypeVar("T")

Headers = list[tuple[str, bytes]]

# What a broker answers while a coordinator or a partition leader is moving (a broker
# restart, a cluster or topic just created): worth asking again shortly.
_MOVING = frozenset(
    {
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        # A leader just elected answers offset requests with this until its high
        # watermark has caught up (KIP-207): seen right after a broker crash.
        KafkaError.OFFSET_NOT_AVAILABLE,
    }
)


def while_moving(call: Callable[[], T], timeout: float) -> T:
    """Run an admin request, again while Kafka says a coordinator or leader is moving, for up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            moving = isinstance(error, KafkaError) and (error.retriable() or error.code() in _MOVING)
            if not moving or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@dataclass(frozen=True, slots=True)
class RawRecord:
    """A record as read from the topic, before decoding."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes | None], ...] = ()


@dataclass(frozen=True)
class TopicReport:
    name: str
    partitions: int
    created: bool


def ensure_topics(
    settings: Settings,
    specs: dict[str, int],
    *,
    replication_factor: int = -1,
    configs: dict[str, dict[str, str]] | None = None,
    timeout: float = 30.0,
) -> list[TopicReport]:
    """Create the topics in `specs` (name -> partitions) that do not exist yet, with `configs` per topic.

    `replication_factor` -1 takes the broker's `default.replication.factor` (and its
    `min.insync.replicas`), so a three-node cluster gets replicated topics without
    every caller knowing the cluster's size.

    An existing topic is left as it is, even with another partition count: adding
    partitions would move keys to new partitions and break per-skill ordering, so
    that is an operator's decision, reported here rather than made.
    """
    existing = list_topic_names(settings, timeout)
    admin = AdminClient(settings.kafka_config())
    missing = [
        NewTopic(
            name,
            num_partitions=partitions,
            replication_factor=replication_factor,
            config=(configs or {}).get(name, {}),
        )
        for name, partitions in specs.items()
        if name not in existing
    ]
    created: set[str] = set()
    for name, future in (admin.create_topics(missing, request_timeout=timeout) if missing else {}).items():
        try:
            future.result(timeout)
            created.add(name)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    # A created topic can take a moment to show in the metadata of the broker asked.
    deadline = time.monotonic() + timeout
    while True:
        metadata = admin.list_topics(timeout=timeout).topics
        if all(name in metadata and metadata[name].partitions for name in specs) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    reports = []
    for name, wanted in specs.items():
        actual = len(metadata[name].partitions) if name in metadata else 0
        if name not in created and actual != wanted:
            log.warning("topic %s exists with %d partitions (asked for %d); left as it is", name, actual, wanted)
        reports.append(TopicReport(name, actual, name in created))
    return reports


class KafkaUnreachable(ConnectionError):
    """No broker answered at the bootstrap address in time."""

    def __init__(self, settings: Settings, timeout: float, cause: BaseException) -> None:
        super().__init__(
            f"cannot reach Kafka at {settings.kafka_bootstrap} within {timeout:g}s: check the address "
            f"(--bootstrap or SKILLSTATS_KAFKA_BOOTSTRAP), that the broker is up and reachable from here, and the "
            f"security settings ({cause})"
        )


def list_topic_names(settings: Settings, timeout: float = FIRST_ANSWER_S) -> dict[str, Any]:
    """The cluster's topics (name -> metadata).

    KafkaRefused as soon as a broker refuses our credentials or TLS (waiting cures
    neither), KafkaUnreachable when no broker answers within `timeout`.
    """
    refusals = RefusalWatch()
    admin = AdminClient(settings.kafka_config(error_cb=refusals))
    return cluster_metadata(admin, refusals, settings, timeout).topics


def cluster_metadata(
    admin: AdminClient, refusals: RefusalWatch, settings: Settings, timeout: float, topic: str | None = None
) -> Any:
    """`admin.list_topics` within `timeout`, stopping at the first refusal `refusals` (its error_cb) saw.

    Short waits first, so a refusal ends it within a second; then longer ones, so a
    cluster slow to answer still gets the whole `timeout` for one reply.
    """
    deadline = time.monotonic() + timeout
    wait = 0.5
    while True:
        try:
            return admin.list_topics(topic, timeout=max(0.1, min(wait, deadline - time.monotonic())))
        except KafkaException as exc:
            admin.poll(0)  # serves error_cb
            refusals.raise_if_refused(settings)
            if time.monotonic() >= deadline:
                raise KafkaUnreachable(settings, timeout, exc) from None
            wait *= 2


class KafkaRefused(KafkaUnreachable):
    """A broker answered but refused who we are: wrong SASL credentials or mechanism, or a TLS failure."""

    def __init__(self, settings: Settings, reason: str) -> None:
        ConnectionError.__init__(
            self,
            f"Kafka at {settings.kafka_bootstrap} refused the connection: {reason}. Check the security settings "
            f"(SKILLSTATS_KAFKA_SECURITY_PROTOCOL, _SASL_MECHANISM, _SASL_USERNAME, _SASL_PASSWORD or "
            f"_SASL_PASSWORD_FILE, _SSL_CA_LOCATION, _SSL_CERTIFICATE_LOCATION, _SSL_KEY_LOCATION)",
        )


class RefusalWatch:
    """An error_cb for librdkafka clients: remembers the first refusal no retry will cure.

    librdkafka retries a refused login or a failed TLS handshake for ever, reporting
    each through error_cb; the call that waits (list_topics, flush) only times out,
    and says "transport failure". With this the caller can stop at the first
    refusal and say what it was.
    """

    def __init__(self) -> None:
        self.reason: str | None = None

    def __call__(self, error: KafkaError) -> None:
        if self.reason is None and refused(error):
            self.reason = error.str()

    def raise_if_refused(self, settings: Settings) -> None:
        if self.reason is not None:
            raise KafkaRefused(settings, self.reason)


def refused(error: KafkaError) -> bool:
    """Whether `error` is a broker refusing our identity (SASL) or a TLS failure, not a broker that is away.

    librdkafka also reports a SASL or TLS handshake that a broker going away cut
    short as an authentication or SSL error ("... handshake failed: Local: Broker
    transport failure"); those say so, and are not refusals.
    """
    text = error.str()
    if any(transient in text for transient in _CUT_SHORT):
        return False
    code = error.code()
    if code in (KafkaError._AUTHENTICATION, KafkaError._SSL, KafkaError.SASL_AUTHENTICATION_FAILED):
        return True
    # A TLS alert from the broker (say, no client certificate) arrives as a failed receive.
    return code == KafkaError._TRANSPORT and ("SSL routines" in text or "certificate" in text)


_CUT_SHORT = ("transport failure", "Timed out", "timed out", "Disconnected", "Connection refused", "Connection reset")


class TopicMissing(LookupError):
    """The topic a command is set to use does not exist (a typo in a setting, or `skillstats init` not run)."""

    def __init__(self, settings: Settings, topic: str) -> None:
        setting = "SKILLSTATS_DLQ_TOPIC (--dlq-topic)" if topic == settings.dlq_topic else "SKILLSTATS_TOPIC (--topic)"
        super().__init__(
            f"topic {topic!r} does not exist on {settings.kafka_bootstrap}: check {setting} for a "
            f"typo; 'skillstats init' creates it, for a new deployment only"
        )
        self.topic = topic


# How long a topic absent from the metadata is asked about again (fresh metadata every
# _SETTLE_PAUSE_S) before it is called missing: a topic just created, or a partition just
# added, takes a moment to reach every broker, and the one asked may not know it yet.
# A topic that really does not exist costs this much more before its one-line refusal.
TOPIC_SETTLE_S = 2.0
_SETTLE_PAUSE_S = 0.25


def partition_count(settings: Settings, topic: str, timeout: float = FIRST_ANSWER_S) -> int:
    """How many partitions `topic` has; a clear error when it does not exist or no broker answers.

    Not every error in a topic's metadata means it does not exist: a topic whose
    leader is being elected (right after it was created, or a broker restart) says
    LEADER_NOT_AVAILABLE. Those are asked again, with fresh metadata, for up to
    `timeout`, and then raised as the KafkaException they are (a failure, not a
    refusal: TopicMissing makes the consumers exit 2). A topic absent from the
    metadata, or UNKNOWN_TOPIC_OR_PART, is asked again for TOPIC_SETTLE_S first.
    """
    started = time.monotonic()
    while True:
        metadata = list_topic_names(settings, timeout).get(topic)
        error = None if metadata is None else metadata.error
        if metadata is not None and error is None:
            return len(metadata.partitions)
        waited = time.monotonic() - started
        if error is None or error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
            if waited >= min(timeout, TOPIC_SETTLE_S):
                raise TopicMissing(settings, topic)
        elif error.retriable() or error.code() in _MOVING:
            if waited >= timeout:
                raise KafkaException(error)
        else:
            raise TopicMissing(settings, topic)
        log.debug("metadata of topic %s: %s; asking again", topic, error or "not listed")
        time.sleep(_SETTLE_PAUSE_S)


class TopicIds:
    """A topic's Kafka id (KIP-516), asked of the cluster every time, through one long-lived admin client.

    A topic deleted and created again keeps its name and gets a new id; so does
    the "same" topic on another cluster. The id is the only way a consumer can
    tell that the log it reads is not the one its fences count.
    """

    def __init__(self, settings: Settings, timeout: float = FIRST_ANSWER_S) -> None:
        self.settings = settings
        self.timeout = timeout
        self._admin: AdminClient | None = None

    def request(self, topic: str) -> Future[Any]:
        """Ask now, answer later (`answer`): the request runs while the caller does other work."""
        if self._admin is None:
            self._admin = AdminClient(self.settings.kafka_config())
        return self._admin.describe_topics(TopicCollection([topic]), request_timeout=self.timeout)[topic]

    def answer(self, topic: str, future: Future[Any]) -> str | None:
        """The id (TopicMissing when the topic does not exist; KafkaUnreachable when Kafka did not answer).

        None on a cluster without topic ids (before Kafka 2.8, or ZooKeeper mode without
        them): its all-zero id says nothing, and only the fences can tell a replaced topic.

        librdkafka sends the request to the controller it knows; when that broker goes
        down, the same client waits for it to come back (seen here: "Timed out waiting
        for controller" for as long as it is down), while a new client finds the new
        one. So after a failure the next request is made by a new client.
        """
        try:
            topic_id = future.result(self.timeout).topic_id
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            if isinstance(error, KafkaError) and error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                raise TopicMissing(self.settings, topic) from None
            self._admin = None
            if isinstance(error, KafkaError) and error.code() in _BROKER_GONE:
                raise KafkaUnreachable(self.settings, self.timeout, exc) from None
            raise
        except TimeoutError as exc:  # the future's own wait
            self._admin = None
            raise KafkaUnreachable(self.settings, self.timeout, exc) from None
        if topic_id.get_most_significant_bits() == 0 and topic_id.get_least_significant_bits() == 0:
            return None
        return str(topic_id)

    def get(self, topic: str) -> str | None:
        """Asked again, by a new client, while Kafka cannot say: right after a broker is killed the
        cluster still names it until the controller fences it (broker.session.timeout.ms, 9 s by
        default), for up to PATIENCE times the timeout; while a leader moves (a retriable
        error) for as long; and an unknown topic for TOPIC_SETTLE_S (just created, the broker asked
        may not know it yet) before it is TopicMissing."""
        started = time.monotonic()
        deadline = started + PATIENCE * self.timeout
        while True:
            try:
                return self.answer(topic, self.request(topic))
            except KafkaUnreachable:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)
            except TopicMissing:
                if time.monotonic() - started >= min(self.timeout, TOPIC_SETTLE_S):
                    raise
                self._admin = None  # fresh metadata
                time.sleep(_SETTLE_PAUSE_S)
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                moving = isinstance(error, KafkaError) and (error.retriable() or error.code() in _MOVING)
                if not moving or time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)


def topic_configs(
    settings: Settings, topic: str, names: tuple[str, ...], timeout: float = FIRST_ANSWER_S
) -> dict[str, str]:
    """The values of the named configuration entries of `topic` (an entry Kafka does not report is left out)."""
    admin = AdminClient(settings.kafka_config())
    resource = ConfigResource(ResourceType.TOPIC, topic)
    entries = admin.describe_configs([resource], request_timeout=timeout)[resource].result(timeout)
    return {name: entries[name].value for name in names if name in entries and entries[name].value is not None}


# What a topic's configuration does to exactness (checked by `init` and `status`).
CLEANUP_POLICY, TIMESTAMP_TYPE = "cleanup.policy", "message.timestamp.type"


def topic_config_problems(configs: dict[str, str]) -> list[str]:
    """What is wrong, or worth knowing, in an events topic's configuration; empty when nothing is."""
    problems = []
    policy = configs.get(CLEANUP_POLICY, "delete")
    if {part.strip() for part in policy.split(",")} != {"delete"}:
        problems.append(
            f"cleanup.policy is {policy!r}: compaction keeps only the newest record per key (per skill), so it "
            f"deletes events no group has counted yet; the events topic must use cleanup.policy=delete "
            f"(kafka-configs.sh --alter --entity-type topics --entity-name TOPIC --add-config cleanup.policy=delete)"
        )
    if configs.get(TIMESTAMP_TYPE) == "LogAppendTime":
        problems.append(
            "message.timestamp.type is LogAppendTime: a record's timestamp is the broker's clock, not the "
            "publisher's, and an event whose occurred_at is more than 10 minutes past it is parked as "
            "bad_timestamp (docs/contract.md, validity); a publisher whose clock runs ahead of the broker's loses "
            "its events to the DLQ. Keep publishers' clocks in sync, or use CreateTime"
        )
    return problems


def end_offsets(settings: Settings, topic: str, timeout: float = FIRST_ANSWER_S) -> dict[int, int]:
    """High watermark (next offset to be written) of every partition of `topic`."""
    return {p: high for p, (_low, high) in watermarks(settings, topic, timeout).items()}


def watermarks(settings: Settings, topic: str, timeout: float = FIRST_ANSWER_S) -> dict[int, tuple[int, int]]:
    """(log start offset, high watermark) of every partition of `topic`."""
    # read_uncommitted: the high watermark itself, not the last stable offset below an open transaction.
    probe = {"group.id": "skillstats-offsets-probe", "enable.auto.commit": False, "isolation.level": "read_uncommitted"}
    consumer = Consumer(settings.kafka_config(**probe))
    try:
        result = {}
        for partition in range(partition_count(settings, topic, timeout)):
            result[partition] = _watermark(consumer, TopicPartition(topic, partition), timeout)
        return result
    finally:
        consumer.close()


# A partition whose leader has just crashed answers nothing until the controller fences
# that broker (broker.session.timeout.ms, 9 s by default) and names a new leader: the
# request times out. The new leader then answers OFFSET_NOT_AVAILABLE, at once, until
# its high watermark has caught up (KIP-207), which can take seconds on a busy cluster.
# Hence asking again, with fresh metadata and a pause, for up to this many times the
# caller's timeout; an unreachable cluster fails before this, in partition_count.
PATIENCE = 3
# What librdkafka itself reports meanwhile: the request timed out, or its connection to
# the dead broker went away under it.
_BROKER_GONE = frozenset({KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError._DESTROY_BROKER})


def _watermark(consumer: Consumer, partition: TopicPartition, timeout: float) -> tuple[int, int]:
    deadline = time.monotonic() + PATIENCE * timeout
    while True:
        try:
            low, high = consumer.get_watermark_offsets(partition, timeout=timeout)
            return low, high
        except KafkaException as exc:
            error = exc.args[0] if exc.args else None
            again = isinstance(error, KafkaError) and (
                error.retriable()
                or error.code() in _MOVING
                or error.code() in _BROKER_GONE
                # partition_count listed it: a leader that does not know it yet (just added).
                or error.code() in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION)
            )
            if not again or time.monotonic() >= deadline:
                raise
            log.warning("offsets of %s [%d]: %s; asking again", partition.topic, partition.partition, error)
            time.sleep(0.5)
            # Fresh metadata, so the next request goes to the new leader rather than the dead one.
            with contextlib.suppress(KafkaException):
                consumer.list_topics(partition.topic, timeout=timeout)


def group_members(settings: Settings, group: str, timeout: float = FIRST_ANSWER_S) -> int:
    """How many members the consumer group has now (0 for a group Kafka does not know)."""
    admin = AdminClient(settings.kafka_config())
    try:
        described = while_moving(
            lambda: admin.describe_consumer_groups([group], request_timeout=timeout)[group].result(timeout), timeout
        )
    except KafkaException as exc:
        if exc.args and isinstance(exc.args[0], KafkaError) and exc.args[0].code() == KafkaError.GROUP_ID_NOT_FOUND:
            return 0
        raise
    return len(described.members)


def commit_offsets(
    settings: Settings,
    group: str,
    topic: str,
    offsets: dict[int, int],
    timeout: float = FIRST_ANSWER_S,
    metadata: str | None = None,
) -> None:
    """Set a group's committed offsets outright; the group must have no members (its consumers stopped).

    `metadata`: the database mark the group's commits carry (sinks/identity.py)."""
    members = group_members(settings, group, timeout)
    if members:
        raise RuntimeError(f"group {group!r} has {members} active member(s); stop its consumers first")
    consumer = Consumer(settings.kafka_config(**{"group.id": group, "enable.auto.commit": False}))
    try:
        consumer.commit(
            # confluent-kafka takes no None for metadata: leave it out where there is none.
            offsets=[
                TopicPartition(topic, p, o) if metadata is None else TopicPartition(topic, p, o, metadata=metadata)
                for p, o in sorted(offsets.items())
            ],
            asynchronous=False,
        )
    finally:
        consumer.close()


def commit_metadata(
    settings: Settings, group: str, topic: str, partitions: int | None = None, timeout: float = FIRST_ANSWER_S
) -> dict[int, str]:
    """The metadata of the group's last commit per partition of `topic` (partitions never committed left out).

    Asked through a consumer of the group that never subscribes (an OffsetFetch to
    the group's coordinator: the group is not joined), as `committed_offsets` asks.
    Not through the admin API's list_consumer_group_offsets: with confluent-kafka
    2.16 that crashed the process (SIGSEGV) when asked right after a broker's first
    start, before its group coordinator was up (a CI run's first worker died of it).
    Where the consumers write which database counts the group."""
    if partitions is None:
        partitions = partition_count(settings, topic, timeout)
    wanted = [TopicPartition(topic, p) for p in range(partitions)]
    consumer = Consumer(settings.kafka_config(**{"group.id": group, "enable.auto.commit": False}))
    try:
        for _attempt in range(3):
            try:
                return {
                    tp.partition: tp.metadata or ""
                    for tp in consumer.committed(wanted, timeout=timeout)
                    if tp.offset >= 0 and tp.error is None
                }
            except UnicodeDecodeError:  # metadata without a NUL, read past its end (sinks/identity.py): ask again
                continue
    finally:
        consumer.close()
    raise KafkaException(KafkaError(KafkaError._BAD_MSG, f"group {group}: its commits' metadata cannot be read"))


def committed_offsets(settings: Settings, group: str, topic: str, timeout: float = FIRST_ANSWER_S) -> dict[int, int]:
    """The group's committed offset per partition (partitions it never committed are left out)."""
    consumer = Consumer(settings.kafka_config(**{"group.id": group, "enable.auto.commit": False}))
    try:
        partitions = [TopicPartition(topic, p) for p in range(partition_count(settings, topic, timeout))]
        return {tp.partition: tp.offset for tp in consumer.committed(partitions, timeout=timeout) if tp.offset >= 0}
    finally:
        consumer.close()
