"""`fences reset` against a model of fences, topics and ids (issue 27, items 1 and 2): whatever the database
holds and whatever the operator chooses, a reset that goes through leaves no fence that skips a record of the
log it records, and never hands the tables to a group that did not count them."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from skillstats.sinks.fences import plan_reset
from skillstats.sinks.identity import WINDOWS, Owner

GROUP, TOPIC = "skillstats-windows", "events"
ids = st.sampled_from([None, "id-old", "id-new"])


@st.composite
def cases(draw: st.DrawFn) -> tuple:
    partitions = draw(st.integers(1, 6))
    logs = {}
    for p in range(partitions):
        low = draw(st.integers(0, 50))
        logs[p] = (low, low + draw(st.integers(0, 50)))
    current = draw(st.dictionaries(st.integers(0, 8), st.integers(0, 120), max_size=9))
    recorded = draw(
        st.none()
        | st.builds(
            Owner,
            st.just(WINDOWS),
            st.sampled_from([GROUP, GROUP + "-v2"]),
            st.sampled_from([TOPIC, "events-old"]),
            ids,
        )
    )
    chosen = draw(st.none() | st.sets(st.integers(0, 8), max_size=9))
    group = draw(st.sampled_from([GROUP, GROUP + "-v2", GROUP[:-1]]))
    return group, draw(ids), recorded, logs, current, chosen, draw(st.sampled_from(["start", "end"]))


@settings(max_examples=400, deadline=None)
@given(cases())
def test_an_accepted_reset_leaves_every_fence_fitting_the_log_it_records(case: tuple) -> None:
    group, topic_id, recorded, logs, current, chosen, to = case
    plan = plan_reset(group, TOPIC, topic_id, recorded, logs, current, chosen, to)
    if recorded is not None and recorded.group_id != group:
        assert plan.refusal is not None and "takeover" in plan.refusal  # never another group's tables
        return
    if plan.refusal is not None:
        assert plan.left and plan.records_id  # refused only for a fence that would not fit
        return
    after = {p: n for p, n in current.items() if p not in plan.dropped} | plan.targets
    assert set(plan.targets) | set(plan.left) == set(logs)  # the dry run shows every partition
    for p, (low, high) in logs.items():
        if p in plan.targets:
            assert after[p] == (low if to == "start" else high)
    if plan.replaced:
        # Nothing of the old topic's positions survives: every fence is one this reset set.
        assert set(after) == set(plan.targets) == set(logs)
    if plan.records_id:
        assert all(p in logs and n <= logs[p][1] for p, n in after.items())


@settings(max_examples=200, deadline=None)
@given(cases())
def test_the_owner_can_always_reset_every_partition(case: tuple) -> None:
    _group, topic_id, recorded, logs, current, _chosen, to = case
    owner = recorded.group_id if recorded is not None else GROUP
    assert plan_reset(owner, TOPIC, topic_id, recorded, logs, current, None, to).refusal is None
