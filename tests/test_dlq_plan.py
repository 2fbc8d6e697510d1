"""Which parked records a replay publishes (skillstats/dlq_admin.plan_replay): never a record twice.

A record is its root, the source record it was first parked from; SQL's replay
rows say how often a root was replayed and where each copy landed; a parcel of
such a copy is that copy parked again. Headers decide nothing.
"""

from __future__ import annotations

from dataclasses import replace

from skillstats.config import Settings
from skillstats.contract import make_event
from skillstats.dlq_admin import ParkedRecord, ReplayBook, Selection, plan_replay

SETTINGS = Settings(topic="events", dlq_topic="events.dlq")
EVENT = make_event("sk_1", "download", 1_700_000_000_000)  # valid by today's contract


def parcel(partition: int, offset: int, *, reason: str = "unknown_kind", **changes: object) -> ParkedRecord:
    """A parcel at DLQ partition:offset of source record events/3/(100 + offset)."""
    record = ParkedRecord(
        partition,
        offset,
        reason,
        "why",
        "windows",
        "events",
        3,
        100 + offset,
        1_000 + offset,
        None,
        False,
        1_700_000_000_000,
        EVENT.key,
        EVENT.encode(),
    )
    return replace(record, **changes)


ROOT = ("events", 3, 105)


def copy_parked_again(at: tuple[int, int], dlq_offset: int) -> ParkedRecord:
    """A parcel of the copy that landed at events/at[0]/at[1]."""
    return parcel(1, dlq_offset, source_partition=at[0], source_offset=at[1], replayed_from="events.dlq:0:5")


def test_first_replay_publishes_one_copy_per_root() -> None:
    original = parcel(0, 5)
    twice = parcel(2, 40)  # the same source record, parked a second time (a zombie worker)
    twice = replace(twice, source_offset=original.source_offset)
    plan = plan_replay(SETTINGS, [original, twice], [original, twice], ReplayBook(), again=False)
    assert [r.address for r in plan.publish] == [(0, 5)] and plan.numbers == {ROOT: 1}


def test_a_root_whose_copies_all_came_back_is_replayed_again_only_with_again() -> None:
    book = ReplayBook(published={ROOT: 1}, copies={(7, 900): ROOT})
    original, copy = parcel(0, 5), copy_parked_again((7, 900), 9)
    parked = [original, copy]
    refused = plan_replay(SETTINGS, parked, parked, book, again=False)
    assert refused.publish == [] and "--again" in refused.skipped[0][1]
    plan = plan_replay(SETTINGS, parked, parked, book, again=True)
    # The original and its parked-again copy are one record: one copy, replay number 2.
    assert len(plan.publish) == 1 and plan.numbers == {ROOT: 2}


def test_a_root_whose_copy_did_not_come_back_is_never_replayed_again() -> None:
    """The copy counted (or is on its way, or where it landed was never recorded): another would count twice."""
    original = parcel(0, 5)
    for book in (ReplayBook(published={ROOT: 1}, copies={(7, 900): ROOT}), ReplayBook(published={ROOT: 1})):
        for again in (False, True):
            plan = plan_replay(SETTINGS, [original], [original], book, again=again)
            assert plan.publish == [] and "count twice" in plan.skipped[0][1]
    # Two replays, one copy back (parked twice, still one copy): still one counted.
    book = ReplayBook(published={ROOT: 2}, copies={(7, 900): ROOT, (7, 950): ROOT})
    parked = [original, copy_parked_again((7, 900), 9), copy_parked_again((7, 900), 10)]
    assert plan_replay(SETTINGS, parked, parked, book, again=True).publish == []


def test_a_header_claiming_to_be_a_copy_is_not_one() -> None:
    """A parcel whose replayed_from names the root, but whose source is no recorded copy, is its own record."""
    book = ReplayBook(published={ROOT: 1}, copies={(7, 900): ROOT})
    forged = parcel(1, 3, source_partition=5, source_offset=1, replayed_from="events.dlq:0:5")
    parked = [parcel(0, 5), forged]
    plan = plan_replay(SETTINGS, parked, [parked[0]], book, again=True)
    assert plan.publish == [] and "count twice" in plan.skipped[0][1]


def test_records_a_replay_cannot_reproduce_are_left_out() -> None:
    cut = parcel(0, 1, truncated=True)
    elsewhere = parcel(0, 2, source_topic="other")
    no_time = parcel(0, 3, reason="bad_timestamp", timestamp_ms=None)
    unknown_source = parcel(0, 4, source_partition=None)
    still_invalid = parcel(0, 7, key=b"k", value=b"not json")
    fine = parcel(0, 6)
    everything = [cut, elsewhere, no_time, unknown_source, still_invalid, fine]
    plan = plan_replay(SETTINGS, everything, everything, ReplayBook(), again=True)
    assert [r.address for r in plan.publish] == [(0, 6)]
    assert len(plan.skipped) == 5
    assert any("still refuses it (malformed" in why for _root, why in plan.skipped)
    forced = plan_replay(SETTINGS, everything, everything, ReplayBook(), again=True, force=True)
    assert sorted(r.address for r in forced.publish) == [(0, 6), (0, 7)]


def test_a_record_the_database_refused_goes_to_the_windows_tables_not_the_topic() -> None:
    """Only when SQL says the windows group's fence passed it as refused: otherwise it may have counted since."""
    refused = parcel(0, 5, reason="rejected_by_database")
    plan = plan_replay(SETTINGS, [refused], [refused], ReplayBook(refused={ROOT}), again=False)
    assert plan.publish == [] and plan.direct == [ROOT] and plan.numbers == {ROOT: 1}
    unproven = plan_replay(SETTINGS, [refused], [refused], ReplayBook(), again=False)
    assert unproven.direct == [] and "not recorded as skipped" in unproven.skipped[0][1]
    forced = plan_replay(SETTINGS, [refused], [refused], ReplayBook(), again=False, force=True)
    assert forced.direct == [ROOT]


def test_selection_filters_combine() -> None:
    a, b = parcel(0, 1, reason="malformed"), parcel(0, 2)
    assert [r for r in (a, b) if Selection(reasons=("malformed",))(r)] == [a]
    assert [r for r in (a, b) if Selection(sources=((3, 102),))(r)] == [b]
    assert [r for r in (a, b) if Selection(since_ms=1_002)(r)] == [b]
    assert [r for r in (a, b) if Selection(reasons=("malformed",), sources=((3, 102),))(r)] == []
