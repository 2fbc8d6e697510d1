"""`skillstats rebuild`: recompute the windows tables from the log beside the live ones, and swap (skillstats/rebuild/).

Exit statuses: 0 done (status: the rebuild is healthy; diff: the tables agree); 1 status: the rebuild is failing
(it can never be swapped: drop it), diff: rows differ; 2 a refusal (nothing changed: the message says why and what
to do) or a missing --confirm.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from datetime import date
from typing import TYPE_CHECKING, TypeVar

from skillstats.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    database_options,
    kafka_options,
    positive,
    verbosity,
)
from skillstats.config import Settings

if TYPE_CHECKING:
    from skillstats.rebuild.generations import SwapOutcome
    from skillstats.rebuild.report import Diff, Status

T = TypeVar("T")

RUNBOOK = "docs/operations.md, 'Recompute'"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Recompute skill_daily_stats and skill_hourly_stats from the log the topic retains, beside the live tables, "
        "while the live worker runs on: `start` records a rebuild and its empty shadow tables; `skillstats windows "
        "--rebuild` fills them (a windows worker of the rebuild's own group); `status` shows how far it is; `diff` "
        "compares it with the live tables (an audit of the live tables, if never swapped); `swap` puts it in place "
        f"in one transaction; `rollback` puts the previous tables back; `drop` discards. Runbook: {RUNBOOK}."
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    start = actions.add_parser("start", help="record a rebuild and create its empty shadow tables")
    where = start.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--from-start",
        action="store_true",
        help="recompute every day the retained log wholly holds (the earliest it supports)",
    )
    where.add_argument(
        "--from",
        dest="from_day",
        metavar="DAY",
        type=_day,
        help="recompute the UTC days from DAY (YYYY-MM-DD) on; refused when retention has deleted records of DAY",
    )
    start.add_argument("--dry-run", action="store_true", help="say what would be recomputed and from where; no writes")
    status = actions.add_parser("status", help="progress per partition, lag, rows written, whether a swap is allowed")
    diff = actions.add_parser("diff", help="rows where the rebuilt and live tables disagree, over the rebuilt days")
    diff.add_argument("--limit", type=positive, default=20, metavar="N", help="differing rows shown (default 20)")
    swap = actions.add_parser("swap", help="put the rebuilt tables in place, the live ones kept as the previous")
    swap.add_argument("--confirm", metavar="TOKEN", help="SWAP")
    rollback = actions.add_parser("rollback", help="put the previous tables back (brought to the live fences)")
    rollback.add_argument("--confirm", metavar="TOKEN", help="ROLLBACK")
    drop = actions.add_parser("drop", help="discard the building rebuild, or (--previous) the previous tables")
    drop.add_argument("--previous", action="store_true", help="drop the previous generation instead")
    drop.add_argument("--confirm", metavar="TOKEN", help="DROP")
    for sub in (start, status, diff, swap, rollback, drop):
        kafka_options(sub)
        database_options(sub)
        verbosity(sub)
        if sub in (status, diff, swap, rollback):
            sub.add_argument(
                "--max-gap",
                type=positive,
                default=None,
                metavar="N",
                help="most records between the rebuild's and the live group's fences for a swap (default 200000); "
                "the swap reads them from the log while it holds the fence rows",
            )
        if sub in (status, diff, start):
            sub.add_argument("--json", action="store_true", help="machine-readable output (one JSON object)")


def _day(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a day (YYYY-MM-DD): {text!r}") from None


def _confirm(args: argparse.Namespace, token: str, what: str) -> None:
    if args.confirm != token:
        raise UsageError(f"{what}: add --confirm {token} (runbook: {RUNBOOK})")


def run(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.rebuild import generations, report
    from skillstats.rebuild.state import RebuildRefused, live_owner
    from skillstats.sinks.db import open_engine
    from skillstats.sinks.migrate import require_current

    engine = open_engine(settings.database_url)
    require_current(engine)
    max_gap = getattr(args, "max_gap", None) or generations.MAX_GAP
    try:
        if args.action == "start":
            live_owner(engine, settings.topic)
            generations.refuse_unrecorded_imports(engine)
            plan = generations.with_skips(
                engine, settings, generations.plan_start(settings, settings.topic, args.from_day)
            )
            shown = {
                "recomputes": plan.why,
                "starts": plan.starts,
                "records_to_read": plan.records,
                "dry_run": args.dry_run,
            }
            if args.dry_run:
                _print(
                    args, shown, f"would recompute {plan.why}\nwould read {plan.records:,} record(s) from {plan.starts}"
                )
                return EXIT_OK
            rebuild = generations.start(engine, settings, plan)
            _print(
                args,
                {**shown, "rebuild": rebuild.id, "group": rebuild.group_id},
                f"rebuild {rebuild.id} started: group {rebuild.group_id}, recomputes {plan.why}\n"
                f"{plan.records:,} record(s) to read; now run `skillstats windows --rebuild` (as many as the live "
                f"workers), then `skillstats rebuild status`",
            )
            return EXIT_OK
        if args.action == "status":
            found = report.status(engine, settings, max_gap)
            if args.json:
                print(json.dumps(_status_json(found)))
            else:
                print(found.render())
            return EXIT_FAILED if found.failing else EXIT_OK
        if args.action == "diff":
            compared = report.diff(engine, settings, args.limit, max_gap)
            if args.json:
                print(json.dumps(_diff_json(compared), default=str))
            else:
                print(compared.render())
            return EXIT_FAILED if compared.any else EXIT_OK
        if args.action == "swap":
            _confirm(args, generations.SWAP_TOKEN, "a swap replaces the live windows tables")
            outcome = _with_lock_retries(lambda: generations.swap(engine, settings, max_gap))
            print(_swapped(outcome))
            return EXIT_OK
        if args.action == "rollback":
            _confirm(args, generations.ROLLBACK_TOKEN, "a rollback replaces the live windows tables")
            rolled = generations.rollback(engine, settings)
            if rolled.behind <= max_gap:
                try:
                    outcome = _with_lock_retries(lambda: generations.swap(engine, settings, max_gap))
                except Exception:
                    # Half a rollback is a state of its own: say it before the swap's error (said below).
                    print(
                        f"skillstats rebuild rollback: the previous generation is rebuild {rolled.rebuild.id} again, "
                        f"building (group {rolled.rebuild.group_id}) from the fences it was swapped out at; the live "
                        f"tables are the ones it was to replace, unchanged. Swapping it back failed: once the cause "
                        f"below is gone, `skillstats rebuild swap --confirm SWAP` finishes the rollback "
                        f"(`skillstats rebuild status` says whether it may; when it says failing, the previous "
                        f"generation cannot come back and `skillstats rebuild drop --confirm DROP` discards it)",
                        file=sys.stderr,
                    )
                    raise
                print(f"rolled back: {_swapped(outcome)}")
            else:
                print(
                    f"the previous generation is rebuild {rolled.rebuild.id} again (group {rolled.rebuild.group_id}), "
                    f"{rolled.behind:,} record(s) behind the live fences, more than --max-gap {max_gap:,}: run "
                    f"`skillstats windows --rebuild` until `skillstats rebuild status` allows the swap, then "
                    f"`skillstats rebuild swap --confirm SWAP`"
                )
            return EXIT_OK
        if args.action == "drop":
            _confirm(args, generations.DROP_TOKEN, "dropping discards tables for good")
            print(generations.drop(engine, args.previous))
            return EXIT_OK
    except RebuildRefused as exc:
        print(f"skillstats rebuild {args.action}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    raise AssertionError(args.action)


def _with_lock_retries(call: Callable[[], T]) -> T:
    """A swap waits LOCK_WAIT_S for the tables' locks (a long reader of a live table); then it is tried again."""
    from sqlalchemy.exc import OperationalError

    for attempt in range(3):
        try:
            return call()
        except OperationalError as exc:
            if not any(word in str(exc).lower() for word in ("lock", "deadlock")) or attempt == 2:
                raise
            print(f"waiting for a lock on the windows tables (try {attempt + 1}): {exc.orig}", file=sys.stderr)
            time.sleep(1.0)
    raise AssertionError("unreachable")


