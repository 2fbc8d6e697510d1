"""`skillstats status`: what an on-call engineer looks at first (skillstats/status.py)."""

from __future__ import annotations

import argparse

from skillstats.cli.common import EXIT_FAILED, EXIT_OK, database_options, kafka_options, verbosity
from skillstats.config import Settings


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "For the windows and docsync groups: records in the topic, records applied to SQL (below the fences), "
        "Kafka's committed offsets and the lag; who the database says writes each group's tables, from which "
        "topic (by its Kafka id), and whether that still holds; offsets lost to retention; what in the topic's "
        "configuration loses events; then the most recent docsync runs. Exit status 1 when a group would refuse "
        "to run (a fence ahead of its log, a recreated topic, a group the database does not know), else 0."
    )
    kafka_options(parser, dlq=True)
    database_options(parser)
    verbosity(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output, per partition")


def run(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.status import render, status

    report = status(settings)
    print(render(report, args.json))
    # Non-zero when a group would refuse to run (a fence ahead of its log, another group's or topic's
    # counts) or docsync holds a partition back (the database refuses its deltas): for on-call scripts and
    # probes. Lag alone is not an error.
    refused = any(group["fences_ahead"] or group["refused"] for group in report["groups"])
    return EXIT_FAILED if refused or report.get("docsync_held_back") else EXIT_OK
