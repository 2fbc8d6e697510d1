"""The `skillstats` command line (README, operations): one module per command, imported only when it runs.

`COMMANDS` maps each command to its module and its one-line summary; the top
level lists them from there (a bare `skillstats` too), and only the chosen
command's module is imported and asked for its options (`configure`) and its
work (`run`). Options shared by several commands live in `common`.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from skillstats import __version__
from skillstats.cli.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    settings,
    topic_hint,
)

# name -> (module under skillstats.cli, one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "init": ("init", "create the topics and the SQL schema (idempotent)"),
    "publish": ("publish", "publish one event, or a JSONL file of events"),
    "ingest": ("ingest", "serve POST /v1/events: publish events sent over HTTP (for services without Kafka)"),
    "windows": ("windows", "run the per-day/per-hour worker (faust app)"),
    "docsync": ("docsync", "apply skill and owner stat deltas (one bounded drain, or --every)"),
    "status": ("status", "how far each consumer group is; the last docsync runs"),
    "fences": ("fences", "show, reset or hand over a group's SQL fences (the way out of a refusal)"),
    "dlq": ("dlq", "inspect and replay the dead-letter topic"),
    "top": ("top", "the most downloaded or installed skills of the last days"),
    "prune": ("prune", "delete old events every required group has read (dry run unless --apply)"),
    "lag-exporter": ("lag_exporter", "serve both groups' lag (records and seconds) to Prometheus; always on"),
    "bench": ("bench", "measure throughput, memory and latency of each consumer"),
    "legacy": ("legacy", "move in from the legacy system: plan and import a Convex export, exactly once"),
    "rebuild": ("rebuild", "recompute the windows tables from the log beside the live ones, then swap them in"),
}


def _module(name: str) -> object:
    return importlib.import_module(f"skillstats.cli.{COMMANDS[name][0]}")


class _Parser(argparse.ArgumentParser):
    """A usage error in one line that names the way to the options, not argparse's whole usage block."""

    command: str | None = None  # on the top level: the command argv names, whose help the hint points to

    def error(self, message: str) -> NoReturn:
        prog = f"{self.prog} {self.command}" if self.command else self.prog
        self.exit(EXIT_USAGE, f"{prog}: {message} ({prog} --help lists the options)\n")


def build_parser(only: str | None = None) -> _Parser:
    """The whole command line; with `only`, just that command's options are built (the others are listed)."""
    parser = _Parser(
        prog="skillstats",
        description="Exact per-skill, per-day and per-hour stat counters in SQL, from a Kafka topic of stat events.",
        epilog="Each command has its own --help. Configuration: SKILLSTATS_* environment variables, see README.",
    )
    parser.add_argument("--version", action="version", version=f"skillstats {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    for name, (_module_name, summary) in COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=summary)
        if only is None or only == name:
            _module(name).configure(sub)  # type: ignore[attr-defined]
    return parser


def operator_errors() -> tuple[type[Exception], ...]:
    """What exits 2 from any command, in one line: a setting to fix or an operator's decision, which running
    again does not cure (docs/operations.md, 'Exit statuses'). Anything else a command raises is a failure,
    exit 1. Imported when a command runs (SQLAlchemy, librdkafka), never for --help."""
    from skillstats.kafka import TopicMissing
    from skillstats.metrics import PortUnavailable
    from skillstats.sinks.db import DatabaseUrlError
    from skillstats.sinks.fences import FenceAheadOfLog
    from skillstats.sinks.identity import IdentityMismatch
    from skillstats.sinks.migrate import MigrationRefused, SchemaOutdated

    return (
        UsageError,
        PortUnavailable,
        TopicMissing,
        IdentityMismatch,
        FenceAheadOfLog,
        SchemaOutdated,
        MigrationRefused,
        DatabaseUrlError,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is not None and command not in COMMANDS:
        near = difflib.get_close_matches(command, COMMANDS, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        print(f"skillstats: no command {command!r}{hint} (skillstats --help lists them)", file=sys.stderr)
        return EXIT_USAGE
    # Without a command (`skillstats`, `skillstats --help`) no command's module is imported: the list is enough.
    parser = build_parser(command or "")
    parser.command = command
    if not argv:
        parser.print_help()
        return EXIT_OK
    args = parser.parse_args(argv)
    from skillstats.config import LIBRDKAFKA_LOG, MaskSecrets, SettingsError, mask

    logging.basicConfig(
        level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(getattr(args, "verbose", 0), 2)],
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    LIBRDKAFKA_LOG.setLevel(logging.CRITICAL if getattr(args, "verbose", 0) == 0 else logging.DEBUG)
    try:
        configured = settings(args)
    except SettingsError as exc:
        parser.exit(EXIT_USAGE, f"skillstats {args.command}: {exc}\n")
    secrets = configured.secrets()
    masking = MaskSecrets(secrets)
    for handler in logging.getLogger().handlers:
        handler.addFilter(masking)
    from skillstats.kafka import TopicMissing

    try:
        return int(_module(args.command).run(args, configured))  # type: ignore[attr-defined]
    except operator_errors() as exc:
        # A setting to fix or an operator's decision to make: the message says which. A missing events topic
        # also says which topic the database counts: the likely typo, and never a hint to create the misspelt
        # one (the DLQ topic is not one the database counts: no hint).
        missing = isinstance(exc, TopicMissing) and exc.topic == configured.topic
        hint = topic_hint(configured, exc.topic) if missing else ""
        parser.exit(EXIT_USAGE, mask(f"skillstats {args.command}: {exc}{hint}\n", secrets))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`skillstats status | head`): nothing is wrong, nothing more to say.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:
        logging.getLogger("skillstats").debug("failed", exc_info=True)
        print(mask(f"skillstats {args.command}: {type(exc).__name__}: {exc}", secrets), file=sys.stderr)
        return EXIT_FAILED
