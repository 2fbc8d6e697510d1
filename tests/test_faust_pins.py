"""What streams/windows.py relies on in faust-streaming and aiokafka beyond their public API.

faust has no public hook for a batch drain or for clamping commits, and
aiokafka's isolation level is a constructor argument faust does not expose, so
the worker overrides a few private members. pyproject.toml pins both packages
to the minor versions checked here; when an upgrade changes any of these
facts, this file fails before the worker misbehaves. The behaviour end to end
is covered by the rebalance, scaling and kill tests on a real broker.
"""

from __future__ import annotations

import asyncio
import inspect
from importlib.metadata import version
from pathlib import Path
from typing import Any

import aiokafka
from faust.transport import consumer as faust_consumer
from faust.transport.drivers import aiokafka as aiokafka_driver

from skillstats.streams.aiokafka_records import KeptBytes, RecordsAsRead
from skillstats.streams.windows import (
    PARTITION_FETCH_MIB,
    FencedConsumer,
    ReadCommittedConsumerThread,
    WindowsApp,
)


def test_versions_are_the_pinned_ones() -> None:
    assert version("faust-streaming").startswith("0.15."), version("faust-streaming")
    assert version("aiokafka").startswith("0.14."), version("aiokafka")


def test_overridden_methods_exist_with_the_expected_shape() -> None:
    base = aiokafka_driver.Consumer
    for name in ("_drain_messages", "_commit", "_new_consumer_thread", "perform_seek"):
        assert hasattr(base, name), name
        assert getattr(FencedConsumer, name) is not getattr(base, name)
    assert inspect.iscoroutinefunction(base._drain_messages)
    assert inspect.iscoroutinefunction(base._commit)
    assert list(inspect.signature(base._commit).parameters) == ["self", "offsets"]
    assert hasattr(aiokafka_driver.AIOKafkaConsumerThread, "_create_worker_consumer")
    assert issubclass(ReadCommittedConsumerThread, aiokafka_driver.AIOKafkaConsumerThread)


def test_fetch_goes_through_the_fetcher_as_fausts_own_does() -> None:
    source = inspect.getsource(aiokafka_driver.AIOKafkaConsumerThread._fetch_records)
    assert "fetcher._subscriptions.fetch_context()" in source and "fetcher.fetched_records(" in source


def test_faust_seeks_to_kafkas_commit_only_through_perform_seek() -> None:
    """After every assignment faust seeks each partition to Kafka's committed offset through the public
    perform_seek, before it resumes the flow: FencedConsumer replaces it (the drain positions every partition
    at its SQL fence instead), and the drain fetches only while the flow is active."""
    assert "seek_to_committed" in inspect.getsource(faust_consumer.Consumer.perform_seek)
    resume = inspect.getsource(__import__("faust.tables.recovery", fromlist=["x"]).Recovery._resume_streams)
    assert resume.index("perform_seek") < resume.index("resume_flow")
    assert FencedConsumer.perform_seek is not faust_consumer.Consumer.perform_seek
    assert hasattr(aiokafka_driver.AIOKafkaConsumerThread, "call_thread")
    assert hasattr(aiokafka_driver.AIOKafkaConsumerThread, "_ensure_consumer")


def test_aiokafka_hands_records_only_from_the_position_in_the_current_assignment() -> None:
    """What PartitionReads relies on: a fetch's records are returned only while the partition's position is
    where they start and their assignment is active; a seek drops what was fetched before it; a new assignment
    is a new Assignment object; the position is passed over control batches and aborted records."""
    from aiokafka.consumer import fetcher, subscription_state

    check = inspect.getsource(fetcher.FetchResult.check_assignment)
    assert "assignment.active" in check and "position != self._partition_records.next_fetch_offset" in check
    assert "del self._records[tp]" in inspect.getsource(fetcher.Fetcher.seek_to)
    assert "self._assignment = Assignment(topic_partitions)" in inspect.getsource(
        subscription_state.Subscription._assign
    )
    unpack = inspect.getsource(fetcher.PartitionRecords._unpack_records)
    assert unpack.count("self.next_fetch_offset = next_batch.next_offset") >= 2  # control and aborted batches
    assert "self.next_fetch_offset = record.offset + 1" in unpack
    state = subscription_state.TopicPartitionState
    assert isinstance(state.position, property) and isinstance(state.has_valid_position, property)
    assert {"tps", "active"} <= {n for n, v in vars(subscription_state.Assignment).items() if isinstance(v, property)}
    assert inspect.iscoroutinefunction(fetcher.Fetcher.fetched_records)
    assert "fetch_context" in vars(subscription_state.SubscriptionState)


