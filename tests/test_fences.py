"""A fence ahead of the log is loud, and `skillstats fences reset` is the explicit way out (docs/contract.md)."""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from skillstats.config import Settings, SettingsError
from skillstats.sinks.db import open_engine
from skillstats.sinks.identity import DOCSYNC, WINDOWS, IdentityMismatch, Owner, claim, owner_of, take_over
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.schema import consumers
from skillstats.sinks.upserts import now_utc_naive
from skillstats.workload import generate
from tests.helpers import (
    WorkerProcess,
    actual_windows,
    caught_up,
    expected_windows,
    fences,
    forget_topic_ids,
    publish,
    recreate_topic,
    wait_until,
)
from tests.test_publish import cli


@pytest.mark.faults  # a worker refused, the reset, a worker again: in the longer suite
def test_windows_refuses_a_fence_ahead_of_the_log_until_reset(settings: Settings, tmp_path: Path) -> None:
    """In a database migrated from before topic ids were kept, a recreated topic shorter than the fences is caught
    by the fences (with the id recorded, the id comes first: test_positions.py)."""
    now = int(time.time() * 1000)
    first = list(generate(3000, now_ms=now, skills=50, seed=1))
    assert publish(settings, first) == len(first)
    worker = WorkerProcess(settings, tmp_path / "a.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the first worker to catch up")
    assert worker.terminate() == 0, worker.log_tail()
    before = actual_windows(settings)
    fences_before = fences(settings, settings.windows_group)

    forget_topic_ids(settings)
    recreate_topic(settings, 12)
    second = list(generate(300, now_ms=now, skills=50, seed=2))
    assert publish(settings, second) == len(second)

    # The worker stops by itself, exit 2, naming the partition, its fence and the log end.
    refused = WorkerProcess(settings, tmp_path / "b.log")
    code = refused.process.wait(120)
    log = refused.log_path.read_text(errors="replace")
    assert code == 2, log[-3000:]
    assert "past the end of topic" in log and "fence" in log and "log end" in log, log[-3000:]
    assert actual_windows(settings) == before
    assert fences(settings, settings.windows_group) == fences_before

    status = cli(settings, "status")
    assert status.returncode == 1, status.stderr  # for on-call scripts: a group refuses to run
    assert "FENCE AHEAD OF LOG" in status.stdout

    dry = cli(settings, "fences", "reset", "--group", settings.windows_group, "--to", "start")
    assert dry.returncode == 0, dry.stderr
    assert "AHEAD OF LOG" in dry.stdout and "dry run" in dry.stdout
    assert fences(settings, settings.windows_group) == fences_before
    wrong = cli(settings, "fences", "reset", "--group", settings.windows_group, "--to", "start", "--confirm", "yes")
    assert wrong.returncode == 2 and "RESET_FENCES" in wrong.stderr

    done = cli(
        settings, "fences", "reset", "--group", settings.windows_group, "--to", "start", "--confirm", "RESET_FENCES"
    )
    assert done.returncode == 0, done.stderr
    worker = WorkerProcess(settings, tmp_path / "c.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to count the new topic")
    assert worker.terminate() == 0, worker.log_tail()
    assert actual_windows(settings) == expected_windows(first + second)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_reset_says_what_it_counts_again_and_waits_for_the_group_to_stop(settings: Settings, tmp_path: Path) -> None:
    records = list(generate(1200, now_ms=int(time.time() * 1000), skills=40, seed=7))
    assert publish(settings, records) == len(records)
    worker = WorkerProcess(settings, tmp_path / "a.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to catch up")
    reset = ["fences", "reset", "--group", settings.windows_group, "--to", "start"]
    dry = cli(settings, *reset)
    assert dry.returncode == 0, dry.stderr
    assert "1,200 offset(s) already applied would be applied again" in dry.stdout, dry.stdout
    assert "offset(s) applied again" in dry.stdout.splitlines()[1]  # per partition, too
    running = cli(settings, *reset, "--confirm", "RESET_FENCES")
    assert running.returncode == 2 and "active member" in running.stderr, running.stderr
    assert sum(fences(settings, settings.windows_group).values()) == 1200  # nothing changed
    assert worker.terminate() == 0
    helped = " ".join(cli(settings, "fences", "reset", "--help").stdout.split())
    assert "Not the tool for a database restored from a backup of its own" in helped


