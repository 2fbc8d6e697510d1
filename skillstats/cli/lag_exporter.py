"""`skillstats lag-exporter`: both groups' lag in records and seconds, served to Prometheus (skillstats/lag.py)."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import Any

from skillstats.cli.common import EXIT_OK, UsageError, database_options, kafka_options, metrics_options, verbosity
from skillstats.config import Settings


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Measure, every --interval seconds, for the windows and docsync groups and every partition: committed "
        "offset, SQL fence, log end offset, lag in records, and lag in seconds as the age of the oldest record not "
        "yet applied (that record is read, its timestamp taken); the groups' state and members; the DLQ's size; "
        "the last successful docsync run, offsets lost to retention and whether the topic is still the one the "
        "counts belong to (from SQL). Serves the last measurement on /metrics until SIGTERM, and keeps serving "
        "while Kafka is unreachable, with skillstats_lag_exporter_up 0. The groups are SKILLSTATS_WINDOWS_GROUP "
        "and SKILLSTATS_DOCSYNC_GROUP (defaults skillstats-windows, skillstats-docsync)."
    )
    kafka_options(parser, dlq=True)
    database_options(parser)
    verbosity(parser)
    metrics_options(parser, "lag-exporter")
    parser.add_argument("--interval", type=float, default=15.0, help="seconds between measurements (default 15)")
    parser.add_argument(
        "--timeout", type=float, default=10.0, help="bound on each Kafka request, in seconds (default 10)"
    )


def run(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.lag import LagExporter
    from skillstats.metrics import REGISTRY, Probes, serve
    from skillstats.sinks.db import open_engine, sqlite_path

    if args.interval <= 0 or args.timeout <= 0:
        raise UsageError("--interval and --timeout must be positive")
    if not args.metrics_port:
        raise UsageError("the lag-exporter only serves metrics: give it a --metrics-port")
    path = sqlite_path(settings.database_url)

    def open_database() -> Any:
        # The exporter never creates a database: until there is one it serves Kafka's view only.
        if path is not None and not path.exists():
            raise FileNotFoundError(f"no SQLite database at {path} yet")
        return open_engine(settings.database_url)

    exporter = LagExporter(settings, interval=args.interval, timeout=args.timeout, open_database=open_database)
    REGISTRY.register(exporter)
    server = serve(args.metrics_host, args.metrics_port, Probes(exporter.live, exporter.live), REGISTRY)
    refuse_early(settings, "lag-exporter")  # after the port: a taken port is said at once
    exporter.start()
    print(
        f"skillstats lag-exporter: measuring {settings.windows_group} and {settings.docsync_group} on "
        f"{settings.topic} every {args.interval:g}s; serving http://{args.metrics_host}:{server.port}/metrics",
        flush=True,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    exporter.close()
    server.close()
    return EXIT_OK


def refuse_early(settings: Settings, command: str) -> None:
    """Stop a long-running command at once when Kafka refuses its credentials or TLS.

    A broker that is merely away is not an error here: the exporter keeps trying
    (Kubernetes may start it before Kafka). A refusal is different: no retry
    cures it, and faust's client would otherwise retry it silently for ever.
    """
    from skillstats.kafka import KafkaRefused, KafkaUnreachable, list_topic_names

    try:
        list_topic_names(settings, timeout=15)
    except KafkaRefused:
        raise
    except KafkaUnreachable as exc:
        logging.getLogger("skillstats").warning("%s: %s; starting anyway, it keeps trying", command, exc)
