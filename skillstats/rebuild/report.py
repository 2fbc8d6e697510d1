"""`rebuild status` and `rebuild diff`: where a rebuild stands, and where it disagrees with the live tables.

Both read only. The diff compares the two generations at one position: the
tables and both groups' fences are read in one snapshot (PostgreSQL: a
repeatable-read transaction; SQLite: one read transaction, which WAL keeps
consistent), and the records between the two groups' fences are read from the
log and folded into the rebuilt side as the swap would fold them. So a row the
diff reports is a row the swap would change, not one of the workers in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, Table, and_, func, not_, or_, select

from skillstats.config import Settings
from skillstats.kafka import TopicIds, watermarks
from skillstats.rebuild.generations import (
    MAX_GAP,
    Gap,
    Problem,
    counted_apart,
    fences_of,
    gap_events,
    swap_problems,
    topic_replaced,
)
from skillstats.rebuild.log import first_timestamps, read_between
from skillstats.rebuild.state import Rebuild, RebuildRefused, building, live_owner, swapped_in
from skillstats.sinks.rebuild import PREVIOUS, SHADOW, OwnedDays, existing, generation, rows_of
from skillstats.sinks.schema import partition_fences
from skillstats.sinks.upserts import utc_naive
from skillstats.sinks.windows import Buckets, fold


@dataclass(frozen=True, slots=True)
class PartitionProgress:
    partition: int
    start: int
    fence: int
    end: int
    live_fence: int | None
    lag_seconds: float | None

    @property
    def lag(self) -> int:
        return max(self.end - self.fence, 0)

    @property
    def done(self) -> float:
        total = self.end - self.start
        return 1.0 if total <= 0 else min(max((self.fence - self.start) / total, 0.0), 1.0)


@dataclass(slots=True)
class Status:
    rebuild: Rebuild | None
    live: Rebuild | None  # the rebuild swapped in last
    previous_kept: bool
    owned: str = ""
    partitions: list[PartitionProgress] = field(default_factory=list)
    rows: dict[str, int] = field(default_factory=dict)
    rate: float | None = None  # records/s since it started
    eta_seconds: float | None = None
    gap: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def failing(self) -> bool:
        """A problem no waiting cures is among them: the rebuild must be dropped (status exits 1)."""
        return any(problem.failing for problem in self.problems)

    @property
    def swappable(self) -> bool:
        return self.rebuild is not None and not self.problems

    def render(self) -> str:
        lines = []
        if self.live is not None:
            lines.append(
                f"live tables: rebuild {self.live.id}, swapped in at {self.live.swapped_at:%Y-%m-%dT%H:%M:%SZ}"
                f"{'; the previous generation is kept (`rebuild rollback`)' if self.previous_kept else ''}"
            )
        elif self.previous_kept:
            lines.append("a previous generation is kept (skill_*_stats_previous)")
        if self.rebuild is None:
            lines.append("no rebuild is building (`skillstats rebuild start`)")
            return "\n".join(lines)
        r = self.rebuild
        lines.append(
            f"rebuild {r.id}: group {r.group_id}, topic {r.topic}, started {r.started_at:%Y-%m-%dT%H:%M:%SZ}"
            f"{f' ({r.note})' if r.note else ''}"
        )
        lines.append(f"  recomputes {self.owned}; carries every other day over from the live tables at the swap")
        lines.append(
            f"  {'partition':>9} {'start':>12} {'fence':>12} {'log end':>12} {'lag':>10} {'lag s':>8} {'done':>6} "
            f"{'live fence':>12}"
        )
        for p in self.partitions:
            seconds = "-" if p.lag_seconds is None else f"{p.lag_seconds:.0f}"
            live = "-" if p.live_fence is None else str(p.live_fence)
            lines.append(
                f"  {p.partition:>9} {p.start:>12} {p.fence:>12} {p.end:>12} {p.lag:>10} {seconds:>8} "
                f"{p.done:>6.1%} {live:>12}"
            )
        lag = sum(p.lag for p in self.partitions)
        rate = "-" if self.rate is None else f"{self.rate:,.0f} records/s"
        eta = "-" if self.eta_seconds is None else f"{self.eta_seconds:,.0f}s"
        lines.append(f"  lag {lag:,} record(s); {rate} since it started; time left about {eta}")
        lines.append("  rows written: " + ", ".join(f"{name} {count:,}" for name, count in self.rows.items()))
        lines.append(f"  {self.gap:,} record(s) between its fences and the live group's")
        if self.problems:
            verdict = "FAILING" if self.failing else "not yet"
            lines.append(f"  swap: {verdict}: " + "; ".join(self.problems))
        else:
            lines.append("  swap: allowed now (`skillstats rebuild swap --confirm SWAP`)")
        return "\n".join(lines)


def status(engine: Engine, settings: Settings, max_gap: int = MAX_GAP) -> Status:
    with engine.connect() as connection:
        rebuild = building(connection)
        report = Status(rebuild, swapped_in(connection), existing(connection, PREVIOUS))
        if rebuild is None:
            return report
        live = live_owner(connection)
        report.problems, gap = swap_problems(connection, rebuild, live, max_gap)
        report.gap = gap.records
        report.owned = rebuild.owned(connection).describe()
        report.rows = rows_of(connection, generation(SHADOW))
        newest = connection.execute(
            select(func.max(partition_fences.c.updated_at)).where(partition_fences.c.group_id == rebuild.group_id)
        ).scalar()
    replaced = topic_replaced(settings, rebuild, live, TopicIds(settings))
    if replaced:
        report.problems.append(replaced)
        return report
    ends = {p: end for p, (_low, end) in watermarks(settings, rebuild.topic).items()}
    behind = {p: f for p, f in gap.rebuild.items() if f < ends.get(p, 0)}
    stamps = first_timestamps(settings, rebuild.topic, behind, ends) if behind else {}
    now_ms = time.time() * 1000
    for p in sorted(set(ends) | set(gap.rebuild)):
        fence = gap.rebuild.get(p, rebuild.starts.get(p, 0))
        report.partitions.append(
            PartitionProgress(
                p,
                rebuild.starts.get(p, 0),
                fence,
                ends.get(p, 0),
                gap.live.get(p),
                _seconds_behind(now_ms, stamps.get(p)) if p in behind else None,
            )
        )
    done = sum(max(p.fence - p.start, 0) for p in report.partitions)
    if newest is not None and done:
        elapsed = (newest - rebuild.started_at).total_seconds()
        if elapsed > 0:
            report.rate = done / elapsed
            report.eta_seconds = sum(p.lag for p in report.partitions) / report.rate
    return report


def _seconds_behind(now_ms: float, stamp: int | None) -> float | None:
    """How old the first record a partition has yet to read is (None: it carries no timestamp)."""
    return None if stamp is None or stamp < 0 else max(now_ms - stamp, 0) / 1000


@dataclass(frozen=True, slots=True)
class RowDiff:
    table: str
    skill_id: str
    bucket: Any
    live: tuple[int, int]
    rebuilt: tuple[int, int]


@dataclass(slots=True)
class Diff:
    rebuild: Rebuild
    owned: str
    differing: dict[str, int] = field(default_factory=dict)
    first: list[RowDiff] = field(default_factory=list)
    totals: dict[str, tuple[tuple[int, int], tuple[int, int]]] = field(default_factory=dict)  # table -> (live, rebuilt)
    position: dict[int, int] = field(default_factory=dict)

    @property
    def any(self) -> bool:
        return any(self.differing.values())

    def render(self) -> str:
        lines = [f"rebuild {self.rebuild.id} against the live tables, over {self.owned}, at the live fences"]
        for table, count in self.differing.items():
            (ld, li), (rd, ri) = self.totals[table]
            lines.append(
                f"  {table}: {count:,} row(s) differ; totals live downloads {ld:,} installs {li:,}, rebuilt "
                f"downloads {rd:,} installs {ri:,}"
            )
        if self.first:
            lines.append(
                f"  first {len(self.first)} differing row(s): table, skill, bucket, live (d, i), rebuilt (d, i)"
            )
            for row in self.first:
                lines.append(f"    {row.table} {row.skill_id} {row.bucket} {row.live} {row.rebuilt}")
        lines.append("the tables agree" if not self.any else "the tables DIFFER")
        return "\n".join(lines)


def diff(
    engine: Engine,
    settings: Settings,
    limit: int = 20,
    max_gap: int = MAX_GAP,
    read: Callable[..., list] = read_between,  # type: ignore[type-arg]
) -> Diff:
    """The rows where the rebuilt and live tables disagree, over the days the rebuild owns, at the live fences."""
    with engine.connect() as connection:
        if connection.dialect.name == "postgresql":
            connection = connection.execution_options(isolation_level="REPEATABLE READ")
        with connection.begin():
            rebuild = building(connection)
            if rebuild is None:
                raise RebuildRefused("no rebuild is building: nothing to compare (`skillstats rebuild start`)")
            live = live_owner(connection, rebuild.topic)
            owned = rebuild.owned(connection)
            gap = Gap(
                fences_of(connection, live.group_id, live.topic), fences_of(connection, rebuild.group_id, rebuild.topic)
            )
            missing = sorted(set(gap.live) ^ set(gap.rebuild))
            if missing:
                raise RebuildRefused(
                    f"partition(s) {missing} have a fence in one group only: nothing to compare yet "
                    f"(`skillstats rebuild status`)"
                )
            if gap.records > max_gap:
                raise RebuildRefused(
                    f"the rebuild is {gap.records:,} record(s) from the live group's fences, more than --max-gap "
                    f"{max_gap:,}: let its worker catch up first (the diff reads them from the log)"
                )
            ids = TopicIds(settings)
            replaced = topic_replaced(settings, rebuild, live, ids)
            apart = counted_apart(connection, rebuild, live)
            plus, minus = gap_events(settings, rebuild, owned, gap, apart, read) if not replaced else ([], [])
            replaced = replaced or topic_replaced(settings, rebuild, live, ids)  # replaced while it read?
            if replaced:
                raise RebuildRefused(f"nothing to compare at the live fences: {replaced}")
            live_at = gap.live
            result = Diff(rebuild, owned.describe(), position=dict(live_at))
            hourly_plus, daily_plus = fold(plus)
            hourly_minus, daily_minus = fold(minus)
            live_tables, shadow = generation(None), generation(SHADOW)
            for index, (bucket, plus_b, minus_b) in enumerate(
                (("hour", hourly_plus, hourly_minus), ("day", daily_plus, daily_minus))
            ):
                _compare(connection, owned, live_tables[index], shadow[index], bucket, plus_b, minus_b, limit, result)
            return result


def _compare(
    connection: Connection,
    owned: OwnedDays,
    live: Table,
    shadow: Table,
    bucket: str,
    plus: Buckets,
    minus: Buckets,
    limit: int,
    result: Diff,
) -> None:
    """One table's differing rows (live against rebuilt plus the correction) and its totals, into `result`."""
    dialect = connection.dialect.name
    correction: dict[tuple[str, Any], list[int]] = {}
    for sign, buckets in ((1, plus), (-1, minus)):
        for (skill_id, ms), (d, i) in buckets.items():
            at = utc_naive(ms) if bucket == "hour" else utc_naive(ms).date()
            counts = correction.setdefault((skill_id, at), [0, 0])
            counts[0] += sign * d
            counts[1] += sign * i
    joined = and_(live.c.skill_id == shadow.c.skill_id, live.c[bucket] == shadow.c[bucket])
    stored: dict[tuple[str, Any], tuple[int, int, int, int]] = {}  # (live d, i, rebuilt d, i) as stored
    left = (
        select(
            live.c.skill_id, live.c[bucket], live.c.downloads, live.c.installs, shadow.c.downloads, shadow.c.installs
        )
        .select_from(live.outerjoin(shadow, joined))
        .where(
            not_(owned.carried_clause(live, dialect)),
            or_(
                shadow.c.skill_id.is_(None),
                live.c.downloads != shadow.c.downloads,
                live.c.installs != shadow.c.installs,
            ),
        )
    )
    for skill_id, at, ld, li, sd, si in connection.execute(left):
        stored[(skill_id, at)] = (ld, li, sd or 0, si or 0)
    right = (
        select(shadow.c.skill_id, shadow.c[bucket], shadow.c.downloads, shadow.c.installs)
        .select_from(shadow.outerjoin(live, joined))
        .where(live.c.skill_id.is_(None), not_(owned.carried_clause(shadow, dialect)))
    )
    for skill_id, at, sd, si in connection.execute(right):
        stored[(skill_id, at)] = (0, 0, sd, si)
    for key in correction:
        if key not in stored:  # agreeing as stored: the correction alone decides
            stored[key] = _stored(connection, live, shadow, bucket, key)
    count = 0
    for key in sorted(stored):
        ld, li, sd, si = stored[key]
        c = correction.get(key, (0, 0))
        rebuilt = (sd + c[0], si + c[1])
        if (ld, li) != rebuilt:
            count += 1
            if len(result.first) < limit:
                result.first.append(RowDiff(live.name, key[0], key[1], (ld, li), rebuilt))
    result.differing[live.name] = count
    live_total = _totals(connection, live, owned, dialect)
    rebuilt_total = _totals(connection, shadow, owned, dialect)
    result.totals[live.name] = (
        live_total,
        (
            rebuilt_total[0] + sum(c[0] for c in correction.values()),
            rebuilt_total[1] + sum(c[1] for c in correction.values()),
        ),
    )


def _stored(connection: Connection, live: Table, shadow: Table, bucket: str, key: tuple[str, Any]) -> tuple[int, ...]:
    values: list[int] = []
    for table in (live, shadow):
        row = connection.execute(
            select(table.c.downloads, table.c.installs).where(table.c.skill_id == key[0], table.c[bucket] == key[1])
        ).first()
        values.extend(row if row is not None else (0, 0))
    return tuple(values)


def _totals(connection: Connection, live: Table, owned: OwnedDays, dialect: str) -> tuple[int, int]:
    row = connection.execute(
        select(func.coalesce(func.sum(live.c.downloads), 0), func.coalesce(func.sum(live.c.installs), 0)).where(
            not_(owned.carried_clause(live, dialect))
        )
    ).one()
    return int(row[0]), int(row[1])