def _reset(settings: Settings, *args: str, group: str | None = None) -> subprocess.CompletedProcess[str]:
    return cli(settings, "fences", "reset", "--group", group or settings.windows_group, *args)


def _owner(settings: Settings) -> Owner | None:
    return owner_of(open_engine(settings.database_url), WINDOWS)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_partial_reset_on_a_replaced_topic_is_refused_and_every_partition_is_listed(settings: Settings) -> None:
    """Issue 27.1: a reset that records a new topic id leaves no fence of the old topic behind."""
    assert publish(settings, list(generate(600, now_ms=int(time.time() * 1000), skills=30, seed=3))) == 600
    assert _reset(settings, "--to", "end", "--confirm", "RESET_FENCES").returncode == 0  # the old topic counted
    old_id = _owner(settings).topic_id  # type: ignore[union-attr]
    assert sum(fences(settings, settings.windows_group).values()) == 600
    recreate_topic(settings, 12)
    assert publish(settings, list(generate(120, now_ms=int(time.time() * 1000), skills=30, seed=4))) == 120

    for confirm in ((), ("--confirm", "RESET_FENCES")):
        partial = _reset(settings, "--to", "start", "--partition", "0", "--partition", "5", *confirm)
        assert partial.returncode == 2, partial.stdout + partial.stderr
        assert "Reset every partition" in partial.stderr, partial.stderr
        listed = [line for line in partial.stdout.splitlines() if line.strip().startswith("partition ")]
        assert len(listed) == 12, partial.stdout  # the dry run shows where every partition would read
        assert sum("unchanged (not chosen)" in line for line in listed) == 10, partial.stdout
    assert sum(fences(settings, settings.windows_group).values()) == 600  # nothing changed
    assert _owner(settings).topic_id == old_id  # type: ignore[union-attr]

    whole = _reset(settings, "--to", "start", "--confirm", "RESET_FENCES")
    assert whole.returncode == 0, whole.stderr
    assert _owner(settings).topic_id != old_id  # type: ignore[union-attr]
    assert sum(fences(settings, settings.windows_group).values()) == 0  # every partition from the new log's start


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_partial_reset_that_records_the_first_id_refuses_other_fences_past_the_log(settings: Settings) -> None:
    """Issue 27.1, the first id: fences left alone must fit the log the id is recorded for."""
    assert publish(settings, list(generate(900, now_ms=int(time.time() * 1000), skills=30, seed=5))) == 900
    assert _reset(settings, "--to", "end", "--confirm", "RESET_FENCES").returncode == 0
    forget_topic_ids(settings)
    recreate_topic(settings, 12)  # a shorter log: most fences are past its end now
    assert publish(settings, list(generate(60, now_ms=int(time.time() * 1000), skills=30, seed=6))) == 60
    before = fences(settings, settings.windows_group)
    partial = _reset(settings, "--to", "start", "--partition", "1", "--confirm", "RESET_FENCES")
    assert partial.returncode == 2 and "past their log end" in partial.stderr, partial.stdout + partial.stderr
    assert fences(settings, settings.windows_group) == before
    assert _owner(settings).topic_id is None  # type: ignore[union-attr]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("how", ["new name", "typo with --role"])
