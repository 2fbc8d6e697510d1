"""The markdown the bench prints (and `--output` writes): a table per workload, then the latency line.

docs/performance.md's Results are this output pasted; tests/test_bench.py reads it back, so a
column's name is part of what the tests check.
"""

from __future__ import annotations

from dataclasses import dataclass

from .measure import Result
from .workload import PARTITIONS, Workload


@dataclass
class WorkloadRun:
    workload: Workload
    topic: str
    publish_rate: float
    results: list[Result]


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
            "| consumer | events/s (steady) | ratio to (a) | CPU s per million events | CPU s per million, steady "
            "| SQL rows upserted/s | wall, cold start to caught up | peak RSS | note |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for r in results:
            ratio = f"{r.rate / ceiling:.2f}" if ceiling else "-"
            rows_rate = "-" if r.rows_rate is None else f"{r.rows_rate:,.0f}"
            cpu = f"{r.cpu_per_million:.1f}" if r.cpu_seconds else "-"
            steady_cpu = "-" if r.steady_cpu_per_million is None else f"{r.steady_cpu_per_million:.1f}"
            lines.append(
                f"| {r.name} | {r.rate:,.0f} | {ratio} | {cpu} | {steady_cpu} | {rows_rate} | {r.wall_seconds:.1f} s "
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
