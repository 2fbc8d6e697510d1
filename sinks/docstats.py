"""The doc-stats sink: per-skill stat columns and per-owner totals, once per drain (docs/contract.md).

Those rows are read by every page of the registry, so each is patched at most
once per drain rather than once per batch: a partition's deltas for the whole
drain are applied in one transaction together with that partition's fence, so
the fence says exactly what is in SQL.

Correctness does not depend on a skill living in one partition. The publishers
are meant to key by skill with murmur2 (docs/contract.md, validity), but one that uses another
partitioner (kcat, librdkafka's default consistent_random) or a topic whose
partition count was raised spreads one skill over several partitions. Deltas
for one skill from the partitions of a transaction are therefore summed, never
one partition's replacing another's: each partition's fence moves past exactly
the records whose deltas went in, whichever partitions a skill's events took.

The fence is also the lock between drains: a drain remembers the fence it
started reading a partition from and applies only if the fence is still there
(compare-and-set under the row lock), so two drains that both read a partition
(a rebalance between two processes) cannot both apply it.

A partition the database refuses for good (a registry constraint such as
`CHECK (installs_current >= 0)` rejecting one skill's delta) must not hold the
others back. When a transaction fails on the data itself, the same partitions
are applied again one by one, each in a savepoint of one transaction
(`one_by_one`): those the database accepts are applied with their fences, and a
refused one is rolled back to its savepoint and *held back*: nothing of it is
applied, its fence stays where it was, and the next drain reads and tries it
again, so its deltas still count exactly once, when the database takes them.
It is not parked: docsync folds a partition's events per skill, so what the
database refuses is a sum against the registry's row, not one record, and the
windows group counts those very records (parking them would drop valid events
from these columns for good). What holding costs: the held partition's other
skills wait with it, until the row or the constraint is fixed. The refused
skill is looked for by halving the partition's skill updates in savepoints that
are always rolled back (log2 of its skills in UPDATEs, only for a refused
partition), so the error says which row to look at.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select

from skillstats.contract import FIXED_SKILL_DELTAS, Invalid, StatEvent, decode_many, native
from skillstats.sinks.fences import FenceRow, PartitionFences
from skillstats.sinks.recovery import describe, is_data_error
from skillstats.sinks.schema import skills, user_skill_stats
from skillstats.sinks.upserts import add_to_existing, now_utc_naive, upsert_adding

log = logging.getLogger(__name__)
_IN_CHUNK = 1000


def register_missing_skills(connection: Any, owners: dict[str, str | None]) -> int:
    """Give the skills that have no row in `skills` one, with their owners; existing rows are left alone.

    The registry owns that table and docsync only adds to its stat columns (a skill
    without a row is skipped, docs/contract.md); this is for stacks with no registry
    in front of them, the demos. Returns how many rows were added.
    """
    ids = sorted(owners)
    existing: set[str] = set()
    for start in range(0, len(ids), _IN_CHUNK):
        chunk = ids[start : start + _IN_CHUNK]
        existing.update(connection.execute(select(skills.c.id).where(skills.c.id.in_(chunk))).scalars())
    missing = [{"id": skill, "owner_id": owners[skill]} for skill in ids if skill not in existing]
    if missing:
        connection.execute(skills.insert(), missing)
    return len(missing)


@dataclass
class PartitionDeltas:
    """What one drain read from one partition: from fence `start` up to `next_offset`."""

    partition: int
    start: int
    next_offset: int
    # skill id -> [downloads, installs_all_time, installs_current, events]
    deltas: dict[str, list[int]] = field(default_factory=dict)
    events: int = 0
    invalid: int = 0
    kinds: dict[str, int] = field(default_factory=dict)  # valid events by kind
    invalid_reasons: dict[str, int] = field(default_factory=dict)

    def add_records(
        self, keys: Sequence[bytes | None], values: Sequence[bytes | None], timestamps: Sequence[int | None]
    ) -> None:
        """Decode and fold some of this partition's records: `decode_many`'s verdicts, `add_decoded`'s counts.

        With the C module the records it can prove valid are counted straight from their bytes
        (`fold_records`: no event built, a drain's largest per-record cost after librdkafka's); the
        rest go through `decode_many`, which alone says why a record is invalid."""
        if native is None:
            self.add_decoded(*decode_many(keys, values, timestamps))
            return
        pending = native.fold_records(keys, values, timestamps, FIXED_SKILL_DELTAS, self.kinds, self.deltas)
        if pending:
            self.add_decoded(
                *decode_many([keys[i] for i in pending], [values[i] for i in pending], [timestamps[i] for i in pending])
            )

    def add_decoded(self, events: Sequence[StatEvent | None], invalid: Sequence[tuple[int, Invalid]]) -> None:
        """Fold what `decode_many` made of some of this partition's records (None: an invalid one)."""
        for _index, why in invalid:
            reason = why.reason.value
            self.invalid_reasons[reason] = self.invalid_reasons.get(reason, 0) + 1
        self.invalid += len(invalid)
        if native is not None:  # the loop below in C (skillstats/_native.c), the same dicts
            native.fold_skills(events, FIXED_SKILL_DELTAS, self.kinds, self.deltas)
            return
        kinds = self.kinds
        deltas = self.deltas
        fixed = FIXED_SKILL_DELTAS
        for event in filter(None, events):
            kind = event.kind
            kinds[kind] = kinds.get(kind, 0) + 1
            # A non-empty tuple is true, so only the kinds that read their own delta call the method.
            downloads, all_time, current = fixed.get(kind) or event.skill_deltas()
            row = deltas.get(event.skill_id)
            if row is None:
                deltas[event.skill_id] = [downloads, all_time, current, 1]
            else:
                row[0] += downloads
                row[1] += all_time
                row[2] += current
                row[3] += 1


