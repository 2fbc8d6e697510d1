"""Memory of the windows worker over a long run (`--soak-events`): its RSS sampled as a large backlog drains.

Flat memory is the claim (docs/performance.md): the figure reported is the RSS at 10% of the
stream, at 50%, and the most from 10% to the end.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

from skillstats.config import Settings
from skillstats.kafka import end_offsets, ensure_topics
from skillstats.publisher import Publisher
from skillstats.sinks.db import open_engine
from skillstats.sinks.identity import WINDOWS, release
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.windows import WindowsSink
from skillstats.workload import generate

from .measure import log, rss_mb
from .workload import PARTITIONS


def soak(settings: Settings, database_url: str, events: int, skills: int) -> str:
    """Memory of the windows worker over a long run: RSS sampled as the backlog drains; one markdown line."""
    topic = f"bench-soak-{uuid.uuid4().hex[:8]}"
    soaked = settings.override(
        topic=topic, dlq_topic=f"{topic}.dlq", windows_group=f"{topic}-windows", database_url=database_url
    )
    ensure_topics(soaked, {topic: PARTITIONS, soaked.dlq_topic: 1})
    log(f"soak: preloading {events:,} events")
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
            samples.append((applied / total, rss_mb(worker.pid)))
            time.sleep(1.0)
    finally:
        worker.terminate()
        worker.wait(60)
    elapsed = time.monotonic() - started

    def at(share: float) -> float:
        return next((rss for done, rss in samples if done >= share), samples[-1][1])

    early, late = at(0.1), max(rss for done, rss in samples if done >= 0.1)
    log(f"soak: RSS {early:.0f} MiB at 10%, at most {late:.0f} MiB after")
    return (
        f"Memory over {total:,} events ({elapsed:.0f} s, {total / elapsed:,.0f} events/s): RSS {early:.0f} MiB "
        f"at 10% of the stream, {at(0.5):.0f} MiB at 50%, at most {late:.0f} MiB from 10% to the end "
        f"({(late - early) / early:+.0%})."
    )
