"""The workloads each consumer is measured on: what the preloaded topic's events look like.

They differ in what the same number of events costs in SQL: near-now events fold into a few
hundred (skill, hour) rows per batch, a backfill's into nearly one row per event, so rows/s is
reported beside events/s. Definitions only (the CLI's help lists them without loading Kafka or
SQL); bench/run.py preloads them.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def workload_names(text: str) -> list[str]:
    """The workloads named in `--workload`, checked: ValueError names what is wrong."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise ValueError(f"unknown workload {', '.join(unknown) or repr(text)}; choose from {', '.join(WORKLOADS)}")
    return list(dict.fromkeys(names))
