"""`skillstats bench`'s options and its entry point (skillstats/cli/bench.py calls these).

Light to import: the option list (and `skillstats bench --help`) needs only the workload
definitions; the run itself (bench/run.py) is imported when one starts.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from skillstats.config import Settings

from .workload import WORKLOADS, workload_names

SKIPPABLE = "bare,decode,windows,two-workers,librdkafka-sink,docsync,naive,perftest,latency,ingest,legacy,rebuild"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--events", type=int, default=2_000_000, help="events to preload, per workload (default 2,000,000)"
    )
    parser.add_argument(
        "--workload",
        default="steady,backfill",
        help="comma-separated workloads to run: "
        + "; ".join(f"{w.name}: {w.description}".replace("%", "%%") for w in WORKLOADS.values())
        + " (default both; naive faust, perf-test and latency run on the first)",
    )
    parser.add_argument("--skills", type=int, default=20_000, help="distinct skills (default 20,000)")
    parser.add_argument("--sqlite", metavar="PATH", help="SQLite file for case c (default: a temporary file)")
    parser.add_argument("--postgres", metavar="URL", help="PostgreSQL URL for case c (default: skip PostgreSQL)")
    parser.add_argument(
        "--skip",
        default="",
        help=f"comma-separated: {SKIPPABLE} (all but legacy and rebuild: cases j and k alone)",
    )
    parser.add_argument(
        "--naive-events",
        type=int,
        default=200_000,
        help="events the naive faust agent reads (default 200,000; it is slow)",
    )
    parser.add_argument("--latency-rate", type=int, default=5000, help="offered events/s for the latency part")
    parser.add_argument("--latency-seconds", type=int, default=60, help="length of the latency part (0: skip)")
    parser.add_argument(
        "--ingest-rate", type=int, default=500, help="single-event requests/s offered to skillstats ingest (case i)"
    )
    parser.add_argument("--ingest-seconds", type=int, default=20, help="length of case i's latency part")
    parser.add_argument(
        "--import-events",
        type=int,
        default=200_000,
        help="events in the synthetic Convex export `skillstats legacy import` reads in case j, into a fresh SQLite "
        "file and (with --postgres) a fresh database on that server (default 200,000; 0: skip)",
    )
    parser.add_argument(
        "--rebuild-events",
        type=int,
        default=200_000,
        help="case k: events the live worker reads alone, then as many more beside a rebuild of all of them, per "
        "database (default 200,000; 0: skip)",
    )
    parser.add_argument(
        "--soak-events",
        type=int,
        default=0,
        help="also run the windows worker over this many events and report its memory (e.g. 10000000)",
    )
    parser.add_argument("--output", type=Path, help="also write the markdown table to this file")


def main_from_cli(args: argparse.Namespace, settings: Settings) -> int:
    from .run import run
    from .soak import soak

    databases: dict[str, str] = {}
    names = workload_names(args.workload)
    with tempfile.TemporaryDirectory(prefix="skillstats-bench-") as scratch:
        databases["SQLite"] = f"sqlite:///{args.sqlite or Path(scratch) / 'bench.db'}"
        if args.postgres:
            databases["PostgreSQL"] = args.postgres
        table = run(
            settings,
            events=args.events,
            skills=args.skills,
            databases=databases,
            skip={s.strip() for s in args.skip.split(",") if s.strip()},
            latency_rate=args.latency_rate,
            latency_seconds=args.latency_seconds,
            naive_events=args.naive_events,
            workloads=[WORKLOADS[n] for n in names],
            ingest_rate=args.ingest_rate,
            ingest_seconds=args.ingest_seconds,
            import_events=args.import_events,
            rebuild_events=args.rebuild_events,
        )
        if args.soak_events:
            table += "\n\n" + soak(
                settings, databases.get("PostgreSQL", databases["SQLite"]), args.soak_events, args.skills
            )
    print(table)
    if args.output:
        args.output.write_text(table + "\n")
    return 0
