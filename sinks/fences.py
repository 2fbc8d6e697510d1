"""Per-partition fences: the SQL cursor each consumer group moves in the same transaction as its counts.

A fence row holds, for one group, topic and partition, the next offset not yet
applied. It is written only inside the transaction that applies the records
below it, after being read under a row lock, so it always says exactly what is
in SQL, whatever Kafka's committed offsets say (those are a resume hint, clamped
to the fence, never the truth).

The row also carries the windows group's DLQ mark (`dlq_partition`,
`dlq_next_offset`): a DLQ offset below which no parcel for a record above the
fence can sit. A batch replayed after a crash reads the DLQ from that mark to
find what it parked before it died, so a record is parked once (see
skillstats.dlq).

The fence is also the position: on every assignment a consumer reads each
partition from its fence (`begin_reading`), never from Kafka's committed
offset, which a restored database, a lost SQLite tail or an admin's offset
reset leaves ahead of it. Against the partition's log as it is now:

- a fence inside the log is where reading starts, and nothing is jumped over;
- a fence below the log start means retention deleted records before they were
  applied: they are lost, for good. The fence is moved up to the log start in a
  transaction of its own that also adds them to the row's `offsets_lost`, and
  the consumer logs it at ERROR and counts it (`records_lost_to_retention`); it
  is never inferred from a gap in a batch;
- a partition without a fence row starts at the log start (a row is created
  there);
- a fence above the log end means the log is not the one the database counted
  (the topic was recreated or truncated, or the database restored from another
  cluster). Records below such a fence would be skipped as "already applied"
  for ever, so the consumers refuse to run (`FenceAheadOfLog`) until an
  operator chooses with `skillstats fences reset`. (A recreated topic that has
  already grown past the fence is caught by its topic id: sinks/identity.py.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, and_, bindparam, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite

from skillstats.sinks.identity import Owner, mismatch, not_the_owner_message, owner_of, record, record_topic_id
from skillstats.sinks.schema import dlq_replays, partition_fences, rejected_records

DlqMark = tuple[int, int]  # (DLQ partition, DLQ offset to read parked parcels from)
RESET_TOKEN = "RESET_FENCES"


@dataclass(frozen=True, slots=True)
class FenceRow:
    next_offset: int
    dlq_mark: DlqMark | None


@dataclass(frozen=True, slots=True)
class ReadStart:
    """Where a partition's reading starts (its fence after `begin_reading`) and what that took."""

    partition: int
    offset: int
    lost: tuple[int, int] | None = None  # [first, end) deleted by retention before it was applied, now passed
    created: bool = False  # there was no fence row: it starts at the log start


class FenceAheadOfLog(RuntimeError):
    """A stored fence is past the end of its partition's log: refuse to skip records silently."""

    def __init__(self, group: str, topic: str, ahead: Mapping[int, tuple[int, int]]) -> None:
        self.group, self.topic, self.ahead = group, topic, dict(ahead)
        where = ", ".join(f"partition {p}: fence {f} > log end {e}" for p, (f, e) in sorted(ahead.items()))
        super().__init__(
            f"group {group!r} has SQL fences past the end of topic {topic!r} ({where}). The topic was recreated "
            f"or truncated, or the database restored from another cluster; records below those fences would be "
            f"skipped as already applied, so nothing was applied. See `skillstats status`, then choose: "
            f"`skillstats fences reset --group {group} --to start --confirm {RESET_TOKEN}` counts what the topic "
            f"holds now, `--to end` counts only what arrives from now on (docs: README, 'Fences')."
        )


def check_within_log(group: str, topic: str, fences: Mapping[int, int], ends: Mapping[int, int]) -> None:
    """Raise FenceAheadOfLog when a fence is past its partition's log end (a missing partition has end 0)."""
    ahead = {p: (f, ends.get(p, 0)) for p, f in fences.items() if f > ends.get(p, 0)}
    if ahead:
        raise FenceAheadOfLog(group, topic, ahead)


_FENCE_COLUMNS = select(
    partition_fences.c.partition,
    partition_fences.c.next_offset,
    partition_fences.c.dlq_partition,
    partition_fences.c.dlq_next_offset,
)


