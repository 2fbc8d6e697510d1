"""Whose counts these are: the one group and the one topic each role's tables come from (docs/contract.md).

The fences say how far a group has applied a partition; they cannot say which
group or which topic the counts came from, and both can change under a worker
without a word: a ConfigMap that renames `SKILLSTATS_WINDOWS_GROUP` (a new
group has no fences, so it counts everything the topic retains again), a
second deployment pointed at the same database, a topic deleted and created
again under the same name (its offsets start over, so old fences skip the
head of the new log as "already applied"), a cluster swapped behind the same
bootstrap name.

So the database records, per role (`windows`: the daily and hourly tables;
`docsync`: the stat columns of `skills` and `user_skill_stats`), the group
that writes it, the topic it reads and that topic's Kafka id (KIP-516, which a
recreated topic does not keep). A consumer claims its role before it reads and
is refused (`IdentityMismatch`, exit status 2) when any of the three differ;
the windows group also checks the row inside every transaction, so a takeover
or reset done while an old worker still runs stops that worker at its next
batch instead of letting it write. The way out is always explicit and
confirmed: `skillstats fences takeover` hands a group's fences and its role
to a new name, `skillstats fences reset` starts a group over on the topic as
it is now (and records the new id).

The row lives in the same database as the counts and moves with them: a
restored backup brings back the owner its counts were written by.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Connection, Engine, select, update
from sqlalchemy.dialects import postgresql, sqlite

from skillstats.sinks.db import connected
from skillstats.sinks.schema import consumers, partition_fences

WINDOWS, DOCSYNC = "windows", "docsync"
ROLES = (WINDOWS, DOCSYNC)
# A rebuild's group (skillstats/rebuild/): the windows worker writing a rebuild's shadow tables.
REBUILD = "rebuild"
TAKEOVER_TOKEN = "TAKE_OVER_FENCES"
TABLES = {
    WINDOWS: "skill_daily_stats and skill_hourly_stats",
    DOCSYNC: "the skills stat columns and user_skill_stats",
    REBUILD: "rebuild's shadow tables (skill_daily_stats_rebuild and skill_hourly_stats_rebuild)",
}


@dataclass(frozen=True, slots=True)
class Owner:
    """Who writes a role's tables: a group, reading a topic (known by name and, once seen, by id)."""

    role: str
    group_id: str
    topic: str
    topic_id: str | None


class IdentityMismatch(RuntimeError):
    """A consumer is not the one whose counts the database holds: it must not write (exit status 2)."""


def owner_of(connection: Connection | Engine, role: str) -> Owner | None:
    with connected(connection) as c:
        row = c.execute(
            select(consumers.c.group_id, consumers.c.topic, consumers.c.topic_id).where(consumers.c.role == role)
        ).one_or_none()
    return None if row is None else Owner(role, *row)


def owners(engine: Engine) -> dict[str, Owner]:
    with engine.connect() as connection:
        rows = connection.execute(
            select(consumers.c.role, consumers.c.group_id, consumers.c.topic, consumers.c.topic_id)
        )
        return {role: Owner(role, group, topic, topic_id) for role, group, topic, topic_id in rows}


def counted_topics(engine: Engine) -> dict[str, list[str]]:
    """Topic name -> the roles whose tables in this database count it (empty: nothing claimed yet)."""
    found: dict[str, list[str]] = {}
    for role, owner in sorted(owners(engine).items()):
        found.setdefault(owner.topic, []).append(role)
    return found


def claim(engine: Engine, wanted: Owner, now: datetime, recount: Mapping[int, int] | None = None) -> Owner:
    """Register `wanted`'s group and topic as its role's owner if the role has none; refuse (IdentityMismatch) if
    it has another. Returns the recorded owner.

    The topic id is not recorded here: only once the group's fences were found to
    fit the topic's log (`record_topic_id`, in the transaction that positions the
    consumer), so a topic replaced before the first start with ids is not taken
    for the one the counts belong to. `recount`, the records per partition a new
    group would count again, goes into the message about a rename.
    """
    dialect = postgresql if engine.dialect.name == "postgresql" else sqlite
    with engine.begin() as connection:
        # A write first, so SQLite takes its write lock before the read (as PartitionFences.lock does).
        connection.execute(
            dialect.insert(consumers).on_conflict_do_nothing(),
            [
                {
                    "role": wanted.role,
                    "group_id": wanted.group_id,
                    "topic": wanted.topic,
                    "topic_id": None,
                    "registered_at": now,
                    "updated_at": now,
                    "claim_id": claim_mark(wanted.role, now),
                }
            ],
        )
        check_role_clash(connection, wanted)
        recorded = owner_of(connection, wanted.role)
        assert recorded is not None
        mismatch(recorded, wanted, recount)
        return recorded


