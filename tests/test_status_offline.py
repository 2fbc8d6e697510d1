"""`skillstats status` when Kafka is the problem: what the database says, with Kafka's figures unknown (issue 28).

On call opens `status` first, and an outage of Kafka is when it is needed most:
the fences, when they last moved, the owners, offsets lost to retention, the
windows tables and the docsync runs are all in the database. No broker is
stopped here: the settings point at a closed loopback port, with a real
database (SQLite and PostgreSQL) written as the consumers would have left it.
The command line's side (the reason on stderr, exit 1) is
tests/test_cli_usage.py::test_an_unreachable_broker_is_one_clear_line.
"""

from __future__ import annotations

import json
from datetime import datetime

from sqlalchemy import insert, update

from skillstats.config import Settings
from skillstats.kafka import KafkaUnreachable
from skillstats.sinks.db import open_engine
from skillstats.sinks.fences import PartitionFences
from skillstats.sinks.identity import DOCSYNC, WINDOWS, Owner, claim
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.schema import docsync_runs, partition_fences, skill_hourly_stats
from skillstats.status import render, status
from tests.helpers import free_port

MOVED = datetime(2026, 11, 30, 7, 40, 11)  # naive UTC, as the tables keep it
MOVED_ISO = "2026-11-30T07:40:11Z"
UNREACHABLE = "Kafka: unreachable"  # where a figure only Kafka knows would be


def database_as_left(settings: Settings) -> None:
    """Fences of both groups (the windows group's with offsets lost), a docsync owner of another name, a run,
    an hourly row: what the consumers leave behind."""
    engine = open_engine(settings.database_url)
    try:
        upgrade(engine)
        windows = PartitionFences(engine, settings.windows_group, settings.topic)
        owner = Owner(WINDOWS, settings.windows_group, settings.topic, None)
        windows.reset({0: 40, 1: 2}, {0: (0, 0), 1: (0, 0)}, MOVED, owner=owner)
        PartitionFences(engine, settings.docsync_group, settings.topic).reset({0: 30}, {0: (0, 0)}, MOVED)
        claim(engine, Owner(DOCSYNC, "docsync-before-a-rename", settings.topic, None), MOVED)
        with engine.begin() as connection:
            connection.execute(
                update(partition_fences)
                .where(partition_fences.c.group_id == settings.windows_group, partition_fences.c.partition == 1)
                .values(offsets_lost=7)
            )
            connection.execute(
                insert(docsync_runs).values(
                    group_id=settings.docsync_group,
                    started_at=MOVED,
                    finished_at=MOVED,
                    events_read=30,
                    skills_updated=4,
                    stopped_reason="caught_up",
                )
            )
            connection.execute(
                insert(skill_hourly_stats).values(
                    skill_id="sk_1", hour=MOVED.replace(minute=0, second=0), downloads=1, installs=0, updated_at=MOVED
                )
            )
    finally:
        engine.dispose()


def test_without_kafka_status_reports_what_the_database_says(database_url: str) -> None:
    settings = Settings(
        kafka_bootstrap=f"127.0.0.1:{free_port()}",
        database_url=database_url,
        topic="events-offline",
        dlq_topic="events-offline.dlq",
        windows_group="windows-offline",
        docsync_group="docsync-offline",
    )
    database_as_left(settings)

    report, unreachable = status(settings, timeout=1.0)

    assert isinstance(unreachable, KafkaUnreachable)
    assert report["kafka_unreachable"] == str(unreachable)
    assert f"cannot reach Kafka at {settings.kafka_bootstrap}" in report["kafka_unreachable"]
    groups = {group["group"]: group for group in report["groups"]}
    windows, docsync = groups[settings.windows_group], groups[settings.docsync_group]
    assert (windows["applied"], windows["fences_moved_at"], windows["offsets_lost"]) == (42, MOVED_ISO, {"1": 7})
    assert [(p["partition"], p["fence"], p["lag_records"]) for p in windows["partitions"]] == [
        (0, 40, None),
        (1, 2, None),
    ]
    assert (windows["state"], windows["members"], windows["lag_records"], windows["refused"]) == (None,) * 4
    # Named by the database alone: the docsync tables belong to another group name.
    assert "written by group 'docsync-before-a-rename'" in docsync["refused"]
    assert [(r["events_read"], r["stopped_reason"]) for r in report["docsync_runs"]] == [(30, "caught_up")]
    assert report["windows_tables"]["last_written"] == MOVED_ISO
    assert (report["records"], report["topic_id"], report["dlq"]) == (None, None, None)

    text = render(report, as_json=False)
    assert f"{UNREACHABLE} (at " in text.splitlines()[0], text
    row = next(line for line in text.splitlines() if line.strip().startswith(settings.windows_group))
    assert row.split()[1:4] == ["?", "?", "42"], row
    assert f"{UNREACHABLE}; fences last moved {MOVED_ISO}" in row, row
    assert f"LOST TO RETENTION: {settings.windows_group}: 7 offset(s)" in text, text
    assert f"REFUSED: {settings.docsync_group} would not run" in text, text
    assert f"last written {MOVED_ISO}" in text and f"DLQ: {UNREACHABLE}" in text, text
    assert "#1" in text and "caught_up" in text and "events 30, skills 4" in text, text

    as_json = json.loads(render(report, as_json=True))
    assert as_json["kafka_unreachable"] == report["kafka_unreachable"]
    assert {g["group"]: (g["state"], g["applied"]) for g in as_json["groups"]} == {
        settings.windows_group: (None, 42),
        settings.docsync_group: (None, 30),
    }
