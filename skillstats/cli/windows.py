"""`skillstats windows`: the per-day and per-hour worker (streams/windows.py)."""

from __future__ import annotations

import argparse
import os

from skillstats.cli.common import (
    EXIT_OK,
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
        "Run the consumer group that keeps skill_daily_stats and skill_hourly_stats exact, seconds behind the "
        "stream, reading every partition from its SQL fence. Runs until SIGTERM or SIGINT. Until Kafka and the "
        "database answer it waits (/readyz 503 meanwhile); cut off from Kafka later (no fetch answered for 10 s) "
        "it says so once, /readyz 503 and skillstats_kafka_unreachable 1 until Kafka answers, and reads on from "
        "its fences; a topic that does not exist, a database whose counts belong to another group or topic, or a "
        "fence past its log end exit 2 with what to do."
    )
    kafka_options(parser, dlq=True)
    database_options(parser)
    verbosity(parser)
    metrics_options(parser, "windows")
    parser.add_argument("--group", help="consumer group id [SKILLSTATS_WINDOWS_GROUP] (default skillstats-windows)")
    parser.add_argument(
        "--rebuild",
        action="store_true",
        help="fill the building rebuild's shadow tables instead, under the rebuild's own group (`skillstats rebuild "
        "start` first); it stops (exit 2) once the rebuild is swapped in or dropped",
    )
    parser.add_argument(
        "--instance-id",
        default=os.environ.get("SKILLSTATS_INSTANCE_ID"),
        help="static group membership id, stable across restarts, e.g. the pod name [SKILLSTATS_INSTANCE_ID]",
    )
    parser.add_argument(
        "--batch-size",
        type=positive,
        default=50_000,
        help="most records per SQL transaction (default 50000); records fetched while one "
        "transaction runs form the next, so batches are small when the stream is quiet",
    )
    parser.add_argument(
        "--fetch-size", type=positive, default=10_000, help="most records per fetch from Kafka (default 10000)"
    )
    parser.add_argument(
        "--partition-fetch-mib",
        type=positive,
        default=4,
        help="most MiB one fetch brings per partition (default 4); the worker may hold this much compressed data "
        "per partition it owns, and below 4 it waits on the broker more (docs/performance.md)",
    )
    shutdown_option(parser)
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="info (default): the start, assignments, rebalances; debug: every batch too",
    )


def run(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.streams.windows import run as run_worker

    rebuild = _building_rebuild(settings) if args.rebuild else None
    run_worker(
        settings,
        log_level=args.log_level,
        batch_size=args.batch_size,
        fetch_size=args.fetch_size,
        partition_fetch_mib=args.partition_fetch_mib,
        instance_id=args.instance_id,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        shutdown_budget=budget(args.shutdown_budget),
        rebuild=rebuild,
    )
    return EXIT_OK


def _building_rebuild(settings: Settings) -> object:
    """The rebuild a `--rebuild` worker fills (IdentityMismatch, exit 2: none is building)."""
    from skillstats.rebuild.state import building
    from skillstats.sinks.db import open_engine
    from skillstats.sinks.identity import IdentityMismatch
    from skillstats.sinks.migrate import require_current

    engine = open_engine(settings.database_url)
    try:
        require_current(engine)
        found = building(engine)
    finally:
        engine.dispose()
    if found is None:
        raise IdentityMismatch("no rebuild is building in this database: `skillstats rebuild start` first")
    if found.topic != settings.topic:
        raise IdentityMismatch(
            f"the building rebuild reads topic {found.topic!r}, and this worker is set to read {settings.topic!r}"
        )
    return found
