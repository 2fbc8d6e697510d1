"""The windows sink: per-(skill, UTC hour) and per-(skill, UTC day) counts by event time (docs/contract.md, kinds)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Connection

from skillstats.contract import EFFECTS, MS_PER_DAY, MS_PER_HOUR, StatEvent
from skillstats.sinks.batch import FencedSink
from skillstats.sinks.schema import skill_daily_stats, skill_hourly_stats
from skillstats.sinks.upserts import upsert_adding, utc_naive

Buckets = dict[tuple[str, int], list[int]]  # (skill id, bucket start ms) -> [downloads, installs]


class WindowsSink(FencedSink):
    """Per-(skill, UTC hour) and per-(skill, UTC day) counts by event time."""

    def fold(self, events: list[StatEvent]) -> tuple[Buckets, Buckets]:
        hourly: Buckets = {}
        daily: Buckets = {}
        for event in events:
            effect = EFFECTS[event.kind]
            if not effect.touches_windows:
                continue
            at = event.occurred_at
            for buckets, start in ((hourly, at - at % MS_PER_HOUR), (daily, at - at % MS_PER_DAY)):
                counts = buckets.get((event.skill_id, start))
                if counts is None:
                    buckets[(event.skill_id, start)] = [effect.window_downloads, effect.window_installs]
                else:
                    counts[0] += effect.window_downloads
                    counts[1] += effect.window_installs
        return hourly, daily

    def write(self, connection: Connection, folded: Any, now: datetime) -> dict[str, int]:
        hourly, daily = folded
        instants: dict[int, datetime] = {}

        def instant(ms: int) -> datetime:
            value = instants.get(ms)
            if value is None:
                value = instants[ms] = utc_naive(ms)
            return value

        counters = ("downloads", "installs")
        upsert_adding(
            connection,
            skill_hourly_stats,
            ("skill_id", "hour"),
            counters,
            [(s, instant(h), d, i) for (s, h), (d, i) in hourly.items()],
            "updated_at",
            now,
        )
        upsert_adding(
            connection,
            skill_daily_stats,
            ("skill_id", "day"),
            counters,
            [(s, instant(day).date(), d, i) for (s, day), (d, i) in daily.items()],
            "updated_at",
            now,
        )
        return {skill_hourly_stats.name: len(hourly), skill_daily_stats.name: len(daily)}
