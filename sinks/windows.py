"""The windows sink: per-(skill, UTC hour) and per-(skill, UTC day) counts by event time (docs/contract.md, kinds)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import date, datetime
from typing import Any

from sqlalchemy import Connection

from skillstats.contract import MS_PER_DAY, MS_PER_HOUR, WINDOW_DELTAS, StatEvent, native
from skillstats.sinks.batch import FencedSink
from skillstats.sinks.schema import skill_daily_stats, skill_hourly_stats
from skillstats.sinks.upserts import upsert_adding, utc_naive

Buckets = dict[tuple[str, int], list[int]]  # (skill id, bucket start ms) -> [downloads, installs]


class WindowsSink(FencedSink):
    """Per-(skill, UTC hour) and per-(skill, UTC day) counts by event time."""

    # The tables written: (hourly, daily); a rebuild's sink writes its shadow tables (sinks/rebuild.py).
    tables: Any = (skill_hourly_stats, skill_daily_stats)

    def fold(self, events: list[StatEvent]) -> tuple[Buckets, Buckets]:
        return fold(events)

    def write(self, connection: Connection, folded: Any, now: datetime) -> dict[str, int]:
        return write_buckets(connection, self.tables, folded, now)


def fold(events: list[StatEvent]) -> tuple[Buckets, Buckets]:
    """Per-(skill, hour) and per-(skill, day) counts of `events` (the kinds' window effects).

    In C where skillstats._native is built (the same loop: skillstats/_native.c),
    in Python where it is not; tests/test_native.py checks both give the same
    dicts. The C loop gains little (the work is the dict's tuples and lists either
    way: docs/performance.md, "The hot path in C").
    """
    if native is not None:
        return native.fold_windows(events, WINDOW_DELTAS)
    return fold_python(events)


def fold_python(events: list[StatEvent]) -> tuple[Buckets, Buckets]:
    """`fold` without skillstats._native."""
    # Per event only the hour; days are summed from the hours afterwards (a UTC day
    # is whole UTC hours), so the per-event dict work is done once, not twice: on
    # a live stream a batch of thousands of events folds into a few hundred hours.
    hourly: Buckets = {}
    window = WINDOW_DELTAS
    for event in events:
        effect = window.get(event.kind)
        if effect is None:
            continue
        at = event.occurred_at
        key = (event.skill_id, at - at % MS_PER_HOUR)
        counts = hourly.get(key)
        if counts is None:
            hourly[key] = list(effect)
        else:
            counts[0] += effect[0]
            counts[1] += effect[1]
    daily: Buckets = {}
    for (skill_id, hour), (downloads, installs) in hourly.items():
        key = (skill_id, hour - hour % MS_PER_DAY)
        counts = daily.get(key)
        if counts is None:
            daily[key] = [downloads, installs]
        else:
            counts[0] += downloads
            counts[1] += installs
    return hourly, daily


def write_buckets(connection: Connection, tables: Any, folded: Any, now: datetime) -> dict[str, int]:
    """Add folded counts to `tables` (hourly, daily); rows written per table."""
    hourly, daily = folded
    hourly_rows = bucket_rows(hourly, utc_naive)
    daily_rows = bucket_rows(daily, _utc_date)
    counters = ("downloads", "installs")
    hourly_table, daily_table = tables
    upsert_adding(
        connection,
        hourly_table,
        ("skill_id", "hour"),
        counters,
        hourly_rows,
        "updated_at",
        now,
        ordered=True,
    )
    upsert_adding(
        connection,
        daily_table,
        ("skill_id", "day"),
        counters,
        daily_rows,
        "updated_at",
        now,
        ordered=True,
    )
    return {hourly_table.name: len(hourly), daily_table.name: len(daily)}


def bucket_rows(buckets: Buckets, convert: Callable[[int], Any]) -> list[tuple[Any, ...]]:
    """(skill id, convert(bucket start), downloads, installs) per bucket, in (skill id, start) order.

    The order is the upserts' (upsert_adding is told the rows are in it), and is
    taken while the start is still an int: CPython's sort compares a list whose
    first items are all str on a fast path, and ties then compare ints, not
    datetimes (sorting the (key, counts) items instead was 15% of a backfill).
    `convert` runs once per distinct start (a batch spans a few hundred at most).
    In C where skillstats._native is built: one pass instead of three
    comprehensions and a sort, about a tenth of a backfill's interpreter time.
    """
    if native is not None:
        return native.bucket_rows(buckets, convert)
    rows = [(s, start, d, i) for (s, start), (d, i) in buckets.items()]
    rows.sort()
    starts = {start: convert(start) for start in {start for _s, start in buckets}}
    return [(s, starts[start], d, i) for s, start, d, i in rows]


def _utc_date(ms: int) -> date:
    return utc_naive(ms).date()
