"""The windows tables in generations: a rebuild's shadow tables, the live ones, the previous ones (SQL side).

`skillstats rebuild` (skillstats/rebuild/) recomputes the windows tables from
the log beside the live ones. Its worker writes the *shadow* tables
(`skill_hourly_stats_rebuild`, `skill_daily_stats_rebuild`) through the same
fenced sink as the live worker, under a group and a claim of its own (role
`rebuild`), so it is exact under kill -9 and rebalances for the same reasons.
A swap renames, in one transaction, the live tables to `*_previous` and the
shadow ones to the live names: the registry reads the same names before and
after, and sees either generation whole, never a mix (PostgreSQL: renames are
transactional, the readers of a table wait for the rename's lock; SQLite: the
swap holds the write lock, readers in WAL mode read the last committed
generation until it commits).

Which buckets a rebuild owns (`OwnedDays`): the UTC days from `owns_from` on
(every day when NULL), except the days `skillstats legacy import` added counts
to (skillstats_imported_days: counts that are not in the log). Everything else
is *carried over*: the worker skips events of those days, and the swap copies
their rows from the live tables as they are at the swap.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from typing import Any, Final, NamedTuple

from sqlalchemy import Connection, Engine, MetaData, Table, delete, false, func, inspect, or_, select, text, update

from skillstats.contract import MS_PER_DAY, StatEvent
from skillstats.sinks.batch import PartitionBatch, Prepared
from skillstats.sinks.db import connected
from skillstats.sinks.identity import IdentityMismatch
from skillstats.sinks.schema import imported_days, rebuild_skips, rebuilds, skill_daily_stats, skill_hourly_stats
from skillstats.sinks.windows import WindowRows, WindowsSink, fold, write_buckets

SHADOW: Final = "rebuild"  # table suffixes
PREVIOUS: Final = "previous"
BUILDING, LIVE, PREVIOUS_STATE, DROPPED = "building", "live", "previous", "dropped"
_EPOCH_DAY: Final = date(1970, 1, 1)


class Generation(NamedTuple):
    """One generation's hourly and daily tables (WindowsSink.tables)."""

    hourly: Table
    daily: Table

    @property
    def names(self) -> tuple[str, str]:
        return self.hourly.name, self.daily.name


def _copy(table: Table, name: str, metadata: MetaData) -> Table:
    return Table(name, metadata, *(column._copy() for column in table.columns), **table.dialect_kwargs)


def generation(suffix: str | None) -> Generation:
    """The live tables (None), or the `suffix` ones: the same columns and keys under other names."""
    if suffix is None:
        return LIVE_TABLES
    return _GENERATIONS[suffix]


LIVE_TABLES: Final = Generation(skill_hourly_stats, skill_daily_stats)
_metadata = MetaData()
_GENERATIONS: Final = {
    suffix: Generation(
        _copy(skill_hourly_stats, f"{skill_hourly_stats.name}_{suffix}", _metadata),
        _copy(skill_daily_stats, f"{skill_daily_stats.name}_{suffix}", _metadata),
    )
    for suffix in (SHADOW, PREVIOUS)
}


def day_number(day: date) -> int:
    return (day - _EPOCH_DAY).days


def day_of(number: int) -> date:
    return _EPOCH_DAY + timedelta(days=number)


