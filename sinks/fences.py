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

A fence above the partition's log end means the log is not the one the
database counted (the topic was recreated or truncated, or the database was
restored from elsewhere). Records below such a fence would be skipped as
"already applied" for ever, so the consumers refuse to run (`FenceAheadOfLog`)
until an operator chooses with `skillstats fences reset`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, and_, bindparam, select, update
from sqlalchemy.dialects import postgresql, sqlite

from skillstats.sinks.schema import partition_fences

DlqMark = tuple[int, int]  # (DLQ partition, DLQ offset to read parked parcels from)
RESET_TOKEN = "RESET_FENCES"


@dataclass(frozen=True, slots=True)
class FenceRow:
    next_offset: int
    dlq_mark: DlqMark | None


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

    def __init__(self, engine: Engine, group_id: str, topic: str) -> None:
        self.engine = engine
        self.group_id = group_id
        self.topic = topic

    def fences(self) -> dict[int, int]:
        """Next offset to apply, per partition this group has written."""
        return {p: row.next_offset for p, row in self.rows().items()}

    def rows(self) -> dict[int, FenceRow]:
        with self.engine.connect() as connection:
            found = connection.execute(_FENCE_COLUMNS.where(self._mine()))
            return {p: _row(n, dp, do) for p, n, dp, do in found}

    def _mine(self) -> Any:
        return and_(partition_fences.c.group_id == self.group_id, partition_fences.c.topic == self.topic)

    def lock(self, connection: Connection, partitions: Iterable[int], now: datetime) -> dict[int, FenceRow]:
        """Create missing fence rows at 0, then lock the rows (in partition order: no deadlocks) and read them."""
        wanted = sorted(set(partitions))
        if not wanted:
            return {}
        dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
        connection.execute(
            dialect.insert(partition_fences).on_conflict_do_nothing(),
            [
                {"group_id": self.group_id, "topic": self.topic, "partition": p, "next_offset": 0, "updated_at": now}
                for p in wanted
            ],
        )
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

    def reset(self, targets: Mapping[int, int], dlq_marks: Mapping[int, DlqMark], now: datetime) -> None:
        """Set fences outright (an operator's explicit choice, see `skillstats fences reset`).

        The DLQ marks move to the DLQ's current end: parcels already there belong to
        the records before the reset (a recreated topic reuses their offsets), and
        must not pass for parcels of the records to come.
        """
        with self.engine.begin() as connection:
            self.lock(connection, targets, now)
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


def _row(next_offset: int, dlq_partition: int | None, dlq_next_offset: int | None) -> FenceRow:
    mark = None if dlq_partition is None or dlq_next_offset is None else (dlq_partition, dlq_next_offset)
    return FenceRow(next_offset, mark)
