"""The consumers measured in processes of their own: `python -m skillstats_bench ROLE ...` (bench/__main__.py).

Each runs alone in its process so that its CPU time and peak RSS (bench/measure.py, `Watched`) are
its own: `bare` and `decode`, the confluent-kafka loop without and with decoding (the ceiling
on this machine); `librdkafka-sink`, the windows sink behind that loop; `naive-faust`, the textbook
faust agent. What each needs is imported in the role itself, so starting one loads nothing else.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import time

from .workload import PARTITIONS


def _role_loop(bootstrap: str, topic: str, group: str, expected: int, decode_records: bool) -> None:
    """A bare confluent-kafka consume loop (optionally decoding, as the consumers do: one decode_many call per
    consume() batch); prints first/last record times and the process's CPU seconds at each."""
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
    cpu_first = 0.0
    now_ms = int(time.time() * 1000)
    while seen < expected:
        # A short wait: consume() returns once it has 10,000 records or the wait is over, so with a long one the
        # first call sat in librdkafka while its prefetch filled, unclocked, and a short run (200,000 records)
        # was measured at up to 7x its fetch-bound rate (tests/test_perf_guard.py).
        messages = consumer.consume(10_000, timeout=0.1)
        if messages and not first:
            first = time.time()
            cpu_first = time.process_time()  # every thread of the process, librdkafka's too
        if decode_records:
            records = [m for m in messages if m.error() is None]
            decode_many([m.key() for m in records], [m.value() for m in records], [now_ms] * len(records))
            seen += len(records)
        else:
            for message in messages:
                if message.error() is None:
                    seen += 1
    print(f"first={first} last={time.time()} cpu_first={cpu_first} cpu_last={time.process_time()}", flush=True)
    consumer.close()


def _role_librdkafka_sink(bootstrap: str, topic: str, group: str, database_url: str) -> None:
    """The windows sink fed by a confluent-kafka loop instead of faust/aiokafka: what the transport costs.

    A measurement, not a consumer to run: no group-membership handling beyond
    librdkafka's, no DLQ, no offsets committed (the fences are the cursor here).
    Each fetch is decoded, folded and applied exactly as the windows worker does.
    """
    import gc
    from typing import NamedTuple

    from confluent_kafka import Consumer

    from skillstats.sinks.db import open_engine
    from skillstats.sinks.pipeline import COLLECTOR_THRESHOLD, decode_batch
    from skillstats.sinks.windows import WindowsSink

    class Fetched(NamedTuple):
        partition: int
        offset: int
        timestamp: int | None
        key: bytes | None
        value: bytes | None
        headers: list[tuple[str, bytes | None]]

    gc.freeze()  # as `skillstats windows` runs (streams/windows.py)
    gc.set_threshold(COLLECTOR_THRESHOLD, 50, 100)
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
            decoded = decode_batch(fetched, since, fold=sink.fold_at_decode())  # as the worker decodes
            sink.apply(sink.prepare(decoded.parts, folded_at_decode=decoded.folded))


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


def run_role(argv: list[str]) -> None:
    """One measured consumer in its own process: `python -m skillstats_bench ROLE ...` (see bench/__main__.py)."""
    role, *rest = argv
    if role in ("bare", "decode"):
        _role_loop(rest[0], rest[1], rest[2], int(rest[3]), decode_records=role == "decode")
    elif role == "librdkafka-sink":
        _role_librdkafka_sink(rest[0], rest[1], rest[2], rest[3])
    elif role == "naive-faust":
        _role_naive_faust(rest[0], rest[1], rest[2])
    elif role == "stages":
        from .stages import run_stages

        run_stages(rest)
    else:
        raise SystemExit(f"unknown role {role!r}")
