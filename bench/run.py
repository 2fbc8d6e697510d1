"""One run of the benchmark: each workload preloaded into a fresh topic, then each case in order.

Cases (docs/performance.md): (a) the bare confluent-kafka loop and (b) with decoding, the ceiling;
(c) `skillstats windows` and (h) two of them in one group, on each database; (g) the windows sink
behind a confluent-kafka loop; (d) a docsync drain; then, on the first workload only, (e) the naive
faust agent and (f) kafka-consumer-perf-test; then the latency part, (i) HTTP ingest
(bench/ingest.py), (j) the legacy import (bench/legacy_import.py) and (k) a rebuild beside the live
worker (bench/rebuild.py). Every case uses a new
consumer group and topic in the scratch databases.
"""

from __future__ import annotations

import os
import sys
import time
import uuid

from skillstats.config import Settings
from skillstats.kafka import committed_offsets, end_offsets, ensure_topics
from skillstats.publisher import Publisher
from skillstats.sinks.db import open_engine
from skillstats.sinks.identity import WINDOWS, release
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.windows import WindowsSink
from skillstats.workload import generate

from .latency import latency as measure_latency
from .measure import (
    Result,
    any_sql_progress,
    caught_up_sql,
    free_port,
    kafka_perf_test,
    log,
    measure,
    measure_docsync,
    prefix_offsets,
    scraped_rows,
)
from .report import WorkloadRun, report
from .workload import PARTITIONS, WORKLOADS, Workload


def preload(settings: Settings, topic: str, events: int, skills: int, workload: Workload) -> float:
    """A fresh topic holding `events` of the workload; returns the publish rate."""
    ensure_topics(settings, {topic: PARTITIONS, f"{topic}.dlq": 1})
    log(f"{workload.name}: preloading {events:,} events ({skills:,} skills) into {topic}")
    started = time.monotonic()
    now_ms = int(time.time() * 1000)
    with Publisher(settings, flush_timeout=300) as publisher:
        for record in generate(
            events, now_ms=now_ms, skills=skills, seed=42, days=workload.days, late_ratio=workload.late_ratio
        ):
            publisher.send_raw(record.key, record.value)
    rate = events / (time.monotonic() - started)
    log(f"{workload.name}: preloaded at {rate:,.0f} events/s")
    return rate


# The cases that read or write Kafka: with all of them skipped no workload is preloaded (case j alone needs no broker).
KAFKA_CASES = frozenset(
    ("bare", "decode", "windows", "two-workers", "librdkafka-sink", "docsync", "naive", "perftest", "latency", "ingest")
)


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
    import_events: int = 200_000,
    rebuild_events: int = 200_000,
) -> str:
    """Every case not in `skip`; the markdown report."""
    parts = []
    if not skip >= KAFKA_CASES:
        parts.append(
            _kafka_cases(
                settings,
                events=events,
                skills=skills,
                databases=databases,
                skip=skip,
                latency_rate=latency_rate,
                latency_seconds=latency_seconds,
                naive_events=naive_events,
                workloads=workloads,
                ingest_rate=ingest_rate,
                ingest_seconds=ingest_seconds,
            )
        )
    if "legacy" not in skip and import_events:
        from .legacy_import import bench_case as measure_legacy_import

        log(f"j. skillstats legacy import of a {import_events:,}-event export")
        parts.append(measure_legacy_import(databases, import_events, skills))
    if "rebuild" not in skip and rebuild_events:
        from .rebuild import bench_case as measure_rebuild

        log(f"k. skillstats rebuild of {2 * rebuild_events:,} events beside the live worker")
        parts.append(measure_rebuild(settings, databases, rebuild_events, skills))
    return "\n\n".join(parts)


def _kafka_cases(
    settings: Settings,
    *,
    events: int,
    skills: int,
    databases: dict[str, str],
    skip: set[str],
    latency_rate: int,
    latency_seconds: int,
    naive_events: int,
    workloads: list[Workload] | None,
    ingest_rate: int,
    ingest_seconds: int,
) -> str:
    """Cases a to i: each workload preloaded, each consumer measured, then latency and HTTP ingest."""
    run_id = uuid.uuid4().hex[:8]
    env = dict(os.environ)
    python = sys.executable
    runs: list[WorkloadRun] = []

    def group() -> str:
        return f"bench-{run_id}-{uuid.uuid4().hex[:6]}"

    for workload in workloads or list(WORKLOADS.values()):
        topic = f"bench-{run_id}-{workload.name}"
        bench = settings.override(topic=topic, dlq_topic=f"{topic}.dlq")
        publish_rate = preload(bench, topic, events, skills, workload)
        ends = end_offsets(bench, topic)
        results: list[Result] = []
        runs.append(WorkloadRun(workload, topic, publish_rate, results))
        for role, name in (("bare", "a. bare confluent-kafka loop"), ("decode", "b. loop + decode/validate")):
            if role not in skip:
                argv = [python, "-m", "skillstats_bench", role, bench.kafka_bootstrap, topic, group(), str(events)]
                results.append(measure(f"{name}", argv, env, events, None))
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
                    if (port := free_port()) not in ports:
                        ports.append(port)
                worker = [python, "-m", "skillstats.cli", "windows", "--metrics-host", "127.0.0.1"]
                name = f"c. skillstats windows ({label})" if workers == 1 else f"h. two windows workers ({label})"
                results.append(
                    measure(
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
                        caught_up_sql(sink, ends),
                        any_sql_progress(sink),
                        note="" if workers == 1 else "one group, the partitions split between two processes",
                        rows=scraped_rows(ports, events),
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
                measure(
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
                    caught_up_sql(sink, ends),
                    any_sql_progress(sink),
                    note="a prototype, not the product: the windows sink behind a confluent-kafka fetch",
                )
            )
        if "docsync" not in skip:
            for label, url in databases.items():
                results.append(measure_docsync(f"d. skillstats docsync drain ({label})", bench, url, group(), events))
    first = runs[0]
    bench = settings.override(topic=first.topic, dlq_topic=f"{first.topic}.dlq")
    if "naive" not in skip:
        # At a few thousand events/s the textbook agent would take many minutes over the
        # whole topic; its steady rate is the same over a prefix, so it reads one.
        naive_group = group()
        naive_n = min(naive_events, events)
        wanted = prefix_offsets(bench, first.topic, naive_n)

        def naive_done() -> bool:
            committed = committed_offsets(bench, naive_group, first.topic)
            return all(committed.get(p, 0) >= n for p, n in wanted.items())

        first.results.append(
            measure(
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
        perf = kafka_perf_test(bench, first.topic, events)
        if perf:
            first.results.append(perf)
    latency = None
    if latency_seconds and "latency" not in skip and databases:
        label, url = next(reversed(databases.items()))
        log(f"latency: {latency_rate:,} events/s for {latency_seconds}s into windows ({label})")
        latency = (label, *measure_latency(settings, url, latency_rate, latency_seconds))
    table = report(runs, events, skills, latency, latency_rate, latency_seconds)
    if "ingest" not in skip:
        from .ingest import measure as measure_ingest

        log("i. skillstats ingest beside the direct publisher")
        table += "\n\n" + measure_ingest(settings, min(events, 400_000), rate=ingest_rate, seconds=ingest_seconds)
    return table