def _partition_records(key_deserializer: Any = None) -> Any:
    """aiokafka's PartitionRecords over one real v2 batch of three records (one with headers, one without a key)."""
    from aiokafka.consumer import fetcher
    from aiokafka.record.default_records import DefaultRecordBatchBuilder
    from aiokafka.record.memory_records import MemoryRecords

    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=0,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=1 << 20,
    )
    builder.append(0, timestamp=1_700_000_000_000, key=b"skill-1", value=b"{}", headers=[])
    builder.append(1, timestamp=1_700_000_000_001, key=None, value=b"[]", headers=[("replayed-from", b"t/0@5")])
    builder.append(2, timestamp=1_700_000_000_002, key=b"skill-2", value=None, headers=[])
    tp = aiokafka.TopicPartition("t", 3)
    return fetcher.PartitionRecords(
        tp, MemoryRecords(bytes(builder.build())), [], 1, key_deserializer, None, True, fetcher.READ_COMMITTED
    )


# What streams/aiokafka_records.py copied, a record batch at a time: aiokafka's per-record loop and the getall
# around it, as they read in aiokafka 0.14. A change to either is to be read and carried over before this passes.
COPIED_FROM_AIOKAFKA = {
    "PartitionRecords._unpack_records": "b803e6d46480732c7a7faa8e784b338bcdd4e707ea67fba96c013654b04b8a08",
    "FetchResult.getall": "3e717e30de5068d549dd41b231928c67a24e832a928d48bac5f485e448daa903",
}


def test_the_code_whole_batches_stands_for_is_the_code_it_was_copied_from() -> None:
    """RecordsAsRead (streams/aiokafka_records.py) gives each FetchResult added to the Fetcher's `_records` (an
    OrderedDict made once, filled by item assignment) its own `getall`, which `fetched_records` calls on every
    FetchResult it takes records from; what that getall does is aiokafka's, copied: the source must be the
    same, and the members it reads must be there."""
    import hashlib

    from aiokafka.consumer import fetcher

    assert "self._records = collections.OrderedDict()" in inspect.getsource(fetcher.Fetcher.__init__)
    from aiokafka.record.memory_records import MemoryRecords

    fetching = inspect.getsource(fetcher.Fetcher._proc_fetch_request)
    assert "self._records[tp] = FetchResult(" in fetching
    # KeptBytes stands in for the reader by its name in the fetcher's module, made from the partition's bytes.
    assert "records = MemoryRecords(part_data[-1])" in fetching and fetcher.MemoryRecords in (MemoryRecords, KeptBytes)
    for member in ("has_next", "next_batch", "size_in_bytes"):
        assert callable(getattr(MemoryRecords, member)), member
    taken = inspect.getsource(fetcher.Fetcher.fetched_records)
    assert "type(res_or_error) is FetchResult" in taken and "res_or_error.getall(max_records)" in taken
    for name, digest in COPIED_FROM_AIOKAFKA.items():
        owner, member = name.split(".")
        source = inspect.getsource(getattr(getattr(fetcher, owner), member))
        assert hashlib.sha256(source.encode()).hexdigest() == digest, name
    for member in ("check_assignment", "has_more", "_update_position"):
        assert callable(getattr(fetcher.FetchResult, member)), member
    for member in ("_consume_aborted_up_to", "_contains_abort_marker"):
        assert callable(getattr(fetcher.PartitionRecords, member)), member
    init = inspect.getsource(fetcher.PartitionRecords.__init__)
    for member in ("_tp", "_records", "_aborted_producers", "_key_deserializer", "_value_deserializer"):
        assert f"self.{member} = " in init, member
    for member in ("_check_crcs", "_isolation_level", "next_fetch_offset", "_records_iterator"):
        assert f"self.{member} = " in init, member
    result = inspect.getsource(fetcher.FetchResult.__init__)
    assert "self._topic_partition = tp" in result and "self._partition_records = partition_records" in result


