"""`skillstats dlq list` and `dlq replay` against a real broker and a real windows worker (skillstats/dlq_admin.py)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Producer

from skillstats.config import Settings
from skillstats.contract import make_event
from skillstats.dlq import H_REPLAYED_FROM, H_REPLAYED_REASON, REJECTED_BY_DATABASE, Parcel, park_headers
from skillstats.kafka import RawRecord
from skillstats.publisher import Publisher
from skillstats.workload import Record
from tests.conftest import settings_env
from tests.helpers import WorkerProcess, actual_windows, caught_up, publish, read_records, read_topic, wait_until


def cli(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skillstats.cli", "dlq", *args],
        env=settings_env(settings),
        capture_output=True,
        text=True,
        timeout=120,
    )


def listed(settings: Settings, *filters: str) -> dict:
    result = cli(settings, "list", "--json", *filters)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.faults  # every filter and a replay loop over a real DLQ: in the longer suite
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_list_filter_replay_once_and_a_still_invalid_copy_never_loops(settings: Settings, tmp_path: Path) -> None:
    now = int(time.time() * 1000)
    good = make_event("sk_ok", "download", now)
    # Two invalid records: an unknown kind (a contract a later version may accept), and a
    # value that is not JSON (still invalid when replayed).
    unknown_kind = orjson.dumps({"v": 1, "event_id": "e1", "skill_id": "sk_new", "kind": "fork", "occurred_at": now})
    records = [
        Record(good.key, good.encode(), True),
        Record(b"sk_new", unknown_kind, False),
        Record(b"sk_x", b"{", False),
    ]
    publish(settings, records)
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to apply and park")
    wait_until(lambda: len(listed(settings)["records"]) == 2, 30, "both invalid records in the DLQ")

    everything = listed(settings)
    assert everything["counts_by_reason"] == {"unknown_kind": 1, "malformed": 1}
    assert {(r["reason"], r["group"], r["replayed_from"]) for r in everything["records"]} == {
        ("unknown_kind", settings.windows_group, None),
        ("malformed", settings.windows_group, None),
    }
    # Parked with this database's claim mark: a renamed group recognises them (tests/test_dlq_lineage.py).
    assert len({r["database"] for r in everything["records"]}) == 1 and everything["records"][0]["database"]
    malformed = listed(settings, "--reason", "malformed")["records"]
    assert len(malformed) == 1
    source = f"{malformed[0]['source_partition']}:{malformed[0]['source_offset']}"
    assert listed(settings, "--source-offsets", source)["records"] == malformed
    assert listed(settings, "--since", str(now + 3_600_000))["records"] == []

    # Replay needs a selection; a dry run publishes nothing. Today's contract still refuses
    # the malformed record: it is left out, saying so, unless forced.
    assert cli(settings, "replay").returncode == 2
    refused = cli(settings, "replay", "--reason", "malformed", "--dry-run")
    assert refused.returncode == 0 and "still refuses it (malformed" in refused.stderr, refused.stderr
    dry = cli(settings, "replay", "--reason", "malformed", "--dry-run", "--force")
    assert dry.returncode == 0 and "1 record(s) would be replayed" in dry.stdout, dry.stderr
    assert len(read_topic(settings, settings.topic)) == 3

    # The malformed record replayed (forced): the copy carries where it came from, is parked
    # again with that kept, and is not replayed again without --again; nor is the original.
    replayed = cli(settings, "replay", "--reason", "malformed", "--force")
    assert replayed.returncode == 0, replayed.stderr
    assert "replayed 1 record(s)" in replayed.stdout
    copies = [h for _k, _v, h in read_topic(settings, settings.topic) if H_REPLAYED_FROM in h]
    origin = f"{settings.dlq_topic}:{malformed[0]['dlq_partition']}:{malformed[0]['dlq_offset']}".encode()
    assert [c[H_REPLAYED_FROM] for c in copies] == [origin]
    wait_until(caught_up(settings, settings.windows_group, worker), 60, "the worker to read the copy")
    wait_until(lambda: listed(settings)["counts_by_reason"].get("malformed") == 2, 30, "the copy parked again")
    parked_again = [r for r in listed(settings, "--reason", "malformed")["records"] if r["replayed_from"]]
    assert [r["replayed_from"] for r in parked_again] == [origin.decode()]

    # The same selection again: refused without --again; with it, one copy (the original and
    # its parked-again copy are one record), which is parked again, still invalid.
    twice = cli(settings, "replay", "--reason", "malformed", "--force")
    assert twice.returncode == 2 and "--again" in twice.stderr
    assert len(read_topic(settings, settings.topic)) == 4  # nothing more was published
    again = cli(settings, "replay", "--reason", "malformed", "--again", "--force")
    assert again.returncode == 0 and "replayed 1 record(s)" in again.stdout, again.stderr
    wait_until(caught_up(settings, settings.windows_group, worker), 60, "the worker to read the copy")
    wait_until(lambda: listed(settings)["counts_by_reason"].get("malformed") == 3, 30, "the copy parked again")
    assert worker.terminate() == 0
    # Through all of it only the valid event counted.
    daily, _hourly = actual_windows(settings)
    assert {skill for skill, _day in daily} == {"sk_ok"}


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_replayed_record_that_is_valid_now_counts_once_and_never_again(settings: Settings, tmp_path: Path) -> None:
    """A parcel of a record valid today (parked by an older, stricter contract): a copy counts once; then no
    replay sends another, --again included, since the copy did not come back."""
    now = int(time.time() * 1000)
    event = make_event("sk_late_ok", "download", now)
    parcel = Parcel(RawRecord(0, 77, event.key, event.encode()), "unknown_kind", "an older contract", None, now)
    producer = Producer({"bootstrap.servers": settings.kafka_bootstrap})
    producer.produce(
        settings.dlq_topic,
        key=event.key,
        value=event.encode(),
        partition=0,
        headers=park_headers(parcel, settings.topic, settings.windows_group, now),
    )
    assert producer.flush(30) == 0
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    replayed = cli(settings, "replay", "--reason", "unknown_kind")
    assert replayed.returncode == 0 and "replayed 1 record(s)" in replayed.stdout, replayed.stderr
    copies = [h for _k, _v, h in read_topic(settings, settings.topic) if H_REPLAYED_FROM in h]
    assert len(copies) == 1
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to count the copy")
    for extra in ((), ("--again",)):
        refused = cli(settings, "replay", "--reason", "unknown_kind", *extra)
        assert refused.returncode == 2 and "count twice" in refused.stderr, refused.stderr
    assert worker.terminate() == 0
    daily, _hourly = actual_windows(settings)
    assert sum(downloads for downloads, _installs in daily.values()) == 1
    assert len(read_topic(settings, settings.topic)) == 1


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_dry_run_with_nothing_replayable_exits_0_and_says_so(settings: Settings) -> None:
    """A dry run that finds nothing to do did what it was asked (exit 0, a line saying so); the replay itself
    is refused (exit 2), as before: it was asked to publish and cannot."""
    now = int(time.time() * 1000)
    parcel = Parcel(RawRecord(0, 5, b"sk_x", b"{"), "malformed", "not JSON", None, now)
    producer = Producer({"bootstrap.servers": settings.kafka_bootstrap})
    producer.produce(
        settings.dlq_topic,
        key=b"sk_x",
        value=b"{",
        partition=0,
        headers=park_headers(parcel, settings.topic, settings.windows_group, now),
    )
    assert producer.flush(30) == 0
    dry = cli(settings, "replay", "--reason", "malformed", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.strip() == (
        "none of the 1 matching parked record(s) would be replayed (see above; dry run: nothing changed)"
    )
    assert "left out" in dry.stderr and "still refuses it (malformed" in dry.stderr, dry.stderr
    refused = cli(settings, "replay", "--reason", "malformed")
    assert refused.returncode == 2 and "none of the 1 matching parked record(s) can be replayed" in refused.stderr
    assert read_topic(settings, settings.topic) == []  # nothing was published by either


def test_source_offsets_must_be_partition_offset_pairs(settings: Settings) -> None:
    result = cli(settings, "list", "--source-offsets", "3-1200")
    assert result.returncode == 2 and "partition:offset" in result.stderr


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_headers_a_publisher_sets_change_nothing_either_group_counts(settings: Settings, tmp_path: Path) -> None:
    """Where the contract says headers are not read, neither group reads them: a valid event that carries
    `skillstats.replayed_reason: rejected_by_database` (any publisher can set it) counts in both groups."""
    from skillstats.streams.docsync import DocSync
    from tests.helpers import actual_docstats, seed_registry

    seed_registry(settings, {"sk_1": "u1"})
    now = int(time.time() * 1000)
    with Publisher(settings) as publisher:
        publisher.send(make_event("sk_1", "download", now))
        for reason in (REJECTED_BY_DATABASE, "unknown_kind"):
            origin = [(H_REPLAYED_FROM, b"x.dlq:0:1"), (H_REPLAYED_REASON, reason.encode())]
            publisher.send_raw(b"sk_1", make_event("sk_1", "download", now).encode(), headers=origin)
    summary = DocSync(settings).drain()
    assert summary.stopped_reason == "caught_up", summary.error
    assert actual_docstats(settings)[0] == {"sk_1": (3, 0, 0)}
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to count them")
    assert worker.terminate() == 0
    daily, _hourly = actual_windows(settings)
    assert sum(downloads for downloads, _installs in daily.values()) == 3


def park_by_hand(settings: Settings, parcels: list[tuple[Parcel, list[tuple[str, bytes]]]]) -> None:
    """Parcels written to the DLQ as a worker would, with extra headers (what a publisher could add)."""
    now = int(time.time() * 1000)
    producer = Producer({"bootstrap.servers": settings.kafka_bootstrap})
    for parcel, extra in parcels:
        producer.produce(
            settings.dlq_topic,
            key=parcel.record.key,
            value=parcel.record.value,
            partition=0,
            headers=[*park_headers(parcel, settings.topic, settings.windows_group, now), *extra],
        )
    assert producer.flush(30) == 0


@pytest.mark.faults  # a worker counting the one copy of two parcels: in the longer suite
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_two_parcels_of_one_source_record_publish_one_copy(settings: Settings, tmp_path: Path) -> None:
    """A record parked twice (a rebalance whose settle timed out, a DLQ leader lost mid-send) is one record:
    its root is the source record, so one copy is published, once, and counts once."""
    now = int(time.time() * 1000)
    event = make_event("sk_twice", "download", now)
    parcel = Parcel(RawRecord(4, 1234, event.key, event.encode()), "unknown_kind", "an older contract", None, now)
    park_by_hand(settings, [(parcel, []), (parcel, [])])
    assert listed(settings)["counts_by_reason"] == {"unknown_kind": 2}
    dry = cli(settings, "replay", "--reason", "unknown_kind", "--dry-run")
    assert dry.returncode == 0 and "1 record(s) would be replayed" in dry.stdout, dry.stderr
    replayed = cli(settings, "replay", "--reason", "unknown_kind")
    assert replayed.returncode == 0 and "replayed 1 record(s)" in replayed.stdout, replayed.stderr
    assert len(read_topic(settings, settings.topic)) == 1
    again = cli(settings, "replay", "--all", "--again")
    assert again.returncode == 2 and "count twice" in again.stderr, again.stderr
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to count the copy")
    assert worker.terminate() == 0
    daily, _hourly = actual_windows(settings)
    assert sum(downloads for downloads, _installs in daily.values()) == 1


@pytest.mark.faults  # a worker counting a copy, then parking a forged one: in the longer suite
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_forged_replayed_from_header_does_not_open_a_second_replay(settings: Settings, tmp_path: Path) -> None:
    """A record whose root was replayed and counted stays refused, even when another invalid record arrives
    claiming (by header) to be that root's copy parked again: only SQL says where copies landed."""
    now = int(time.time() * 1000)
    event = make_event("sk_once", "download", now)
    parcel = Parcel(RawRecord(2, 50, event.key, event.encode()), "unknown_kind", "an older contract", None, now)
    park_by_hand(settings, [(parcel, [])])
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    replayed = cli(settings, "replay", "--reason", "unknown_kind")
    assert replayed.returncode == 0, replayed.stderr
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to count the copy")
    root_parcel = listed(settings)["records"][0]
    forged = f"{settings.dlq_topic}:{root_parcel['dlq_partition']}:{root_parcel['dlq_offset']}".encode()
    with Publisher(settings) as publisher:  # invalid, and claiming to be the copy parked again
        publisher.send_raw(b"sk_other", b"{not json", headers=[(H_REPLAYED_FROM, forged)])
    wait_until(caught_up(settings, settings.windows_group, worker), 60, "the worker to park it")
    wait_until(lambda: listed(settings)["counts_by_reason"].get("malformed") == 1, 30, "the forged record parked")
    for extra in ((), ("--again",)):
        refused = cli(settings, "replay", "--reason", "unknown_kind", *extra)
        assert refused.returncode == 2 and "count twice" in refused.stderr, refused.stderr
    assert worker.terminate() == 0
    daily, _hourly = actual_windows(settings)
    assert sum(downloads for downloads, _installs in daily.values()) == 1


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_record_the_database_refused_is_added_to_the_windows_tables_once(settings: Settings) -> None:
    """docsync counted it (its database accepted it): a copy on the topic would count twice there, so the
    replay adds it to the windows tables directly, recorded in the same transaction: once, never again."""
    from sqlalchemy import insert

    from skillstats.sinks.db import open_engine
    from skillstats.sinks.schema import rejected_records

    now = int(time.time() * 1000)
    event = make_event("sk_refused_once", "install_new", now)
    parcel = Parcel(RawRecord(1, 9, event.key, event.encode()), REJECTED_BY_DATABASE, "simulated", None, now)
    park_by_hand(settings, [(parcel, [])])
    # Without the windows group's record that its fence passed it as refused, it may have counted since.
    unproven = cli(settings, "replay", "--reason", REJECTED_BY_DATABASE, "--dry-run")
    # A dry run with nothing it would replay is no failure (exit 0), and it says why this one would be refused.
    said = unproven.stdout + unproven.stderr
    assert unproven.returncode == 0 and "not recorded as skipped" in said, said
    engine = open_engine(settings.database_url)
    with engine.begin() as connection:  # as the worker's transaction that passes it writes it
        connection.execute(
            insert(rejected_records),
            [
                {
                    "group_id": settings.windows_group,
                    "topic": settings.topic,
                    "partition": 1,
                    "offset": 9,
                    "rejected_at": datetime.now(UTC).replace(tzinfo=None),
                }
            ],
        )
    engine.dispose()
    dry = cli(settings, "replay", "--reason", REJECTED_BY_DATABASE, "--dry-run")
    assert dry.returncode == 0 and "would add to the windows tables" in dry.stdout, dry.stdout + dry.stderr
    done = cli(settings, "replay", "--reason", REJECTED_BY_DATABASE)
    assert done.returncode == 0 and "added 1 to the windows tables" in done.stdout, done.stderr
    assert read_topic(settings, settings.topic) == []  # nothing published
    daily, hourly = actual_windows(settings)
    assert list(daily.values()) == [(0, 1)] and list(hourly.values()) == [(0, 1)]
    again = cli(settings, "replay", "--reason", REJECTED_BY_DATABASE, "--again")
    assert again.returncode == 2 and "count twice" in again.stderr, again.stderr
    assert actual_windows(settings)[0] == daily


