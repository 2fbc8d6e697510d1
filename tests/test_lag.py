"""Lag in records and seconds, measured against a real broker (skillstats/lag.py)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from confluent_kafka import Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client.core import Metric
from sqlalchemy import insert

from skillstats.config import Settings
from skillstats.kafka import KafkaRefused, commit_offsets, ensure_topics
from skillstats.lag import DOCSYNC, REBUILD, WINDOWS, LagExporter, LagProbe, PartitionLag, groups_of, measure_lag
from skillstats.sinks.db import open_engine
from skillstats.sinks.identity import Owner
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.schema import docsync_runs, partition_fences
from tests.helpers import wait_until

# Partition 0: five records, 5000 .. 1000 seconds older than the test's start.
AGES_S = [5000, 4000, 3000, 2000, 1000]


@pytest.fixture
def now_ms() -> int:
    return int(time.time() * 1000)


@pytest.fixture
def lag_settings(kafka_bootstrap: str, now_ms: int) -> Iterator[Settings]:
    run = uuid.uuid4().hex[:10]
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap,
        database_url="sqlite:///unused.db",
        topic=f"lag-{run}",
        dlq_topic=f"lag-{run}.dlq",
        windows_group=f"windows-{run}",
        docsync_group=f"docsync-{run}",
    )
    ensure_topics(settings, {settings.topic: 4, settings.dlq_topic: 2})
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    for age in AGES_S:
        producer.produce(settings.topic, b"x", b"k", partition=0, timestamp=now_ms - age * 1000)
    producer.produce(settings.dlq_topic, b"parked", b"k", partition=1)
    assert producer.flush(30) == 0
    yield settings


def partition(snapshot_groups: list, role: str, number: int) -> PartitionLag:
    group = next(g for g in snapshot_groups if g.role == role)
    return next(p for p in group.partitions if p.partition == number)


def test_lag_seconds_is_the_age_of_the_record_at_the_committed_offset(lag_settings: Settings, now_ms: int) -> None:
    commit_offsets(lag_settings, lag_settings.windows_group, lag_settings.topic, {0: 2})
    probe = LagProbe(lag_settings, timeout=10)
    try:
        before = time.time()
        snapshot = probe.measure(groups_of(lag_settings))
        after = time.time()
    finally:
        probe.close()

    windows = partition(snapshot.groups, WINDOWS, 0)
    assert (windows.committed, windows.log_end, windows.lag_records) == (2, 5, 3)
    # The record at offset 2 was read: its timestamp, not an interpolation.
    assert windows.oldest_pending_ms == now_ms - 3000 * 1000
    assert windows.lag_seconds is not None
    assert before - now_ms / 1000 + 3000 - 1 <= windows.lag_seconds <= after - now_ms / 1000 + 3000 + 1

    # docsync never committed: reported as missing (None, never -1), measured from the log start.
    docsync = partition(snapshot.groups, DOCSYNC, 0)
    assert docsync.committed is None
    assert (docsync.lag_records, docsync.oldest_pending_ms) == (5, now_ms - 5000 * 1000)

    # An empty partition owes nothing, in records or seconds.
    empty = partition(snapshot.groups, WINDOWS, 1)
    assert (empty.committed, empty.lag_records, empty.lag_seconds) == (None, 0, 0.0)

    group = next(g for g in snapshot.groups if g.role == DOCSYNC)
    assert group.members == 0 and group.state in ("DEAD", "EMPTY")
    assert snapshot.dlq is not None and snapshot.dlq.partitions[1] == (0, 1)
    assert snapshot.topic.retention_ms is not None and snapshot.topic.retention_ms > 0


def test_only_transaction_markers_pending_is_no_age(lag_settings: Settings) -> None:
    """A committed offset parked on a commit marker, or before an aborted transaction, owes no record."""
    producer = Producer({"bootstrap.servers": lag_settings.kafka_bootstrap, "transactional.id": uuid.uuid4().hex})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(lag_settings.topic, b"committed", b"k", partition=2)
    producer.commit_transaction(30)  # offsets: 0 record, 1 commit marker
    producer.begin_transaction()
    producer.produce(lag_settings.topic, b"aborted", b"k", partition=3)
    producer.flush(30)  # written before the abort (abort_transaction purges what is unsent)
    producer.abort_transaction(30)  # offsets: 0 aborted record, 1 abort marker
    commit_offsets(lag_settings, lag_settings.windows_group, lag_settings.topic, {2: 1, 3: 0})
    snapshot = measure_lag(lag_settings)
    marker = partition(snapshot.groups, WINDOWS, 2)
    assert (marker.lag_records, marker.oldest_pending_ms, marker.lag_seconds) == (1, None, 0.0)
    aborted = partition(snapshot.groups, WINDOWS, 3)
    assert (aborted.lag_records, aborted.oldest_pending_ms, aborted.lag_seconds) == (2, None, 0.0)
    # docsync, from the log start of partition 2, is handed the committed record.
    assert partition(snapshot.groups, DOCSYNC, 2).oldest_pending_ms is not None


def test_records_deleted_below_a_committed_offset_show_as_loss(lag_settings: Settings, now_ms: int) -> None:
    commit_offsets(lag_settings, lag_settings.windows_group, lag_settings.topic, {0: 1})
    admin = AdminClient({"bootstrap.servers": lag_settings.kafka_bootstrap})
    deleted = admin.delete_records([TopicPartition(lag_settings.topic, 0, 3)])
    for future in deleted.values():
        future.result(30)
    snapshot = measure_lag(lag_settings)
    windows = partition(snapshot.groups, WINDOWS, 0)
    # The committed offset stays what it is (below the log start: records lost), and the
    # lag counts what can still be read, from the log start.
    assert (windows.log_start, windows.committed, windows.lag_records) == (3, 1, 2)
    assert windows.oldest_pending_ms == now_ms - 2000 * 1000
    assert windows.lost_to_retention == 2
    # docsync never started: nothing of its own was lost.
    assert partition(snapshot.groups, DOCSYNC, 0).lost_to_retention == 0


def test_an_open_transaction_is_measured_by_its_first_record(lag_settings: Settings, now_ms: int) -> None:
    """Everything after an open transaction waits for it: its first record is the oldest pending."""
    producer = Producer({"bootstrap.servers": lag_settings.kafka_bootstrap, "transactional.id": uuid.uuid4().hex})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(lag_settings.topic, b"open", b"k", partition=1, timestamp=now_ms - 700_000)
    producer.flush(30)
    plain = Producer({"bootstrap.servers": lag_settings.kafka_bootstrap})
    plain.produce(lag_settings.topic, b"after", b"k", partition=1, timestamp=now_ms - 100_000)
    assert plain.flush(30) == 0
    try:
        snapshot = measure_lag(lag_settings)
    finally:
        producer.abort_transaction(30)
    held = partition(snapshot.groups, WINDOWS, 1)
    assert held.lag_records == 2
    assert held.oldest_pending_ms == now_ms - 700_000
    assert held.lag_seconds is not None and held.lag_seconds >= 700


def test_the_sql_fence_counts_where_the_kafka_commit_trails_it(lag_settings: Settings) -> None:
    """A commit that timed out leaves Kafka behind the fence: the group has consumed up to the fence."""
    commit_offsets(lag_settings, lag_settings.windows_group, lag_settings.topic, {0: 1})
    snapshot = measure_lag(lag_settings, applied={lag_settings.windows_group: {0: 5}})
    caught_up = partition(snapshot.groups, WINDOWS, 0)
    assert (caught_up.committed, caught_up.applied, caught_up.lag_records, caught_up.lag_seconds) == (1, 5, 0, 0.0)


def test_a_fence_behind_the_kafka_commit_is_where_the_group_reads_from(lag_settings: Settings) -> None:
    """A database restored from a backup, or an admin's reset to the end: the group reads from its fence, so
    its lag is measured from there, not from the commit ahead of it."""
    commit_offsets(lag_settings, lag_settings.windows_group, lag_settings.topic, {0: 5})
    snapshot = measure_lag(lag_settings, applied={lag_settings.windows_group: {0: 1}})
    behind = partition(snapshot.groups, WINDOWS, 0)
    assert (behind.committed, behind.applied, behind.lag_records) == (5, 1, 4)
    assert behind.oldest_pending_ms is not None and behind.lag_seconds is not None and behind.lag_seconds > 0


def test_exporter_serves_offsets_lost_and_a_refused_owner_from_sql(lag_settings: Settings) -> None:
    exporter = LagExporter(lag_settings, interval=60, timeout=10)
    exporter.refresh()
    assert exporter.snapshot is not None and exporter.snapshot.topic_id
    exporter.owners = {
        WINDOWS: Owner(WINDOWS, lag_settings.windows_group, lag_settings.topic, "an-older-topic-id"),
        DOCSYNC: Owner(DOCSYNC, lag_settings.docsync_group, lag_settings.topic, exporter.snapshot.topic_id),
    }
    exporter.lost = {lag_settings.windows_group: {2: 7}}
    got = samples(exporter)
    mismatch = {s["role"]: v for s, v in got["skillstats_topic_identity_mismatch"]}
    assert mismatch == {WINDOWS: 1.0, DOCSYNC: 0.0}
    lost = [(s["role"], s["partition"], v) for s, v in got["skillstats_consumer_offsets_lost"]]
    assert lost == [(WINDOWS, "2", 7.0)]
    exporter.owners = {WINDOWS: Owner(WINDOWS, "a-renamed-group", lag_settings.topic, None)}
    got = samples(exporter)
    assert {s["role"]: v for s, v in got["skillstats_topic_identity_mismatch"]} == {WINDOWS: 1.0, DOCSYNC: 0.0}


def test_a_rebuild_group_measured_before_its_swap_or_drop_is_no_identity_mismatch(lag_settings: Settings) -> None:
    """The rebuild's group comes from the database: when the database already names another one (the measured
    rebuild was swapped or dropped, a new one started), the measurement is stale, not a foreign owner."""
    exporter = LagExporter(lag_settings, interval=60, timeout=10)
    exporter.rebuild_group = "windows-rebuild-1"
    exporter.refresh()
    assert exporter.snapshot is not None and exporter.snapshot.topic_id
    topic_id = exporter.snapshot.topic_id
    lag_roles = {s["role"] for s, _v in samples(exporter)["skillstats_consumer_lag_records"]}
    assert lag_roles == {WINDOWS, DOCSYNC, REBUILD}
    own = {role: Owner(role, group, lag_settings.topic, topic_id) for group, role in groups_of(lag_settings)}
    exporter.owners = {**own, REBUILD: Owner(REBUILD, "windows-rebuild-1", lag_settings.topic, topic_id)}
    mismatch = {s["role"]: v for s, v in samples(exporter)["skillstats_topic_identity_mismatch"]}
    assert mismatch == {WINDOWS: 0.0, DOCSYNC: 0.0, REBUILD: 0.0}
    exporter.owners = {**own, REBUILD: Owner(REBUILD, "windows-rebuild-2", lag_settings.topic, topic_id)}
    mismatch = {s["role"]: v for s, v in samples(exporter)["skillstats_topic_identity_mismatch"]}
    assert mismatch == {WINDOWS: 0.0, DOCSYNC: 0.0}
    exporter.owners = {**own, REBUILD: Owner(REBUILD, "windows-rebuild-1", lag_settings.topic, "an-older-topic-id")}
    mismatch = {s["role"]: v for s, v in samples(exporter)["skillstats_topic_identity_mismatch"]}
    assert mismatch == {WINDOWS: 0.0, DOCSYNC: 0.0, REBUILD: 1.0}
    exporter.close()


def test_the_exporter_reads_a_database_whose_schema_has_no_rebuilds_yet(lag_settings: Settings, tmp_path: Path) -> None:
    """A migration not yet run (the init Job still running, or failed) takes nothing from what the exporter serves
    but the rebuild's group."""
    from alembic import command

    from skillstats.sinks.migrate import _config

    url = f"sqlite:///{tmp_path}/old.db"
    engine = open_engine(url)
    config = _config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0009")
    exporter = LagExporter(
        lag_settings.override(database_url=url), interval=60, timeout=10, open_database=lambda: engine
    )
    exporter.read_database()
    assert exporter.database_up and exporter.rebuild_group is None
    assert set(exporter.applied) == {lag_settings.windows_group, lag_settings.docsync_group}
    exporter.close()