def test_records_as_read_carry_what_consumer_records_would() -> None:
    """RecordsAsRead hands on the records aiokafka read instead of the ConsumerRecords it would build from them:
    the same offsets, timestamps, keys, values and headers, from the position on (the record below it skipped
    as before), and the position moved as before; only where no deserializer is set."""
    from aiokafka.consumer import fetcher
    from aiokafka.consumer.subscription_state import Assignment
    from aiokafka.structs import ConsumerRecord

    tp = aiokafka.TopicPartition("t", 3)

    def result(records: Any) -> Any:
        assignment = Assignment({tp})
        assignment.state_value(tp).seek(1)
        return fetcher.FetchResult(tp, assignment=assignment, partition_records=records, backoff=0)

    async def read() -> tuple[list[Any], list[Any], Any, Any]:
        built, read = result(_partition_records()), result(_partition_records())
        RecordsAsRead()[tp] = read
        expected, as_read = built.getall(None), read.getall(None)
        return expected, as_read, built._assignment.state_value(tp), read._assignment.state_value(tp)

    expected, as_read, built_state, read_state = asyncio.run(read())
    assert all(isinstance(r, ConsumerRecord) for r in expected) and [r.offset for r in expected] == [1, 2]
    assert not any(isinstance(r, ConsumerRecord) for r in as_read)
    assert [(r.offset, r.timestamp, r.key, r.value, tuple(r.headers)) for r in as_read] == [
        (r.offset, r.timestamp, r.key, r.value, tuple(r.headers)) for r in expected
    ]
    assert read_state.position == built_state.position == 3

    deserialized = fetcher.FetchResult(
        tp, assignment=None, partition_records=_partition_records(key_deserializer=bytes.upper), backoff=0
    )
    RecordsAsRead()[tp] = deserialized
    assert "getall" not in vars(deserialized)  # left to aiokafka: its ConsumerRecords, deserialized


def test_with_auto_offset_reset_none_aiokafka_reports_instead_of_resetting() -> None:
    """An out-of-range position, or a new partition without a committed offset, is raised to the fetch (the
    drain positions the partition itself), never reset to a place of aiokafka's choosing."""
    from aiokafka.consumer import fetcher

    assert fetcher.OffsetResetStrategy.from_str("none") == fetcher.OffsetResetStrategy.NONE
    response = inspect.getsource(fetcher.Fetcher._proc_fetch_request)
    assert "Errors.OffsetOutOfRangeError({tp: fetch_offset})" in response
    assert "NoOffsetForPartitionError(tp)" in inspect.getsource(fetcher.Fetcher._update_fetch_positions)


def test_isolation_level_is_read_when_the_consumer_starts() -> None:
    async def build() -> str:
        consumer = aiokafka.AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1")
        return consumer._isolation_level

    assert asyncio.run(build()) == "read_uncommitted"
    assert "isolation_level=self._isolation_level" in inspect.getsource(aiokafka.AIOKafkaConsumer.start)


def test_the_worker_consumer_faust_builds_never_commits_on_its_own() -> None:
    """aiokafka's auto-commit (on by default) commits every resolved position, with empty metadata, on a timer and
    on stop: ahead of the SQL flush, and over the database's mark. faust turns it off for the worker's consumer."""
    assert inspect.signature(aiokafka.AIOKafkaConsumer).parameters["enable_auto_commit"].default is True
    source = inspect.getsource(aiokafka_driver.AIOKafkaConsumerThread._create_worker_consumer)
    assert "enable_auto_commit=False" in source
    ours = inspect.getsource(ReadCommittedConsumerThread._create_worker_consumer)
    assert "super()._create_worker_consumer(transport)" in ours and "enable_auto_commit" not in ours