def copy_sqlite(source: str, target: str) -> None:
    """A backup taken, or restored, with SQLite's online backup: the whole database as it was at that moment."""
    with sqlite3.connect(source) as src, sqlite3.connect(target) as dst:
        src.backup(dst)


def replay_rows(settings: Settings) -> list[tuple[int, int, int | None, int | None]]:
    """(source partition, source offset, copy partition, copy offset) of each replay SQL knows, by number."""
    from sqlalchemy import select

    from skillstats.sinks.db import open_engine
    from skillstats.sinks.schema import dlq_replays

    engine = open_engine(settings.database_url)
    try:
        with engine.connect() as connection:
            rows = connection.execute(
                select(
                    dlq_replays.c.source_partition,
                    dlq_replays.c.source_offset,
                    dlq_replays.c.copy_partition,
                    dlq_replays.c.copy_offset,
                ).order_by(dlq_replays.c.replay_number)
            )
            return [tuple(row) for row in rows]
    finally:
        engine.dispose()


@pytest.mark.faults  # a backup, a replay, a restore, the workers again: in the longer suite
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_database_restored_to_before_a_replay_does_not_get_the_record_a_second_copy(
    settings: Settings, tmp_path: Path
) -> None:
    """The database goes back to a backup from before a replay: SQL no longer knows the copy, which is still in
    the topic above the restored fences (the consumers count it again, once). A replay then finds it in the
    replay ledger, records it in SQL, and publishes nothing: the record has one copy, and counts once."""
    now = int(time.time() * 1000)
    event = make_event("sk_restored", "download", now)
    parcel = Parcel(RawRecord(5, 321, event.key, event.encode()), "unknown_kind", "an older contract", None, now)
    park_by_hand(settings, [(parcel, [])])
    database = settings.database_url.removeprefix("sqlite:///")
    copy_sqlite(database, str(tmp_path / "backup.db"))

    replayed = cli(settings, "replay", "--reason", "unknown_kind")
    assert replayed.returncode == 0 and "replayed 1 record(s)" in replayed.stdout, replayed.stderr
    copies = [r for r in read_records(settings, settings.topic) if H_REPLAYED_FROM in r.headers]
    assert len(copies) == 1
    assert replay_rows(settings) == [(5, 321, copies[0].partition, copies[0].offset)]

    copy_sqlite(str(tmp_path / "backup.db"), database)  # the restore
    assert replay_rows(settings) == []
    for extra in ((), ("--again",)):
        again = cli(settings, "replay", "--reason", "unknown_kind", *extra)
        assert again.returncode == 2 and "count twice" in again.stderr, again.stdout + again.stderr
    assert len(read_records(settings, settings.topic)) == 1  # no second copy
    # SQL knows the replay again, and where its copy landed.
    assert replay_rows(settings) == [(5, 321, copies[0].partition, copies[0].offset)]
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to count the copy")
    assert worker.terminate() == 0
    daily, _hourly = actual_windows(settings)
    assert sum(downloads for downloads, _installs in daily.values()) == 1


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_copy_parked_again_whose_position_sql_lost_is_known_by_the_ledger(settings: Settings, tmp_path: Path) -> None:
    """A copy still invalid comes back parked; SQL does not know where the copy landed (the replay was cut off
    before it recorded it, or the database restored to before the replay). The ledger says where: the parcel
    is that copy parked again, so `--again` may send one more (none of them counted), and no new root is
    made of the parked copy."""
    now = int(time.time() * 1000)
    parcel = Parcel(RawRecord(7, 70, b"sk_bad", b"{not json"), "malformed", "not JSON", None, now)
    park_by_hand(settings, [(parcel, [])])
    database = settings.database_url.removeprefix("sqlite:///")
    copy_sqlite(database, str(tmp_path / "backup.db"))
    first = cli(settings, "replay", "--reason", "malformed", "--force")
    assert first.returncode == 0 and "replayed 1 record(s)" in first.stdout, first.stderr
    (copy,) = [r for r in read_records(settings, settings.topic) if H_REPLAYED_FROM in r.headers]
    # The worker parks the copy again (by hand here: as the worker would, naming the copy as its source).
    came_back = Parcel(RawRecord(copy.partition, copy.offset, b"sk_bad", b"{not json"), "malformed", "again")
    park_by_hand(settings, [(came_back, [(H_REPLAYED_FROM, copy.headers[H_REPLAYED_FROM])])])
    copy_sqlite(str(tmp_path / "backup.db"), database)  # SQL forgets the replay and where its copy landed

    dry = cli(settings, "replay", "--reason", "malformed", "--force", "--again", "--dry-run")
    assert dry.returncode == 0 and "1 record(s) would be replayed" in dry.stdout, dry.stdout + dry.stderr
    assert f"would replay {settings.topic}:7:70 " in dry.stdout, dry.stdout  # one root: the original record
    again = cli(settings, "replay", "--reason", "malformed", "--force", "--again")
    assert again.returncode == 0 and "replayed 1 record(s)" in again.stdout, again.stderr
    copies = [r for r in read_records(settings, settings.topic) if H_REPLAYED_FROM in r.headers]
    assert len(copies) == 2
    assert replay_rows(settings) == [(7, 70, c.partition, c.offset) for c in copies]