def samples(collector: LagExporter) -> dict[str, list[tuple[dict[str, str], float]]]:
    families: list[Metric] = list(collector.collect())
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in families}


def test_exporter_serves_the_measurement_and_reports_missing_commits(lag_settings: Settings) -> None:
    commit_offsets(lag_settings, lag_settings.windows_group, lag_settings.topic, {0: 4})
    exporter = LagExporter(lag_settings, interval=60, timeout=10)
    exporter.refresh()
    got = samples(exporter)
    assert got["skillstats_lag_exporter_up"] == [({}, 1.0)]
    assert got["skillstats_consumer_applied_offset"] == []  # no database given: no fences
    committed = {(s["role"], s["partition"]): v for s, v in got["skillstats_consumer_committed_offset"]}
    assert committed == {(WINDOWS, "0"): 4.0}  # no series at all where nothing was committed
    has = {(s["role"], s["partition"]): v for s, v in got["skillstats_consumer_has_committed_offset"]}
    assert has[(WINDOWS, "0")] == 1.0 and has[(DOCSYNC, "0")] == 0.0 and has[(WINDOWS, "1")] == 0.0
    lag = {(s["role"], s["partition"]): v for s, v in got["skillstats_consumer_lag_records"]}
    assert lag[(WINDOWS, "0")] == 1 and lag[(DOCSYNC, "0")] == 5
    seconds = {(s["role"], s["partition"]): v for s, v in got["skillstats_consumer_lag_seconds"]}
    assert 1000 <= seconds[(WINDOWS, "0")] < 1100 and 5000 <= seconds[(DOCSYNC, "0")] < 5100
    assert got["skillstats_dlq_records"] == [({"topic": lag_settings.dlq_topic}, 1.0)]
    members = {s["role"]: v for s, v in got["skillstats_consumer_group_members"]}
    assert members == {WINDOWS: 0.0, DOCSYNC: 0.0}


