"""`skillstats prune` on the real broker: it never deletes a record a required group has not committed past.

Records are published with Kafka timestamps three days old (older than
`--retention-days 2`, younger than the local broker's own 7-day retention, which
would otherwise delete them under the test) or now. The groups' committed
offsets are set outright with `commit_offsets`, the windows group's SQL fences
with `PartitionFences.reset`; the CLI runs as a user runs it, in a subprocess.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta

import pytest
from confluent_kafka import Producer
from sqlalchemy import func, insert, select

from skillstats.config import Settings
from skillstats.kafka import commit_offsets, committed_offsets, watermarks
from skillstats.prune import CONFIRM_TOKEN, HourlyPlan, delete_hourly, hourly_cutoff
from skillstats.sinks.db import open_engine
from skillstats.sinks.fences import PartitionFences
from skillstats.sinks.schema import skill_hourly_stats
from skillstats.sinks.upserts import now_utc_naive
from tests.test_publish import SQLITE_ONLY, cli

DAY_MS = 86_400_000


def produce(settings: Settings, partition: int, count: int, timestamp_ms: int) -> None:
    producer = Producer({"bootstrap.servers": settings.kafka_bootstrap, "linger.ms": 5})
    failures: list[object] = []
    for n in range(count):
        producer.produce(
            settings.topic,
            key=b"sk_1",
            value=f'{{"n": {n}}}'.encode(),
            partition=partition,
            timestamp=timestamp_ms + n,
            on_delivery=lambda error, _msg: failures.append(error) if error else None,
        )
    assert producer.flush(30) == 0 and not failures, failures


def lows(settings: Settings) -> dict[int, int]:
    return {p: low for p, (low, _high) in watermarks(settings, settings.topic).items()}


# partition -> (records three days old, records from now)
LOG = {0: (10, 5), 1: (10, 5), 2: (10, 0), 3: (10, 0), 4: (10, 0), 5: (10, 0)}
WINDOWS_COMMITS = {0: 12, 1: 15, 2: 10, 3: 10, 4: 8, 5: 3, 6: 100}
DOCSYNC_COMMITS = {0: 12, 1: 4, 3: 10, 4: 10, 5: 10, 6: 100}  # none on 2; 1 lags behind the time cutoff
# 4: a fence below the commit (database restored); 5: ahead of it (a late commit); the rest as committed
WINDOWS_FENCES = {**WINDOWS_COMMITS, 4: 6, 5: 9}
# none on 3: a commit but no fence row (a database restored from before docsync's first drain there)
DOCSYNC_FENCES = {p: n for p, n in DOCSYNC_COMMITS.items() if p != 3}
EXPECTED_CUTOFFS = {0: 10, 1: 4, 4: 6, 5: 3}  # every other partition is left alone


def prepare(settings: Settings) -> None:
    now = int(time.time() * 1000)
    for partition, (old, new) in LOG.items():
        produce(settings, partition, old, now - 3 * DAY_MS)
        if new:
            produce(settings, partition, new, now)
    commit_offsets(settings, settings.windows_group, settings.topic, WINDOWS_COMMITS)
    commit_offsets(settings, settings.docsync_group, settings.topic, DOCSYNC_COMMITS)
    engine = open_engine(settings.database_url)
    try:
        for group, fences in ((settings.windows_group, WINDOWS_FENCES), (settings.docsync_group, DOCSYNC_FENCES)):
            marks = {p: (0, 0) for p in fences}
            PartitionFences(engine, group, settings.topic).reset(fences, marks, now_utc_naive())
    finally:
        engine.dispose()


def prune_json(settings: Settings, *args: str) -> dict:
    result = cli(settings, "prune", "--retention-days", "2", "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.faults  # both groups run, then a prune at each of their positions: in the longer suite
def test_prune_never_deletes_what_a_required_group_has_not_committed_past(settings: Settings) -> None:
    prepare(settings)
    before = lows(settings)
    assert set(before.values()) == {0}

    # Dry run (the default): the plan, per partition, and nothing changes.
    report = prune_json(settings)
    assert report["dry_run"] is True
    by_partition = {p["partition"]: p for p in report["partitions"]}
    empty = {p: 0 for p in range(7, 12)}  # nothing in them and nobody read them: ready, nothing to delete
    assert {p: r["cutoff"] for p, r in by_partition.items() if r["ready"]} == {**EXPECTED_CUTOFFS, **empty}
    assert {p: r["records"] for p, r in by_partition.items() if r["ready"]} == {**EXPECTED_CUTOFFS, **empty}
    assert report["records"] == sum(EXPECTED_CUTOFFS.values())
    assert by_partition[0]["limited_by"] == "retention" and by_partition[0]["retention_offset"] == 10
    assert by_partition[1]["limited_by"] == settings.docsync_group  # lags behind the time cutoff
    assert "no SQL fence" in by_partition[3]["reason"] and settings.docsync_group in by_partition[3]["reason"]
    assert by_partition[4]["limited_by"] == settings.windows_group and "SQL fence" in by_partition[4]["reason"]
    assert by_partition[5]["limited_by"] == settings.windows_group and "committed" in by_partition[5]["reason"]
    assert "not ready" in by_partition[2]["reason"] and settings.docsync_group in by_partition[2]["reason"]
    assert "past the log end" in by_partition[6]["reason"]
    # Empty partitions have nothing to delete: said so, not "not ready" for a cursor they cannot have.
    assert all(by_partition[p]["reason"] == "empty: no records" for p in range(7, 12))
    assert all(by_partition[p]["records"] == 0 for p in range(7, 12))
    assert report["not_ready"] == [2, 3, 6]
    assert lows(settings) == before

    text = cli(settings, "prune", "--retention-days", "2")
    assert text.returncode == 0, text.stderr
    assert "dry run: 23 offset(s) in 4 partition(s) would be deleted" in text.stdout, text.stdout
    assert f"--apply --confirm {CONFIRM_TOKEN}" in text.stdout
    line = next(ln for ln in text.stdout.splitlines() if ln.split()[:1] == ["1"])
    assert line.split()[:4] == ["1", "0", "4", "4"] and f"group {settings.docsync_group}" in line, line
    assert lows(settings) == before

    # --apply without the token, or with another, is refused before anything is read.
    for extra in ([], ["--confirm", "yes"], ["--confirm", CONFIRM_TOKEN.lower()]):
        refused = cli(settings, "prune", "--retention-days", "2", "--apply", *extra)
        assert refused.returncode == 2, refused.stderr
        assert CONFIRM_TOKEN in refused.stderr and "nothing was deleted" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr and refused.stdout == ""
    assert lows(settings) == before

    # Apply: exactly up to each cutoff, and never past any required group's commit or fence.
    done = prune_json(settings, "--apply", "--confirm", CONFIRM_TOKEN)
    assert done["dry_run"] is False
    after = lows(settings)
    assert after == {p: EXPECTED_CUTOFFS.get(p, 0) for p in range(12)}
    assert {p["partition"]: p["low_watermark_after"] for p in done["partitions"] if p["records"]} == EXPECTED_CUTOFFS
    for group in (settings.windows_group, settings.docsync_group):
        committed = committed_offsets(settings, group, settings.topic)
        assert all(after[p] <= committed[p] for p in after if after[p]), (group, committed, after)
    assert all(after[p] <= f for p, f in WINDOWS_FENCES.items())

    # Again: nothing more to delete.
    again = prune_json(settings, "--apply", "--confirm", CONFIRM_TOKEN)
    assert again["records"] == 0
    assert lows(settings) == after


@SQLITE_ONLY
def test_only_the_required_groups_hold_records_back(settings: Settings) -> None:
    prepare(settings)
    result = cli(settings, "prune", "--retention-days", "2", "--json", "--require-groups", settings.windows_group)
    assert result.returncode == 0, result.stderr
    assert f"group {settings.docsync_group} is not required" in result.stderr
    partitions = {p["partition"]: p for p in json.loads(result.stdout)["partitions"]}
    # The docsync group no longer holds partition 1 back nor keeps 2 "not ready".
    assert partitions[1]["cutoff"] == 10 and partitions[1]["limited_by"] == "retention"
    assert partitions[2]["cutoff"] == 10 and partitions[2]["ready"]
    # A group that never committed anything makes every partition not ready.
    never = f"never-ran-{settings.topic}"
    idle = cli(settings, "prune", "--retention-days", "2", "--json", "--require-groups", f"x,{never}, x")
    assert idle.returncode == 0, idle.stderr
    report = json.loads(idle.stdout)
    assert report["required_groups"] == ["x", never] and report["records"] == 0
    assert "no committed offset" in report["partitions"][0]["reason"]
    assert report["partitions"][7]["reason"] == "empty: no records"
    assert set(lows(settings).values()) == {0}


@SQLITE_ONLY
def test_an_empty_partition_a_group_has_read_is_empty_not_not_ready(settings: Settings) -> None:
    """Issue 28: an empty partition is "empty: no records" whoever read it (the docs' words), not "not ready"
    because one group committed there and the other did not, nor "no SQL fence" for a fence at 0."""
    produce(settings, 0, 3, int(time.time() * 1000))  # one partition with records: the rest are empty
    commit_offsets(settings, settings.docsync_group, settings.topic, {1: 0, 2: 0, 3: 0})
    commit_offsets(settings, settings.windows_group, settings.topic, {0: 0, 2: 0, 3: 0})
    engine = open_engine(settings.database_url)
    try:
        # Fences at 0 where each group read (a new fence row is at the log start); docsync has none on 3.
        marks = {p: (0, 0) for p in range(4)}
        PartitionFences(engine, settings.windows_group, settings.topic).reset(
            {0: 0, 2: 0, 3: 0}, marks, now_utc_naive()
        )
        PartitionFences(engine, settings.docsync_group, settings.topic).reset({1: 0, 2: 0}, marks, now_utc_naive())
    finally:
        engine.dispose()
    report = prune_json(settings)
    reasons = {p["partition"]: p["reason"] for p in report["partitions"]}
    assert all(reasons[p] == "empty: no records" for p in range(1, 12)), reasons
    assert "not ready" in reasons[0] and settings.docsync_group in reasons[0], reasons  # it has records to wait for
    assert report["not_ready"] == [0] and report["records"] == 0
    text = cli(settings, "prune", "--retention-days", "2")
    assert text.returncode == 0 and "left alone: 1 partition(s) (0)" in text.stdout, text.stdout + text.stderr


@SQLITE_ONLY
def test_usage_mistakes(settings: Settings) -> None:
    for args in (["--retention-days", "0"], ["--retention-days", "91"], ["--retention-days", "x"]):
        result = cli(settings, "prune", *args)
        assert result.returncode == 2 and "1 to 90" in result.stderr, result.stderr
    lonely = cli(settings, "prune", "--confirm", CONFIRM_TOKEN)
    assert lonely.returncode == 2 and "--confirm goes with --apply" in lonely.stderr
    empty = cli(settings, "prune", "--require-groups", ",")
    assert empty.returncode == 2 and "at least one group" in empty.stderr


def hourly_rows(settings: Settings) -> set[tuple[str, datetime]]:
    engine = open_engine(settings.database_url)
    try:
        with engine.connect() as connection:
            found = connection.execute(select(skill_hourly_stats.c.skill_id, skill_hourly_stats.c.hour))
            return {(s, h) for s, h in found}
    finally:
        engine.dispose()


def insert_hourly(settings: Settings, keys: list[tuple[str, datetime]]) -> None:
    engine = open_engine(settings.database_url)
    now = now_utc_naive()
    try:
        with engine.begin() as connection:
            connection.execute(
                insert(skill_hourly_stats),
                [{"skill_id": s, "hour": h, "downloads": 1, "installs": 0, "updated_at": now} for s, h in keys],
            )
    finally:
        engine.dispose()


def test_hourly_rows_older_than_n_days_go_in_batches(settings: Settings) -> None:
    this_hour = now_utc_naive().replace(minute=0, second=0, microsecond=0)
    old = [(f"sk_{n:05d}", this_hour - timedelta(days=10)) for n in range(12_001)]
    old += [("sk_a", this_hour - timedelta(days=2, hours=3)), ("sk_b", this_hour - timedelta(days=40))]
    new = [("sk_a", this_hour), ("sk_a", this_hour - timedelta(days=2) + timedelta(hours=3)), ("sk_b", this_hour)]
    insert_hourly(settings, old + new)

    dry = cli(settings, "prune", "--hourly-days", "2", "--json")
    assert dry.returncode == 0, dry.stderr
    hourly = json.loads(dry.stdout)["hourly"]
    assert hourly["rows"] == len(old) and hourly["deleted"] == 0
    assert len(hourly_rows(settings)) == len(old) + len(new)

    done = cli(settings, "prune", "--hourly-days", "2", "--apply", "--confirm", CONFIRM_TOKEN)
    assert done.returncode == 0, done.stderr
    assert f"deleted {len(old):,} row(s)" in done.stdout, done.stdout
    progress = [ln.strip() for ln in done.stdout.splitlines() if ln.strip().endswith("row(s) deleted")]
    assert progress == ["5,000 row(s) deleted", "10,000 row(s) deleted", "12,003 row(s) deleted"], done.stdout
    assert hourly_rows(settings) == set(new)


def test_delete_hourly_walks_the_key_in_small_batches(settings: Settings) -> None:
    cutoff = datetime(2026, 1, 10)
    old = [(f"sk_{n % 7}", cutoff - timedelta(hours=1 + n)) for n in range(40)]
    new = [(f"sk_{n % 7}", cutoff + timedelta(hours=n)) for n in range(20)]
    insert_hourly(settings, old + new)
    engine = open_engine(settings.database_url)
    seen: list[int] = []
    try:
        with engine.connect() as connection:
            assert connection.execute(select(func.count()).select_from(skill_hourly_stats)).scalar_one() == 60
        plan = delete_hourly(engine, HourlyPlan(1, cutoff, len(old), None), batch_rows=6, progress=seen.append)
    finally:
        engine.dispose()
    assert plan.deleted == 40
    assert seen == [6, 12, 18, 24, 30, 36, 40]
    assert hourly_rows(settings) == set(new)


def test_hourly_cutoff_is_the_start_of_an_hour_that_ended_n_days_ago() -> None:
    from datetime import UTC

    now = datetime(2026, 11, 30, 10, 59, 59, tzinfo=UTC)
    assert hourly_cutoff(2, now) == datetime(2026, 11, 28, 10)
    assert hourly_cutoff(1, datetime(2026, 11, 30, 0, 0, tzinfo=UTC)) == datetime(2026, 11, 29, 0)
    with pytest.raises(ValueError):
        hourly_cutoff(0, now)