class PartitionFences:
    """One consumer group's per-partition fences on one topic, in SQL."""

    # Set once the consumer has claimed its role (sinks/identity.py): every transaction that
    # writes counts then checks, before it writes, that the database still names this owner.
    owner: Owner | None = None

    def __init__(self, engine: Engine, group_id: str, topic: str) -> None:
        self.engine = engine
        self.group_id = group_id
        self.topic = topic

    def check_owner(self, connection: Connection) -> None:
        """Raise IdentityMismatch when the database's owner of this group's role is no longer `owner`."""
        if self.owner is not None:
            mismatch(owner_of(connection, self.owner.role), self.owner)

    def begin_reading(
        self, logs: Mapping[int, tuple[int, int]], now: datetime, owner: Owner | None = None
    ) -> dict[int, ReadStart]:
        """Where to read each partition of `logs` (partition -> (log start, log end)) from: its fence.

        One transaction: a missing fence row is created at the log start, a fence
        below the log start is moved up to it (counting the offsets lost), and a
        fence past the log end raises FenceAheadOfLog with nothing changed. Once the
        fences fit the log, `owner`'s topic id is recorded if its role has none yet.
        """
        wanted = sorted(logs)
        if not wanted:
            return {}
        with self.engine.begin() as connection:
            created = self._create(connection, wanted, now, {p: logs[p][0] for p in wanted})
            existing = self._locked(connection, wanted)
            ahead = {p: (row.next_offset, logs[p][1]) for p, row in existing.items() if row.next_offset > logs[p][1]}
            if ahead:
                raise FenceAheadOfLog(self.group_id, self.topic, ahead)
            if owner is not None and owner.topic_id is not None:
                record_topic_id(connection, owner, now)
            starts: dict[int, ReadStart] = {}
            moved = []
            for p in wanted:
                fence, log_start = existing[p].next_offset, logs[p][0]
                if fence < log_start:
                    moved.append({"p": p, "n": log_start, "lost": log_start - fence})
                    starts[p] = ReadStart(p, log_start, lost=(fence, log_start))
                else:
                    starts[p] = ReadStart(p, fence, created=p in created)
            if moved:
                connection.execute(
                    update(partition_fences)
                    .where(self._mine(), partition_fences.c.partition == bindparam("p"))
                    .values(
                        next_offset=bindparam("n"),
                        offsets_lost=partition_fences.c.offsets_lost + bindparam("lost"),
                        updated_at=now,
                    ),
                    moved,
                )
            return starts

    def record_rejected(self, connection: Connection, records: Sequence[tuple[int, int]], now: datetime) -> None:
        """Inside the transaction whose fences pass them: the records the database refused (parked)."""
        dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
        connection.execute(
            dialect.insert(rejected_records).on_conflict_do_nothing(),
            [
                {"group_id": self.group_id, "topic": self.topic, "partition": p, "offset": o, "rejected_at": now}
                for p, o in records
            ],
        )

    def offsets_lost(self) -> dict[int, int]:
        """Per partition, offsets retention deleted before this group applied them (only partitions with any)."""
        with self.engine.connect() as connection:
            found = connection.execute(
                select(partition_fences.c.partition, partition_fences.c.offsets_lost).where(
                    self._mine(), partition_fences.c.offsets_lost > 0
                )
            )
            return {p: n for p, n in found}

    def fences(self) -> dict[int, int]:
        """Next offset to apply, per partition this group has written."""
        return {p: row.next_offset for p, row in self.rows().items()}

    def rows(self) -> dict[int, FenceRow]:
        with self.engine.connect() as connection:
            found = connection.execute(_FENCE_COLUMNS.where(self._mine()))
            return {p: _row(n, dp, do) for p, n, dp, do in found}

    def _mine(self) -> Any:
        return and_(partition_fences.c.group_id == self.group_id, partition_fences.c.topic == self.topic)

    def lock(
        self,
        connection: Connection,
        partitions: Iterable[int],
        now: datetime,
        create_at: Mapping[int, int] | None = None,
        create_none_of: Iterable[int] = (),
    ) -> dict[int, FenceRow]:
        """Create missing fence rows (at `create_at`, else 0; none for `create_none_of`), then lock the rows
        (in partition order: no deadlocks) and read them."""
        wanted = sorted(set(partitions))
        creating = sorted(set(wanted) - set(create_none_of))
        if creating:
            self._create(connection, creating, now, create_at or {})
        elif wanted and connection.dialect.name == "sqlite":
            # Still a write first, so SQLite takes its write lock before any fence is read (sinks/db.py).
            self._create(connection, [], now, {})
        return self._locked(connection, wanted)

    def _create(self, connection: Connection, wanted: list[int], now: datetime, at: Mapping[int, int]) -> set[int]:
        """Insert the missing fence rows; returns the partitions whose rows this created.

        With none wanted on SQLite, a write that changes nothing still takes the write lock."""
        dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
        if not wanted:
            connection.execute(
                update(partition_fences).where(self._mine(), partition_fences.c.partition == -1).values(next_offset=0)
            )
            return set()
        rows = [
            {
                "group_id": self.group_id,
                "topic": self.topic,
                "partition": p,
                "next_offset": at.get(p, 0),
                "updated_at": now,
            }
            for p in wanted
        ]
        statement = dialect.insert(partition_fences).values(rows).on_conflict_do_nothing()
        return set(connection.execute(statement.returning(partition_fences.c.partition)).scalars())

    def _locked(self, connection: Connection, wanted: list[int]) -> dict[int, FenceRow]:
        if not wanted:
            return {}
        found = connection.execute(
            _FENCE_COLUMNS.where(self._mine(), partition_fences.c.partition.in_(wanted))
            .order_by(partition_fences.c.partition)
            .with_for_update()
        )
        return {p: _row(n, dp, do) for p, n, dp, do in found}

    def advance(
        self,
        connection: Connection,
        locked: Mapping[int, FenceRow],
        advanced: Mapping[int, int],
        now: datetime,
        dlq_marks: Mapping[int, tuple[DlqMark | None, DlqMark]] | None = None,
    ) -> None:
        """Write new fences (and DLQ marks) for rows this transaction holds locked.

        `dlq_marks` maps a partition to (the mark its DLQ read started from, the new
        mark). The new mark replaces the stored one only if nobody changed it since
        that read; otherwise the lower of the two is kept. A mark too low costs a
        longer read; a mark too high could park a record twice.
        """
        values: dict[int, dict[str, Any]] = {}
        for p, next_offset in advanced.items():
            values[p] = {"n": max(next_offset, locked[p].next_offset)}
        for p, (seen, new) in (dlq_marks or {}).items():
            stored = locked[p].dlq_mark
            mark = new if stored == seen or stored is None or stored[0] != new[0] else min(stored, new)
            values.setdefault(p, {"n": locked[p].next_offset}).update(dp=mark[0], do=mark[1])
        if not values:
            return
        plain = [{"p": p, "n": v["n"]} for p, v in sorted(values.items()) if "dp" not in v]
        marked = [{"p": p, **v} for p, v in sorted(values.items()) if "dp" in v]
        where = (self._mine(), partition_fences.c.partition == bindparam("p"))
        if plain:
            connection.execute(
                update(partition_fences).where(*where).values(next_offset=bindparam("n"), updated_at=now), plain
            )
        if marked:
            connection.execute(
                update(partition_fences)
                .where(*where)
                .values(
                    next_offset=bindparam("n"),
                    dlq_partition=bindparam("dp"),
                    dlq_next_offset=bindparam("do"),
                    updated_at=now,
                ),
                marked,
            )

    def reset(
        self,
        targets: Mapping[int, int],
        dlq_marks: Mapping[int, DlqMark],
        now: datetime,
        owner: Owner | None = None,
        replaced: bool = False,
        dropped: Sequence[int] = (),
    ) -> None:
        """Set fences outright (an operator's explicit choice, see `skillstats fences reset`), and record `owner`
        (the group, the topic and its id as they are now) as its role's, in the same transaction.

        The DLQ marks move to the DLQ's current end: parcels already there belong to
        the records before the reset (a recreated topic reuses their offsets), and
        must not pass for parcels of the records to come. For a `replaced` topic, what
        SQL knows by position in the old one is forgotten too: where replayed copies
        landed (a new record there is no copy; its root stays replayed, never sent
        again) and which records its database refused.
        """
        with self.engine.begin() as connection:
            self.lock(connection, targets, now)
            if owner is not None:
                record(connection, owner, now)
            if replaced:
                connection.execute(
                    update(dlq_replays)
                    .where(or_(dlq_replays.c.source_topic == self.topic, dlq_replays.c.source_topic.is_(None)))
                    .values(copy_partition=None, copy_offset=None)
                )
                # This group's only: another role's records of the topic are its own to forget, at its own reset.
                connection.execute(
                    rejected_records.delete().where(
                        rejected_records.c.topic == self.topic, rejected_records.c.group_id == self.group_id
                    )
                )
            if dropped:  # rows of partitions the topic does not have: written against another topic
                connection.execute(
                    partition_fences.delete().where(self._mine(), partition_fences.c.partition.in_(list(dropped)))
                )
            connection.execute(
                update(partition_fences)
                .where(self._mine(), partition_fences.c.partition == bindparam("p"))
                .values(
                    next_offset=bindparam("n"),
                    dlq_partition=bindparam("dp"),
                    dlq_next_offset=bindparam("do"),
                    updated_at=now,
                ),
                [{"p": p, "n": n, "dp": dlq_marks[p][0], "do": dlq_marks[p][1]} for p, n in sorted(targets.items())],
            )