def test_a_reset_of_a_group_that_does_not_own_the_tables_is_refused(settings: Settings, how: str) -> None:
    """Issue 27.2: the tables hold the owner's counts; another name would count them all again."""
    assert publish(settings, list(generate(300, now_ms=int(time.time() * 1000), skills=30, seed=8))) == 300
    assert _reset(settings, "--to", "end", "--confirm", "RESET_FENCES").returncode == 0
    other = f"{settings.windows_group}-v2" if how == "new name" else settings.windows_group[:-1]
    role = ("--role", "windows")
    for confirm in ((), ("--confirm", "RESET_FENCES")):
        refused = _reset(settings, "--to", "start", *role, *confirm, group=other)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "nothing is counted twice" not in refused.stdout
        assert "fences takeover --from " + settings.windows_group in refused.stderr, refused.stderr
    assert _owner(settings).group_id == settings.windows_group  # type: ignore[union-attr]
    assert fences(settings, other) == {}


def test_one_group_for_both_roles_is_refused_by_the_settings_and_by_the_claim(tmp_path: Path) -> None:
    """Issue 27.4: the settings refuse it, and a database whose other role has the group refuses the claim."""
    with pytest.raises(SettingsError, match="SKILLSTATS_DOCSYNC_GROUP"):
        Settings(windows_group="same", docsync_group="same")
    with pytest.raises(SettingsError):
        Settings.from_env({"SKILLSTATS_WINDOWS_GROUP": "g", "SKILLSTATS_DOCSYNC_GROUP": "g"})
    engine = open_engine(f"sqlite:///{tmp_path}/roles.db")
    upgrade(engine)
    now = now_utc_naive()
    claim(engine, Owner(DOCSYNC, "shared", "events", None), now)
    with pytest.raises(IdentityMismatch) as refused:
        claim(engine, Owner(WINDOWS, "shared", "events", None), now)
    assert "SKILLSTATS_WINDOWS_GROUP (--group) must differ" in str(refused.value)
    assert "takeover" not in str(refused.value)  # no way out offered that would be refused in turn
    assert owner_of(engine, WINDOWS) is None
    claim(engine, Owner(WINDOWS, "mine", "events", None), now)
    with pytest.raises(IdentityMismatch, match="cannot also write"):
        take_over(engine, WINDOWS, "mine", "shared", now)
    assert owner_of(engine, WINDOWS) == Owner(WINDOWS, "mine", "events", None)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_reset_or_takeover_onto_the_other_roles_group_names_the_clash(settings: Settings) -> None:
    """Issue 27.4, the operator's tools: the refusal names the clash, not a takeover."""
    assert _reset(settings, "--to", "end", "--confirm", "RESET_FENCES", group=settings.docsync_group).returncode == 0
    clash = _reset(settings, "--to", "end", "--role", "windows", group=settings.docsync_group)
    assert clash.returncode == 2 and "cannot also write" in clash.stderr, clash.stdout + clash.stderr
    assert _owner(settings) is None


def test_the_database_mark_is_kept_by_resets_takeovers_and_a_backup_from_before_it_existed(tmp_path: Path) -> None:
    """Issue 27.3: the mark says which database counts a group; its own restored backup must say the same, even a
    backup from before revision 0007 (the mark is derived from the claim, not drawn at random), and a database of
    its own must differ."""
    from alembic import command

    from skillstats.sinks.identity import claim_mark, database_mark, record
    from skillstats.sinks.migrate import _config

    engine = open_engine(f"sqlite:///{tmp_path}/old.db")
    config = _config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, "0006")
    claimed_at = now_utc_naive()
    with engine.begin() as connection:  # a claim written by a version before the mark existed
        connection.execute(
            consumers.insert().values(
                role=WINDOWS,
                group_id="g",
                topic="events",
                topic_id=None,
                registered_at=claimed_at,
                updated_at=claimed_at,
            )
        )
    upgrade(engine)
    mark = database_mark(engine, WINDOWS)
    assert mark.endswith(claim_mark(WINDOWS, claimed_at))  # what the running database had computed too
    with engine.begin() as connection:
        record(connection, Owner(WINDOWS, "g", "events-2", "id-2"), now_utc_naive())  # a reset to a new topic
    take_over(engine, WINDOWS, "g", "g-v2", now_utc_naive())
    assert database_mark(engine, WINDOWS) == mark
    other = open_engine(f"sqlite:///{tmp_path}/other.db")
    upgrade(other)
    claim(other, Owner(WINDOWS, "g", "events", None), now_utc_naive())
    assert database_mark(other, WINDOWS) != mark


