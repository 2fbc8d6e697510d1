"""Which parked records a replay publishes (skillstats/dlq_admin.plan_replay): never a record twice."""

from __future__ import annotations

from dataclasses import replace

from skillstats.config import Settings
from skillstats.dlq_admin import ParkedRecord, Selection, plan_replay

SETTINGS = Settings(topic="events", dlq_topic="events.dlq")


def parcel(
    partition: int,
    offset: int,
    *,
    reason: str = "unknown_kind",
    copy_of: tuple[int, int] | None = None,
    **changes: object,
) -> ParkedRecord:
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
        f"events.dlq:{copy_of[0]}:{copy_of[1]}" if copy_of else None,
        False,
        1_700_000_000_000,
        b"k",
        b"v",
    )
    return replace(record, **changes)


def test_first_replay_publishes_one_copy_per_root() -> None:
    original = parcel(0, 5)
    plan = plan_replay(SETTINGS, [original], [original], {}, again=False)
    assert [r.address for r in plan.publish] == [(0, 5)] and plan.numbers == {(0, 5): 1}


def test_a_root_whose_copies_all_came_back_is_replayed_again_only_with_again() -> None:
    original, copy = parcel(0, 5), parcel(1, 9, copy_of=(0, 5))
    parked = [original, copy]
    refused = plan_replay(SETTINGS, parked, parked, {(0, 5): 1}, again=False)
    assert refused.publish == [] and "--again" in refused.skipped[0][1]
    plan = plan_replay(SETTINGS, parked, parked, {(0, 5): 1}, again=True)
    # The original and its parked-again copy are one record: one copy, replay number 2.
    assert len(plan.publish) == 1 and plan.numbers == {(0, 5): 2}


def test_a_root_whose_copy_did_not_come_back_is_never_replayed_again() -> None:
    """The copy counted (or is on its way): another would count twice, --again or not."""
    original = parcel(0, 5)
    for again in (False, True):
        plan = plan_replay(SETTINGS, [original], [original], {(0, 5): 1}, again=again)
        assert plan.publish == [] and "count twice" in plan.skipped[0][1]
    # Two replays, one copy back: still one counted.
    parked = [original, parcel(1, 9, copy_of=(0, 5))]
    assert plan_replay(SETTINGS, parked, parked, {(0, 5): 2}, again=True).publish == []


def test_records_a_replay_cannot_reproduce_are_left_out() -> None:
    cut = parcel(0, 1, truncated=True)
    elsewhere = parcel(0, 2, source_topic="other")
    no_time = parcel(0, 3, reason="bad_timestamp", timestamp_ms=None)
    foreign_copy = replace(parcel(0, 4), replayed_from="other.dlq:0:1")
    fine = parcel(0, 6)
    everything = [cut, elsewhere, no_time, foreign_copy, fine]
    plan = plan_replay(SETTINGS, everything, everything, {}, again=True)
    assert [r.address for r in plan.publish] == [(0, 6)]
    assert len(plan.skipped) == 4


def test_selection_filters_combine() -> None:
    a, b = parcel(0, 1, reason="malformed"), parcel(0, 2)
    assert [r for r in (a, b) if Selection(reasons=("malformed",))(r)] == [a]
    assert [r for r in (a, b) if Selection(sources=((3, 102),))(r)] == [b]
    assert [r for r in (a, b) if Selection(since_ms=1_002)(r)] == [b]
    assert [r for r in (a, b) if Selection(reasons=("malformed",), sources=((3, 102),))(r)] == []
