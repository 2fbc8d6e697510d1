"""`skillstats legacy`: move in from the legacy system, counting a Convex export once (skillstats/legacy/).

`plan` reads the export and prints what an import would do (no writes); `import` applies it, in
chunks of a transaction each, under the manifest that makes running it again safe. Exit statuses:
0 done; 1 the database failed a chunk past its retries; 2 an export that does not fit the old schema,
a missing token, or a refusal needing an operator (nothing written); 130 stopped by SIGTERM or
SIGINT at a chunk boundary (what was applied stays applied, once: run it again to go on).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from skillstats.cli.common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    UsageError,
    database_options,
    positive,
    verbosity,
)
from skillstats.config import Settings


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Move in from the legacy system: count, once, what its two crons had not counted, from a Convex export "
        "(`npx convex export --path FILE.zip`: the ZIP or the directory it unpacks to). `plan` writes nothing; "
        "`import` applies each event to exactly the tables its old cron had not reached (README, 'Moving in'; "
        "the runbook: docs/operations.md, 'Cut-over from the legacy system')."
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    plan = actions.add_parser("plan", help="what an import would do, and the old system's survivor figures (no writes)")
    run_import = actions.add_parser("import", help="apply the export, exactly once (needs --confirm IMPORT_LEGACY)")
    for sub in (plan, run_import):
        sub.add_argument("export", metavar="EXPORT", help="the export: a ZIP file or the directory it unpacks to")
        sub.add_argument(
            "--history", action="store_true", help="also the old skillDailyStats rows, into skill_daily_stats"
        )
        sub.add_argument("--json", action="store_true", help="machine-readable output (one JSON object)")
        database_options(sub)
        verbosity(sub)
    run_import.add_argument("--confirm", metavar="TOKEN", help="IMPORT_LEGACY: counts written here stay written")
    run_import.add_argument(
        "--chunk-size", type=positive, default=2000, metavar="N", help="events per transaction (default 2000)"
    )
    run_import.add_argument(
        "--allow-older-rows",
        action="store_true",
        help="import rows not in the manifest that are older than an earlier imported export's newest row (see "
        "`plan`: another deployment's export would count its events twice)",
    )
    run_import.add_argument(
        "--allow-unknown-skills",
        action="store_true",
        help="import even when events owed to the skill totals are for skills with no row in `skills` (see `plan`: "
        "they are skipped for good, as docsync skips a deleted skill's events)",
    )
    run_import.add_argument(
        "--skip-out-of-contract",
        action="store_true",
        help="leave uncounted the events (and --history rows) outside the contract's ranges: an occurredAt before "
        "2000 or after 9999, an install_clear delta over 1e9 in size (see `plan`); each is recorded in the manifest "
        "as skipped",
    )
    run_import.add_argument(
        "--allow-empty-registry",
        action="store_true",
        help="import even when `skills` has no rows (the events owed to the skill totals are then skipped for good)",
    )


def _bar(total: int, label: str) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc=label,
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        mininterval=0.5,
    )


def run(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.legacy.export import EVENTS, Export, ExportError
    from skillstats.legacy.importer import CONFIRM_TOKEN, DatabaseAway, Importer, LegacyRefusal
    from skillstats.legacy.plan import make_plan
    from skillstats.sinks.db import open_engine
    from skillstats.sinks.migrate import require_current

    if args.action == "import" and args.confirm != CONFIRM_TOKEN:
        raise UsageError(
            f"an import writes counts for good: add --confirm {CONFIRM_TOKEN} (run `skillstats legacy plan` first); "
            f"nothing was written"
            if args.confirm is None
            else f"the confirmation token is {CONFIRM_TOKEN}, not {args.confirm!r}; nothing was written"
        )
    stop = threading.Event()
    engine = open_engine(settings.database_url)
    try:
        require_current(engine)
        with Export(args.export) as export:
            with _bar(export.size(EVENTS), "read") as bar:
                if args.action == "plan":
                    plan = make_plan(export, engine, history=args.history, progress=bar.update)
                    print(plan.render(args.json))
                    return EXIT_OK
                importer = Importer(engine, chunk_size=args.chunk_size, stop=stop)
                plan = importer.plan(export, history=args.history, progress=bar.update)
            if not args.json:
                print(plan.render(), flush=True)
            importer.check(
                plan,
                allow_older_rows=args.allow_older_rows,
                allow_empty_registry=args.allow_empty_registry,
                allow_unknown_skills=args.allow_unknown_skills,
                skip_out_of_contract=args.skip_out_of_contract,
            )
            previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
            try:
                with _bar(export.size(EVENTS), "import") as bar:
                    outcome = importer.run(
                        export,
                        plan,
                        history=args.history,
                        progress=bar.update,
                        skip_out_of_contract=args.skip_out_of_contract,
                    )
            finally:
                for number, handler in previous.items():
                    signal.signal(number, handler)
    except (ExportError, LegacyRefusal) as exc:
        raise UsageError(str(exc)) from None
    except DatabaseAway as exc:
        print(f"skillstats legacy import: {exc}", file=sys.stderr)
        return EXIT_INTERRUPTED if stop.is_set() else EXIT_FAILED
    finally:
        engine.dispose()
    print(_json(plan, outcome) if args.json else outcome.render(), flush=True)
    if outcome.stopped:
        print(
            f"skillstats legacy import: stopped by a signal at a chunk boundary after {outcome.chunks:,} chunk(s): "
            f"what was applied is applied once; run the same command again to go on",
            file=sys.stderr,
        )
        return EXIT_INTERRUPTED
    return EXIT_OK


def _json(plan: Any, outcome: Any) -> str:
    import json

    return json.dumps({"plan": plan.to_dict(), "import": outcome.to_dict()}, sort_keys=True)
