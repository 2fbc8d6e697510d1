"""`skillstats bench`: throughput, memory and latency of each consumer (bench/, docs/performance.md)."""

from __future__ import annotations

import argparse

from skillstats.cli.common import UsageError, database_options, kafka_options, verbosity
from skillstats.config import Settings


def configure(parser: argparse.ArgumentParser) -> None:
    from skillstats_bench import add_arguments

    parser.description = (
        "For each workload (steady, backfill), preload a fresh topic and measure, in one run, each consumer from a "
        "cold start to caught up: (a) a bare confluent-kafka loop, the ceiling; (b) the loop plus decoding; (c) "
        "skillstats windows and (d) a docsync drain, on SQLite and PostgreSQL; (e) a naive faust agent updating a "
        "windowed Table per event; (f) Kafka's own kafka-consumer-perf-test; (g) the windows sink behind a "
        "confluent-kafka loop; (h) two windows workers in one group. Each row gives events/s, the ratio to (a), "
        "CPU seconds per million events (process start to exit, and from the first record to caught up) and SQL "
        "rows upserted/s. Then publish-to-SQL latency at a steady offered load, (i) skillstats ingest beside the "
        "direct publisher, and (j) skillstats legacy import of a synthetic Convex export (events/s, peak RSS). See "
        "docs/performance.md."
    )
    kafka_options(parser, dlq=True)
    database_options(parser)
    verbosity(parser)
    add_arguments(parser)


def run(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats_bench import main_from_cli, workload_names

    try:
        workload_names(args.workload)
    except ValueError as exc:
        raise UsageError(f"--workload: {exc}") from None
    return main_from_cli(args, settings)
