"""The SQL fence is the position and the identity (docs/contract.md, exactly once), end to end.

Real broker, real SQLite and PostgreSQL, the worker and docsync as real
processes. Each scenario is something an operator does or suffers that moves a
store back in time or swaps it: a database restored from a backup (with the
worker stopped, and under a running worker, as a failover does), an admin's
offset reset, a topic deleted and created again, a group renamed, a setting
that names a topic that does not exist, Kafka and the database away when the
worker starts, retention deleting records no group applied. Every one ends
with the tables compared to an expectation computed from the events alone
(tests/helpers.py), or with the refusal it must end in and nothing counted.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient

from skillstats.config import Settings
from skillstats.kafka import end_offsets, watermarks
from skillstats.workload import Record, generate
from tests.helpers import (
    WorkerProcess,
    actual_docstats,
    actual_windows,
    backup_database,
    caught_up,
    expected_docstats,
    expected_windows,
    fences,
    free_port,
    get,
    publish,
    read_records,
    recreate_topic,
    restore_database,
    run_docsync,
    wait_until,
)
from tests.test_publish import cli

pytestmark = pytest.mark.faults


def events(count: int, seed: int) -> list[Record]:
    return list(generate(count, now_ms=int(time.time() * 1000), skills=300, seed=seed, invalid_ratio=0.01))


def windows_exact(settings: Settings, records: list[Record]) -> None:
    assert actual_windows(settings) == expected_windows(records)


def docstats_exact(settings: Settings, records: list[Record], rows: dict[str, str | None]) -> None:
    skills, owners, _unknown = expected_docstats(records, rows)
    assert actual_docstats(settings) == (skills, owners)


def drain(settings: Settings) -> dict[str, object]:
    code, summaries = run_docsync(settings)
    assert code == 0, summaries
    return summaries[-1]


def test_a_database_restored_from_a_backup_counts_exactly(
    settings: Settings, registry_rows: dict[str, str | None], tmp_path: Path
) -> None:
    """Restored under a running worker (a failover to a replica that lost its tail) and with it stopped (a
    backup put back): the worker reads again from the restored fences, not from Kafka's commit ahead of them."""
    a, b, c, d = (events(3000, seed) for seed in (1, 2, 3, 4))
    publish(settings, a)
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "slice a applied")
    drain(settings)
    first = backup_database(settings.database_url, tmp_path / "after-a")
    publish(settings, b)
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "slice b applied")
    drain(settings)
    windows_exact(settings, a + b)

    # Under the running worker: the database loses slice b, Kafka's commits do not.
    restore_database(settings.database_url, first)
    windows_exact(settings, a)
    publish(settings, c)
    wait_until(caught_up(settings, settings.windows_group, worker), 180, "slices b and c applied again")
    windows_exact(settings, a + b + c)
    assert "the database went back in time" in worker.log_path.read_text()
    drain(settings)
    docstats_exact(settings, a + b + c, registry_rows)

    # With the worker stopped: a backup taken before slice d put back, then more events.
    second = backup_database(settings.database_url, tmp_path / "after-c")
    publish(settings, d)
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "slice d applied")
    drain(settings)
    assert worker.terminate() == 0, worker.log_tail()
    restore_database(settings.database_url, second)
    e = events(1000, 5)
    publish(settings, e)
    worker = WorkerProcess(settings, tmp_path / "worker-2.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 180, "slices d and e applied again")
    assert worker.terminate() == 0, worker.log_tail()
    windows_exact(settings, a + b + c + d + e)
    drain(settings)
    docstats_exact(settings, a + b + c + d + e, registry_rows)


def reset_offsets_to_end(settings: Settings, group: str) -> None:
    """What `kafka-consumer-groups --reset-offsets --to-latest --execute` does, through the admin API."""
    admin = AdminClient({"bootstrap.servers": settings.kafka_bootstrap})
    latest = [TopicPartition(settings.topic, p, o) for p, o in end_offsets(settings, settings.topic).items()]
    request = ConsumerGroupTopicPartitions(group, latest)
    admin.alter_consumer_group_offsets([request])[group].result(30)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_offsets_reset_by_an_admin_change_nothing(
    settings: Settings, registry_rows: dict[str, str | None], tmp_path: Path
) -> None:
    a, b, c = (events(3000, seed) for seed in (11, 12, 13))
    publish(settings, a)
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "slice a applied")
    assert worker.terminate() == 0
    drain(settings)
    publish(settings, b)
    for group in (settings.windows_group, settings.docsync_group):
        reset_offsets_to_end(settings, group)  # slice b now looks consumed to Kafka
    publish(settings, c)
    worker = WorkerProcess(settings, tmp_path / "worker-2.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "slices b and c applied")
    assert worker.terminate() == 0
    windows_exact(settings, a + b + c)
    drain(settings)
    docstats_exact(settings, a + b + c, registry_rows)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_topic_recreated_under_a_running_worker_stops_both_groups(
    settings: Settings, registry_rows: dict[str, str | None], tmp_path: Path
) -> None:
    """The new topic grows past the old fences (so no fence is ahead of its log): only its Kafka id tells."""
    a = events(3000, 21)
    publish(settings, a)
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "slice a applied")
    drain(settings)
    before = fences(settings, settings.windows_group)
    recreate_topic(settings, 12)
    b = events(9000, 22)
    publish(settings, b)
    assert all(n > before.get(p, 0) for p, n in end_offsets(settings, settings.topic).items() if n)
    code = worker.process.wait(120)
    log = worker.log_path.read_text(errors="replace")
    assert code == 2, log[-3000:]
    assert "its Kafka topic id was" in log and "fences reset" in log, log[-3000:]
    windows_exact(settings, a)
    docsync_code, summaries = run_docsync(settings)
    assert docsync_code == 2 and "its Kafka topic id was" in str(summaries[-1]["error"]), summaries
    docstats_exact(settings, a, registry_rows)
    status = cli(settings, "status")
    assert status.returncode == 1 and "REFUSED" in status.stdout and "its Kafka topic id was" in status.stdout, (
        status.stdout + status.stderr
    )

    # The way out: count what the new topic holds, for both groups.
    for group in (settings.windows_group, settings.docsync_group):
        dry = cli(settings, "fences", "reset", "--group", group, "--to", "start")
        assert dry.returncode == 0 and "none of these records was counted" in dry.stdout, dry.stdout + dry.stderr
        done = cli(settings, "fences", "reset", "--group", group, "--to", "start", "--confirm", "RESET_FENCES")
        assert done.returncode == 0, done.stderr
    worker = WorkerProcess(settings, tmp_path / "worker-2.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the new topic applied")
    assert worker.terminate() == 0
    windows_exact(settings, a + b)
    drain(settings)
    docstats_exact(settings, a + b, registry_rows)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_renamed_group_is_refused_until_it_takes_over(
    settings: Settings, registry_rows: dict[str, str | None], tmp_path: Path
) -> None:
    a, b = events(3000, 31), events(2000, 32)
    publish(settings, a)
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "slice a applied")
    assert worker.terminate() == 0
    drain(settings)
    renamed = settings.override(
        windows_group=f"{settings.windows_group}-v2", docsync_group=f"{settings.docsync_group}-v2"
    )
    refused = WorkerProcess(renamed, tmp_path / "refused.log")
    assert refused.process.wait(60) == 2, refused.log_tail()
    log = refused.log_path.read_text()
    assert f"written by group {settings.windows_group!r}" in log and "fences takeover" in log, log[-3000:]
    assert "3,000 record(s)" in log or "record(s) over" in log, log[-3000:]
    docsync_code, summaries = run_docsync(renamed)
    assert docsync_code == 2 and "fences takeover" in str(summaries[-1]["error"]), summaries
    windows_exact(settings, a)

    for old, new in ((settings.windows_group, renamed.windows_group), (settings.docsync_group, renamed.docsync_group)):
        dry = cli(renamed, "fences", "takeover", "--from", old, "--group", new)
        assert dry.returncode == 0 and "dry run" in dry.stdout, dry.stderr
        done = cli(renamed, "fences", "takeover", "--from", old, "--group", new, "--confirm", "TAKE_OVER_FENCES")
        assert done.returncode == 0, done.stderr
    publish(settings, b)
    worker = WorkerProcess(renamed, tmp_path / "worker-2.log")
    wait_until(caught_up(renamed, renamed.windows_group, worker), 120, "slice b applied by the new name")
    assert worker.terminate() == 0
    windows_exact(settings, a + b)
    drain(renamed)
    docstats_exact(settings, a + b, registry_rows)
    # And the old name is now the one refused.
    old = WorkerProcess(settings, tmp_path / "old.log")
    assert old.process.wait(60) == 2, old.log_tail()


