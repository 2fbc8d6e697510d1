"""`skillstats bench`: where the time goes, measured in one run on one machine.

For each workload (`steady`: what a live registry sends; `backfill`: a week of
history replayed), preloads a fresh topic, then runs each consumer in a process
of its own, from a cold start until it has caught up with the preloaded
records, and reports for each: the steady rate from its first record to caught
up, the ratio of that rate to the bare confluent-kafka loop (the ceiling on
this machine), the process's CPU seconds per million events (user + system,
process start to exit, from `wait4`), the SQL rows its upserts wrote per
second, the wall time from process start and the peak RSS. A second part
offers a steady load and measures publish-to-visible-in-SQL latency; a third
(case i, bench/ingest.py) measures `skillstats ingest` beside the direct
Python publisher.

The workloads differ in what the same number of events costs in SQL: near-now
events fold into a few hundred (skill, hour) rows per batch, a backfill's into
nearly one row per event, so rows/s is reported beside events/s.

The consumer roles (`bare`, `decode`, `naive-faust`) also run from here, as
`python -m skillstats_bench ROLE ...`, so that each is measured in isolation.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import bindparam, text

from skillstats.config import Settings
from skillstats.contract import make_event
from skillstats.kafka import committed_offsets, end_offsets, ensure_topics
from skillstats.publisher import Publisher
from skillstats.sinks.db import open_engine
from skillstats.sinks.identity import DOCSYNC, WINDOWS, release
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.windows import WindowsSink
from skillstats.workload import generate

PARTITIONS = 12


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    days: int  # how far back late events reach
    late_ratio: float  # share of events anywhere in those days; the rest in the last quarter hour


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "steady",
            "what a live registry sends: `occurred_at` in the last quarter hour, 5% of events up to 7 days late",
            7,
            0.05,
        ),
        Workload(
            "backfill",
            "a replay after an outage or a new deployment: `occurred_at` anywhere in the last 7 days",
            7,
            1.0,
        ),
    )
}


@dataclass
class Result:
    name: str
    events: int
    wall_seconds: float  # process start -> caught up
    steady_seconds: float  # first record -> caught up
    peak_rss_mb: float
    note: str = ""
    cpu_seconds: float = 0.0  # user + system, process start to exit
    rows_upserted: int | None = None  # None: the consumer writes no SQL

    @property
    def rate(self) -> float:
        return self.events / self.steady_seconds if self.steady_seconds > 0 else 0.0

    @property
    def cpu_per_million(self) -> float:
        return self.cpu_seconds * 1_000_000 / self.events if self.events else 0.0

    @property
    def rows_rate(self) -> float | None:
        if self.rows_upserted is None or self.steady_seconds <= 0:
            return None
        return self.rows_upserted / self.steady_seconds


def _log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- child roles


def _role_loop(bootstrap: str, topic: str, group: str, expected: int, decode_records: bool) -> None:
    """A bare confluent-kafka consume loop (optionally decoding, as the consumers do: one decode_many call per
    consume() batch); prints first/last record times."""
    from confluent_kafka import Consumer

    from skillstats.contract import decode_many

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "fetch.min.bytes": 1,
            "queued.max.messages.kbytes": 262144,
        }
    )
    consumer.subscribe([topic])
    seen = 0
    first = 0.0
    now_ms = int(time.time() * 1000)
    while seen < expected:
        messages = consumer.consume(10_000, timeout=1.0)
        if messages and not first:
            first = time.time()
        if decode_records:
            records = [m for m in messages if m.error() is None]
            decode_many([m.key() for m in records], [m.value() for m in records], [now_ms] * len(records))
            seen += len(records)
        else:
            for message in messages:
                if message.error() is None:
                    seen += 1
    print(f"first={first} last={time.time()}", flush=True)
    consumer.close()


def _role_librdkafka_sink(bootstrap: str, topic: str, group: str, database_url: str) -> None:
    """The windows sink fed by a confluent-kafka loop instead of faust/aiokafka: what the transport costs.

    A measurement, not a consumer to run: no group-membership handling beyond
    librdkafka's, no DLQ, no offsets committed (the fences are the cursor here).
    Each fetch is decoded, folded and applied exactly as the windows worker does.
    """
    from typing import NamedTuple

    from confluent_kafka import Consumer

    from skillstats.sinks.pipeline import decode_batch

    class Fetched(NamedTuple):
        partition: int
        offset: int
        timestamp: int | None
        key: bytes | None
        value: bytes | None
        headers: list[tuple[str, bytes | None]]

    import gc

    gc.freeze()  # as `skillstats windows` runs (streams/windows.py)
    gc.set_threshold(100_000, 50, 100)
    sink = WindowsSink(open_engine(database_url), group, topic)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "queued.max.messages.kbytes": 262144,
        }
    )
    consumer.subscribe([topic])
    # A fresh topic read from its start by a fresh group: each partition's read starts at 0
    # and goes on where the last batch ended (no rebalance is expected in a measurement).
    read_to: dict[int, int] = {}
    while True:
        messages = consumer.consume(10_000, timeout=1.0)
        fetched: dict[int, list[Fetched]] = {}
        for m in messages:
            if m.error() is None:
                fetched.setdefault(m.partition(), []).append(
                    Fetched(m.partition(), m.offset(), m.timestamp()[1], m.key(), m.value(), m.headers() or [])
                )
        if fetched:
            since = {p: read_to.get(p, 0) for p in fetched}
            read_to.update({p: records[-1].offset + 1 for p, records in fetched.items()})
            sink.apply(sink.prepare(decode_batch(fetched, since).parts))


def _role_naive_faust(bootstrap: str, topic: str, group: str) -> None:
    """The textbook faust way: one windowed Table update per event."""
    from datetime import timedelta

    import faust
    import orjson

    app = faust.App(
        group,
        broker=f"kafka://{bootstrap}",
        store="memory://",
        key_serializer="raw",
        value_serializer="raw",
        web_enabled=False,
        topic_partitions=PARTITIONS,
        topic_disable_leader=True,
        consumer_auto_offset_reset="earliest",
        broker_commit_interval=0.5,
        # faust makes a data directory even for in-memory tables: in a temporary
        # directory, removed on exit, not one left in the working directory per run.
        datadir=tempfile.mkdtemp(prefix=f"{group}-"),
    )
    atexit.register(shutil.rmtree, app.conf.datadir, ignore_errors=True)
    source = app.topic(topic, key_type=bytes, value_type=bytes)
    downloads = app.Table(f"{group}-downloads", default=int, partitions=PARTITIONS).tumbling(
        timedelta(hours=1), expires=timedelta(days=30)
    )

    @app.agent(source)
    async def count(stream):  # type: ignore[no-untyped-def]
        async for value in stream:
            event = orjson.loads(value)
            if event["kind"] == "download":
                downloads[event["skill_id"]] += 1

    faust.Worker(app, loglevel="warning", quiet=True).execute_from_commandline()


# ---------------------------------------------------------------- measuring


def _measure(
    name: str,
    argv: list[str] | list[list[str]],
    env: dict[str, str],
    events: int,
    done: Callable[[], bool] | None,
    first_progress: Callable[[], bool] | None = None,
    note: str = "",
    rows: Callable[[], int] | None = None,
) -> Result:
    """Run `argv` until it exits (done=None) or `done()` holds; time it, read its CPU time and peak RSS.

    `argv` may be several command lines (with `done`): processes started together
    and measured as one consumer, their CPU times summed, the largest peak RSS.
    `rows`, asked once `done()` holds and before the processes are stopped, says
    how many SQL rows they wrote.
    """
    _log(f"{name}: starting")
    started = time.monotonic()
    argvs: list[list[str]] = argv if isinstance(argv[0], list) else [argv]  # type: ignore[assignment,list-item]
    processes = [
        subprocess.Popen(line, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for line in argvs
    ]
    process = processes[0]
    first_at = 0.0
    rows_upserted = None
    if done is not None:
        while not done():
            if first_progress is not None and not first_at and first_progress():
                first_at = time.monotonic()
            for running in processes:
                if running.poll() is not None:
                    raise RuntimeError(f"{name} exited early with status {running.returncode}")
            time.sleep(0.05)
        finished = time.monotonic()
        rows_upserted = rows() if rows is not None else None
        for running in processes:
            running.terminate()
    cpu_seconds, peak_rss_mb = 0.0, 0.0
    for running in processes:
        _pid, status, usage = os.wait4(running.pid, 0)
        running.returncode = os.waitstatus_to_exitcode(status)
        cpu_seconds += usage.ru_utime + usage.ru_stime
        peak_rss_mb = max(peak_rss_mb, usage.ru_maxrss / 1024)
    output = process.stdout.read() if process.stdout else ""
    if done is None:
        finished = time.monotonic()
        if process.returncode != 0:
            raise RuntimeError(f"{name} failed with status {process.returncode}: {output[-500:]}")
        fields = dict(part.split("=") for part in output.split() if "=" in part)
        steady = float(fields["last"]) - float(fields["first"])
    else:
        steady = finished - (first_at or started)
    result = Result(name, events, finished - started, steady, peak_rss_mb, note, cpu_seconds, rows_upserted)
    _log(
        f"{name}: {result.rate:,.0f} events/s steady, {result.cpu_per_million:.1f} CPU s per million, "
        f"{result.wall_seconds:.1f}s wall, {result.peak_rss_mb:.0f} MiB"
    )
    return result


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _scraped_rows(ports: list[int], events: int) -> Callable[[], int]:
    """Rows the workers serving metrics on `ports` say their upserts wrote (skillstats_rows_upserted_total).

    Read once their batches account for all `events` (skillstats_batch_records_sum): the
    fences move in the transaction, the metrics just after it.
    """

    def scrape() -> dict[str, float]:
        totals: dict[str, float] = {}
        for port in ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                body = response.read().decode()
            for line in body.splitlines():
                name = line.split("{", 1)[0].split(" ", 1)[0]
                if name in ("skillstats_rows_upserted_total", "skillstats_batch_records_sum"):
                    totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return totals

    def rows() -> int:
        deadline = time.monotonic() + 30
        totals = scrape()
        while totals.get("skillstats_batch_records_sum", 0) < events and time.monotonic() < deadline:
            time.sleep(0.05)
            totals = scrape()
        return int(totals.get("skillstats_rows_upserted_total", 0))

    return rows


def _measure_docsync(name: str, settings: Settings, database_url: str, group: str, events: int) -> Result:
    """One drain as a CronJob runs it: process start to exit; steady = the drain's own duration."""
    import json

    engine = open_engine(database_url)
    upgrade(engine)
    release(engine, DOCSYNC)  # every case is a new group and topic in the scratch database
    _ensure_registry_rows(engine, events)
    drained = settings.override(docsync_group=group, database_url=database_url)
    _log(f"{name}: starting")
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "skillstats.cli", "docsync", "--json"],
        env=drained.child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    _pid, status, usage = os.wait4(process.pid, 0)
    wall = time.monotonic() - started
    output = process.stdout.read() if process.stdout else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{name} failed: {output[-500:]}")
    summary = json.loads(output.strip().splitlines()[-1])
    if summary["events_read"] != events:
        raise RuntimeError(f"{name} read {summary['events_read']} of {events} events")
    result = Result(
        name,
        events,
        wall,
        summary["duration_seconds"],
        usage.ru_maxrss / 1024,
        f"{summary['skills_updated']:,} skills rows and {summary['owners_updated']:,} owners rows, once each",
        usage.ru_utime + usage.ru_stime,
        summary["skills_updated"] + summary["owners_updated"],
    )
    _log(f"{name}: {result.rate:,.0f} events/s steady, {result.cpu_per_million:.1f} CPU s per million")
    return result