@dataclass(frozen=True, slots=True)
class OwnedDays:
    """Which UTC days (days since 1970-01-01) a rebuild recomputes: from `first` on (None: all), except `carried`."""

    first: int | None
    carried: frozenset[int] = frozenset()

    def owns(self, day: int) -> bool:
        return (self.first is None or day >= self.first) and day not in self.carried

    def owns_ms(self, occurred_at: int) -> bool:
        return self.owns(occurred_at // MS_PER_DAY)

    def describe(self) -> str:
        since = "every day" if self.first is None else f"the UTC days from {day_of(self.first).isoformat()} on"
        if not self.carried:
            return since
        days = sorted(self.carried)
        shown = ", ".join(day_of(d).isoformat() for d in days[:5]) + (" ..." if len(days) > 5 else "")
        return f"{since}, except {len(days)} day(s) holding imported counts ({shown})"

    def carried_clause(self, table: Table, dialect: str) -> Any:
        """SQL: the rows of `table` (a generation's hourly or daily table) this rebuild carries over."""
        bucket = table.c.day if "day" in table.c else table.c.hour
        clauses = []
        if self.first is not None:
            first = day_of(self.first)
            clauses.append(bucket < (first if "day" in table.c else datetime(first.year, first.month, first.day)))
        if self.carried:
            as_day = bucket if "day" in table.c else _date_of(bucket, dialect)
            clauses.append(as_day.in_(select(imported_days.c.day).scalar_subquery()))
        return or_(*clauses) if clauses else false()


def _date_of(column: Any, dialect: str) -> Any:
    # SQLite keeps a DateTime as 'YYYY-MM-DD HH:MM:SS...' text and a Date as 'YYYY-MM-DD': date() makes the one the
    # other (a CAST there would take the leading number). PostgreSQL casts.
    return func.date(column) if dialect == "sqlite" else column.cast(skill_daily_stats.c.day.type)


def owned_days(connection: Connection | Engine, owns_from: date | None) -> OwnedDays:
    """The rule for a rebuild starting at `owns_from`, with the imported days as the database holds them now."""

    with connected(connection) as c:
        carried = frozenset(day_number(d) for (d,) in c.execute(select(imported_days.c.day)))
    return OwnedDays(None if owns_from is None else day_number(owns_from), carried)


class RebuildSink(WindowsSink):
    """The windows sink of a rebuild: its shadow tables, only the days it owns, none of the records the live group
    had parked (skillstats_rebuild_skips), stopped once swapped or dropped."""

    def __init__(self, engine: Engine, group_id: str, topic: str, rebuild_id: int, owned: OwnedDays) -> None:
        super().__init__(engine, group_id, topic)
        self.tables = generation(SHADOW)
        self.rebuild_id = rebuild_id
        self.owned = owned
        self.skips: dict[int, frozenset[int]] = {}
        for p, offsets in skipped(engine, rebuild_id).items():
            self.skips[p] = frozenset(offsets)

    def fold_at_decode(self) -> Any:
        return None  # its fold keeps only the days it owns and leaves the skipped records out: from the events

    def prepare_parts(self, parts: Sequence[PartitionBatch], folded_at_decode: Any = None) -> Prepared:
        if folded_at_decode is not None:
            raise ValueError("a rebuild's sink folds the events: it takes no fold made at the decode")
        if self.skips:
            parts = [self._without_skipped(part) for part in parts]
        return super().prepare_parts(parts)

    def _without_skipped(self, part: PartitionBatch) -> PartitionBatch:
        skip = self.skips.get(part.partition)
        if not skip or skip.isdisjoint(part.offsets):
            return part
        events = [None if o in skip else e for o, e in zip(part.offsets, part.events, strict=True)]
        return PartitionBatch(part.partition, part.offsets, events, part.since, part.until)

    def fold(self, events: list[StatEvent]) -> WindowRows:
        owns = self.owned.owns_ms
        return super().fold([event for event in events if owns(event.occurred_at)])

    def check_owner(self, connection: Connection) -> None:
        super().check_owner(connection)
        state = connection.execute(select(rebuilds.c.state).where(rebuilds.c.id == self.rebuild_id)).scalar()
        if state != BUILDING:
            raise IdentityMismatch(
                f"rebuild {self.rebuild_id} (group {self.group_id!r}) is {state or 'gone'}, no longer building: "
                f"this worker has nothing more to write (its tables were swapped in or dropped); stop it"
            )


def skipped(connection: Connection | Engine, rebuild_id: int) -> dict[int, set[int]]:
    """The records a rebuild counts nowhere (the live group had parked them), per partition."""

    found: dict[int, set[int]] = {}
    with connected(connection) as c:
        rows = c.execute(
            select(rebuild_skips.c.partition, rebuild_skips.c.offset).where(rebuild_skips.c.rebuild_id == rebuild_id)
        )
        for p, o in rows:
            found.setdefault(p, set()).add(o)
    return found


def table_exists(connection: Connection, name: str) -> bool:
    return inspect(connection).has_table(name)


def existing(connection: Connection, suffix: str) -> bool:
    """Whether the `suffix` generation's tables exist (either of them)."""
    return any(table_exists(connection, name) for name in generation(suffix).names)


def create_shadow(connection: Connection) -> None:
    """The shadow tables, empty (IdentityMismatch-free: the caller checked none exist)."""
    shadow = generation(SHADOW)
    for table in (shadow.hourly, shadow.daily):
        table.create(connection)


def drop_generation(connection: Connection, suffix: str) -> None:
    for name in generation(suffix).names:
        if table_exists(connection, name):
            connection.execute(text(f'DROP TABLE "{name}"'))


def copy_grants(connection: Connection, source: str | None, target: str | None) -> None:
    """PostgreSQL: the privileges granted on the `source` generation's tables, granted on the `target` one's too, so
    a registry's reader role reads the new live tables as it read the old (a table's grants stay with it through a
    rename). SQLite has none."""
    if connection.dialect.name != "postgresql":
        return
    for old, new in zip(generation(source).names, generation(target).names, strict=True):
        grants = connection.execute(
            text(
                "SELECT grantee, privilege_type FROM information_schema.role_table_grants "
                "WHERE table_schema = current_schema() AND table_name = :t AND grantee <> current_user"
            ),
            {"t": old},
        ).all()
        for grantee, privilege in grants:
            connection.execute(text(f'GRANT {privilege} ON "{new}" TO "{grantee}"'))


def lock_live_tables(connection: Connection) -> None:
    """PostgreSQL: no writer of the live tables (the live worker, a legacy import, a direct DLQ replay, prune) gets
    in between the swap's reads of them and its renames; readers go on until the renames. SQLite's write lock, which
    the swap holds from its start, already does this."""
    if connection.dialect.name == "postgresql":
        names = ", ".join(f'"{name}"' for name in LIVE_TABLES.names)
        connection.execute(text(f"LOCK TABLE {names} IN SHARE ROW EXCLUSIVE MODE"))


def rename_generation(connection: Connection, source: str | None, target: str | None) -> None:
    """Rename the `source` generation's tables to the `target` names (None: the live names), in the caller's
    transaction. On PostgreSQL a table's primary key index keeps the name it was made with, and index names are
    one namespace: the index is renamed with its table, so a later shadow table can take the name again."""
    before, after = generation(source), generation(target)
    for old, new in zip(before.names, after.names, strict=True):
        connection.execute(text(f'ALTER TABLE "{old}" RENAME TO "{new}"'))
        if connection.dialect.name == "postgresql":
            indexes = connection.execute(
                text("SELECT indexname FROM pg_indexes WHERE schemaname = current_schema() AND tablename = :t"),
                {"t": new},
            ).scalars()
            for index in list(indexes):
                if index.startswith(old):
                    connection.execute(text(f'ALTER INDEX "{index}" RENAME TO "{new}{index[len(old) :]}"'))


def carry_over(connection: Connection, owned: OwnedDays, into: str = SHADOW) -> dict[str, int]:
    """Replace, in the `into` generation, every row of a day `owned` carries over with the live row (as it is now,
    in the caller's transaction); rows copied per table."""
    copied: dict[str, int] = {}
    dialect = connection.dialect.name
    for live, target in zip(
        (LIVE_TABLES.hourly, LIVE_TABLES.daily), (generation(into).hourly, generation(into).daily), strict=True
    ):
        connection.execute(delete(target).where(owned.carried_clause(target, dialect)))
        carried = owned.carried_clause(live, dialect)
        columns = [c.name for c in live.columns]
        connection.execute(target.insert().from_select(columns, select(*live.columns).where(carried)))
        # Counted, not taken from the INSERT's rowcount: psycopg reports -1 for INSERT ... SELECT.
        copied[live.name] = connection.execute(select(func.count()).select_from(live).where(carried)).scalar_one()
    return copied


def add_events(connection: Connection, target: Generation, events: list[StatEvent], sign: int, now: datetime) -> None:
    """Add (sign 1) or take away (sign -1) the window counts of `events` in `target`'s tables."""
    if not events:
        return
    hourly, daily = fold(events)
    if sign < 0:
        hourly = {key: [-d, -i] for key, (d, i) in hourly.items()}
        daily = {key: [-d, -i] for key, (d, i) in daily.items()}
    write_buckets(connection, target, (hourly, daily), now)


def rows_of(connection: Connection, target: Generation) -> dict[str, int]:
    """Rows per table of a generation."""
    return {t.name: connection.execute(select(func.count()).select_from(t)).scalar_one() for t in target}


def set_state(connection: Connection, rebuild_id: int, state: str, **values: Any) -> None:
    connection.execute(update(rebuilds).where(rebuilds.c.id == rebuild_id).values(state=state, **values))


def starts_json(starts: Mapping[int, int]) -> str:
    return json.dumps({str(p): o for p, o in sorted(starts.items())})


def starts_from_json(value: str | None) -> dict[int, int]:
    return {int(p): int(o) for p, o in json.loads(value or "{}").items()}


def record_imported_days(connection: Connection, days: Iterable[date], now: datetime) -> None:
    """Inside the import's transaction: the days it adds windows counts to (a rebuild carries them over)."""
    from sqlalchemy.dialects import postgresql, sqlite

    wanted = sorted(set(days))
    if not wanted:
        return
    dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
    connection.execute(
        dialect.insert(imported_days).on_conflict_do_nothing(), [{"day": d, "imported_at": now} for d in wanted]
    )
