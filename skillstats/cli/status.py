"""`skillstats status`: what an on-call engineer looks at first (skillstats/status.py)."""

from __future__ import annotations

import argparse

from skillstats.cli.common import EXIT_OK, database_options, kafka_options, verbosity
from skillstats.config import Settings


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "For the windows and docsync groups: records in the topic, records applied to SQL (below the fences), "
        "Kafka's committed offsets and the lag; who the database says writes each group's tables, from which "
        "topic (by its Kafka id), and whether that still holds; offsets lost to retention; what in the topic's "
        "configuration loses events; then the most recent docsync runs."
    )
    kafka_options(parser, dlq=True)
    database_options(parser)
    verbosity(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output, per partition")


def run(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.status import render, status

    print(render(status(settings), args.json))
    return EXIT_OK
