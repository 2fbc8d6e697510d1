"""Scaling the windows group 1 -> 3 -> 1 while a backlog drains: nothing lost, nothing counted twice.

What a Kubernetes rollout or an autoscaler does. Every membership change
happens with records in flight (the test checks the backlog is not drained
yet at each one), so each rebalance revokes partitions with batches fetched
but not applied, and faust seeks the new owners back to the committed
offsets. The over-count this once caused was intermittent, so the scenario
runs several times per database, each on its own topic and group.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import delete

from skillstats.config import Settings
from skillstats.dlq import DLQ_TOPIC_CONFIG
from skillstats.kafka import ensure_topics, group_members
from skillstats.sinks.db import open_engine
from skillstats.sinks.schema import consumers, skill_daily_stats, skill_hourly_stats, skills, user_skill_stats
from skillstats.workload import generate
from tests.helpers import WorkerProcess, caught_up, publish, registry, seed_registry, wait_until
from tests.scenario import ScenarioReport, SteadyPublisher, applied

pytestmark = pytest.mark.faults  # consumers scaled under load: the fault suite

ROUNDS = int(os.environ.get("SKILLSTATS_TEST_SCALE_ROUNDS", "3"))
EVENTS = 60_000  # the backlog, published before the first worker starts
LIVE_RATE = 500  # events/s published meanwhile, while the group changes
# Small fetches and transactions: the backlog drains slowly enough that every
# membership change lands while batches are fetched, pending and in flight.
SLOW = ("--fetch-size", "20", "--batch-size", "60", "--log-level", "debug")


def empty_tables(settings: Settings) -> None:
    """The four tables empty (the registry's rows too), and no record of whose counts they were: each round
    starts from nothing, a new group on a new topic (sinks/identity.py would refuse it otherwise)."""
    engine = open_engine(settings.database_url)
    with engine.begin() as connection:
        for table in (skill_daily_stats, skill_hourly_stats, user_skill_stats, skills, consumers):
            connection.execute(delete(table))
    engine.dispose()


def members(settings: Settings) -> int:
    # skillstats.kafka.group_members asks again while the group's coordinator moves (NOT_COORDINATOR), which
    # it does on this three-node cluster while the workers rebalance.
    return group_members(settings, settings.windows_group, timeout=15)


def test_scale_1_3_1_while_a_backlog_drains(settings: Settings, tmp_path: Path) -> None:
    rows = registry(seed=11)
    for round_ in range(ROUNDS):
        run = uuid.uuid4().hex[:8]
        mine = replace(
            settings,
            topic=f"{settings.topic}-{run}",
            dlq_topic=f"{settings.topic}-{run}.dlq",
            windows_group=f"{settings.windows_group}-{run}",
        )
        ensure_topics(mine, {mine.topic: 12, mine.dlq_topic: 3}, configs={mine.dlq_topic: DLQ_TOPIC_CONFIG})
        empty_tables(mine)  # the rounds share the database; each compares its own counts
        seed_registry(mine, rows)
        records = list(generate(EVENTS, now_ms=int(time.time() * 1000), skills=2000, seed=round_, invalid_ratio=0.002))
        assert publish(mine, records) == EVENTS

        # Events keep arriving while the group changes, on top of the backlog.
        with SteadyPublisher(mine, LIVE_RATE, seed=1000 + round_) as publisher:
            first = WorkerProcess(mine, tmp_path / f"{round_}-a.log", *SLOW)
            wait_until(lambda m=mine, w=first: applied(m) > 0 and w.assert_alive() is None, 120, "the first worker")
            at_change = []
            second = WorkerProcess(mine, tmp_path / f"{round_}-b.log", *SLOW)
            wait_until(lambda m=mine: members(m) == 2, 120, "the second worker to join")
            at_change.append(applied(mine))
            third = WorkerProcess(mine, tmp_path / f"{round_}-c.log", *SLOW)
            wait_until(lambda m=mine: members(m) == 3, 120, "the third worker to join")
            at_change.append(applied(mine))
            assert second.terminate() == 0, second.log_tail()
            at_change.append(applied(mine))
            assert third.terminate() == 0, third.log_tail()
            at_change.append(applied(mine))
            assert at_change[-1] < EVENTS, f"round {round_}: the backlog was drained before the last rebalance"

            # Back at one member, mid-backlog. The rest is drained at full speed by a
            # fresh worker (one more hand-over, to keep the test short).
            wait_until(lambda m=mine: members(m) == 1, 120, "the group to be back at one member")
            assert first.terminate() == 0, first.log_tail()
            live = publisher.stop()
        last = WorkerProcess(mine, tmp_path / f"{round_}-d.log")
        wait_until(caught_up(mine, mine.windows_group, last), 240, "the last worker to catch up")
        assert last.terminate() == 0, last.log_tail()
        report = ScenarioReport(f"windows scaled 1 -> 3 -> 1 (round {round_})", settings.database_url.split(":")[0])
        for change, at in zip(("2nd joined", "3rd joined", "2nd left", "3rd left"), at_change, strict=True):
            report.fault(f"{change} with {at:,} records applied")
        report.finish(mine, records + live, rows)
