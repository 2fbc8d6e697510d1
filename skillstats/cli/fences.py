"""`skillstats fences show|reset|takeover`: each group's SQL fences, and the explicit ways out of a refusal.

A consumer refuses to count (exit 2) when the database's fences and identity
do not fit the topic it finds: a fence past its log end, a topic whose Kafka id
changed (recreated, or another cluster), a group name that is not the one that
wrote the tables. Those are an operator's decisions, never the worker's:

- `reset --to start|end` starts a group over on the topic as it is now (and
  records the topic's id): `start` counts what the topic holds, `end` only what
  arrives from now on. The dry run says, per partition, how many offsets each
  choice applies again or leaves out (offsets, not records: a Kafka transaction's
  marker takes an offset and holds no record);
- `takeover --from OLD --group NEW` hands OLD's fences and its role to NEW (a
  renamed group), so NEW goes on where OLD stopped.

Both refuse while the groups concerned have members (their consumers must be
stopped), unless `--force`, and change nothing without `--confirm`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from skillstats.cli.common import EXIT_OK, UsageError, database_options, kafka_options, verbosity
from skillstats.config import Settings

RESET_HELP = (
    "Set a group's fences (and, as a hint for lag tools, its Kafka committed offsets) for the chosen partitions, "
    "and record the topic as it is now (its Kafka id) as the one its counts belong to. The right tool after the "
    "topic was deleted and created again, or the database restored from another cluster, when the consumers "
    "refuse to run: --to start counts everything the topic holds now (right for a recreated topic, whose records "
    "were never counted; on the same topic it counts again what was counted), --to end counts only what arrives "
    "from now on (what the topic holds is never counted). Not the tool for a database restored from a backup of "
    "its own: the consumers read again from the restored fences by themselves. Without --confirm it only prints "
    "what it would do. Stop the group's consumers first."
)
TAKEOVER_HELP = (
    "Hand group --from's fences and the tables it writes to group --group, in one transaction: for a group "
    "renamed on purpose (a new SKILLSTATS_WINDOWS_GROUP or SKILLSTATS_DOCSYNC_GROUP), which the consumers "
    "otherwise refuse (a group without fences would count again everything the topic retains). Without "
    "--confirm it only prints what it would do. Stop both groups' consumers first."
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Each consumer group's SQL fence per partition is the next offset it has not applied, and where it reads "
        "from; its counts in SQL are exactly the records below. `show` prints them beside the log and who the "
        "database says writes each group's tables; `reset` and `takeover` are the explicit ways out when the "
        "consumers refuse to run (see each one's --help)."
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="each group's fences beside the log, and the tables' owners")
    show.add_argument("--group", help="only this group (default: the windows and docsync groups)")
    reset = actions.add_parser("reset", help="start a group over on the topic as it is now", description=RESET_HELP)
    reset.add_argument("--group", required=True, help="the consumer group whose fences are reset")
    reset.add_argument("--to", required=True, choices=["start", "end"], help="the log start or the log end")
    reset.add_argument("--partition", type=int, action="append", help="only this partition (repeatable)")
    reset.add_argument("--role", choices=["windows", "docsync"], help="the group's role, if its name does not say")
    reset.add_argument("--confirm", metavar="TOKEN", help="RESET_FENCES, to really reset")
    reset.add_argument("--force", action="store_true", help="even while the group has active members")
    takeover = actions.add_parser("takeover", help="hand a group's fences to a new name", description=TAKEOVER_HELP)
    takeover.add_argument("--from", dest="old", required=True, metavar="OLD", help="the group that wrote the tables")
    takeover.add_argument("--group", required=True, metavar="NEW", help="the group that goes on from its fences")
    takeover.add_argument("--role", choices=["windows", "docsync"], help="the groups' role, if no name says")
    takeover.add_argument("--confirm", metavar="TOKEN", help="TAKE_OVER_FENCES, to really hand them over")
    takeover.add_argument("--force", action="store_true", help="even while a group has active members")
    for sub in (show, reset, takeover):
        kafka_options(sub, dlq=sub is reset)
        database_options(sub)
        verbosity(sub)


def run(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.sinks.db import open_engine
    from skillstats.sinks.migrate import require_current

    engine = open_engine(settings.database_url)
    try:
        require_current(engine)
        return {"show": show, "reset": reset, "takeover": takeover}[args.action](args, settings, engine)
    finally:
        engine.dispose()


def role_of(settings: Settings, engine: Any, group: str, given: str | None) -> str:
    """The role `group` writes: as the database records it, else as the settings name it, else --role."""
    from skillstats.sinks.identity import DOCSYNC, REBUILD, WINDOWS, owners

    recorded = [role for role, owner in owners(engine).items() if owner.group_id == group]
    named = [
        role for role, name in ((WINDOWS, settings.windows_group), (DOCSYNC, settings.docsync_group)) if name == group
    ]
    found = given or (recorded or named or [None])[0]
    if found == REBUILD:
        raise UsageError(
            f"group {group!r} is a rebuild's (skillstats rebuild): its fences say what its shadow tables hold, and "
            f"moving them would make the tables count records twice or miss them. Drop the rebuild and start "
            f"another (`skillstats rebuild drop --confirm DROP`, then `skillstats rebuild start`)"
        )
    if found is None:
        raise UsageError(
            f"which tables does group {group!r} write? The database does not say and neither do the settings "
            f"(SKILLSTATS_WINDOWS_GROUP, SKILLSTATS_DOCSYNC_GROUP): give --role windows or --role docsync"
        )
    return found


def _confirmed(given: str | None, token: str, what: str) -> bool:
    """True with the right token; without one, a dry run (said so); a wrong one is a usage error."""
    if given == token:
        return True
    if given is not None:
        raise UsageError(f"the confirmation token is {token}")
    print(f"dry run: nothing changed; add --confirm {token} to {what}")
    return False


def _refuse_members(settings: Settings, group: str, force: bool) -> None:
    from skillstats.kafka import group_members

    members = group_members(settings, group)
    if members and not force:
        raise UsageError(
            f"group {group!r} has {members} active member(s): stop its consumers first (their next batch would "
            f"write against the fences being changed), or give --force"
        )
    if members:
        print(f"warning: group {group!r} has {members} active member(s); going on (--force)", file=sys.stderr)


def show(args: argparse.Namespace, settings: Settings, engine: Any) -> int:
    from skillstats.kafka import TopicIds, watermarks
    from skillstats.sinks.fences import PartitionFences
    from skillstats.sinks.identity import owners

    marks = watermarks(settings, settings.topic)
    topic_id = TopicIds(settings).get(settings.topic)
    print(f"topic {settings.topic} on {settings.kafka_bootstrap}: id {topic_id}, {len(marks)} partitions")
    print("(a fence is the next offset its group has not applied; the log runs from its start offset to its end)")
    for role, owner in sorted(owners(engine).items()):
        state = ""
        if owner.topic != settings.topic:
            state = f"  (not this topic: {owner.topic})"
        elif owner.topic_id is not None and owner.topic_id != topic_id:
            state = "  TOPIC REPLACED: the counts belong to another topic of this name"
        print(f"{role} tables written by group {owner.group_id} from {owner.topic} (id {owner.topic_id}){state}")
    groups = [args.group] if args.group else [settings.windows_group, settings.docsync_group]
    for group in groups:
        fences = PartitionFences(engine, group, settings.topic)
        current, lost = fences.fences(), fences.offsets_lost()
        print(f"group {group}, topic {settings.topic}")
        for partition, (low, high) in sorted(marks.items()):
            fence = current.get(partition)
            state = "AHEAD OF LOG" if fence is not None and fence > high else ""
            if lost.get(partition):
                state = f"{state} {lost[partition]:,} offset(s) lost to retention".strip()
            line = f"  partition {partition:>3}  fence {fence if fence is not None else '-':>12}  log {low}..{high}"
            print(f"{line}  {state}".rstrip())
    return EXIT_OK


def reset(args: argparse.Namespace, settings: Settings, engine: Any) -> int:
    from skillstats.dlq import DeadLetters
    from skillstats.kafka import TopicIds, commit_offsets, watermarks
    from skillstats.sinks.fences import RESET_TOKEN, PartitionFences, plan_reset
    from skillstats.sinks.identity import (
        IdentityMismatch,
        Owner,
        check_role_clash,
        database_mark,
        not_the_owner_message,
        owner_of,
    )
    from skillstats.sinks.upserts import now_utc_naive

    role = role_of(settings, engine, args.group, args.role)
    with engine.connect() as connection:
        check_role_clash(connection, Owner(role, args.group, settings.topic, None))
    recorded = owner_of(engine, role)
    if recorded is not None and recorded.group_id != args.group:  # said before anything is asked of Kafka
        raise IdentityMismatch(not_the_owner_message(recorded, args.group))
    marks = watermarks(settings, settings.topic)
    unknown = sorted(set(args.partition or ()) - set(marks))
    if unknown:
        raise UsageError(f"topic {settings.topic} has no partition {unknown[0]} (it has 0..{len(marks) - 1})")
    topic_id = TopicIds(settings).get(settings.topic)
    fences = PartitionFences(engine, args.group, settings.topic)
    current = fences.fences()
    plan = plan_reset(args.group, settings.topic, topic_id, recorded, marks, current, args.partition, args.to)
    print(f"group {args.group} ({role} tables), topic {settings.topic} (id {topic_id}), reset to the log {args.to}")
    if plan.replaced:
        assert recorded is not None
        print(
            f"  the counts so far belong to topic {recorded.topic} (id {recorded.topic_id}): none of these "
            f"records was counted"
        )
    again = skipped = 0
    for partition, (low, high) in sorted(marks.items()):
        fence = current.get(partition)
        shown = fence if fence is not None else "-"
        ahead = "  AHEAD OF LOG" if fence is not None and fence > high else ""
        if partition in plan.left:
            reads = f"reads from {fence}" if fence is not None else f"reads from the log start, {low}"
            print(f"  partition {partition:>3}  fence {shown:>12}    unchanged (not chosen): {reads}{ahead}")
            continue
        counted_to = low if plan.replaced or fence is None else min(max(fence, low), high)
        if args.to == "start":
            count, what = counted_to - low, "offset(s) applied again"
            again += count
        else:
            count, what = high - counted_to, "offset(s) never applied"
            skipped += count
        target = plan.targets[partition]
        print(f"  partition {partition:>3}  fence {shown:>12} -> {target:<12} {count:>10,} {what}{ahead}")
    for partition in plan.dropped:
        print(f"  partition {partition:>3}  fence {current[partition]:>12}    dropped: the topic has no such partition")
    if args.to == "start":
        print(
            f"  {again:,} offset(s) already applied would be applied again: their records counted twice"
            if again
            else "  nothing is counted twice"
        )
    else:
        print(
            f"  {skipped:,} offset(s) in the topic would never be applied: their records never counted"
            if skipped
            else "  nothing is left out"
        )
    if plan.refusal is not None:
        raise UsageError(plan.refusal)
    if not _confirmed(args.confirm, RESET_TOKEN, "reset"):
        return EXIT_OK
    _refuse_members(settings, args.group, args.force)
    dead_letters = DeadLetters(settings, args.group)
    try:
        dlq_marks = dead_letters.end_marks(sorted(plan.targets))
    finally:
        dead_letters.close()
    owner = Owner(role, args.group, settings.topic, topic_id)
    fences.reset(plan.targets, dlq_marks, now_utc_naive(), owner, replaced=plan.replaced, dropped=plan.dropped)
    try:
        mark = database_mark(engine, role)
        commit_offsets(settings, args.group, settings.topic, plan.targets, metadata=mark)
    except Exception as exc:  # a hint for lag tools: the fences, set above, are where the group reads from
        print(f"note: the group's Kafka committed offsets were not set ({exc}); the fences hold", file=sys.stderr)
    print(f"reset {len(plan.targets)} fence(s) of group {args.group}; its counts now belong to topic id {topic_id}")
    return EXIT_OK


def takeover(args: argparse.Namespace, settings: Settings, engine: Any) -> int:
    from skillstats.kafka import commit_offsets
    from skillstats.sinks.fences import PartitionFences
    from skillstats.sinks.identity import TAKEOVER_TOKEN, database_mark, take_over
    from skillstats.sinks.upserts import now_utc_naive

    if args.old == args.group:
        raise UsageError("--from and --group name the same group: there is nothing to hand over")
    role = role_of(settings, engine, args.old, args.role)
    theirs = PartitionFences(engine, args.old, settings.topic).fences()
    print(f"group {args.old}'s fences on {settings.topic} ({role} tables) would go to group {args.group}:")
    for partition, fence in sorted(theirs.items()):
        print(f"  partition {partition:>3}  fence {fence:>12}")
    if not theirs:
        print("  none on this topic")
    if not _confirmed(args.confirm, TAKEOVER_TOKEN, "hand them over"):
        return EXIT_OK
    _refuse_members(settings, args.old, args.force)
    _refuse_members(settings, args.group, args.force)
    moved = take_over(engine, role, args.old, args.group, now_utc_naive())
    if theirs:
        try:
            commit_offsets(settings, args.group, settings.topic, theirs, metadata=database_mark(engine, role))
        except Exception as exc:  # a hint for lag tools
            print(f"note: group {args.group}'s Kafka committed offsets were not set ({exc})", file=sys.stderr)
    print(f"handed {moved} fence row(s) and the {role} tables from group {args.old} to group {args.group}")
    return EXIT_OK
