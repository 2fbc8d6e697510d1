"""A partition the database refuses for good is held back; every other partition moves (real Kafka, SQLite,
PostgreSQL).

The registry owns `skills` and may constrain it: here `CHECK (installs_current >= 0)`,
which refuses the delta of a skill deactivated more often than installed. Before,
that one refusal failed every drain at its partition, and the partitions after it
never moved again. Now the refused partition is held at its fence (nothing of it
applied), the others are applied, the run exits 1, and the run row, `status`, the
`--every` process' metric and the summary name the partition, the offset and the
database's error; once the row is fixed the next drain applies it, once.
Expectations come from tests.helpers' restatement of docs/contract.md, never from
the production code.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from sqlalchemy import Engine, text, update
from sqlalchemy.exc import IntegrityError

from skillstats.config import Settings
from skillstats.contract import make_event
from skillstats.kafka import end_offsets
from skillstats.sinks.db import open_engine
from skillstats.sinks.docstats import DocStatsSink, HeldPartition, PartitionDeltas, held_error, held_from_error
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.schema import skills
from skillstats.workload import Record
from tests.conftest import settings_env
from tests.helpers import (
    actual_docstats,
    expected_docstats,
    fences,
    free_port,
    get,
    murmur2_partition,
    publish,
    run_docsync,
    seed_registry,
    wait_until,
)
from tests.test_publish import cli

CONSTRAINT = "skills_installs_current_nonnegative"
NEGATIVE = "sk_below_zero"  # murmur2 partition 3 of 12: chunk-mates before it, partitions after it
SKILLS = [f"sk_held_{i:02d}" for i in range(36)]
ROWS: dict[str, str | None] = {skill: f"owner_{i % 7}" for i, skill in enumerate([*SKILLS, NEGATIVE])}


def refuse_negative_installs(engine: Engine) -> None:
    """The registry's constraint: `CHECK (installs_current >= 0)` on `skills` (SQLite: the table rebuilt with it)."""
    check = f"CONSTRAINT {CONSTRAINT} CHECK (installs_current >= 0)"
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(text(f"ALTER TABLE skills ADD {check}"))
            return
        # SQLite cannot add a constraint to a table: rebuild it, as the SQLite documentation says to.
        create = connection.execute(text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'skills'"))
        create_sql = create.scalar_one()
        indexes = connection.execute(
            text("SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'skills' AND sql IS NOT NULL")
        ).scalars()
        index_sql = list(indexes)
        close = create_sql.rindex(")")
        connection.execute(text("ALTER TABLE skills RENAME TO skills_unchecked"))
        connection.execute(text(f"{create_sql[:close]}, {check})"))
        connection.execute(text("INSERT INTO skills SELECT * FROM skills_unchecked"))
        connection.execute(text("DROP TABLE skills_unchecked"))
        for sql in index_sql:
            connection.execute(text(sql))


def events() -> list[Record]:
    """Downloads and installs for SKILLS (every partition gets some), and one deactivation of NEGATIVE, which
    has no install: its `installs_current` would go to -1, which the constraint refuses."""
    now = int(time.time() * 1000)
    records = []
    for round_ in range(4):
        for i, skill in enumerate(SKILLS):
            kind = ("download", "install_new", "download", "install_reactivate")[(i + round_) % 4]
            event = make_event(skill, kind, now - 60_000)
            records.append(Record(event.key, event.encode(), True))
    refused = make_event(NEGATIVE, "install_deactivate", now - 60_000)
    records.insert(len(records) // 2, Record(refused.key, refused.encode(), True))
    return records


def status_report(settings: Settings) -> tuple[dict[str, Any], str]:
    """`status` in both forms; exit 1 while a partition is held back (for on-call scripts), else 0."""
    as_json = cli(settings, "status", "--json")
    report = json.loads(as_json.stdout)
    assert as_json.returncode == (1 if report.get("docsync_held_back") else 0), as_json.stderr
    as_text = cli(settings, "status")
    assert as_text.returncode == as_json.returncode, as_text.stderr
    return report, as_text.stdout


@pytest.mark.faults  # a drain held back, then freed, end to end: in the longer suite
def test_a_partition_the_database_refuses_is_held_back_and_every_other_moves(settings: Settings) -> None:
    engine = open_engine(settings.database_url)
    seed_registry(settings, ROWS)
    refuse_negative_installs(engine)
    records = events()
    assert publish(settings, records) == len(records)
    held = murmur2_partition(NEGATIVE.encode(), 12)
    ends = {p: n for p, n in end_offsets(settings, settings.topic).items() if n > 0}
    # The premise: partitions on both sides of the refused one hold records, and so does the refused one
    # besides NEGATIVE's event (they wait with it).
    assert min(ends) < held < max(ends), (held, ends)
    in_held = [r for r in records if murmur2_partition(r.key or b"", 12) == held]
    assert len(in_held) > 1
    elsewhere = [r for r in records if murmur2_partition(r.key or b"", 12) != held]

    status, [summary] = run_docsync(settings)
    assert status == 1, summary
    assert summary["stopped_reason"] == "error"
    assert summary["events_read"] == len(records)
    assert summary["partitions_applied"] == len(ends) - 1
    [reported] = summary["held_back"]
    assert (reported["partition"], reported["offset"], reported["read_to"]) == (held, 0, ends[held])
    assert CONSTRAINT in reported["error"] and repr(NEGATIVE) in reported["error"], reported["error"]
    # Every other partition applied, exactly; the held one not at all, its fence where it was.
    want_skills, want_owners, _unknown = expected_docstats(elsewhere, ROWS)
    assert actual_docstats(settings) == (want_skills, want_owners)
    assert fences(settings, settings.docsync_group) == {p: n for p, n in ends.items() if p != held}
    # The run row says it, and `status` reads it back, partition, offset and the database's error.
    report, shown = status_report(settings)
    [run] = report["docsync_runs"]
    assert run["stopped_reason"] == "error" and f"partition {held} held at offset 0" in run["last_error"]
    [listed] = report["docsync_held_back"]
    assert (listed["partition"], listed["offset"], listed["run_id"]) == (held, 0, run["id"])
    assert CONSTRAINT in listed["error"]
    assert f"HELD BACK: {settings.docsync_group} p{held} at offset 0 " in shown, shown
    assert CONSTRAINT in shown

    # The long-running form: the next drain tries it again, holds it again, and exports it.
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "skillstats.cli", "docsync", "--every", "1h", "--json", "--metrics-port", str(port)],
        env=settings_env(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        again = json.loads(process.stdout.readline())
        assert [h["partition"] for h in again["held_back"]] == [held] and again["events_read"] == len(in_held)
        series = f'skillstats_docsync_held_back_offset{{group="{settings.docsync_group}",partition="{held}"}} 0.0'
        wait_until(lambda: series in get(f"http://127.0.0.1:{port}/metrics")[1], 30, "the held partition metric")
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)

    # The registry fixes the row: the next drain applies the held partition, once.
    with engine.begin() as connection:
        connection.execute(update(skills).where(skills.c.id == NEGATIVE).values(installs_current=3))
    engine.dispose()
    status, [fixed] = run_docsync(settings)
    assert status == 0 and fixed["stopped_reason"] == "caught_up" and fixed["held_back"] == [], fixed
    assert (fixed["events_read"], fixed["partitions_applied"]) == (len(in_held), 1)
    want_skills, want_owners, _unknown = expected_docstats(records, ROWS)
    want_skills[NEGATIVE] = (want_skills[NEGATIVE][0], want_skills[NEGATIVE][1], want_skills[NEGATIVE][2] + 3)
    assert actual_docstats(settings) == (want_skills, want_owners)
    assert fences(settings, settings.docsync_group) == ends
    report, shown = status_report(settings)
    assert report["docsync_held_back"] == [] and "HELD BACK" not in shown


def test_one_by_one_applies_every_partition_the_database_takes(database_url: str) -> None:
    """The sink alone: a chunk refused as a whole is applied partition by partition in savepoints; a partition
    refused at first is tried again once another made room for it; the one refused for good is held, with its
    skill named, and nothing of it (not even its download) is applied."""
    engine = open_engine(database_url)
    upgrade(engine)
    with engine.begin() as connection:
        connection.execute(skills.insert(), [{"id": s, "owner_id": "u1"} for s in ("sk_a", "sk_b", "sk_c")])
    refuse_negative_installs(engine)
    sink = DocStatsSink(engine, "docsync-held-unit", "events-held-unit")
    # skill -> [downloads, installs_all_time, installs_current, events]
    a = PartitionDeltas(0, 0, 5, deltas={"sk_a": [0, 0, -1, 1]})  # alone, before b: -1, refused
    b = PartitionDeltas(1, 0, 7, deltas={"sk_a": [2, 1, 1, 3]})  # makes room for a
    c = PartitionDeltas(2, 0, 9, deltas={"sk_b": [0, 0, -2, 1], "sk_c": [1, 0, 0, 1]})  # refused for good

    def state() -> tuple[dict[str, tuple[int, int, int]], dict[int, int]]:
        with engine.connect() as connection:
            rows = connection.execute(
                text("SELECT id, downloads, installs_all_time, installs_current FROM skills ORDER BY id")
            )
            stats = {row[0]: (row[1], row[2], row[3]) for row in rows}
        return stats, sink.fences()

    with pytest.raises(IntegrityError):
        sink.apply_partitions([a, b, c])
    stats, fenced = state()
    assert set(stats.values()) == {(0, 0, 0)} and not any(fenced.values())

    outcome = sink.apply_partitions([a, b, c], one_by_one=True)
    assert outcome.partitions == 2 and outcome.lost_to_another_writer == []
    [refused] = outcome.held
    assert (refused.partition, refused.offset, refused.read_to) == (2, 0, 9)
    assert CONSTRAINT in refused.error and "skill 'sk_b'" in refused.error and "installs_current -2" in refused.error
    stats, fenced = state()
    assert stats == {"sk_a": (2, 1, 0), "sk_b": (0, 0, 0), "sk_c": (0, 0, 0)}
    assert fenced == {0: 5, 1: 7, 2: 0}
    # Applied once: the same reads again find their fences moved.
    again = sink.apply_partitions([a, b], one_by_one=True)
    assert again.lost_to_another_writer == [0, 1] and again.partitions == 0
    assert state()[0]["sk_a"] == (2, 1, 0)
    # What a run row keeps of it reads back the same, whatever error preceded it.
    for error in (held_error([refused]), f"RuntimeError: something else\n{held_error([refused])}"):
        assert held_from_error(error) == [HeldPartition(2, 0, 9, refused.error)]
    assert held_from_error("OperationalError: connection reset") == []
    engine.dispose()
