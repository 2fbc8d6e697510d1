"""Test helpers: run the worker as a real process, and compute expectations independently.

The expectation functions here deliberately do not import the production
kind→effect table or bucketing code: they restate docs/contract.md, kinds in their own words,
so a mistake in one is caught by the other.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import ClassVar, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from sqlalchemy import insert, select, update

from skillstats.config import Settings
from skillstats.kafka import end_offsets
from skillstats.publisher import Publisher
from skillstats.sinks.db import open_engine
from skillstats.sinks.schema import (
    partition_fences,
    skill_daily_stats,
    skill_hourly_stats,
    skills,
    user_skill_stats,
)
from skillstats.workload import Record, skill_ids
from tests.conftest import settings_env

T = TypeVar("T")
K = TypeVar("K")

# docs/contract.md, kinds, restated: (downloads, installs) added to the day and hour of the event.
WINDOW_COUNTS = {"download": (1, 0), "install_new": (0, 1)}

Counts = dict[tuple[str, object], tuple[int, int]]

# docs/contract.md, kinds restated: (downloads, installs_all_time, installs_current) per kind.
SKILL_DELTAS = {
    "download": (1, 0, 0),
    "install_new": (0, 1, 1),
    "install_reactivate": (0, 0, 1),
    "install_deactivate": (0, 0, -1),
}

Stats = dict[str, tuple[int, int, int]]


def wait_until(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    """Poll `condition` until it returns something truthy; fail with `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


class WorkerProcess:
    """`skillstats windows` as a separate OS process, so it can be killed for real."""

    # Every worker a test starts; conftest kills those still running when the test
    # ends, so a failing test cannot leave a worker behind in a later test's way.
    started: ClassVar[list[WorkerProcess]] = []
    command: ClassVar[tuple[str, ...]] = ("windows", "--log-level", "debug")

    def __init__(self, settings: Settings, log_path: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        WorkerProcess.started.append(self)
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "skillstats.cli", *self.command, *extra],
            env=settings_env(settings) if env is None else env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill9(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)
        self._log.close()

    def terminate(self, timeout: float = 60) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        finally:
            self._log.close()

    def assert_alive(self) -> None:
        if self.process.poll() is not None:
            raise AssertionError(f"worker exited with {self.process.returncode}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def publish(settings: Settings, records: Iterable[Record]) -> int:
    with Publisher(settings, flush_timeout=120) as publisher:
        for record in records:
            publisher.send_raw(record.key, record.value)
    return publisher.delivered


def fences(settings: Settings, group: str) -> dict[int, int]:
    engine = open_engine(settings.database_url)
    try:
        with engine.connect() as connection:
            rows = connection.execute(
                select(partition_fences.c.partition, partition_fences.c.next_offset).where(
                    partition_fences.c.group_id == group, partition_fences.c.topic == settings.topic
                )
            )
            return {p: n for p, n in rows if n > 0}
    finally:
        engine.dispose()


def caught_up(settings: Settings, group: str, worker: WorkerProcess | None = None) -> Callable[[], bool]:
    """A condition: the group's SQL fences equal the topic's end offsets."""
    ends = {p: n for p, n in end_offsets(settings, settings.topic).items() if n > 0}

    def check() -> bool:
        if worker is not None:
            worker.assert_alive()
        return fences(settings, group) == ends

    return check


def _utc(ms: int) -> datetime:
    seconds, millis = divmod(ms, 1000)
    return datetime(1970, 1, 1) + timedelta(seconds=seconds, milliseconds=millis)


def expected_windows(records: Iterable[Record]) -> tuple[Counts, Counts]:
    """Daily and hourly (downloads, installs) per skill from the valid records, by UTC event time."""
    daily: Counter[tuple[str, object, int]] = Counter()
    hourly: Counter[tuple[str, object, int]] = Counter()
    for record in records:
        if not record.valid:
            continue
        body = json.loads(record.value or b"")
        counts = WINDOW_COUNTS.get(body["kind"])
        if counts is None:
            continue
        at = _utc(body["occurred_at"])
        day: date = at.date()
        hour = at.replace(minute=0, second=0, microsecond=0)
        for column, amount in enumerate(counts):
            daily[(body["skill_id"], day, column)] += amount
            hourly[(body["skill_id"], hour, column)] += amount
    return _pairs(daily), _pairs(hourly)


def _pairs(flat: Counter[tuple[str, object, int]]) -> Counts:
    result: Counts = {}
    for (skill, bucket, column), amount in flat.items():
        downloads, installs = result.get((skill, bucket), (0, 0))
        result[(skill, bucket)] = (downloads + amount, installs) if column == 0 else (downloads, installs + amount)
    return result


def actual_windows(settings: Settings) -> tuple[Counts, Counts]:
    engine = open_engine(settings.database_url)
    try:
        with engine.connect() as connection:
            daily = {
                (s, d): (dl, ins)
                for s, d, dl, ins in connection.execute(
                    select(
                        skill_daily_stats.c.skill_id,
                        skill_daily_stats.c.day,
                        skill_daily_stats.c.downloads,
                        skill_daily_stats.c.installs,
                    )
                )
            }
            hourly = {
                (s, h): (dl, ins)
                for s, h, dl, ins in connection.execute(
                    select(
                        skill_hourly_stats.c.skill_id,
                        skill_hourly_stats.c.hour,
                        skill_hourly_stats.c.downloads,
                        skill_hourly_stats.c.installs,
                    )
                )
            }
        return daily, hourly
    finally:
        engine.dispose()


@dataclass(frozen=True)
class TopicRecord:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: dict[str, bytes]


def read_records(settings: Settings, topic: str) -> list[TopicRecord]:
    """Every record of `topic` from the beginning to its current end, with where it is."""
    consumer = Consumer(settings.kafka_config(**{"group.id": "tests-reader", "enable.auto.commit": False}))
    try:
        # The product's own query: it asks again while a partition's leadership moves (a broker just
        # restarted answers NOT_LEADER_FOR_PARTITION for a while), where a bare query failed the test.
        wanted = {partition: high for partition, high in end_offsets(settings, topic, timeout=10).items() if high > 0}
        consumer.assign([TopicPartition(topic, p, 0) for p in wanted])
        records = []
        remaining = dict(wanted)
        deadline = time.monotonic() + 60
        while remaining and time.monotonic() < deadline:
            for message in consumer.consume(1000, timeout=1.0):
                if message.error():
                    continue
                headers = dict(message.headers() or [])
                records.append(
                    TopicRecord(message.partition(), message.offset(), message.key(), message.value(), headers)
                )
                if message.offset() + 1 >= remaining.get(message.partition(), 0):
                    remaining.pop(message.partition(), None)
            # Past the last record may lie a transaction marker (or aborted records): never handed over, the
            # position moves past them all the same.
            if remaining:
                for position in consumer.position([TopicPartition(topic, p) for p in remaining]):
                    if position.offset >= remaining[position.partition]:
                        remaining.pop(position.partition, None)
        assert not remaining, f"could not read {topic} to its end: {remaining}"
        return records
    finally:
        consumer.close()


def read_topic(settings: Settings, topic: str) -> list[tuple[bytes | None, bytes | None, dict[str, bytes]]]:
    """Every record of `topic` from the beginning to its current end: (key, value, headers)."""
    return [(r.key, r.value, r.headers) for r in read_records(settings, topic)]


def murmur2_partition(key: bytes, partitions: int) -> int:
    """The Java client's default partitioner (murmur2, positive, modulo), written out here."""
    seed, m, r = 0x9747B28C, 0x5BD1E995, 24
    length = len(key)
    h = (seed ^ length) & 0xFFFFFFFF
    for i in range(0, length - length % 4, 4):
        k = int.from_bytes(key[i : i + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    tail = length % 4
    base = length - tail
    if tail == 3:
        h ^= key[base + 2] << 16
    if tail >= 2:
        h ^= key[base + 1] << 8
    if tail >= 1:
        h ^= key[base]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return (h & 0x7FFFFFFF) % partitions


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def local_service(script: str, *args: str, **env: str) -> None:
    """Run deploy/local/<script> (kafka.sh, postgres.sh) with `args`, e.g. to stop a service under a test."""
    path = Path(__file__).resolve().parent.parent / "deploy" / "local" / script
    done = subprocess.run([str(path), *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{script} {' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}"


def registry(seed: int, skills: int = 2000) -> dict[str, str | None]:
    """Rows the registry has: two skills in three, owned by 300 owners (some skills by nobody)."""
    rng = random.Random(seed)
    return {
        skill: (None if rng.random() < 0.05 else f"user_{rng.randrange(300):03d}")
        for index, skill in enumerate(skill_ids(skills))
        if index % 3 != 2
    }


def expected_docstats(records: list[Record], rows: dict[str, str | None]) -> tuple[Stats, Stats, int]:
    per_skill: Counter[tuple[str, int]] = Counter()
    unknown = 0
    for record in records:
        if not record.valid:
            continue
        body = json.loads(record.value or b"")
        skill = body["skill_id"]
        if skill not in rows:
            unknown += 1
            continue
        deltas = SKILL_DELTAS.get(body["kind"], (0, 0, 0))
        if body["kind"] == "install_clear":
            deltas = (0, body["delta"]["all_time"], body["delta"]["current"])
        for column, amount in enumerate(deltas):
            per_skill[(skill, column)] += amount
    skill_stats = {s: tuple(per_skill[(s, c)] for c in range(3)) for s in rows}
    owners: Counter[tuple[str, int]] = Counter()
    for skill, owner in rows.items():
        if owner is not None:
            for column in range(3):
                owners[(owner, column)] += per_skill[(skill, column)]
    owner_stats = {o: tuple(owners[(o, c)] for c in range(3)) for o in {o for o in rows.values() if o is not None}}
    return (
        skill_stats,
        {o: v for o, v in owner_stats.items() if v != (0, 0, 0) or o in _touched(rows, per_skill)},
        unknown,
    )


def _touched(rows: dict[str, str | None], per_skill: Counter[tuple[str, int]]) -> set[str]:
    return {o for s, o in rows.items() if o is not None and any(per_skill[(s, c)] for c in range(3))}


def actual_docstats(settings: Settings) -> tuple[Stats, Stats]:
    engine = open_engine(settings.database_url)
    try:
        with engine.connect() as connection:
            skill_rows = {
                row.id: (row.downloads, row.installs_all_time, row.installs_current)
                for row in connection.execute(select(skills))
            }
            owner_rows = {
                row.owner_id: (row.downloads, row.installs_all_time, row.installs_current)
                for row in connection.execute(select(user_skill_stats))
            }
        return skill_rows, owner_rows
    finally:
        engine.dispose()


def nonzero(rows: Mapping[K, tuple[int, ...]]) -> dict[K, tuple[int, ...]]:
    """The rows that count something: a row kept at zero (every event of it taken back) is no row."""
    return {k: tuple(v) for k, v in rows.items() if any(v)}


def assert_four_tables(
    url: str,
    daily: Counts,
    hourly: Counts,
    skill_stats: Stats,
    owner_stats: Stats,
) -> None:
    """The daily, hourly, skills and owners tables in `url` are the model's (rows at zero aside; every skill row
    compared, zeros too: the registry made them)."""
    state = Settings(database_url=url)
    got_daily, got_hourly = actual_windows(state)
    got_skills, got_owners = actual_docstats(state)
    assert nonzero(got_daily) == nonzero(daily)
    assert nonzero(got_hourly) == nonzero(hourly)
    assert got_skills == skill_stats
    assert nonzero(got_owners) == nonzero(owner_stats)


def seed_registry(settings: Settings, rows: dict[str, str | None]) -> None:
    engine = open_engine(settings.database_url)
    with engine.begin() as connection:
        connection.execute(insert(skills), [{"id": s, "owner_id": o} for s, o in rows.items()])
    engine.dispose()


def run_docsync(settings: Settings, *args: str) -> tuple[int, list[dict[str, object]]]:
    result = subprocess.run(
        [sys.executable, "-m", "skillstats.cli", "docsync", "--json", *args],
        env=settings_env(settings),
        capture_output=True,
        text=True,
        timeout=300,
    )
    summaries = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert summaries or result.returncode != 0, result.stderr[-2000:]
    return result.returncode, summaries


def _pg_tool(name: str) -> str:
    """A PostgreSQL client program of the server's own version (Debian's /usr/lib/postgresql/<v>/bin), else PATH."""
    found = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), key=lambda p: int(p.parts[-3]))
    return str(found[-1]) if found else name


def backup_database(url: str, where: Path) -> Path:
    """A backup of the whole database, as an operator takes one: SQLite's backup API, or pg_dump."""
    from skillstats.sinks.db import sqlite_path

    path = sqlite_path(url)
    if path is not None:
        target = where.with_suffix(".db")
        source, copy = sqlite3.connect(path), sqlite3.connect(target)
        with copy:
            source.backup(copy)
        source.close()
        copy.close()
        return target
    target = where.with_suffix(".dump")
    done = subprocess.run([_pg_tool("pg_dump"), "-Fc", "-f", str(target), url], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return target


def restore_database(url: str, backup: Path) -> None:
    """The database set back to `backup`, whoever is connected (a restore, or a failover to a replica that lost
    its tail): SQLite's backup API into the live file (its own locking), or pg_restore in one transaction."""
    from skillstats.sinks.db import sqlite_path

    path = sqlite_path(url)
    if path is not None:
        source, live = sqlite3.connect(backup), sqlite3.connect(path, timeout=60)
        with live:
            source.backup(live)
        source.close()
        live.close()
        return
    done = subprocess.run(
        [_pg_tool("pg_restore"), "--clean", "--if-exists", "--single-transaction", "-d", url, str(backup)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


def recreate_topic(settings: Settings, partitions: int) -> None:
    admin = AdminClient(settings.kafka_config())
    for future in admin.delete_topics([settings.topic], operation_timeout=30).values():
        future.result(30)
    wait_until(lambda: settings.topic not in admin.list_topics(timeout=10).topics, 60, "the topic to be deleted")

    def created() -> bool:
        # The broker's default replication (-1): 3 on the fault suite's cluster, whose min.insync.replicas is 2.
        again = NewTopic(settings.topic, partitions, replication_factor=-1)
        future = admin.create_topics([again], operation_timeout=30)[settings.topic]
        try:
            future.result(30)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
            return False  # the deletion is still being completed
        return True

    wait_until(created, 60, "the topic to be created again", interval=0.5)
    wait_until(
        lambda: len(admin.list_topics(settings.topic, timeout=10).topics[settings.topic].partitions) == partitions,
        60,
        "the new topic's partitions",
    )


def forget_topic_ids(settings: Settings) -> None:
    """The recorded topic ids cleared, as in a database migrated from before they were kept (revision 0005)."""
    from skillstats.sinks.schema import consumers

    engine = open_engine(settings.database_url)
    try:
        with engine.begin() as connection:
            connection.execute(update(consumers).values(topic_id=None))
    finally:
        engine.dispose()