def test_a_topic_that_does_not_exist_exits_2_at_once(settings: Settings, tmp_path: Path) -> None:
    missing = settings.override(topic=f"no-such-topic-{uuid.uuid4().hex[:8]}")
    worker = WorkerProcess(missing, tmp_path / "worker.log")
    assert worker.process.wait(60) == 2, worker.log_tail()
    said = worker.log_path.read_text()
    published = cli(missing, "publish", "--skill-id", "sk_1", "--kind", "download")
    assert published.returncode == 2
    assert published.stderr.strip().split(": ", 1)[1] in said, (published.stderr, said[-2000:])


class Gate:
    """A TCP forwarder that is closed (nothing listens) until opened: a service away, then back."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._server: socket.socket | None = None

    def open(self) -> None:
        server = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


@dataclass
class Gates:
    kafka: Gate
    database: Gate
    away: Settings  # the settings that reach Kafka and the database through the gates


@pytest.fixture
def gates(settings: Settings) -> Iterator[Gates]:
    from sqlalchemy.engine import make_url

    kafka_host, kafka_port = settings.kafka_bootstrap.split(",")[0].rsplit(":", 1)
    database = make_url(settings.database_url)
    kafka, database_gate = (
        Gate((kafka_host, int(kafka_port))),
        Gate((database.host or "127.0.0.1", database.port or 5432)),
    )
    away = settings.override(
        kafka_bootstrap=f"127.0.0.1:{kafka.port}",
        database_url=database.set(port=database_gate.port).render_as_string(False),
    )
    yield Gates(kafka, database_gate, away)
    for gate in (kafka, database_gate):
        gate.close()


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_kafka_and_the_database_away_at_start_then_back(settings: Settings, gates: Gates, tmp_path: Path) -> None:
    """The worker waits (the first failure a WARNING, reminders at INFO, /healthz 200, /readyz 503) and starts
    counting once both answer, in the same process: no exit, no restart."""
    kafka_gate, database_gate, away = gates.kafka, gates.database, gates.away
    a = events(2000, 41)
    publish(settings, a)
    port = free_port()
    worker = WorkerProcess(away, tmp_path / "worker.log", "--metrics-port", str(port))
    wait_until(lambda: get(f"http://127.0.0.1:{port}/readyz")[0] == 503, 60, "readiness to say it waits")
    assert get(f"http://127.0.0.1:{port}/healthz")[0] == 200
    wait_until(lambda: worker.log_path.read_text().count("waiting for the database") >= 2, 60, "two attempts")
    database_gate.open()
    wait_until(lambda: "waiting for Kafka" in worker.log_path.read_text(), 60, "the database reached")
    worker.assert_alive()
    assert "waiting for" in get(f"http://127.0.0.1:{port}/readyz")[1]
    kafka_gate.open()
    wait_until(caught_up(settings, settings.windows_group, worker), 180, "the worker to count, in the same process")
    wait_until(lambda: get(f"http://127.0.0.1:{port}/readyz")[0] == 200, 60, "readiness")
    assert worker.terminate() == 0, worker.log_tail()
    windows_exact(settings, a)
    assert "Traceback" not in worker.log_path.read_text()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_records_deleted_before_they_were_applied_are_said_counted_and_passed(
    settings: Settings, tmp_path: Path
) -> None:
    """A fence below the log start: the records between were lost to retention. The worker says so once at
    ERROR, counts them (metric, SQL, status) and goes on from the log start; nothing else is lost."""
    a, b = events(2000, 51), events(2000, 52)
    publish(settings, a)
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "slice a applied")
    assert worker.terminate() == 0
    applied = fences(settings, settings.windows_group)
    publish(settings, b)
    # Retention (DeleteRecords) takes half of what arrived since on partition 0, before it was applied.
    on_topic = read_records(settings, settings.topic)
    ends = end_offsets(settings, settings.topic)
    cut = applied.get(0, 0) + (ends[0] - applied.get(0, 0)) // 2
    admin = AdminClient({"bootstrap.servers": settings.kafka_bootstrap})
    admin.delete_records([TopicPartition(settings.topic, 0, cut)])[TopicPartition(settings.topic, 0, cut)].result(30)
    assert watermarks(settings, settings.topic)[0][0] == cut
    lost = cut - applied.get(0, 0)
    deleted = Counter((r.key, r.value) for r in on_topic if r.partition == 0 and applied.get(0, 0) <= r.offset < cut)
    survivors = []
    for record in b:
        if deleted[(record.key, record.value)]:
            deleted[(record.key, record.value)] -= 1
        else:
            survivors.append(record)
    assert len(survivors) == len(b) - lost
    worker = WorkerProcess(settings, tmp_path / "worker-2.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the rest applied")
    assert worker.terminate() == 0
    log = worker.log_path.read_text()
    assert log.count("were deleted by retention before group") == 1, log[-3000:]
    assert f"({lost})" in log
    windows_exact(settings, a + survivors)
    status = cli(settings, "status", "--json")
    report = json.loads(status.stdout)
    windows = next(g for g in report["groups"] if g["role"] == "windows")
    assert windows["offsets_lost"] == {"0": lost}


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_docsync_every_waits_for_kafka_and_the_database_then_drains(
    settings: Settings, gates: Gates, registry_rows: dict[str, str | None], tmp_path: Path
) -> None:
    """The long-running docsync waits like the worker (logged once then reminders, /healthz 200, /readyz 503), then
    drains, in the same process; a single drain would have said so in one line and exited 1."""
    import signal
    import subprocess
    import sys

    from tests.conftest import settings_env

    kafka_gate, database_gate, away = gates.kafka, gates.database, gates.away
    a = events(2000, 61)
    publish(settings, a)
    port = free_port()
    log_path = tmp_path / "docsync.log"
    with log_path.open("wb") as out:
        drain = subprocess.Popen(
            [sys.executable, "-m", "skillstats.cli", "docsync", "--every", "1h", "-v", "--metrics-port", str(port)],
            env=settings_env(away),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_until(lambda: get(f"http://127.0.0.1:{port}/readyz")[0] == 503, 60, "readiness to say it waits")
            assert get(f"http://127.0.0.1:{port}/healthz")[0] == 200
            wait_until(lambda: log_path.read_text().count("waiting for the database") >= 2, 60, "two attempts")
            database_gate.open()
            kafka_gate.open()
            wait_until(lambda: "caught_up" in log_path.read_text(), 120, "a drain, in the same process")
            assert drain.poll() is None
            wait_until(lambda: get(f"http://127.0.0.1:{port}/readyz")[0] == 200, 30, "readiness")
        finally:
            drain.send_signal(signal.SIGTERM)
            code = drain.wait(60)
    assert code == 0, log_path.read_text()[-3000:]
    docstats_exact(settings, a, registry_rows)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_second_database_under_the_same_group_is_refused(
    settings: Settings, registry_rows: dict[str, str | None], tmp_path: Path
) -> None:
    """Issue 27.3: a deployment with a database of its own and the default group name must not take half the
    partitions; the group's Kafka commits say which database counts it."""
    a, b = events(3000, 41), events(2000, 42)
    publish(settings, a)
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "slice a applied")
    drain(settings)
    other = settings.override(database_url=f"sqlite:///{tmp_path}/second.db")
    assert cli(other, "init", "--skip-topics").returncode == 0
    intruder = WorkerProcess(other, tmp_path / "intruder.log")
    assert intruder.process.wait(120) == 2, intruder.log_tail()
    log = intruder.log_path.read_text()
    assert "is counted by another database" in log and "--delete --group" in log, log[-3000:]
    docsync_code, summaries = run_docsync(other)
    assert docsync_code == 2 and "another database" in str(summaries[-1]["error"]), summaries
    assert actual_windows(other) == ({}, {})  # the second database counted nothing
    status = cli(other, "status")
    assert status.returncode == 1 and "counted by another database" in status.stdout, status.stdout + status.stderr
    publish(settings, b)
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "slice b applied by the first worker")
    assert worker.terminate() == 0
    windows_exact(settings, a + b)
    drain(settings)
    docstats_exact(settings, a + b, registry_rows)
