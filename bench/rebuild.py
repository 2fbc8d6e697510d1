"""Case k: `skillstats rebuild` beside the live worker (docs/performance.md, "Recompute").

Per database: a fresh topic holding N backfill events; the live windows worker
reads them alone from a cold start (its rate alone); N more events are
published, a rebuild of every day is started (it reads all 2N), and the rebuild
worker and the live worker (catching up the second N) start together: the
rebuild's rate beside the live worker, and the live worker's rate while a
rebuild runs, each timed from its first SQL progress to caught up. Then the
swap, timed as the command's wall time. Both workers are real processes, as
deployed; on this two-core machine they share the cores, which is the point.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping

from skillstats.config import Settings
from skillstats.kafka import end_offsets
from skillstats.sinks.db import open_engine
from skillstats.sinks.identity import WINDOWS, release
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.windows import WindowsSink

from .measure import Result, any_sql_progress, caught_up_sql, log, measure
from .run import preload
from .workload import WORKLOADS


def _cli(env: dict[str, str], *args: str) -> tuple[float, str]:
    """`skillstats ARGS` to completion: (wall seconds, stdout); a failure raises."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "skillstats.cli", *args], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"skillstats {' '.join(args)} failed ({done.returncode}): {done.stderr[-500:]}")
    return time.monotonic() - started, done.stdout


def _clear_generations(env: dict[str, str]) -> None:
    """A scratch database may hold an earlier run's rebuild or previous generation: gone first."""
    for extra in ((), ("--previous",)):
        subprocess.run(
            [sys.executable, "-m", "skillstats.cli", "rebuild", "drop", *extra, "--confirm", "DROP"],
            env=env,
            capture_output=True,
        )


def measure_one(settings: Settings, label: str, url: str, events: int, skills: int) -> tuple[list[Result], float]:
    """One database: (the three rows, the swap's wall seconds)."""
    run_id = uuid.uuid4().hex[:8]
    topic = f"bench-rebuild-{run_id}"
    live = settings.override(
        topic=topic, dlq_topic=f"{topic}.dlq", windows_group=f"bench-{run_id}-live", database_url=url
    )
    env = live.child_env(dict(os.environ))
    engine = open_engine(url)
    upgrade(engine)
    release(engine, WINDOWS)  # a new group and topic in the scratch database
    _clear_generations(env)
    workload = WORKLOADS["backfill"]
    preload(live, topic, events, skills, workload)
    # No metrics endpoint: two workers at once would both want the default port.
    worker = [sys.executable, "-m", "skillstats.cli", "windows", "--metrics-port", "0"]
    live_sink = WindowsSink(engine, live.windows_group, topic)
    alone = measure(
        f"k. live windows alone ({label})",
        worker,
        env,
        events,
        caught_up_sql(live_sink, end_offsets(live, topic)),
        any_sql_progress(live_sink),
    )
    preload(live, topic, events, skills, workload)
    ends = end_offsets(live, topic)
    _cli(env, "rebuild", "start", "--from-start")
    from skillstats.rebuild.state import building

    rebuild = building(engine)
    assert rebuild is not None
    rebuild_sink = WindowsSink(engine, rebuild.group_id, topic)
    live_fences = live_sink.fences()
    results: dict[str, Result] = {}

    def run(name: str, argv: list[str], sink: WindowsSink, count: int, progress: object) -> None:
        results[name] = measure(name, argv, env, count, caught_up_sql(sink, ends), progress)  # type: ignore[arg-type]

    def live_progress() -> bool:
        return live_sink.fences() != live_fences

    rebuild_name = f"k. rebuild worker beside the live worker ({label})"
    live_name = f"k. live windows while a rebuild runs ({label})"
    threads = [
        threading.Thread(
            target=run,
            args=(rebuild_name, [*worker, "--rebuild"], rebuild_sink, 2 * events, any_sql_progress(rebuild_sink)),
        ),
        threading.Thread(target=run, args=(live_name, worker, live_sink, events, live_progress)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # The live worker stopped with the others: a swap needs no running worker, and the fences are where they stand.
    swap_seconds, _out = _cli(env, "rebuild", "swap", "--confirm", "SWAP")
    _clear_generations(env)
    engine.dispose()
    log(f"k. swap ({label}): {swap_seconds:.1f}s")
    return [alone, results[rebuild_name], results[live_name]], swap_seconds


def bench_case(settings: Settings, databases: Mapping[str, str], events: int, skills: int) -> str:
    """The case's markdown: one row per measurement, the ratio to the live worker alone."""
    lines = [
        "### Recompute: `skillstats rebuild` beside the live worker (case k)",
        "",
        f"{events:,} backfill events read by the live worker alone; then {events:,} more, and a rebuild of every day "
        f"({2 * events:,} events) started together with the live worker catching up the second {events:,}: each timed "
        f"from its first SQL progress to caught up. The swap: `rebuild swap` wall time, the workers stopped.",
        "",
        "| run | events/s | ratio to the live worker alone | CPU s per million events | peak RSS | swap |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label, url in databases.items():
        rows, swap_seconds = measure_one(settings, label, url, events, skills)
        alone = rows[0].rate
        for index, r in enumerate(rows):
            ratio = f"{r.rate / alone:.2f}" if alone else "-"
            swap = f"{swap_seconds:.1f} s" if index == 1 else ""
            lines.append(
                f"| {r.name} | {r.rate:,.0f} | {ratio} | {r.cpu_per_million:.1f} | {r.peak_rss_mb:.0f} MiB | {swap} |"
            )
    return "\n".join(lines)
