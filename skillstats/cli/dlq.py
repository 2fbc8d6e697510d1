"""`skillstats dlq list|replay`: what was parked, and bringing it back once (skillstats/dlq_admin.py)."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime

from skillstats.cli.common import (
    EXIT_OK,
    UsageError,
    database_options,
    kafka_options,
    parse_time_ms,
    positive,
    verbosity,
)
from skillstats.config import Settings

LIST_HELP = (
    "The parked records (reason, message, source partition and offset, when), newest last, and counts by reason. "
    "Filters combine: every one given must match."
)
REPLAY_HELP = (
    "Bring the selected parked records back, for when the cause is gone (a contract fixed, a database repaired): "
    "one copy per source record published to the events topic, however many times it was parked, recorded in "
    "SQL with where it landed. Left out, with the reason: a record today's contract still refuses (it would be "
    "parked again; --force publishes it anyway), one replayed before (--again, only when every earlier copy was "
    "parked again), one parked truncated. A record the windows group's database refused is valid and docsync "
    "counted it: it is added to the windows tables directly instead of published. Copies are published in a Kafka "
    "transaction with an entry in the replay ledger (<DLQ topic>.replays, created if missing): read first, it "
    "brings back what a database restored from an older backup forgot, so no record gets a second copy. Filters "
    "combine."
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = "Inspect (`list`) and replay (`replay`) the dead-letter topic; see each one's --help."
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="what was parked, why, from where", description=LIST_HELP)
    replaying = actions.add_parser("replay", help="bring parked records back, once", description=REPLAY_HELP)
    for sub in (listing, replaying):
        sub.add_argument("--reason", action="append", default=[], help="only this reason (repeatable)")
        sub.add_argument("--since", type=parse_time_ms, metavar="WHEN", help="parked at or after (ms or ISO-8601)")
        sub.add_argument(
            "--source-offsets",
            metavar="P:O[,P:O...]",
            help="only these source records: partition:offset of the events topic, comma-separated",
        )
        kafka_options(sub, dlq=True)
        verbosity(sub)
    listing.add_argument("--limit", type=positive, default=50, help="most records shown (default 50)")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    database_options(replaying)
    replaying.add_argument("--all", action="store_true", help="every parked record (no filter given)")
    replaying.add_argument("--dry-run", action="store_true", help="show what would be replayed, change nothing")
    replaying.add_argument("--again", action="store_true", help="also records replayed before (see above)")
    replaying.add_argument(
        "--force", action="store_true", help="also records today's contract still refuses (they are parked again)"
    )


def _source_offsets(text: str | None) -> list[tuple[int, int]]:
    pairs = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        partition, _, offset = item.strip().partition(":")
        if not (partition.isdigit() and offset.isdigit()):
            raise UsageError(f"--source-offsets wants partition:offset pairs, e.g. 3:1200,3:1201; not {item!r}")
        pairs.append((int(partition), int(offset)))
    return pairs


def run(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.dlq_admin import (
        CopyPublisher,
        ReplayRefused,
        Selection,
        counts_by_reason,
        ledger_topic,
        plan_replay,
        read_ledger,
        read_parked,
        record_ledger,
        replay,
        replay_book,
    )
    from skillstats.kafka import TopicIds, watermarks
    from skillstats.sinks.db import open_engine
    from skillstats.sinks.migrate import require_current

    selection = Selection(tuple(args.reason), args.since, tuple(_source_offsets(args.source_offsets)))
    filtered = bool(args.reason or args.since is not None or selection.sources)
    listing = args.action == "list"
    if not listing and not (filtered or args.all):
        raise UsageError("say what to replay: --reason, --since, --source-offsets, or --all for everything")
    ranges = watermarks(settings, settings.dlq_topic)  # no such topic: TopicMissing, exit 2 with the hint
    parked = read_parked(settings, ranges, keep_payload=None if not listing and args.all else selection)
    chosen = [r for r in parked if selection(r)]
    if listing:
        newest = sorted(chosen, key=lambda r: (r.parked_at_ms or 0, r.dlq_partition, r.dlq_offset))
        shown = newest[-args.limit :]
        if args.json:
            report = {
                "records": [r.summary() for r in shown],
                "matched": len(chosen),
                "counts_by_reason": counts_by_reason(chosen),
            }
            print(json.dumps(report, sort_keys=True))
            return EXIT_OK
        more = f" (the newest {len(shown)} shown; --limit for more)" if len(shown) < len(chosen) else ""
        print(f"{settings.dlq_topic}: {len(parked):,} parked, {len(chosen):,} match{more}")
        for r in shown:
            when = "?"
            if r.parked_at_ms is not None:
                when = datetime.fromtimestamp(r.parked_at_ms / 1000, UTC).isoformat(timespec="seconds")
            copy = f"  (a replayed copy of {r.replayed_from}, invalid again)" if r.replayed_from else ""
            print(
                f"  {when:<25} {r.reason:<20} source p{r.source_partition}@{r.source_offset}  "
                f"dlq {r.dlq_partition}:{r.dlq_offset}  {r.message[:80]}{copy}"
            )
        print("by reason: " + (", ".join(f"{k} {v:,}" for k, v in counts_by_reason(chosen).items()) or "none"))
        return EXIT_OK
    engine = open_engine(settings.database_url)
    publisher = None
    try:
        require_current(engine)
        topic_id = TopicIds(settings).get(settings.topic)
        if not args.dry_run:
            # Before the ledger is read: fences an earlier replay still alive, which could commit behind it.
            publisher = CopyPublisher(settings)
        ledger = read_ledger(settings)
        if publisher is not None:
            added = record_ledger(engine, settings, ledger, topic_id)
            if added:
                print(
                    f"the replay ledger {ledger_topic(settings)} knew {added} replay(s) or copy position(s) "
                    f"skillstats_dlq_replays did not (a database restored from an older backup, or a replay cut "
                    f"off before it recorded where its copies landed): recorded in SQL",
                    file=sys.stderr,
                )
        book = replay_book(engine, settings.topic, ledger, topic_id)
        plan = plan_replay(settings, parked, chosen, book, again=args.again, force=args.force)
        for root, why in plan.skipped:
            print(f"left out {root}: {why}", file=sys.stderr)
        if not plan.roots:
            if not chosen:
                print("nothing parked matches; nothing replayed")
                return EXIT_OK
            if args.dry_run:  # a dry run that finds nothing to do did its job: it says so, exit 0
                print(
                    f"none of the {len(chosen)} matching parked record(s) would be replayed (see above; dry run: "
                    f"nothing changed)"
                )
                return EXIT_OK
            raise UsageError(f"none of the {len(chosen)} matching parked record(s) can be replayed (see above)")
        if args.dry_run:
            for root, r in plan.roots.items():
                how = "would add to the windows tables" if root in plan.direct else "would replay"
                print(
                    f"{how} {root[0]}:{root[1]}:{root[2]} ({r.reason}, parked at dlq {r.dlq_partition}:{r.dlq_offset})"
                )
            print(
                f"{len(plan.publish)} record(s) would be replayed to {settings.topic}, {len(plan.direct)} added to the "
                f"windows tables (dry run: nothing changed)"
            )
            return EXIT_OK
        done = replay(settings, engine, plan, publisher, topic_id)
    except ReplayRefused as exc:
        raise UsageError(str(exc)) from None
    finally:
        if publisher is not None:
            publisher.close()
        engine.dispose()
    direct = len(plan.direct)
    print(
        f"replayed {done - direct} record(s) to {settings.topic} (confirmed by the broker)"
        + (f"; added {direct} to the windows tables" if direct else "")
    )
    return EXIT_OK
