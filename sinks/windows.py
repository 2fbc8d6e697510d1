"""The windows sink: per-(skill, UTC hour) and per-(skill, UTC day) counts by event time (docs/contract.md, kinds)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from skillstats.contract import MS_PER_DAY, MS_PER_HOUR, WINDOW_DELTAS, StatEvent
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
    """Per-(skill, hour) and per-(skill, day) counts of `events` (the kinds' window effects)."""
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
    # Bucket starts become datetimes and dates once per distinct value (a batch
    # spans a few hundred at most). Rows are ordered here, as flat tuples led by
    # the skill id with the bucket start as an int: CPython's sort compares a list
    # whose first items are all str on a fast path, and ties then compare ints,
    # not datetimes (sorting the (key, counts) items instead was 15% of a backfill).
    # upsert_adding's own sort then finds them in order.
    hourly_rows = [(s, h, d, i) for (s, h), (d, i) in hourly.items()]
    hourly_rows.sort()
    daily_rows = [(s, day, d, i) for (s, day), (d, i) in daily.items()]
    daily_rows.sort()
    hours = {ms: utc_naive(ms) for ms in {h for _s, h in hourly}}
    days = {ms: utc_naive(ms).date() for ms in {day for _s, day in daily}}
    counters = ("downloads", "installs")
    hourly_table, daily_table = tables
    upsert_adding(
        connection,
        hourly_table,
        ("skill_id", "hour"),
        counters,
        [(s, hours[h], d, i) for s, h, d, i in hourly_rows],
        "updated_at",
        now,
    )
    upsert_adding(
        connection,
        daily_table,
        ("skill_id", "day"),
        counters,
        [(s, days[day], d, i) for s, day, d, i in daily_rows],
        "updated_at",
        now,
    )
    return {hourly_table.name: len(hourly), daily_table.name: len(daily)}