@dataclass(frozen=True)
class HeldPartition:
    """A partition whose deltas the database refused: nothing of it applied, its fence left at `offset`."""

    partition: int
    offset: int  # its fence: the first offset not applied, where the next drain reads it from again
    read_to: int  # the end (exclusive) of what this drain read of it
    error: str  # the database's error, on one line (and the refused skill, when one was found)

    def line(self) -> str:
        return f"partition {self.partition} held at offset {self.offset} (read to {self.read_to}): {self.error}"


# How a run's `last_error` (skillstats_docsync_runs) lists its held partitions, for `status` and
# the lag-exporter to read back (held_from_error): a header line, then one line per partition.
HELD_HEADER = "HeldBack: "
_HELD_LINE = re.compile(r"^  partition (\d+) held at offset (\d+) \(read to (\d+)\): (.*)$")


def held_error(held: Sequence[HeldPartition]) -> str:
    """The text of a run's error for its held partitions (HELD_HEADER, then a line per partition)."""
    partitions = sorted(h.partition for h in held)
    lines = [
        f"{HELD_HEADER}the database refused the deltas of partition(s) {partitions}: held back at their fences, "
        f"every other partition applied; the next drain tries them again"
    ]
    lines += [f"  {h.line()}" for h in sorted(held, key=lambda h: h.partition)]
    return "\n".join(lines)


def held_from_error(text: str | None) -> list[HeldPartition]:
    """The held partitions a run's `last_error` lists (held_error), wherever its block starts; [] if none."""
    if not text:
        return []
    held: list[HeldPartition] = []
    inside = False
    for line in text.splitlines():
        if line.startswith(HELD_HEADER):
            inside, held = True, []
            continue
        found = _HELD_LINE.match(line) if inside else None
        if found is None:
            inside = False
            continue
        partition, offset, read_to, error = found.groups()
        held.append(HeldPartition(int(partition), int(offset), int(read_to), error))
    return held


@dataclass
class DocApplyOutcome:
    partitions: int = 0
    skills_updated: int = 0
    owners_updated: int = 0
    unknown_skill_events: int = 0
    lost_to_another_writer: list[int] = field(default_factory=list)
    held: list[HeldPartition] = field(default_factory=list)  # refused by the database (one_by_one only)

    def add(self, other: DocApplyOutcome) -> None:
        self.partitions += other.partitions
        self.skills_updated += other.skills_updated
        self.owners_updated += other.owners_updated
        self.unknown_skill_events += other.unknown_skill_events


