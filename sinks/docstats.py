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
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import bindparam, func, select, update

from skillstats.contract import FIXED_SKILL_DELTAS, Invalid, StatEvent
from skillstats.sinks.fences import PartitionFences
from skillstats.sinks.schema import skills, user_skill_stats
from skillstats.sinks.upserts import now_utc_naive, upsert_adding

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

    def add_decoded(self, events: Sequence[StatEvent | None], invalid: Sequence[tuple[int, Invalid]]) -> None:
        """Fold what `decode_many` made of some of this partition's records (None: an invalid one)."""
        for _index, why in invalid:
            reason = why.reason.value
            self.invalid_reasons[reason] = self.invalid_reasons.get(reason, 0) + 1
        self.invalid += len(invalid)
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


@dataclass
class DocApplyOutcome:
    partitions: int = 0
    skills_updated: int = 0
    owners_updated: int = 0
    unknown_skill_events: int = 0
    lost_to_another_writer: list[int] = field(default_factory=list)


class DocStatsSink(PartitionFences):
    """Applies whole-partition deltas to `skills` and `user_skill_stats` behind the fences."""

    def apply_partitions(self, drained: Sequence[PartitionDeltas]) -> DocApplyOutcome:
        """One transaction: the partitions' deltas and their fences, each only if its fence is unmoved."""
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
            for skill_id in sorted(totals):
                downloads, all_time, current, events = totals[skill_id]
                if skill_id not in owners:
                    outcome.unknown_skill_events += events
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
            self.advance(connection, locked, {part.partition: part.next_offset for part in mine}, now)
        outcome.partitions = len(mine)
        outcome.skills_updated = len(changed)
        outcome.owners_updated = len(per_owner)
        return outcome

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
        if not changed:
            return
        # COALESCE: a registry that created `skills` itself may have left a stat column
        # without a default, and NULL + 1 would lose the count.
        statement = (
            update(skills)
            .where(skills.c.id == bindparam("skill"))
            .values(
                downloads=_coalesce(skills.c.downloads) + bindparam("d"),
                installs_all_time=_coalesce(skills.c.installs_all_time) + bindparam("a"),
                installs_current=_coalesce(skills.c.installs_current) + bindparam("c"),
                stats_updated_at=now,
            )
        )
        connection.execute(statement, [{"skill": s, "d": d, "a": a, "c": c} for s, d, a, c in changed])


def _coalesce(column: Any) -> Any:
    return func.coalesce(column, 0)
