"""The windows sink's stages apart: CPU seconds of fetch, decode, fold and SQL over one topic's records.

    python -m skillstats_bench stages BOOTSTRAP TOPIC DATABASE_URL [BATCH]

The worker's own CPU figure (bench/measure.py) is one number for everything a
process does, and `py-spy record --gil` misses what runs without the
interpreter's lock (SQLite's own work, librdkafka's). This reads every record
of TOPIC with a bare confluent-kafka loop (timed: the fetch), holds them in
memory, then runs the sink's own functions over them in batches of BATCH
(default 50,000: the worker's --batch-size, which a catching-up worker's
transactions reach, and SQLite's cost per event falls with the batch), each
stage timed with `time.process_time()`: the decode as the worker's does it
(`decode_columns` into the sink's `fold_at_decode`: the records read into the
fold's table, the rest decoded), the fold's rows (`fold_decoded`; without the
C module `decode_many` and `fold_rows` over events), and its `write` in one
transaction per batch into a fresh schema at DATABASE_URL (SQLite's own work
counts there; PostgreSQL's runs in the server). Up to the sixteenth round the
decode built an event per record and the fold read them (docs/performance.md).
The collector is frozen and tuned as the worker does it (streams/windows.py),
or a million held records would make every stage pay for scanning them.
docs/performance.md, "Where each CPU second goes" and "Records as aiokafka read
them", has what it gave.
"""

from __future__ import annotations

import gc
import time

from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Consumer, TopicPartition

from skillstats.config import Settings
from skillstats.kafka import end_offsets
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.pipeline import COLLECTOR_THRESHOLD, decode_columns
from skillstats.sinks.upserts import now_utc_naive
from skillstats.sinks.windows import WindowsSink

Record = tuple[bytes | None, bytes | None, int | None]


def fetch_all(bootstrap: str, topic: str) -> tuple[list[Record], float]:
    """Every record of `topic` (key, value, timestamp) and the CPU seconds the loop took."""
    ends = end_offsets(Settings(kafka_bootstrap=bootstrap, topic=topic), topic)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "skillstats-bench-stages",
            "enable.auto.commit": False,
            "fetch.max.bytes": 8 << 20,
            "max.partition.fetch.bytes": 8 << 20,
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in ends])
    records: list[Record] = []
    left = sum(ends.values())
    began = time.process_time()
    try:
        while left > 0:
            for message in consumer.consume(10_000, 1.0):
                if message.error() is not None:
                    continue
                kind, stamp = message.timestamp()
                records.append((message.key(), message.value(), stamp if kind != TIMESTAMP_NOT_AVAILABLE else None))
                left -= 1
    finally:
        consumer.close()
    return records, time.process_time() - began


def measure(records: list[Record], database_url: str, batch: int) -> dict[str, float]:
    """CPU seconds per stage over `records`, in batches of `batch`."""
    engine = open_engine(database_url)
    upgrade(engine)
    gc.collect()
    gc.freeze()
    gc.set_threshold(COLLECTOR_THRESHOLD, 50, 100)
    spent = {"decode": 0.0, "fold": 0.0, "sql": 0.0}
    sink = WindowsSink(engine, "skillstats-bench-stages", "stages")  # its fold and spelling only
    try:
        for start in range(0, len(records), batch):
            chunk = records[start : start + batch]
            keys, values, stamps = ([r[i] for r in chunk] for i in range(3))
            t0 = time.process_time()
            fold = sink.fold_at_decode()
            events, _invalid, _newest = decode_columns(keys, values, stamps, fold)
            t1 = time.process_time()
            folded = sink.fold_decoded(fold) if fold is not None else sink.fold([e for e in events if e is not None])
            t2 = time.process_time()
            with engine.begin() as connection:
                sink.write(connection, folded, now_utc_naive())
            t3 = time.process_time()
            spent["decode"] += t1 - t0
            spent["fold"] += t2 - t1
            spent["sql"] += t3 - t2
    finally:
        engine.dispose()
    return spent


def run_stages(argv: list[str]) -> None:
    bootstrap, topic, database_url, *rest = argv
    batch = int(rest[0]) if rest else 50_000
    records, fetch = fetch_all(bootstrap, topic)
    spent = measure(records, database_url, batch)
    per_million = 1_000_000 / max(len(records), 1)
    print(f"{len(records):,} records of {topic}, batches of {batch:,}; CPU seconds per million records:")
    for stage, seconds in (("fetch (a bare confluent-kafka loop)", fetch), *spent.items()):
        print(f"  {stage:<36} {seconds * per_million:6.2f}")