def _ensure_registry_rows(engine: Any, events: int) -> None:
    """`skills` rows for the benchmark's skill ids, 300 owners; rows already there are kept."""
    from sqlalchemy.dialects import postgresql, sqlite

    from skillstats.sinks.schema import skills
    from skillstats.workload import skill_ids

    dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
    rows = [{"id": s, "owner_id": f"user_{i % 300:03d}"} for i, s in enumerate(skill_ids(20_000))]
    with engine.begin() as connection:
        connection.execute(dialect.insert(skills).on_conflict_do_nothing(), rows)


def _caught_up_sql(sink: WindowsSink, ends: dict[int, int]) -> Callable[[], bool]:
    wanted = {p: n for p, n in ends.items() if n}
    return lambda: sink.fences() == wanted


def _any_sql_progress(sink: WindowsSink) -> Callable[[], bool]:
    return lambda: bool(sink.fences())


def _prefix_offsets(settings: Settings, topic: str, count: int) -> dict[int, int]:
    """Per-partition end offsets covering about the first `count` records of the topic."""
    ends = {p: n for p, n in end_offsets(settings, topic).items() if n}
    total = sum(ends.values())
    return {p: max(1, n * count // total) for p, n in ends.items()} if count < total else ends


def _kafka_perf_test(settings: Settings, topic: str, events: int) -> Result | None:
    libs = Path(os.environ.get("SKILLSTATS_STATE_DIR", ".local")) / "kafka-libs"
    if not libs.is_dir():
        _log(f"kafka-consumer-perf-test: skipped, no Kafka jars at {libs} (deploy/local/kafka.sh fetch)")
        return None
    argv = [
        "java",
        "-Xmx1g",
        "-cp",
        f"{libs}/*",
        "org.apache.kafka.tools.ConsumerPerformance",
        "--bootstrap-server",
        settings.kafka_bootstrap,
        "--topic",
        topic,
        "--messages",
        str(events),
        "--group",
        f"bench-perftest-{uuid.uuid4().hex[:6]}",
        "--timeout",
        "120000",
    ]
    started = time.monotonic()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    _pid, _status, usage = os.wait4(process.pid, 0)
    wall = time.monotonic() - started
    lines = [line for line in (process.stdout.read() if process.stdout else "").splitlines() if line.strip()]
    header, values = [h.strip() for h in lines[-2].split(",")], [v.strip() for v in lines[-1].split(",")]
    row = dict(zip(header, values, strict=False))
    fetch_rate = float(row.get("fetch.nMsg.sec", row.get("nMsg.sec", "0")))
    consumed = int(float(row.get("data.consumed.in.nMsg", events)))
    result = Result(
        "f. kafka-consumer-perf-test (JVM)",
        consumed,
        wall,
        consumed / fetch_rate if fetch_rate else wall,
        usage.ru_maxrss / 1024,
        "the tool's own fetch.nMsg.sec",
    )
    _log(f"{result.name}: {result.rate:,.0f} events/s")
    return result


def _latency(settings: Settings, database_url: str, rate: int, seconds: int) -> tuple[float, float, int]:
    """Offer `rate` events/s for `seconds` to a windows worker; p50/p99 publish -> visible in SQL."""
    run = uuid.uuid4().hex[:8]
    lat = settings.override(
        topic=f"bench-lat-{run}",
        dlq_topic=f"bench-lat-{run}.dlq",
        windows_group=f"bench-lat-{run}",
        database_url=database_url,
    )
    ensure_topics(lat, {lat.topic: PARTITIONS, lat.dlq_topic: 1})
    engine = open_engine(database_url)
    upgrade(engine)
    release(engine, WINDOWS)
    worker = subprocess.Popen(
        [sys.executable, "-m", "skillstats.cli", "windows", "--metrics-port", "0"],
        env=lat.child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    sent: dict[str, float] = {}
    seen: dict[str, float] = {}
    stop = threading.Event()

    # The probes not yet seen, looked up by key: the hourly table holds every earlier
    # run's rows too, and a LIKE scan of it (90 ms at 900,000 rows) inflated the
    # figure by its own duration and competed with the worker for the CPU.
    lookup = text("SELECT skill_id FROM skill_hourly_stats WHERE skill_id IN :ids").bindparams(
        bindparam("ids", expanding=True)
    )

    def watch() -> None:
        while not stop.is_set():
            waiting = [skill for skill in list(sent) if skill not in seen]
            if waiting:
                with engine.connect() as connection:
                    rows = connection.execute(lookup, {"ids": waiting}).scalars().all()
                now = time.monotonic()
                for skill in rows:
                    seen.setdefault(skill, now)
            time.sleep(0.02)

    try:
        sink = WindowsSink(engine, lat.windows_group, lat.topic)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        load = generate(rate * seconds, now_ms=int(time.time() * 1000), skills=20_000, seed=3)
        publisher = Publisher(lat)
        sent_count = 0
        probe = 0
        # Measure only once the worker has joined and applied something: one invalid
        # record (parked, but it moves the fence) until the fence shows up.
        deadline_first = time.monotonic() + 60
        while not sink.fences() and time.monotonic() < deadline_first:
            publisher.send_raw(b"warm", None)
            publisher.flush()
            time.sleep(0.2)
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < seconds:
            due = int(elapsed * rate)
            while sent_count < due:
                if sent_count % 250 == 0:  # 20 probes a second at 5,000 events/s
                    skill = f"probe-{run}-{probe}"
                    probe += 1
                    event = make_event(skill, "download", int(time.time() * 1000))
                    sent[skill] = time.monotonic()
                    publisher.send(event)
                else:
                    record = next(load)
                    publisher.send_raw(record.key, record.value)
                sent_count += 1
            time.sleep(0.002)
        publisher.flush()
        deadline = time.monotonic() + 30
        while len(seen) < len(sent) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        worker.terminate()
        worker.wait(60)
    latencies = sorted(seen[s] - sent[s] for s in sent if s in seen)
    missing = len(sent) - len(latencies)
    if not latencies:
        raise RuntimeError("no probe became visible")
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
    return statistics.median(latencies), p99, missing


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def soak(settings: Settings, database_url: str, events: int, skills: int) -> str:
    """Memory of the windows worker over a long run: RSS sampled as the backlog drains."""
    topic = f"bench-soak-{uuid.uuid4().hex[:8]}"
    soaked = settings.override(
        topic=topic, dlq_topic=f"{topic}.dlq", windows_group=f"{topic}-windows", database_url=database_url
    )
    ensure_topics(soaked, {topic: PARTITIONS, soaked.dlq_topic: 1})
    _log(f"soak: preloading {events:,} events")
    with Publisher(soaked, flush_timeout=600) as publisher:
        for record in generate(events, now_ms=int(time.time() * 1000), skills=skills, seed=99):
            publisher.send_raw(record.key, record.value)
    engine = open_engine(database_url)
    upgrade(engine)
    release(engine, WINDOWS)
    sink = WindowsSink(engine, soaked.windows_group, topic)
    total = sum(end_offsets(soaked, topic).values())
    worker = subprocess.Popen(
        [sys.executable, "-m", "skillstats.cli", "windows", "--metrics-port", "0"],
        env=soaked.child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    samples: list[tuple[float, float]] = []  # (share applied, RSS MiB)
    started = time.monotonic()
    try:
        while (applied := sum(sink.fences().values())) < total:
            if worker.poll() is not None:
                raise RuntimeError(f"the windows worker exited with {worker.returncode} during the soak")
            samples.append((applied / total, _rss_mb(worker.pid)))
            time.sleep(1.0)
    finally:
        worker.terminate()
        worker.wait(60)
    elapsed = time.monotonic() - started

    def at(share: float) -> float:
        return next((rss for done, rss in samples if done >= share), samples[-1][1])

    early, late = at(0.1), max(rss for done, rss in samples if done >= 0.1)
    _log(f"soak: RSS {early:.0f} MiB at 10%, at most {late:.0f} MiB after")
    return (
        f"Memory over {total:,} events ({elapsed:.0f} s, {total / elapsed:,.0f} events/s): RSS {early:.0f} MiB "
        f"at 10% of the stream, {at(0.5):.0f} MiB at 50%, at most {late:.0f} MiB from 10% to the end "
        f"({(late - early) / early:+.0%})."
    )


# ---------------------------------------------------------------- the run


def _preload(settings: Settings, topic: str, events: int, skills: int, workload: Workload) -> float:
    """A fresh topic holding `events` of the workload; returns the publish rate."""
    ensure_topics(settings, {topic: PARTITIONS, f"{topic}.dlq": 1})
    _log(f"{workload.name}: preloading {events:,} events ({skills:,} skills) into {topic}")
    started = time.monotonic()
    now_ms = int(time.time() * 1000)
    with Publisher(settings, flush_timeout=300) as publisher:
        for record in generate(
            events, now_ms=now_ms, skills=skills, seed=42, days=workload.days, late_ratio=workload.late_ratio
        ):
            publisher.send_raw(record.key, record.value)
    rate = events / (time.monotonic() - started)
    _log(f"{workload.name}: preloaded at {rate:,.0f} events/s")
    return rate


@dataclass
class WorkloadRun:
    workload: Workload
    topic: str
    publish_rate: float
    results: list[Result]


def run(
    settings: Settings,
    *,
    events: int,
    skills: int,
    databases: dict[str, str],
    skip: set[str],
    latency_rate: int,
    latency_seconds: int,
    naive_events: int = 200_000,
    workloads: list[Workload] | None = None,
    ingest_rate: int = 500,
    ingest_seconds: int = 20,
) -> str:
    run_id = uuid.uuid4().hex[:8]
    env = dict(os.environ)
    python = sys.executable
    runs: list[WorkloadRun] = []

    def group() -> str:
        return f"bench-{run_id}-{uuid.uuid4().hex[:6]}"

    for workload in workloads or list(WORKLOADS.values()):
        topic = f"bench-{run_id}-{workload.name}"
        bench = settings.override(topic=topic, dlq_topic=f"{topic}.dlq")
        publish_rate = _preload(bench, topic, events, skills, workload)
        ends = end_offsets(bench, topic)
        results: list[Result] = []
        runs.append(WorkloadRun(workload, topic, publish_rate, results))
        for role, name in (("bare", "a. bare confluent-kafka loop"), ("decode", "b. loop + decode/validate")):
            if role not in skip:
                argv = [python, "-m", "skillstats_bench", role, bench.kafka_bootstrap, topic, group(), str(events)]
                results.append(_measure(f"{name}", argv, env, events, None))
        for workers, case in ((1, "windows"), (2, "two-workers")):
            for label, url in databases.items():
                if case in skip:
                    break
                engine = open_engine(url)
                upgrade(engine)
                release(engine, WINDOWS)  # every case is a new group and topic in the scratch database
                windows = bench.override(windows_group=group(), database_url=url)
                sink = WindowsSink(engine, windows.windows_group, topic)
                ports: list[int] = []
                while len(ports) < workers:  # distinct, though the kernel may hand one out twice
                    if (port := _free_port()) not in ports:
                        ports.append(port)
                worker = [python, "-m", "skillstats.cli", "windows", "--metrics-host", "127.0.0.1"]
                name = f"c. skillstats windows ({label})" if workers == 1 else f"h. two windows workers ({label})"
                results.append(
                    _measure(
                        name,
                        # Two workers get static membership ids, as pods do (deploy/k8s): both
                        # join the group's first generation instead of the second forcing a
                        # rebalance of the first's partitions a few seconds in.
                        [
                            [*worker, "--metrics-port", str(port)]
                            + ([] if workers == 1 else ["--instance-id", f"{windows.windows_group}-{i}"])
                            for i, port in enumerate(ports)
                        ],
                        windows.child_env(env),
                        events,
                        _caught_up_sql(sink, ends),
                        _any_sql_progress(sink),
                        note="" if workers == 1 else "one group, the partitions split between two processes",
                        rows=_scraped_rows(ports, events),
                    )
                )
        for label, url in databases.items():
            if "librdkafka-sink" in skip:
                break
            engine = open_engine(url)
            upgrade(engine)
            sink_group = group()
            sink = WindowsSink(engine, sink_group, topic)
            results.append(
                _measure(
                    f"g. librdkafka loop + the windows sink ({label})",
                    [
                        python,
                        "-m",
                        "skillstats_bench",
                        "librdkafka-sink",
                        bench.kafka_bootstrap,
                        topic,
                        sink_group,
                        url,
                    ],
                    env,
                    events,
                    _caught_up_sql(sink, ends),
                    _any_sql_progress(sink),
                    note="a prototype, not the product: the windows sink behind a confluent-kafka fetch",
                )
            )
        if "docsync" not in skip:
            for label, url in databases.items():
                results.append(_measure_docsync(f"d. skillstats docsync drain ({label})", bench, url, group(), events))
    first = runs[0]
    bench = settings.override(topic=first.topic, dlq_topic=f"{first.topic}.dlq")
    if "naive" not in skip:
        # At a few thousand events/s the textbook agent would take many minutes over the
        # whole topic; its steady rate is the same over a prefix, so it reads one.
        naive_group = group()
        naive_n = min(naive_events, events)
        wanted = _prefix_offsets(bench, first.topic, naive_n)

        def naive_done() -> bool:
            committed = committed_offsets(bench, naive_group, first.topic)
            return all(committed.get(p, 0) >= n for p, n in wanted.items())

        first.results.append(
            _measure(
                "e. naive faust (Table update per event)",
                [python, "-m", "skillstats_bench", "naive-faust", bench.kafka_bootstrap, first.topic, naive_group],
                env,
                sum(wanted.values()),
                naive_done,
                lambda: bool(committed_offsets(bench, naive_group, first.topic)),
                note=f"first {sum(wanted.values()):,} events; done = offsets committed (0.5 s)",
            )
        )
    if "perftest" not in skip:
        perf = _kafka_perf_test(bench, first.topic, events)
        if perf:
            first.results.append(perf)
    latency = None
    if latency_seconds and "latency" not in skip and databases:
        label, url = next(reversed(databases.items()))
        _log(f"latency: {latency_rate:,} events/s for {latency_seconds}s into windows ({label})")
        latency = (label, *_latency(settings, url, latency_rate, latency_seconds))
    table = report(runs, events, skills, latency, latency_rate, latency_seconds)
    if "ingest" not in skip:
        from skillstats_bench.ingest import measure as measure_ingest

        _log("i. skillstats ingest beside the direct publisher")
        table += "\n\n" + measure_ingest(settings, min(events, 400_000), rate=ingest_rate, seconds=ingest_seconds)
    return table


def report(
    runs: list[WorkloadRun],
    events: int,
    skills: int,
    latency: tuple[str, float, float, int] | None,
    rate: int,
    seconds: int,
) -> str:
    lines: list[str] = []
    for workload_run in runs:
        results = workload_run.results
        ceiling = next((r.rate for r in results if r.name.startswith("a.")), 0.0)
        lines += [
            f"### Workload `{workload_run.workload.name}`",
            "",
            f"{events:,} events, {skills:,} skills (Zipf), {PARTITIONS} partitions, "
            f"{workload_run.workload.description}; preloaded at {workload_run.publish_rate:,.0f} events/s by the "
            f"Python publisher.",
            "",
            "| consumer | events/s (steady) | ratio to (a) | CPU s per million events | SQL rows upserted/s "
            "| wall, cold start to caught up | peak RSS | note |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in results:
            ratio = f"{r.rate / ceiling:.2f}" if ceiling else "-"
            rows_rate = "-" if r.rows_rate is None else f"{r.rows_rate:,.0f}"
            cpu = f"{r.cpu_per_million:.1f}" if r.cpu_seconds else "-"
            lines.append(
                f"| {r.name} | {r.rate:,.0f} | {ratio} | {cpu} | {rows_rate} | {r.wall_seconds:.1f} s "
                f"| {r.peak_rss_mb:.0f} MiB | {r.note} |"
            )
        lines.append("")
    if latency:
        label, p50, p99, missing = latency
        lines += [
            f"Publish -> visible in SQL at {rate:,} events/s for {seconds} s ({label}): "
            f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms"
            + (f", {missing} probes never seen" if missing else "")
            + ".",
        ]
    return "\n".join(lines).rstrip("\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--events", type=int, default=2_000_000, help="events to preload, per workload (default 2,000,000)"
    )
    parser.add_argument(
        "--workload",
        default="steady,backfill",
        help="comma-separated workloads to run: "
        + "; ".join(f"{w.name}: {w.description}".replace("%", "%%") for w in WORKLOADS.values())
        + " (default both; naive faust, perf-test and latency run on the first)",
    )
    parser.add_argument("--skills", type=int, default=20_000, help="distinct skills (default 20,000)")
    parser.add_argument("--sqlite", metavar="PATH", help="SQLite file for case c (default: a temporary file)")
    parser.add_argument("--postgres", metavar="URL", help="PostgreSQL URL for case c (default: skip PostgreSQL)")
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated: bare,decode,windows,two-workers,librdkafka-sink,docsync,naive,perftest,latency,ingest",
    )
    parser.add_argument(
        "--naive-events",
        type=int,
        default=200_000,
        help="events the naive faust agent reads (default 200,000; it is slow)",
    )
    parser.add_argument("--latency-rate", type=int, default=5000, help="offered events/s for the latency part")
    parser.add_argument("--latency-seconds", type=int, default=60, help="length of the latency part (0: skip)")
    parser.add_argument(
        "--ingest-rate", type=int, default=500, help="single-event requests/s offered to skillstats ingest (case i)"
    )
    parser.add_argument("--ingest-seconds", type=int, default=20, help="length of case i's latency part")
    parser.add_argument(
        "--soak-events",
        type=int,
        default=0,
        help="also run the windows worker over this many events and report its memory (e.g. 10000000)",
    )
    parser.add_argument("--output", type=Path, help="also write the markdown table to this file")


def workload_names(text: str) -> list[str]:
    """The workloads named in `--workload`, checked: ValueError names what is wrong."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise ValueError(f"unknown workload {', '.join(unknown) or repr(text)}; choose from {', '.join(WORKLOADS)}")
    return list(dict.fromkeys(names))


def main_from_cli(args: argparse.Namespace, settings: Settings) -> int:
    databases: dict[str, str] = {}
    names = workload_names(args.workload)
    with tempfile.TemporaryDirectory(prefix="skillstats-bench-") as scratch:
        databases["SQLite"] = f"sqlite:///{args.sqlite or Path(scratch) / 'bench.db'}"
        if args.postgres:
            databases["PostgreSQL"] = args.postgres
        table = run(
            settings,
            events=args.events,
            skills=args.skills,
            databases=databases,
            skip={s.strip() for s in args.skip.split(",") if s.strip()},
            latency_rate=args.latency_rate,
            latency_seconds=args.latency_seconds,
            naive_events=args.naive_events,
            workloads=[WORKLOADS[n] for n in names],
            ingest_rate=args.ingest_rate,
            ingest_seconds=args.ingest_seconds,
        )
        if args.soak_events:
            table += "\n\n" + soak(
                settings, databases.get("PostgreSQL", databases["SQLite"]), args.soak_events, args.skills
            )
    print(table)
    if args.output:
        args.output.write_text(table + "\n")
    return 0


def run_role(argv: list[str]) -> None:
    """One measured consumer in its own process: `python -m skillstats_bench ROLE ...` (see bench/__main__.py)."""
    role, *rest = argv
    if role in ("bare", "decode"):
        _role_loop(rest[0], rest[1], rest[2], int(rest[3]), decode_records=role == "decode")
    elif role == "librdkafka-sink":
        _role_librdkafka_sink(rest[0], rest[1], rest[2], rest[3])
    elif role == "naive-faust":
        _role_naive_faust(rest[0], rest[1], rest[2])
    else:
        raise SystemExit(f"unknown role {role!r}")
