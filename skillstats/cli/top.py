"""`skillstats top`: the leaderboard the daily table exists for (skillstats/top.py)."""

from __future__ import annotations

import argparse

from skillstats.cli.common import EXIT_OK, database_options, positive, verbosity
from skillstats.config import Settings


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "The leaderboard the daily table exists for: per skill, downloads and installs summed over the last "
        "--days UTC days (today included), from skill_daily_stats. Reads the database only."
    )
    database_options(parser)
    verbosity(parser)
    parser.add_argument("--days", type=positive, default=7, help="UTC days, today included (default 7)")
    parser.add_argument(
        "--by", choices=["downloads", "installs"], default="downloads", help="order by (default downloads)"
    )
    parser.add_argument("--limit", type=positive, default=20, help="rows (default 20)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.sinks.db import open_engine
    from skillstats.sinks.migrate import require_current
    from skillstats.top import leaderboard, render

    engine = open_engine(settings.database_url)
    try:
        require_current(engine)
        report = leaderboard(engine, days=args.days, by=args.by, limit=args.limit)
    finally:
        engine.dispose()
    print(render(report, args.json))
    return EXIT_OK