def check_role_clash(connection: Connection, wanted: Owner) -> None:
    """IdentityMismatch when `wanted`'s group is recorded as the writer of another role's tables.

    The fences are rows per group and topic: one group for both roles would share
    them, and each role would skip as applied what the other applied. Checked in
    every claim and every explicit change of owner (reset, takeover), so no path
    records one group for two roles. A takeover cannot fix this, so the message
    does not offer one.
    """
    rows = connection.execute(
        select(consumers.c.role).where(consumers.c.group_id == wanted.group_id, consumers.c.role != wanted.role)
    ).all()
    for (other,) in rows:
        raise IdentityMismatch(
            f"group {wanted.group_id!r} writes the {TABLES[other]} ({other}) in this database, so it cannot also "
            f"write the {TABLES[wanted.role]} ({wanted.role}): the two roles keep their fences per group, and one "
            f"would skip what the other applied; nothing was applied. Give the {wanted.role} role a group of its "
            f"own: SKILLSTATS_{wanted.role.upper()}_GROUP (--group) must differ from "
            f"SKILLSTATS_{other.upper()}_GROUP."
        )


def record_topic_id(connection: Connection, owner: Owner, now: datetime) -> None:
    """Inside the caller's transaction: `owner`'s topic id, for a role whose id is not known yet."""
    connection.execute(
        update(consumers)
        .where(consumers.c.role == owner.role, consumers.c.group_id == owner.group_id, consumers.c.topic_id.is_(None))
        .values(topic_id=owner.topic_id, updated_at=now)
    )


def mismatch(recorded: Owner | None, wanted: Owner, recount: Mapping[int, int] | None = None) -> None:
    """Raise IdentityMismatch when `wanted` is not `recorded` (an unknown topic id on either side passes)."""
    if recorded is None:
        return
    if recorded.group_id != wanted.group_id:
        raise IdentityMismatch(group_message(recorded, wanted.group_id, recount))
    if recorded.topic != wanted.topic:
        raise IdentityMismatch(
            f"the {TABLES[recorded.role]} in this database hold the counts of topic {recorded.topic!r}, and group "
            f"{wanted.group_id!r} is set to read {wanted.topic!r}: its records would be added to another topic's "
            f"counts, so nothing was applied. Check SKILLSTATS_TOPIC (--topic). To count {wanted.topic!r} from now "
            f"on instead: `skillstats fences reset --group {wanted.group_id} --topic {wanted.topic} --to start` (or "
            f"--to end), which records the new topic (docs: README, 'Fences')."
        )
    if recorded.topic_id is not None and wanted.topic_id is not None and recorded.topic_id != wanted.topic_id:
        raise IdentityMismatch(topic_replaced_message(recorded, wanted.topic_id))


def topic_replaced_message(recorded: Owner, now_id: str) -> str:
    if recorded.role == REBUILD:
        return (
            f"topic {recorded.topic!r} is not the one rebuild group {recorded.group_id!r} read: its Kafka topic id "
            f"was {recorded.topic_id} and is now {now_id} (deleted and created again, or another cluster). A rebuild "
            f"cannot go on over another log: `skillstats rebuild drop --confirm DROP` it, and start again once the "
            f"live group counts the topic as it is now."
        )
    return (
        f"topic {recorded.topic!r} is not the one group {recorded.group_id!r} counted: its Kafka topic id was "
        f"{recorded.topic_id} and is now {now_id}. It was deleted and created again, or another cluster answers "
        f"under the same name; its offsets start over, so the fences would skip its first records as already "
        f"applied, and nothing was applied. Stop the group, then choose: `skillstats fences reset --group "
        f"{recorded.group_id} --to start --confirm RESET_FENCES` counts what the topic holds now, `--to end` only "
        f"what arrives from now on (docs: README, 'Fences')."
    )