def _swapped(o: SwapOutcome) -> str:
    return (
        f"rebuild {o.rebuild.id} is live (the tables it replaced are kept as skill_*_stats_previous: "
        f"`skillstats rebuild rollback --confirm ROLLBACK` puts them back). Brought to the live fences "
        f"{o.live_fences}: {o.added:,} event(s) the live group had counted past the rebuild added, {o.taken:,} the "
        f"rebuild had counted past the live group taken away. Recomputed: {o.owned}; carried over from the live "
        f"tables (every other day): "
        + ", ".join(f"{name} {rows:,} row(s)" for name, rows in o.carried.items())
        + (
            f"; {o.unrejected} record(s) the live group's database had refused are counted now (their "
            f"skillstats_rejected_records rows removed; a rollback puts them back)"
            if o.unrejected
            else ""
        )
    )


def _print(args: argparse.Namespace, data: dict[str, object], text: str) -> None:
    print(json.dumps(data, default=str) if getattr(args, "json", False) else text)


def _status_json(s: Status) -> dict[str, object]:
    rebuild = s.rebuild
    return {
        "rebuild": None if rebuild is None else {"id": rebuild.id, "group": rebuild.group_id, "note": rebuild.note},
        "live_rebuild": None if s.live is None else s.live.id,
        "previous_kept": s.previous_kept,
        "recomputes": s.owned,
        "partitions": [
            {
                "partition": p.partition,
                "start": p.start,
                "fence": p.fence,
                "log_end": p.end,
                "lag": p.lag,
                "lag_seconds": p.lag_seconds,
                "done": p.done,
                "live_fence": p.live_fence,
            }
            for p in s.partitions
        ],
        "rows": s.rows,
        "records_per_second": s.rate,
        "eta_seconds": s.eta_seconds,
        "gap": s.gap,
        "problems": s.problems,
        "failing": s.failing,
        "swap_allowed": s.swappable,
    }


def _diff_json(d: Diff) -> dict[str, object]:
    return {
        "rebuild": d.rebuild.id,
        "recomputes": d.owned,
        "differing": d.differing,
        "totals": {
            table: {"live": {"downloads": lv[0], "installs": lv[1]}, "rebuilt": {"downloads": rb[0], "installs": rb[1]}}
            for table, (lv, rb) in d.totals.items()
        },
        "first": [
            {"table": r.table, "skill_id": r.skill_id, "bucket": r.bucket, "live": r.live, "rebuilt": r.rebuilt}
            for r in d.first
        ],
    }