def test_a_mark_is_read_back_exactly_from_commits_aiokafka_and_librdkafka_wrote() -> None:
    """librdkafka reads commit metadata as a C string: written without a NUL (aiokafka) it came back with junk
    appended (a false "another database"), or undecodable. Ours carry the NUL; junk after it is never a mark."""
    from skillstats.sinks.identity import MARK_PREFIX, commit_metadata_for, other_databases

    mark = MARK_PREFIX + "0" * 32
    assert other_databases(mark, {0: mark + "\0lz4.%", 1: commit_metadata_for(mark), 2: "", 3: "faust"}) == {}
    theirs = MARK_PREFIX + "1" * 32
    assert other_databases(mark, {0: theirs + "\0junk", 1: theirs + "lz4"}) == {0: theirs, 1: theirs}


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_commits_of_both_clients_carry_the_mark_readably(settings: Settings) -> None:
    import asyncio

    from aiokafka import AIOKafkaConsumer
    from aiokafka.structs import OffsetAndMetadata
    from aiokafka.structs import TopicPartition as AioPartition

    from skillstats.kafka import commit_metadata, commit_offsets
    from skillstats.sinks.identity import MARK_PREFIX, commit_metadata_for

    mark = MARK_PREFIX + "ab" * 16

    async def aiokafka_commit() -> None:  # as the windows worker commits: faust turns aiokafka's auto-commit off
        # With it on (aiokafka's default), stop() commits every partition whose position it had resolved, with
        # empty metadata, over ours: a CI run read partition 0 back as "" that way.
        consumer = AIOKafkaConsumer(
            bootstrap_servers=settings.kafka_bootstrap, group_id=settings.windows_group, enable_auto_commit=False
        )
        await consumer.start()
        try:
            partitions = [AioPartition(settings.topic, p) for p in range(6)]
            consumer.assign(partitions)
            await consumer.commit({tp: OffsetAndMetadata(0, commit_metadata_for(mark)) for tp in partitions})
        finally:
            await consumer.stop()

    asyncio.run(aiokafka_commit())
    commit_offsets(settings, settings.windows_group, settings.topic, {p: 0 for p in range(6, 12)}, metadata=mark)
    for _ in range(50):  # the over-read was intermittent: read often
        read = commit_metadata(settings, settings.windows_group, settings.topic)
        assert {p: m.split("\0", 1)[0] for p, m in read.items()} == {p: mark for p in range(12)}


def test_a_coordinator_away_leaves_the_database_check_for_the_next_claim(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The group's commits come from its coordinator, which moves when its broker dies: a docsync drain then must
    not fail on the guard (the fault suite's drain with the coordinator killed did). Said once; another
    database's mark, once readable, still refuses."""
    from confluent_kafka import KafkaError, KafkaException

    from skillstats import positions
    from skillstats.sinks.fences import PartitionFences
    from skillstats.sinks.identity import MARK_PREFIX

    answers: list[Any] = [KafkaException(KafkaError(KafkaError._TIMED_OUT))] * 2 + [{0: MARK_PREFIX + "f" * 32}]

    def commits(*_args: Any) -> dict[int, str]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(positions, "commit_metadata", commits)
    fences = PartitionFences.__new__(PartitionFences)
    fences.group_id, fences.topic = "g", "t"
    checker = positions.Positions(Settings(kafka_bootstrap="127.0.0.1:1"), WINDOWS, fences)
    mine = MARK_PREFIX + "0" * 32
    with caplog.at_level(logging.WARNING, logger="skillstats.positions"):
        checker._check_group_database(12, mine)
        checker._check_group_database(12, mine)
    assert sum("could not read group g's Kafka commits" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(IdentityMismatch, match="counted by another database"):
        checker._check_group_database(12, mine)
