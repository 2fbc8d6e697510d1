"""Publish -> visible in SQL: a steady load offered to one windows worker, probes timed until their rows show.

One event in 250 is a probe for a skill of its own; a watcher thread looks each probe not yet seen
up by key in `skill_hourly_stats` every 20 ms. The rest of the load is the `steady` workload's
traffic, so the worker's batches are the size a live registry makes them.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
import uuid

from sqlalchemy import bindparam, text

from skillstats.config import Settings
from skillstats.contract import make_event
from skillstats.kafka import ensure_topics
from skillstats.publisher import Publisher
from skillstats.sinks.db import open_engine
from skillstats.sinks.identity import WINDOWS, release
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.windows import WindowsSink
from skillstats.workload import generate

from .workload import PARTITIONS


def latency(settings: Settings, database_url: str, rate: int, seconds: int) -> tuple[float, float, int]:
    """Offer `rate` events/s for `seconds` to a windows worker; p50/p99 publish -> visible in SQL, probes missed."""
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