def test_exporter_keeps_serving_while_kafka_is_unreachable(lag_settings: Settings) -> None:
    exporter = LagExporter(lag_settings, interval=1, timeout=10)
    measured = wait_until(lambda: exporter.refresh() or exporter.snapshot, 60, "a first measurement")
    assert samples(exporter)["skillstats_lag_exporter_up"] == [({}, 1.0)]
    # Kafka goes away: one failed measurement keeps the last good one served (the alerts'
    # `for` must not restart on every blip) ...
    exporter.settings = Settings(kafka_bootstrap="127.0.0.1:9", topic=lag_settings.topic)
    exporter.timeout = 1
    exporter._probe = None
    exporter.refresh()
    got = samples(exporter)
    assert got["skillstats_lag_exporter_up"] == [({}, 0.0)]
    assert got["skillstats_consumer_lag_records"] != []
    assert got["skillstats_lag_exporter_last_success_timestamp_seconds"] == [({}, exporter.last_success)]
    # ... until it is older than keep_for; then no stale or invented lag at all.
    measured.measured_at -= exporter.keep_for + 1
    exporter.refresh()
    got = samples(exporter)
    assert got["skillstats_consumer_lag_records"] == [] and got["skillstats_consumer_lag_seconds"] == []
    assert exporter.live() is None  # measurements complete (and fail): alive


