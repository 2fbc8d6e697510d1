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
Row = tuple[str, Any, int, int]  # (skill id, hour as a naive UTC datetime or day as a date, downloads, installs)
WindowRows = tuple[list[Row], list[Row]]  # (hourly, daily), each in (skill id, start) order: the upserts' order


class WindowsSink(FencedSink):
    """Per-(skill, UTC hour) and per-(skill, UTC day) counts by event time."""

    # The tables written: (hourly, daily); a rebuild's sink writes its shadow tables (sinks/rebuild.py).
    tables: Any = (skill_hourly_stats, skill_daily_stats)

    def fold(self, events: list[StatEvent]) -> WindowRows:
        return fold_rows(events)

    def write(self, connection: Connection, folded: Any, now: datetime) -> dict[str, int]:
        return write_rows(connection, self.tables, folded, now)


def fold_rows(events: list[StatEvent]) -> WindowRows:
    """The rows `events` add to the windows tables: `rows_of(fold(events))`, the sink's fold.

    In C where skillstats._native is built (skillstats/_native.c `window_rows`):
    each event's effect is added to a C table keyed by (skill, hour), its slots
    sorted, and the days summed from the sorted hours in the same pass, so no
    Python object is made per event or per bucket, only the rows themselves.
    The dicts of `fold` cost a key tuple, an int and a list per bucket, and a
    backfill's batch is nearly one bucket per event (docs/performance.md, "The
    windows rows in one C pass"). tests/test_native.py checks both give the
    same rows.
    """
    if native is not None:
        return native.window_rows(events, WINDOW_DELTAS, utc_naive, _utc_date)  # type: ignore[no-any-return]
    return rows_of(fold(events))


def fold(events: list[StatEvent]) -> tuple[Buckets, Buckets]:
    """Per-(skill, hour) and per-(skill, day) counts of `events` (the kinds' window effects), keyed by start ms.

    What a rebuild's comparison and corrections work with (skillstats/rebuild,
    sinks/rebuild.py), and the reference for `fold_rows`.
    """
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


def rows_of(folded: tuple[Buckets, Buckets]) -> WindowRows:
    """The rows of `fold`'s buckets, in the upserts' order."""
    hourly, daily = folded
    return bucket_rows(hourly, utc_naive), bucket_rows(daily, _utc_date)


def write_buckets(
    connection: Connection, tables: Any, folded: tuple[Buckets, Buckets], now: datetime
) -> dict[str, int]:
    """Add `fold`'s counts to `tables` (hourly, daily); rows written per table."""
    return write_rows(connection, tables, rows_of(folded), now)


def write_rows(connection: Connection, tables: Any, rows: WindowRows, now: datetime) -> dict[str, int]:
    """Add `fold_rows`'s rows to `tables` (hourly, daily); rows written per table."""
    counters = ("downloads", "installs")
    written: dict[str, int] = {}
    for table, key, table_rows in zip(tables, ("hour", "day"), rows, strict=True):
        upsert_adding(connection, table, ("skill_id", key), counters, table_rows, "updated_at", now, ordered=True)
        written[table.name] = len(table_rows)
    return written


def bucket_rows(buckets: Buckets, convert: Callable[[int], Any]) -> list[Row]:
    """(skill id, convert(bucket start), downloads, installs) per bucket, in (skill id, start) order.

    The order is the upserts' (upsert_adding is told the rows are in it), and is
    taken while the start is still an int: CPython's sort compares a list whose
    first items are all str on a fast path, and ties then compare ints, not
    datetimes. `convert` runs once per distinct start (a batch spans a few
    hundred at most).
    """
    rows = [(s, start, d, i) for (s, start), (d, i) in buckets.items()]
    rows.sort()
    starts = {start: convert(start) for start in {start for _s, start in buckets}}
    return [(s, starts[start], d, i) for s, start, d, i in rows]


def _utc_date(ms: int) -> date:
    return utc_naive(ms).date()