class EmptyRegistry(Exception):
    """The `skills` table has no rows: a drain would skip every event it reads, for good.

    An event for a skill with no row is skipped and its offset passed (the rule for
    deleted skills, docs/contract.md), so a first drain run before the registry's rows
    exist loses every event it reads from these columns. An operator's decision, not
    a failure to retry: docsync refuses (exit 2) unless told --allow-empty-registry.
    """

    def __init__(self, database: str) -> None:
        super().__init__(
            f"the `skills` table of {database} has no rows: every event would be for a skill with no row and be "
            f"skipped for good (the rule for deleted skills), so this drain read and applied nothing. Create the "
            f"registry's rows first (INSERT INTO skills(id, owner_id) VALUES ('sk_1', 'user_1'), ...; "
            f"`skillstats init --demo-registry` for the demo's skills), or pass --allow-empty-registry to drain anyway"
        )


class DocStatsSink(PartitionFences):
    """Applies whole-partition deltas to `skills` and `user_skill_stats` behind the fences."""

    def registry_is_empty(self) -> bool:
        """Whether `skills` has no row at all (see EmptyRegistry); one indexed read of at most one row."""
        with self.engine.connect() as connection:
            return connection.execute(select(skills.c.id).limit(1)).first() is None

    def apply_partitions(self, drained: Sequence[PartitionDeltas], *, one_by_one: bool = False) -> DocApplyOutcome:
        """One transaction: the partitions' deltas and their fences, each only if its fence is unmoved.

        By default the partitions' deltas are summed per skill (each row patched once
        per transaction), and any error fails them all. With `one_by_one`, each
        partition is applied in a savepoint of its own, and one the database refuses
        (a data error: sinks/recovery.py, is_data_error) is rolled back and returned in
        `held`, its fence unmoved, while the others commit. Refused ones are tried
        again once another was applied since (their sum may fit now); any other error
        still fails the whole transaction. It costs a statement per partition and
        table instead of one per table, so it is the way after a refusal, not the first.
        """
        outcome = DocApplyOutcome()
        if not drained:
            return outcome
        now = now_utc_naive()
        with self.engine.begin() as connection:
            locked = self.lock(connection, [d.partition for d in drained], now)
            self.check_owner(connection)
            fences = {p: row.next_offset for p, row in locked.items()}
            mine = []
            for part in drained:
                if fences[part.partition] != part.start:
                    log.warning(
                        "partition %d: fence moved from %d to %d while this drain read it (another drain applied "
                        "it, or the database went back in time), so this one does not apply it",
                        part.partition,
                        part.start,
                        fences[part.partition],
                    )
                    outcome.lost_to_another_writer.append(part.partition)
                else:
                    mine.append(part)
            if one_by_one:
                self._apply_one_by_one(connection, locked, mine, now, outcome)
            else:
                self._apply(connection, locked, mine, now, outcome)
        return outcome

    def _apply(
        self,
        connection: Any,
        locked: dict[int, FenceRow],
        mine: Sequence[PartitionDeltas],
        now: Any,
        outcome: DocApplyOutcome,
    ) -> None:
        """The deltas of `mine`, summed per skill, and their fences (rows already locked), counted into `outcome`."""
        skills, owners, unknown = self.add_deltas(connection, mine, now)
        self.advance(connection, locked, {part.partition: part.next_offset for part in mine}, now)
        outcome.partitions += len(mine)
        outcome.skills_updated += skills
        outcome.owners_updated += owners
        outcome.unknown_skill_events += unknown

    def add_deltas(self, connection: Any, mine: Sequence[PartitionDeltas], now: Any) -> tuple[int, int, int]:
        """The deltas of `mine`, summed per skill, added to `skills` and the owners' `user_skill_stats`, inside
        the caller's transaction and without any fence (what says they were applied is the caller's: the fences
        here, the legacy import's manifest there); (skills updated, owners updated, events of unknown skills)."""
        totals: dict[str, list[int]] = {}
        for part in mine:
            # Summed: a skill's events may have come through several of these partitions.
            for skill_id, row in part.deltas.items():
                total = totals.get(skill_id)
                if total is None:
                    totals[skill_id] = list(row)
                else:
                    for column, amount in enumerate(row):
                        total[column] += amount
        owners = self._owners(connection, sorted(totals))
        changed = []
        unknown = 0
        for skill_id in sorted(totals):
            downloads, all_time, current, events = totals[skill_id]
            if skill_id not in owners:
                unknown += events
            elif downloads or all_time or current:
                changed.append((skill_id, downloads, all_time, current))
        self._add_to_skills(connection, changed, now)
        per_owner: dict[str, list[int]] = {}
        for skill_id, downloads, all_time, current in changed:
            owner = owners[skill_id]
            if owner is None:
                continue
            sums = per_owner.setdefault(owner, [0, 0, 0])
            sums[0] += downloads
            sums[1] += all_time
            sums[2] += current
        upsert_adding(
            connection,
            user_skill_stats,
            ("owner_id",),
            ("downloads", "installs_all_time", "installs_current"),
            [(owner, *sums) for owner, sums in per_owner.items()],
            "updated_at",
            now,
        )
        return len(changed), len(per_owner), unknown

    def _apply_one_by_one(
        self,
        connection: Any,
        locked: dict[int, FenceRow],
        mine: Sequence[PartitionDeltas],
        now: Any,
        outcome: DocApplyOutcome,
    ) -> None:
        pending = list(mine)
        refused: list[tuple[PartitionDeltas, BaseException]] = []
        while pending:
            refused = []
            for part in pending:
                step = DocApplyOutcome()
                try:
                    with connection.begin_nested():
                        self._apply(connection, locked, [part], now, step)
                except Exception as exc:
                    if not is_data_error(exc):
                        raise  # about the database, not this partition: the whole transaction fails
                    refused.append((part, exc))
                    continue
                outcome.add(step)
            if len(refused) == len(pending):
                break
            pending = [part for part, _exc in refused]  # something was applied since: the sums may fit now
        for part, exc in refused:
            error = _one_line(describe(exc))
            detail = _detail(exc)
            if detail:
                error += f" ({detail})"
            skill = self._refused_skill(connection, part, now)
            if skill is not None:
                skill_id, downloads, all_time, current = skill
                error += (
                    f"; the row refused: skill {skill_id!r}, adding downloads {downloads:+d}, installs_all_time "
                    f"{all_time:+d}, installs_current {current:+d}"
                )
            outcome.held.append(HeldPartition(part.partition, part.start, part.next_offset, error[:1000]))

    def _refused_skill(self, connection: Any, part: PartitionDeltas, now: Any) -> tuple[str, int, int, int] | None:
        """The first skill (by id) of `part` whose update alone the database refuses, and its deltas; None when
        the skill updates pass (the owners' totals were refused) or no single one fails.

        Halving in savepoints that are always rolled back: about log2(skills) UPDATEs,
        paid only for a refused partition."""
        owners = self._owners(connection, sorted(part.deltas))
        rows = [
            (skill_id, d, a, c)
            for skill_id, (d, a, c, _events) in sorted(part.deltas.items())
            if skill_id in owners and (d or a or c)
        ]

        def refuses(candidates: list[tuple[str, int, int, int]]) -> bool:
            try:
                with connection.begin_nested() as probe:
                    self._add_to_skills(connection, candidates, now)
                    probe.rollback()
            except Exception as exc:
                if is_data_error(exc):
                    return True
                raise
            return False

        if not rows or not refuses(rows):
            return None
        while len(rows) > 1:
            half = len(rows) // 2
            rows = rows[:half] if refuses(rows[:half]) else rows[half:]
        return rows[0] if refuses(rows) else None

    def _owners(self, connection: Any, skill_ids: list[str]) -> dict[str, str | None]:
        owners: dict[str, str | None] = {}
        if connection.dialect.name == "postgresql":
            # PostgreSQL text cannot hold NUL, so no such skill can have a row; asking
            # would fail the whole transaction, and every retry of it, for ever.
            skill_ids = [s for s in skill_ids if "\x00" not in s]
        for start in range(0, len(skill_ids), _IN_CHUNK):
            chunk = skill_ids[start : start + _IN_CHUNK]
            rows = connection.execute(select(skills.c.id, skills.c.owner_id).where(skills.c.id.in_(chunk)))
            owners.update({skill_id: owner for skill_id, owner in rows})
        return owners

    def _add_to_skills(self, connection: Any, changed: list[tuple[str, int, int, int]], now: Any) -> None:
        add_to_existing(
            connection,
            skills,
            "id",
            ("downloads", "installs_all_time", "installs_current"),
            changed,
            "stats_updated_at",
            now,
        )


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _detail(exc: BaseException) -> str | None:
    """PostgreSQL's DETAIL of an error (for a CHECK violation: the failing row, which names the skill)."""
    cause = getattr(exc, "orig", None) or exc
    diag = getattr(cause, "diag", None)
    detail = getattr(diag, "message_detail", None)
    return _one_line(detail) if detail else None