@dataclass(frozen=True, slots=True)
class ResetPlan:
    """What `skillstats fences reset` would do (`plan_reset`), or why it refuses (`refusal`)."""

    targets: dict[int, int]  # partition -> its new fence
    left: dict[int, int | None]  # partitions not chosen -> their fence (None: no row, reads from the log start)
    dropped: list[int]  # fence rows of partitions the topic does not have: removed
    replaced: bool  # the counts so far belong to another topic (name or id)
    records_id: bool  # the reset records this topic's id as the one the counts belong to
    refusal: str | None = None


def plan_reset(
    group: str,
    topic: str,
    topic_id: str | None,
    recorded: Owner | None,
    logs: Mapping[int, tuple[int, int]],
    current: Mapping[int, int],
    chosen: Iterable[int] | None,
    to: str,
) -> ResetPlan:
    """A reset of `group`'s fences on `topic` (`logs`: partition -> (log start, log end) now) to the log `to`
    ("start" or "end"), for the partitions `chosen` (None: every one), against what the tables hold.

    Refused when `group` is not the recorded owner of the role's tables (a new name
    would count again everything the owner counted: `takeover` renames), and when
    the reset records the topic's id (a replaced topic, or the first id) but would
    leave a fence that does not fit this log: once the id is recorded every check
    passes, and such a fence skips the head of the new log as applied. So a
    replaced topic is reset whole, a first id needs the fences left alone within
    their log, and rows of partitions the topic does not have are dropped.
    """
    wanted = set(logs) if chosen is None else set(chosen) & set(logs)
    replaced = recorded is not None and (
        recorded.topic != topic or (recorded.topic_id is not None and recorded.topic_id != topic_id)
    )
    records_id = replaced or (topic_id is not None and (recorded is None or recorded.topic_id is None))
    targets = {p: (low if to == "start" else high) for p, (low, high) in logs.items() if p in wanted}
    left = {p: current.get(p) for p in logs if p not in wanted}
    dropped = sorted(p for p in current if p not in logs) if records_id else []
    plan = ResetPlan(targets, left, dropped, replaced, records_id)
    if recorded is not None and recorded.group_id != group:
        return replace(plan, refusal=not_the_owner_message(recorded, group))
    if not left or not records_id:
        return plan
    where = ", ".join(str(p) for p in sorted(left))
    if replaced:
        return replace(
            plan,
            refusal=(
                f"topic {topic} is not the one group {group}'s fences were written against, and partitions {where} "
                f"would keep fences of the old topic: once the new topic's id is recorded they would pass every "
                f"check and skip the head of its log as applied. Reset every partition (leave out --partition); "
                f"nothing was changed"
            ),
        )
    ahead = sorted(p for p, fence in left.items() if fence is not None and fence > logs[p][1])
    if ahead:
        return replace(
            plan,
            refusal=(
                f"this reset records topic {topic}'s id for group {group} for the first time, and the fences of "
                f"partitions {', '.join(map(str, ahead))} (not chosen) are past their log end: they were written "
                f"against another log. Reset them too (or every partition); nothing was changed"
            ),
        )
    return plan


def _row(next_offset: int, dlq_partition: int | None, dlq_next_offset: int | None) -> FenceRow:
    mark = None if dlq_partition is None or dlq_next_offset is None else (dlq_partition, dlq_next_offset)
    return FenceRow(next_offset, mark)
