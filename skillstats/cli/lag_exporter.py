"""`skillstats lag-exporter`: both groups' lag in records and seconds, served to Prometheus (skillstats/lag.py)."""

from __future__ import annotations

import argparse
import signal
from typing import Any

from skillstats.cli.common import EXIT_OK, UsageError, database_options, kafka_options, metrics_options, verbosity
from skillstats.config import Settings


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Measure, every --interval seconds, for the windows and docsync groups and every partition: committed "
        "offset, SQL fence, log end offset, lag in records, and lag in seconds as the age of the oldest record not "
        "yet applied (that record is read, its timestamp taken); the groups' state and members; the DLQ's size; "
        "the last successful docsync run, offsets lost to retention and whether the topic is still the one the "
        "counts belong to (from SQL). Serves at once, the last measurement on /metrics until SIGTERM, and keeps "
        "serving while Kafka is unreachable (at start too), with skillstats_lag_exporter_up 0; credentials Kafka "
        "refuses exit 1. The groups are SKILLSTATS_WINDOWS_GROUP "
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
    """Serve at once, measure at once: the port, the probes and the database's view do not wait for Kafka.

    A broker that is away (Kubernetes may start the exporter before Kafka) is served as
    skillstats_lag_exporter_up 0 and said once; credentials or TLS Kafka refuses stop the
    command (exit 1) at the first measurement that meets them, within seconds.
    """
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
    signal.signal(signal.SIGTERM, lambda *_: exporter.stop.set())
    signal.signal(signal.SIGINT, lambda *_: exporter.stop.set())
    exporter.start()
    print(
        f"skillstats lag-exporter: measuring {settings.windows_group} and {settings.docsync_group} on "
        f"{settings.topic} at {settings.kafka_bootstrap} every {args.interval:g}s; serving "
        f"http://{args.metrics_host}:{server.port}/metrics",
        flush=True,
    )
    exporter.stop.wait()
    exporter.close()
    server.close()
    if exporter.refusal is not None:
        raise exporter.refusal
    return EXIT_OK
