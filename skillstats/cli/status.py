"""`skillstats status`: what an on-call engineer looks at first (skillstats/status.py)."""

from __future__ import annotations

import argparse

from skillstats.cli.common import EXIT_FAILED, EXIT_OK, database_options, kafka_options, verbosity
from skillstats.config import Settings


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "For the windows and docsync groups: offsets in the topic, offsets applied to SQL (below the fences), "
        "Kafka's committed offsets and the lag; who the database says writes each group's tables, from which "
        "topic (by its Kafka id), and whether that still holds; offsets lost to retention; what in the topic's "
        "configuration loses events; then the most recent docsync runs. When Kafka is unreachable, what the "
        "database says (fences and when they last moved, the windows tables, the docsync runs), with the reason "
        "on stderr. Exit status 1 when Kafka is unreachable, a group would refuse to run (a fence ahead of its "
        "log, a recreated topic, a group the database does not know) or docsync holds a partition back; 2 when "
        "the topic or the database does not exist; else 0."
    )
    kafka_options(parser, dlq=True)
    database_options(parser)
    verbosity(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output, per partition")


def run(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.status import render, status

    report, unreachable = status(settings)
    print(render(report, args.json), flush=True)
    if unreachable is not None:
        # What the database says is printed; the reason is one line on stderr, exit 1 (cli/__init__.py).
        raise unreachable
    # Non-zero when a group would refuse to run (a fence ahead of its log, another group's or topic's
    # counts) or docsync holds a partition back (the database refuses its deltas): for on-call scripts and
    # probes. Lag alone is not an error.
    refused = any(group["fences_ahead"] or group["refused"] for group in report["groups"])
    return EXIT_FAILED if refused or report.get("docsync_held_back") else EXIT_OK