def test_rebalance_signals_are_public_and_sent_with_the_partitions() -> None:
    assert hasattr(WindowsApp, "on_partitions_revoked") and hasattr(WindowsApp, "on_partitions_assigned")
    from faust.app import base

    source = inspect.getsource(base.App)
    assert "self.on_partitions_revoked.send)(revoked)" in source
    assert "self.on_partitions_assigned.send)(assigned)" in source


def test_the_livelock_check_goes_through_verify_event_path_and_misfires_on_a_batch_drain() -> None:
    """faust's livelock detector calls the public verify_event_path per assigned partition,
    which FencedConsumer replaces: the checks behind it read the per-message stream's
    inbound times, which the batch drain never sets, so they would report a healthy
    worker at ERROR (its health is /healthz, the degraded state and the lag alerts)."""
    detector = inspect.getsource(faust_consumer.Consumer.verify_all_partitions_active)
    assert "self.verify_event_path(now, tp)" in detector
    faust_check = inspect.getsource(aiokafka_driver.AIOKafkaConsumerThread.verify_event_path)
    assert "monitor.stream_inbound_time.get(tp)" in faust_check
    assert FencedConsumer.verify_event_path is not aiokafka_driver.Consumer.verify_event_path
    assert FencedConsumer.verify_event_path(None, 0.0, None) is None  # type: ignore[arg-type]


def test_the_partition_fetch_size_reaches_aiokafka_and_one_fetch_stays_capped() -> None:
    """--partition-fetch-mib goes through faust's public setting to aiokafka, whose fetch_max_bytes caps one
    fetch response (what a worker holds is up to this per partition it owns: streams/windows.py)."""
    source = inspect.getsource(aiokafka_driver.AIOKafkaConsumerThread._create_worker_consumer)
    assert "max_partition_fetch_bytes=conf.consumer_max_fetch_size" in source
    assert "fetch_max_bytes" not in source  # faust leaves aiokafka's default cap in place
    defaults = inspect.signature(aiokafka.AIOKafkaConsumer).parameters
    assert defaults["fetch_max_bytes"].default == 50 * 1024 * 1024
    assert defaults["fetch_max_bytes"].default > PARTITION_FETCH_MIB * 1024 * 1024


def test_partition_fetch_mib_from_the_command_line_reaches_faust(tmp_path: Path) -> None:
    from skillstats.cli import build_parser
    from skillstats.config import Settings
    from skillstats.sinks.db import open_engine
    from skillstats.sinks.migrate import upgrade
    from skillstats.streams.windows import build_app

    parsed = build_parser().parse_args(["windows", "--partition-fetch-mib", "3"])
    assert parsed.partition_fetch_mib == 3
    assert build_parser().parse_args(["windows"]).partition_fetch_mib == PARTITION_FETCH_MIB
    url = f"sqlite:///{tmp_path}/f.db"
    upgrade(open_engine(url))
    app = build_app(Settings(kafka_bootstrap="127.0.0.1:1", database_url=url), partition_fetch_mib=3)
    assert app.conf.consumer_max_fetch_size == 3 * 1024 * 1024


def test_fausts_own_commit_crashes_the_worker_on_a_rebalance_race_so_it_is_bypassed() -> None:
    """faust's thread-side commit filters by the assignment, then commits: a rebalance in between raises in
    aiokafka and faust crashes the worker. FencedConsumer commits through its own thread-side call, which
    logs the refusal (tests/test_windows_reads.py)."""
    source = inspect.getsource(aiokafka_driver.AIOKafkaConsumerThread._commit)
    assert "await self.crash(exc)" in source and "IllegalStateError" in source
    assert "call_thread(_commit_in_thread" in inspect.getsource(FencedConsumer._commit)