def test_the_first_measurement_is_no_recovery_and_an_outage_is_said_once_each_way(
    lag_settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    exporter = LagExporter(lag_settings, interval=1, timeout=1)

    def said(text: str) -> list[tuple[int, str]]:
        return [(r.levelno, r.getMessage()) for r in caplog.records if text in r.getMessage()]

    with caplog.at_level(logging.INFO, logger="skillstats.lag"):
        exporter.refresh()
        assert exporter.kafka_up
        assert [(level, "again" in text) for level, text in said("measuring lag")] == [(logging.INFO, False)]
        exporter.settings, exporter._probe = Settings(kafka_bootstrap="127.0.0.1:9", topic=lag_settings.topic), None
        for _ in range(3):
            exporter.refresh()
        assert [level for level, _ in said("cannot measure lag")] == [logging.WARNING]  # once, not per interval
        exporter.settings, exporter._probe = lag_settings, None
        exporter.refresh()
        exporter.refresh()
    again = [(level, text) for level, text in said("measuring lag") if "again" in text]
    assert len(again) == 1 and again[0][0] == logging.WARNING and "(3 failed measurement(s))" in again[0][1]
    results = {s["result"]: v for s, v in samples(exporter)["skillstats_lag_exporter_measurements"]}
    assert results == {"ok": 3.0, "failed": 3.0}


def test_an_exporter_started_without_kafka_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    exporter = LagExporter(Settings(kafka_bootstrap="127.0.0.1:9", topic="t-away"), interval=1, timeout=1)
    with caplog.at_level(logging.INFO, logger="skillstats.lag"):
        exporter.refresh()
        exporter.refresh()
    assert [r.levelno for r in caplog.records if "cannot measure lag" in r.getMessage()] == [logging.WARNING]
    assert exporter.refusal is None and not exporter.stop.is_set()  # away is not refused: it keeps trying


def test_credentials_kafka_refuses_stop_the_exporter() -> None:
    exporter = LagExporter(Settings(topic="t-refused"), interval=60, timeout=1)

    class Refusing:
        def measure(self, *_: object) -> None:
            raise KafkaRefused(exporter.settings, "SASL authentication error: Authentication failed")

        def close(self) -> None:
            pass

    exporter._probe = Refusing()  # type: ignore[assignment]
    exporter.refresh()
    assert exporter.stop.is_set() and exporter.refusal is not None
    assert "refused the connection" in str(exporter.refusal)


def test_exporter_reads_fences_and_the_last_successful_drain_from_the_database(
    lag_settings: Settings, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    exporter = LagExporter(lag_settings, interval=60, timeout=10, open_database=lambda: open_engine(url))
    exporter.read_database()
    assert not exporter.database_up  # no schema yet: down, and said so, not a crash
    engine = open_engine(url)
    upgrade(engine)
    finished = datetime(2026, 11, 30, 6, 0, 0)
    with engine.begin() as connection:
        connection.execute(
            insert(partition_fences),
            [
                {
                    "group_id": lag_settings.windows_group,
                    "topic": lag_settings.topic,
                    "partition": 0,
                    "next_offset": 5,
                    "updated_at": finished,
                }
            ],
        )
        connection.execute(
            insert(docsync_runs),
            [
                {
                    "group_id": lag_settings.docsync_group,
                    "started_at": finished,
                    "finished_at": finished,
                    "stopped_reason": "caught_up",
                },
                {
                    "group_id": lag_settings.docsync_group,
                    "started_at": finished,
                    "finished_at": finished.replace(hour=7),
                    "stopped_reason": "error",
                },
            ],
        )
    exporter.read_database()
    exporter.refresh()
    got = samples(exporter)
    assert got["skillstats_lag_exporter_database_up"] == [({}, 1.0)]
    assert got["skillstats_docsync_last_success_timestamp_seconds"] == [
        ({"group": lag_settings.docsync_group}, finished.replace(tzinfo=UTC).timestamp())
    ]
    applied = {(s["role"], s["partition"]): v for s, v in got["skillstats_consumer_applied_offset"]}
    assert applied == {(WINDOWS, "0"): 5.0}
    lag = {(s["role"], s["partition"]): v for s, v in got["skillstats_consumer_lag_records"]}
    assert lag[(WINDOWS, "0")] == 0 and lag[(DOCSYNC, "0")] == 5


def test_a_database_the_exporter_cannot_read_is_logged_once_masked_and_so_is_its_recovery(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine exists before the first failure (PostgreSQL): the failure is still said, once, with the
    password masked, and the recovery once."""
    from skillstats.sinks.db import open_engine
    from skillstats.sinks.migrate import upgrade

    broken = "postgresql://someone:s3cret-pw@127.0.0.1:1/nowhere"
    settings = Settings(database_url=broken, topic="t-db")
    exporter = LagExporter(settings, interval=60, timeout=2, open_database=lambda: open_engine(broken))
    with caplog.at_level(logging.INFO, logger="skillstats.lag"):
        exporter.read_database()
        exporter.read_database()
        failures = [r for r in caplog.records if "cannot read the database" in r.getMessage()]
        assert len(failures) == 1 and failures[0].levelno == logging.WARNING
        assert "postgresql://someone:***@127.0.0.1:1/nowhere" in failures[0].getMessage()
        assert "s3cret-pw" not in caplog.text
        assert exporter.database_up is False
        good = f"sqlite:///{tmp_path}/ok.db"
        upgrade(open_engine(good))
        exporter._engine, exporter.open_database = None, lambda: open_engine(good)
        exporter.read_database()
        exporter.read_database()
    assert exporter.database_up is True
    assert sum("again" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records) == 1
