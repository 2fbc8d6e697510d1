"""What the commands share: exit statuses, the usage error, option groups, value types, the settings."""

from __future__ import annotations

import argparse
import os
from datetime import datetime
from pathlib import Path

from skillstats.config import Settings, redact_url
from skillstats.metrics import METRICS_HOST

# The exit statuses every command shares (docs/operations.md, 'Exit statuses', lists them and
# tests/test_cli_usage.py walks that table); 3, a shutdown past its budget, is skillstats.shutdown's.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """Bad input from the user, or a setting that cannot work: reported on stderr, exit status 2."""


def kafka_options(parser: argparse.ArgumentParser, *, dlq: bool = False) -> None:
    group = parser.add_argument_group("Kafka (flags override the SKILLSTATS_* environment)")
    group.add_argument("--bootstrap", metavar="HOST:PORT", help="Kafka bootstrap servers [SKILLSTATS_KAFKA_BOOTSTRAP]")
    group.add_argument("--topic", help="stat events topic [SKILLSTATS_TOPIC]")
    if dlq:
        group.add_argument("--dlq-topic", help="dead-letter topic [SKILLSTATS_DLQ_TOPIC]")


def database_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("database (the flag overrides the environment)")
    group.add_argument(
        "--database-url",
        metavar="URL",
        help="postgresql://user:pass@host/db, or sqlite:////abs/path.db (four slashes; three make the path "
        "relative) [SKILLSTATS_DATABASE_URL]",
    )


def verbosity(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")


# Default metrics ports, one per long-running command, so they can share a host.
METRICS_PORTS = {"windows": 9310, "lag-exporter": 9311, "docsync": 9312}


def metrics_options(parser: argparse.ArgumentParser, command: str) -> None:
    group = parser.add_argument_group("metrics and health probes (GET /metrics, /healthz, /readyz)")
    group.add_argument(
        "--metrics-port",
        type=port,
        # A string default goes through `type` too: a bad SKILLSTATS_METRICS_PORT is a usage error.
        default=os.environ.get("SKILLSTATS_METRICS_PORT", str(METRICS_PORTS[command])),
        metavar="PORT",
        help=f"HTTP port; 0 serves nothing [SKILLSTATS_METRICS_PORT] (default {METRICS_PORTS[command]})",
    )
    group.add_argument(
        "--metrics-host",
        default=os.environ.get("SKILLSTATS_METRICS_HOST", METRICS_HOST),
        metavar="ADDRESS",
        help="address to listen on [SKILLSTATS_METRICS_HOST] (default 0.0.0.0, every interface)",
    )


def shutdown_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shutdown-budget",
        type=float,
        default=os.environ.get("SKILLSTATS_SHUTDOWN_BUDGET", "10"),  # a string default goes through `type`
        metavar="SECONDS",
        help="on SIGTERM: finish or abandon the work in flight, commit and leave within this; past it, exit 3 "
        "with a message [SKILLSTATS_SHUTDOWN_BUDGET] (default 10)",
    )


def budget(seconds: float) -> float:
    if not 0 < seconds < 3600:
        raise UsageError(f"--shutdown-budget must be between 0 and 3600 seconds, not {seconds:g}")
    return seconds


def settings(args: argparse.Namespace) -> Settings:
    """The environment's settings, overridden by the flags this command has."""
    group = getattr(args, "group", None)
    return Settings.from_env().override(
        kafka_bootstrap=getattr(args, "bootstrap", None),
        database_url=getattr(args, "database_url", None),
        topic=getattr(args, "topic", None),
        dlq_topic=getattr(args, "dlq_topic", None),
        windows_group=group if args.command == "windows" else None,
        docsync_group=group if args.command == "docsync" else None,
    )


# ---------------------------------------------------------------------- value types


def parse_time_ms(text: str) -> int:
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not epoch milliseconds or ISO-8601: {text!r}") from exc
    if parsed.tzinfo is None:
        raise argparse.ArgumentTypeError(f"give a timezone (e.g. a trailing Z for UTC): {text!r}")
    return int(parsed.timestamp() * 1000)


def port(text: str) -> int:
    if not text.strip().isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port (0-65535; 0 serves nothing): {text!r}")
    return int(text)


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def counted_topics(settings: Settings) -> dict[str, list[str]]:
    """The topics this database's consumers count (sinks/identity.py), for a hint about a missing or misspelt
    topic; empty when the database cannot be read (a SQLite file that is not there is not created)."""
    from sqlalchemy.engine import make_url

    from skillstats.sinks.db import open_engine
    from skillstats.sinks.identity import counted_topics as recorded

    try:
        url = make_url(settings.database_url)
        if url.get_backend_name() == "sqlite" and not (url.database and Path(url.database).is_file()):
            return {}
        engine = open_engine(settings.database_url)
        try:
            return recorded(engine)
        finally:
            engine.dispose()
    except Exception:  # only a hint: the command's own error stands
        return {}


def topic_hint(settings: Settings, wanted: str) -> str:
    """What the database says about `wanted` when it is not a topic it counts ('' when it says nothing)."""
    topics = counted_topics(settings)
    if not topics or wanted in topics:
        return ""
    named = "; ".join(f"{topic!r} ({', '.join(roles)})" for topic, roles in sorted(topics.items()))
    return f" The database {redact_url(settings.database_url)} counts topic {named}, not {wanted!r}."
