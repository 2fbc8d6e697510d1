"""The swap's arithmetic, for any positions: the rebuilt counts plus what the live group counted past the rebuild,
minus what the rebuild counted past the live group, are the live group's counts of the owned days at its fences.

`gap_events` is given a model log (any events, any offsets, any two fences, records the live group's database
refused, records both groups skip) through a fake `read` that hands over what the real one would: the valid
events of the records in the spans asked. Unit level; the real broker and databases are tests/test_rebuild.py's.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from skillstats.contract import MS_PER_DAY, MS_PER_HOUR, StatEvent
from skillstats.rebuild.generations import Gap, gap_events
from skillstats.rebuild.log import LoggedEvent
from skillstats.rebuild.state import Rebuild
from skillstats.sinks.rebuild import OwnedDays
from skillstats.sinks.windows import fold

DAY0 = 20_000  # days since 1970: any day will do
KINDS = ("download", "install_new", "star")


@st.composite
def scenario(draw: st.DrawFn) -> tuple[dict[int, list[StatEvent | None]], Gap, dict[int, int], OwnedDays, set, set]:
    owned = OwnedDays(DAY0 + draw(st.integers(0, 2)), frozenset(draw(st.sets(st.integers(DAY0, DAY0 + 4), max_size=2))))
    log: dict[int, list[StatEvent | None]] = {}
    live: dict[int, int] = {}
    rebuild: dict[int, int] = {}
    starts: dict[int, int] = {}
    for p in range(draw(st.integers(1, 3))):
        size = draw(st.integers(0, 30))
        start = draw(st.integers(0, size))
        records: list[StatEvent | None] = []
        for offset in range(size):
            if draw(st.booleans()) and offset % 7 == 3:
                records.append(None)  # invalid (or a transaction marker): nobody counts it
                continue
            day = DAY0 + draw(st.integers(0, 4))
            if offset < start:  # the start rule: below it, no event of an owned day
                day = min(day, (owned.first or DAY0) - 1)
            at = day * MS_PER_DAY + draw(st.integers(0, 23)) * MS_PER_HOUR
            records.append(StatEvent(f"e{p}-{offset}", f"s{draw(st.integers(0, 3))}", draw(st.sampled_from(KINDS)), at))
        log[p] = records
        starts[p] = start
        live[p] = draw(st.integers(0, size))
        rebuild[p] = draw(st.integers(start, size))
    skips = {(p, o) for p in log for o in range(len(log[p])) if draw(st.booleans()) and o % 5 == 1}
    # The live group's database refused some records past the rebuild's fence (those below both fences that the
    # rebuild counted lose their rows in the swap: _settle_rejected, not this arithmetic).
    refused = {(p, o) for p in log for o in range(rebuild[p], live[p]) if draw(st.booleans()) and o % 4 == 2}
    return log, Gap(live, rebuild), starts, owned, skips, refused


def counts(events: list[StatEvent]) -> Counter[tuple[str, int, int]]:
    hourly, _daily = fold(events)
    flat: Counter[tuple[str, int, int]] = Counter()
    for (skill, hour), (downloads, installs) in hourly.items():
        flat[(skill, hour, 0)] += downloads
        flat[(skill, hour, 1)] += installs
    return flat


@settings(max_examples=300, deadline=None)
@given(scenario())
def test_the_rebuilt_counts_brought_to_the_live_fences_are_the_live_counts(case: tuple) -> None:  # type: ignore[type-arg]
    log, gap, starts, owned, skips, refused = case
    rebuild = Rebuild(1, "g", "t", None, None, starts, "building", datetime(2026, 1, 1), None, None, None, None)

    def read(_settings: object, _topic: str, spans: dict[int, tuple[int, int]]) -> list[LoggedEvent]:
        return [
            LoggedEvent(p, o, log[p][o])  # type: ignore[arg-type]
            for p, (first, end) in spans.items()
            for o in range(first, end)
            if log[p][o] is not None
        ]

    def counted(p: int, first: int, end: int, apart: set) -> list[StatEvent]:  # type: ignore[type-arg]
        return [
            e
            for o in range(first, end)
            if (e := log[p][o]) is not None and (p, o) not in apart and owned.owns_ms(e.occurred_at)
        ]

    rebuilt = [e for p in log for e in counted(p, starts[p], gap.rebuild[p], skips)]
    plus, minus = gap_events(None, rebuild, owned, gap, (skips | refused, skips), read)  # type: ignore[arg-type]
    live_view = [e for p in log for e in counted(p, 0, gap.live[p], skips | refused)]
    assert counts(rebuilt) + counts(plus) - counts(minus) == counts(live_view)
    assert not [e for e in plus + minus if not owned.owns_ms(e.occurred_at)]
