"""The windows sink: per-(skill, UTC hour) and per-(skill, UTC day) counts by event time (docs/contract.md, kinds)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import date, datetime
from typing import Any, NamedTuple

from sqlalchemy import Connection

from skillstats.contract import MS_PER_DAY, MS_PER_HOUR, WINDOW_DELTAS, StatEvent, native
from skillstats.sinks.batch import FencedSink
from skillstats.sinks.schema import skill_daily_stats, skill_hourly_stats
from skillstats.sinks.upserts import renderer, upsert_adding, utc_naive

Buckets = dict[tuple[str, int], list[int]]  # (skill id, bucket start ms) -> [downloads, installs]
# (skill id, hour or day start, downloads, installs); the start as `Starts` spells it (a naive UTC datetime or a
# date, or their text on SQLite)
Row = tuple[str, Any, int, int]
WindowRows = tuple[list[Row], list[Row]]  # (hourly, daily), each in (skill id, start) order: the upserts' order


def _utc_date(ms: int) -> date:
    return utc_naive(ms).date()


class Starts(NamedTuple):
    """How a fold spells the start of an hour and of a day in its rows (from ms), and whether that is already
    as the database's driver takes it (`upsert_adding`'s `rendered`)."""

    hour: Callable[[int], Any]
    day: Callable[[int], Any]
    rendered: bool


AS_VALUES = Starts(utc_naive, _utc_date, rendered=False)  # a naive UTC datetime, a date


def starts_for(dialect: Any, tables: Any) -> Starts:
    """How the windows sink's fold spells starts for `dialect` and `tables` (hourly, daily).

    On SQLite, as the driver takes them: the text SQLAlchemy's DateTime and Date types store (the same bind
    processors the upserts otherwise apply, so a row's key is the same text whichever path wrote it). The fold
    calls these once per distinct start, so the upsert binds its rows as they are, with no Python per row.
    PostgreSQL's statement takes each column as one array literal, spelled from the values.
    """
    if dialect.name != "sqlite":
        return AS_VALUES
    hourly, daily = tables
    hour_text, day_text = renderer(hourly.c.hour, dialect), renderer(daily.c.day, dialect)
    return Starts(lambda ms: hour_text(utc_naive(ms)), lambda ms: day_text(_utc_date(ms)), rendered=True)


class WindowsSink(FencedSink):
    """Per-(skill, UTC hour) and per-(skill, UTC day) counts by event time."""

    # The tables written: (hourly, daily); a rebuild's sink writes its shadow tables (sinks/rebuild.py).
    tables: Any = (skill_hourly_stats, skill_daily_stats)

    @functools.cached_property
    def starts(self) -> Starts:
        return starts_for(self.engine.dialect, self.tables)

    def fold(self, events: list[StatEvent]) -> WindowRows:
        return fold_rows(events, self.starts)

    def fold_at_decode(self) -> Any:
        """The C fold (skillstats/_native.c `WindowFold`) where the module is built: the decode adds the records
        it can prove valid straight from their bytes, as docsync's drain does, and the others' events; the
        rows are `fold_rows`' (tests/test_native.py). None, and the events are folded, without the module or
        for a subclass with a `fold` of its own (the fold at the decode would not be that fold)."""
        if native is None or type(self).fold is not WindowsSink.fold:
            return None
        return native.WindowFold(WINDOW_DELTAS)

    def fold_decoded(self, folded_at_decode: Any) -> WindowRows:
        return folded_at_decode.rows(self.starts.hour, self.starts.day)  # type: ignore[no-any-return]

    def write(self, connection: Connection, folded: Any, now: datetime) -> dict[str, int]:
        return write_rows(connection, self.tables, folded, now, rendered=self.starts.rendered)


def fold_rows(events: list[StatEvent], starts: Starts = AS_VALUES) -> WindowRows:
    """The rows `events` add to the windows tables: `rows_of(fold(events))`, the sink's fold, starts spelled
    by `starts`.

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
        return native.window_rows(events, WINDOW_DELTAS, starts.hour, starts.day)  # type: ignore[no-any-return]
    return rows_of(fold(events), starts)


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


def rows_of(folded: tuple[Buckets, Buckets], starts: Starts = AS_VALUES) -> WindowRows:
    """The rows of `fold`'s buckets, in the upserts' order."""
    hourly, daily = folded
    return bucket_rows(hourly, starts.hour), bucket_rows(daily, starts.day)


def write_buckets(
    connection: Connection, tables: Any, folded: tuple[Buckets, Buckets], now: datetime
) -> dict[str, int]:
    """Add `fold`'s counts to `tables` (hourly, daily); rows written per table."""
    return write_rows(connection, tables, rows_of(folded), now)


def write_rows(
    connection: Connection, tables: Any, rows: WindowRows, now: datetime, rendered: bool = False
) -> dict[str, int]:
    """Add `fold_rows`'s rows to `tables` (hourly, daily); rows written per table. `rendered`: their starts
    as the driver takes them (`Starts`)."""
    counters = ("downloads", "installs")
    written: dict[str, int] = {}
    for table, key, table_rows in zip(tables, ("hour", "day"), rows, strict=True):
        upsert_adding(
            connection,
            table,
            ("skill_id", key),
            counters,
            table_rows,
            "updated_at",
            now,
            ordered=True,
            rendered=rendered,
        )
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
