"""`skillstats docsync`: the bounded drain into the skills stat columns and user_skill_stats (streams/docsync.py)."""

from __future__ import annotations

import argparse

from skillstats.cli.common import (
    UsageError,
    budget,
    database_options,
    kafka_options,
    metrics_options,
    positive,
    shutdown_option,
    verbosity,
)
from skillstats.config import Settings


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run the consumer group that keeps the skills stat columns and user_skill_stats exact. By default one "
        "bounded drain, then exit (fit for a Kubernetes CronJob): snapshot the end offsets, read each partition "
        "from its SQL fence up to them (or to --max-events / --max-seconds), apply each skill's deltas once, "
        "print a summary. Exit status 0 unless the drain failed (1; also when the database refused a "
        "partition's deltas: that partition is held back at its fence, every other one is applied, and the "
        "summary, the run row and `skillstats status` name it), or was refused (2: no such topic, a "
        "database whose counts belong to another group or topic, a fence past its log end, an empty `skills` "
        "table without --allow-empty-registry). With --every, "
        "drain on that cadence until SIGTERM, serving metrics (a single drain serves none: the lag-exporter "
        "reports the last successful run)."
    )
    kafka_options(parser)
    database_options(parser)
    verbosity(parser)
    metrics_options(parser, "docsync")
    parser.add_argument("--group", help="consumer group id [SKILLSTATS_DOCSYNC_GROUP] (default skillstats-docsync)")
    parser.add_argument(
        "--every", metavar="INTERVAL", help="drain repeatedly; a number with a unit: 30s, 15m, 6h, 1d (default: once)"
    )
    parser.add_argument("--max-events", type=positive, help="stop reading after this many records")
    parser.add_argument("--max-seconds", type=float, help="stop reading after this many seconds")
    parser.add_argument(
        "--chunk-partitions",
        type=positive,
        default=4,
        help="partitions per SQL transaction (default 4; halved on database errors)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object per drain")
    parser.add_argument(
        "--allow-empty-registry",
        action="store_true",
        help="drain even when the `skills` table has no rows (every event read is then skipped for good, as a "
        "deleted skill's); without it such a drain is refused, exit 2, nothing read: create the registry's rows "
        "first",
    )
    shutdown_option(parser)


def run(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.streams.docsync import DrainBudget, DrainSummary, parse_interval, run

    try:
        every = parse_interval(args.every) if args.every else None
    except ValueError as exc:
        raise UsageError(str(exc)) from exc

    def emit(summary: DrainSummary) -> None:
        print(summary.to_json() if args.json else summary.describe(), flush=True)

    limits = DrainBudget(
        max_events=args.max_events, max_seconds=args.max_seconds, chunk_partitions=args.chunk_partitions
    )
    return run(
        settings,
        limits,
        every=every,
        emit=emit,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        shutdown_budget=budget(args.shutdown_budget),
        allow_empty_registry=args.allow_empty_registry,
    )