def group_message(recorded: Owner, wanted_group: str, recount: Mapping[int, int] | None) -> str:
    again = ""
    if recount is not None:
        total = sum(recount.values())
        again = f" ({total:,} record(s) over {sum(1 for n in recount.values() if n)} partition(s))"
    return (
        f"the {TABLES[recorded.role]} in this database are written by group {recorded.group_id!r}, not "
        f"{wanted_group!r}. A group of another name starts without fences, so it would count again everything "
        f"{recorded.group_id!r} already counted that topic {recorded.topic!r} still holds{again}; nothing was "
        f"applied. If {wanted_group!r} is the same group renamed, stop {recorded.group_id!r}'s consumers and hand "
        f"its fences over: `skillstats fences takeover --from {recorded.group_id} --group {wanted_group} --confirm "
        f"{TAKEOVER_TOKEN}`. If it is another deployment, give it a database of its own. Otherwise check "
        f"SKILLSTATS_{recorded.role.upper()}_GROUP (--group)."
    )


def not_the_owner_message(recorded: Owner, group: str) -> str:
    """Why an operator's tool refuses to make `group` the owner of tables `recorded.group_id` writes."""
    return (
        f"the {TABLES[recorded.role]} in this database hold the counts of group {recorded.group_id!r}, not "
        f"{group!r}: a reset would make {group!r} their writer with fences of its own, and it would count again "
        f"what {recorded.group_id!r} counted; nothing was changed. Reset {recorded.group_id!r} itself, or, if "
        f"{group!r} is that group renamed, hand its fences over first: `skillstats fences takeover --from "
        f"{recorded.group_id} --group {group} --confirm {TAKEOVER_TOKEN}`."
    )


def record(connection: Connection, owner: Owner, now: datetime) -> None:
    """Set `owner` as its role's owner outright, inside the caller's transaction (a reset or a takeover)."""
    check_role_clash(connection, owner)
    dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
    values = {"group_id": owner.group_id, "topic": owner.topic, "topic_id": owner.topic_id, "updated_at": now}
    connection.execute(
        dialect.insert(consumers)
        .values(role=owner.role, registered_at=now, claim_id=claim_mark(owner.role, now), **values)
        .on_conflict_do_update(index_elements=["role"], set_=values)
    )


# Which database counts a group, as its Kafka offset commits carry it (their metadata): MARK_PREFIX and the
# role's claim_id. Derived from the role and the moment it was first claimed in this database, so it is kept
# through resets and takeovers (the same counts go on), carried by a restored backup (even one from before the
# column existed: migration 0007 derives it from the same row), and different for a database of its own.
MARK_PREFIX = "skillstats-database:"
_MARK_PATTERN = re.compile(re.escape(MARK_PREFIX) + "[0-9a-f]{32}")


def claim_mark(role: str, registered_at: datetime) -> str:
    """The claim's mark: a digest of the role and its first claim's time (naive UTC, to the microsecond)."""
    moment = registered_at.replace(tzinfo=None).isoformat(timespec="microseconds")
    return hashlib.sha256(f"skillstats-claim\0{role}\0{moment}".encode()).hexdigest()[:32]


def commit_metadata_for(mark: str) -> str:
    """The offset-commit metadata that carries `mark`: the mark and a NUL.

    librdkafka (confluent-kafka, which docsync, `status` and the operator's tools
    read commits with) hands metadata to Python as a C string: metadata written
    without a terminating NUL (as aiokafka, the windows worker's client, writes it)
    is read past its end, with junk appended or a decode error, and memory that is
    not its own touched. confluent-kafka's own commits store the NUL; so the windows
    worker writes it too, and every commit of ours reads back exactly.
    """
    return mark + "\0"


def _mark_in(metadata: str) -> str | None:
    """The mark a commit's metadata carries (None: none of ours), whatever was read past its NUL."""
    found = _MARK_PATTERN.match(metadata.split("\0", 1)[0])
    return found.group(0) if found else None


def recorded_mark(engine: Engine, role: str) -> str | None:
    """This database's mark for `role` as recorded (None: not claimed, or no mark yet); reads only."""
    with engine.connect() as connection:
        found = connection.execute(select(consumers.c.claim_id).where(consumers.c.role == role)).scalar()
    return None if found is None else MARK_PREFIX + found


