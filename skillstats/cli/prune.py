"""`skillstats prune`: delete old events every required group has read, never above a fence (skillstats/prune.py)."""

from __future__ import annotations

import argparse
import sys

from skillstats.cli.common import EXIT_FAILED, EXIT_OK, UsageError, database_options, kafka_options, positive, verbosity
from skillstats.config import Settings


def _retention_days(text: str) -> int:
    from skillstats.prune import MAX_RETENTION_DAYS, MIN_RETENTION_DAYS

    if not text.strip().isdigit() or not MIN_RETENTION_DAYS <= int(text) <= MAX_RETENTION_DAYS:
        raise argparse.ArgumentTypeError(f"days from {MIN_RETENTION_DAYS} to {MAX_RETENTION_DAYS}, not {text!r}")
    return int(text)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Per partition of the events topic, delete the records older than --retention-days AND below the "
        "committed offset of every required group (never above that group's SQL fence): Kafka's time retention "
        "alone can delete records a lagging group has not read; prune cannot. A partition where a required group "
        "has no committed offset is left alone (not ready); an empty one says 'empty: no records'. Prints, per "
        "partition, the log start (low watermark), the cutoff, the offsets below it and what set it. A dry run "
        "unless --apply --confirm PRUNE_SKILL_STAT_EVENTS. With --hourly-days, also deletes the skill_hourly_stats "
        "rows of hours that ended more than N days ago, a few thousand rows per transaction."
    )
    kafka_options(parser)
    database_options(parser)
    verbosity(parser)
    parser.add_argument(
        "--retention-days",
        type=_retention_days,
        default=7,
        metavar="N",
        help="keep records newer than N days (1-90, default 7)",
    )
    parser.add_argument(
        "--require-groups",
        metavar="GROUP[,GROUP...]",
        help="consumer groups that must have committed past a record before it goes, comma-separated "
        "(default: the windows and docsync groups, SKILLSTATS_WINDOWS_GROUP and SKILLSTATS_DOCSYNC_GROUP)",
    )
    parser.add_argument(
        "--hourly-days",
        type=positive,
        metavar="N",
        help="also delete skill_hourly_stats rows older than N days (default: keep them all)",
    )
    parser.add_argument("--apply", action="store_true", help="really delete (needs --confirm)")
    parser.add_argument("--confirm", metavar="TOKEN", help="PRUNE_SKILL_STAT_EVENTS, with --apply")
    parser.add_argument("--json", action="store_true", help="machine-readable output, per partition")
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="bound on each Kafka request, in seconds (default 30)"
    )


def run(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.kafka import partition_count
    from skillstats.prune import CONFIRM_TOKEN, apply, count_hourly, delete_hourly, plan, render
    from skillstats.sinks.db import open_engine
    from skillstats.sinks.migrate import require_current

    if args.confirm is not None and not args.apply:
        raise UsageError(f"--confirm goes with --apply: --apply --confirm {CONFIRM_TOKEN}")
    if args.apply and args.confirm != CONFIRM_TOKEN:
        if args.confirm is None:
            raise UsageError(f"--apply deletes records for good: add --confirm {CONFIRM_TOKEN}; nothing was deleted")
        raise UsageError(f"the confirmation token is {CONFIRM_TOKEN}, not {args.confirm!r}; nothing was deleted")
    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    default_groups = [settings.windows_group, settings.docsync_group]
    groups = default_groups
    if args.require_groups is not None:
        groups = list(dict.fromkeys(g.strip() for g in args.require_groups.split(",") if g.strip()))
        if not groups:
            raise UsageError("--require-groups needs at least one group name (comma-separated)")
    for group in default_groups:
        if group not in groups:
            print(f"note: group {group} is not required: records it has not read may be deleted", file=sys.stderr)
    out = sys.stderr if args.json else sys.stdout
    engine = open_engine(settings.database_url)
    try:
        require_current(engine)
        partition_count(settings, settings.topic)  # an unreachable broker or a missing topic, said at once
        prune = plan(settings, engine, retention_days=args.retention_days, groups=groups, timeout=args.timeout)
        if args.hourly_days is not None:
            prune.hourly = count_hourly(engine, args.hourly_days)
        if args.apply:
            apply(settings, prune, timeout=args.timeout)
            if prune.hourly is not None and prune.hourly.rows:
                print(f"skill_hourly_stats: deleting {prune.hourly.rows:,} row(s) ...", file=out, flush=True)
                delete_hourly(
                    engine, prune.hourly, progress=lambda n: print(f"  {n:,} row(s) deleted", file=out, flush=True)
                )
    finally:
        engine.dispose()
    print(render(prune.to_dict(), args.json))
    return EXIT_FAILED if prune.failed else EXIT_OK