def database_mark(engine: Engine, role: str) -> str:
    """The commit metadata that says this database counts `role`'s group (a mark made now if the row has none)."""
    with engine.begin() as connection:
        row = connection.execute(
            select(consumers.c.claim_id, consumers.c.registered_at).where(consumers.c.role == role)
        ).one_or_none()
        if row is None:
            raise IdentityMismatch(f"the {role} role is not claimed in this database: nothing to mark")
        found, registered_at = row
        if found is None:
            found = claim_mark(role, registered_at)
            connection.execute(
                update(consumers).where(consumers.c.role == role, consumers.c.claim_id.is_(None)).values(claim_id=found)
            )
    return MARK_PREFIX + found


def other_databases(mark: str, committed: Mapping[int, str | None]) -> dict[int, str]:
    """The partitions whose last Kafka commit says another database counts the group (no mark: none says)."""
    found = {p: _mark_in(m or "") for p, m in committed.items()}
    return {p: m for p, m in found.items() if m is not None and m != mark}


def another_database_message(group: str, topic: str, mark: str, theirs: Mapping[int, str], bootstrap: str) -> str:
    partitions = ", ".join(str(p) for p in sorted(theirs)[:12]) + (" ..." if len(theirs) > 12 else "")
    other = sorted(set(theirs.values()))[0].removeprefix(MARK_PREFIX)
    return (
        f"group {group!r} on topic {topic!r} is counted by another database: its Kafka commits of partitions "
        f"{partitions} carry database mark {other}, and this database's is {mark.removeprefix(MARK_PREFIX)}. Two "
        f"databases under one group split its partitions, and each would miss what the other reads; nothing was "
        f"applied. Give this deployment a group of its own (SKILLSTATS_WINDOWS_GROUP / SKILLSTATS_DOCSYNC_GROUP, "
        f"then `skillstats fences` shows where it starts), or point it at the database that counts the group. If "
        f"this database is meant to replace that one, stop every consumer of the group, delete the group's "
        f"committed offsets (they are hints; the SQL fences are the position): `kafka-consumer-groups.sh "
        f"--bootstrap-server {bootstrap} --delete --group {group}`, and start again."
    )


def take_over(engine: Engine, role: str, old_group: str, new_group: str, now: datetime) -> int:
    """Hand `old_group`'s fences and `role` to `new_group`, in one transaction; returns the fence rows moved."""
    with engine.begin() as connection:
        recorded = owner_of(connection, role)
        check_role_clash(connection, Owner(role, new_group, recorded.topic if recorded else "", None))
        if recorded is not None and recorded.group_id != old_group:
            raise IdentityMismatch(
                f"the {role} role belongs to group {recorded.group_id!r}, not {old_group!r}: nothing was handed over"
            )
        mine = (partition_fences.c.group_id == new_group,)
        clash = connection.execute(select(partition_fences.c.partition).where(*mine).limit(1)).first()
        if clash is not None:
            raise IdentityMismatch(
                f"group {new_group!r} already has fences of its own (it has counted before): a takeover would mix "
                f"two groups' positions, so nothing was handed over"
            )
        moved = connection.execute(
            update(partition_fences)
            .where(partition_fences.c.group_id == old_group)
            .values(group_id=new_group, updated_at=now)
        ).rowcount
        topic = recorded.topic if recorded is not None else None
        if topic is None:
            topic = connection.execute(
                select(partition_fences.c.topic).where(partition_fences.c.group_id == new_group).limit(1)
            ).scalar()
        if topic is None:
            raise IdentityMismatch(f"group {old_group!r} has no fences: there is nothing to hand over")
        record(connection, Owner(role, new_group, topic, recorded.topic_id if recorded else None), now)
        return int(moved)


def release(engine: Engine, role: str) -> None:
    """Forget who owns `role`: for a benchmark's scratch database only, whose every run is a new group and topic.

    Never part of operating skillstats: a released role is claimed by whichever
    group starts next, which is exactly what the claim is there to prevent.
    """
    with engine.begin() as connection:
        connection.execute(consumers.delete().where(consumers.c.role == role))
