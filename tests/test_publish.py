"""Publishing: the CLI, the Python API, and a non-Python publisher (Debian's kcat)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import orjson
import pytest
from confluent_kafka import Consumer, TopicPartition

from skillstats.config import Settings
from skillstats.contract import Invalid, decode, make_event
from skillstats.kafka import end_offsets
from skillstats.publisher import Publisher, PublishError
from tests.conftest import settings_env
from tests.helpers import WorkerProcess, actual_windows, caught_up, murmur2_partition, read_topic, wait_until

SQLITE_ONLY = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def cli(settings: Settings, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skillstats.cli", *args],
        env=settings_env(settings),
        input=stdin.decode() if stdin else None,
        capture_output=True,
        text=True,
        timeout=120,
    )


def published(settings: Settings) -> int:
    return sum(end_offsets(settings, settings.topic).values())


@SQLITE_ONLY
def test_jsonl_with_invalid_lines_sends_nothing_and_names_the_lines(settings: Settings, tmp_path: Path) -> None:
    now = int(time.time() * 1000)
    lines = [
        orjson.dumps({"skill_id": "sk_1", "kind": "download", "occurred_at": now}),
        b"{broken",
        orjson.dumps({"skill_id": "sk_2", "kind": "install_clear", "occurred_at": now}),
        orjson.dumps({"skill_id": "sk_3", "kind": "install_new", "occurred_at": now}),
    ]
    path = tmp_path / "events.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    refused = cli(settings, "publish", "--file", str(path))
    assert refused.returncode == 2
    assert "line 2: not JSON" in refused.stderr and "line 3: bad_delta" in refused.stderr
    assert "nothing was published" in refused.stderr
    assert published(settings) == 0

    sent = cli(settings, "publish", "--file", str(path), "--skip-invalid")
    assert sent.returncode == 0, sent.stderr
    assert "published 2 event(s)" in sent.stdout
    assert published(settings) == 2


def test_a_line_takes_the_same_defaults_and_times_as_the_flags(tmp_path: Path) -> None:
    """One rule for both forms: occurred_at defaults to now and may be ISO-8601 with a zone; what cannot be
    read is said in words. Checked before Kafka is even asked (none here)."""
    path = tmp_path / "events.jsonl"
    path.write_text(
        '{"skill_id": "sk_1", "kind": "download"}\n'
        '{"skill_id": "sk_1", "kind": "download", "occurred_at": "2026-12-01T07:30:00Z"}\n'
        "not json at all\n"
        '{"skill_id": "sk_1", "kind": "download", "occurred_at": "yesterday"}\n'
        '{"skill_id": "sk_1", "kind": "download", "occurred_at": "2026-12-01T07:30:00"}\n'
        "[1, 2]\n"
        '{"skill_id": "sk_1", "kind": "download", "occurred_at": null}\n'
    )
    result = cli(Settings(kafka_bootstrap="127.0.0.1:1"), "publish", "--file", str(path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[:5] == [
        "line 3: not JSON: Expecting value at column 1 (each line is one JSON object)",
        "line 4: occurred_at: not epoch milliseconds or ISO-8601: 'yesterday'",
        "line 5: occurred_at: give a timezone (e.g. a trailing Z for UTC): '2026-12-01T07:30:00'",
        "line 6: not a JSON object (each line is one event object, {...})",
        # Absent means now; an explicit null is a mistake upstream, not "now".
        "line 7: bad_timestamp: occurred_at must be integer milliseconds since the epoch, got null",
    ]
    assert "send the 2 valid ones" in lines[5]
    assert "occurred_at to now" in " ".join(cli(Settings(), "publish", "--help").stdout.split())


@SQLITE_ONLY
def test_single_event_flags(settings: Settings) -> None:
    ok = cli(
        settings,
        "publish",
        "--skill-id",
        "sk_1",
        "--kind",
        "install_clear",
        "--delta-all-time",
        "-2",
        "--delta-current",
        "-1",
        "--occurred-at",
        "2025-11-30T00:00:00Z",
    )
    assert ok.returncode == 0, ok.stderr
    bad = cli(settings, "publish", "--skill-id", "sk_1", "--kind", "download", "--occurred-at", "1999-12-31T23:59:59Z")
    assert bad.returncode == 2 and "bad_timestamp" in bad.stderr
    usage = cli(settings, "publish", "--kind", "download")
    assert usage.returncode == 2 and "--skill-id" in usage.stderr
    assert published(settings) == 1


def test_publish_to_an_unreachable_broker_fails_clearly() -> None:
    settings = Settings(kafka_bootstrap="127.0.0.1:1", topic="nowhere")
    publisher = Publisher(settings, flush_timeout=2)
    publisher.send(make_event("sk_1", "download", int(time.time() * 1000)))
    with pytest.raises(PublishError) as raised:
        publisher.flush()
    assert raised.value.unconfirmed == 1 and "not confirmed" in str(raised.value)


@SQLITE_ONLY
def test_python_publisher_partitions_like_the_java_client(settings: Settings) -> None:
    keys = [f"sk_{i}" for i in range(60)] + ["sk_é✓", "x" * 128]
    with Publisher(settings) as publisher:
        for key in keys:
            publisher.send(make_event(key, "download", int(time.time() * 1000)))
    assert _partitions_of(settings) == {key.encode(): murmur2_partition(key.encode(), 12) for key in keys}


@SQLITE_ONLY
def test_record_from_kcat_is_counted(settings: Settings, tmp_path: Path) -> None:
    kcat = shutil.which("kcat")
    assert kcat, "kcat is not installed (the README's test command installs Debian's kcat)"
    occurred = int(time.time() * 1000) - 5000
    value = orjson.dumps(
        {"v": 1, "event_id": "from-kcat", "skill_id": "sk_kcat", "kind": "download", "occurred_at": occurred}
    )
    subprocess.run(
        [
            kcat,
            "-P",
            "-b",
            settings.kafka_bootstrap,
            "-t",
            settings.topic,
            "-k",
            "sk_kcat",
            "-X",
            "partitioner=murmur2_random",
        ],
        input=value,
        check=True,
        timeout=60,
    )
    assert _partitions_of(settings) == {b"sk_kcat": murmur2_partition(b"sk_kcat", 12)}
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to count the kcat record")
    worker.terminate()
    daily, hourly = actual_windows(settings)
    assert [(skill, counts) for (skill, _), counts in daily.items()] == [("sk_kcat", (1, 0))]
    assert len(hourly) == 1


def _partitions_of(settings: Settings) -> dict[bytes, int]:
    """key -> partition for every record on the topic."""
    consumer = Consumer({"bootstrap.servers": settings.kafka_bootstrap, "group.id": "tests-partitions"})
    try:
        ends = end_offsets(settings, settings.topic)
        consumer.assign([TopicPartition(settings.topic, p, 0) for p, end in ends.items() if end])
        found: dict[bytes, int] = {}
        want = sum(ends.values())
        deadline = time.monotonic() + 30
        seen = 0
        while seen < want and time.monotonic() < deadline:
            for message in consumer.consume(500, timeout=1):
                if not message.error():
                    found[message.key()] = message.partition()
                    seen += 1
        return found
    finally:
        consumer.close()


def test_publish_before_init_names_the_missing_topic(kafka_bootstrap: str) -> None:
    settings = Settings(kafka_bootstrap=kafka_bootstrap, topic=f"never-created-{uuid.uuid4().hex[:8]}")
    result = cli(settings, "publish", "--skill-id", "sk_1", "--kind", "download")
    assert result.returncode == 2  # a setting to fix
    assert f"topic {settings.topic!r} does not exist on {kafka_bootstrap}: check SKILLSTATS_TOPIC" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_misspelt_topic_is_never_created_by_init_and_publish_names_the_counted_one(settings: Settings) -> None:
    """Issue 27.5: the hint to run `init` must not lead publishers to a topic no consumer reads."""
    from skillstats.kafka import list_topic_names
    from skillstats.sinks.db import open_engine
    from skillstats.sinks.identity import WINDOWS, Owner, claim
    from skillstats.sinks.upserts import now_utc_naive

    claim(
        open_engine(settings.database_url),
        Owner(WINDOWS, settings.windows_group, settings.topic, None),
        now_utc_naive(),
    )
    typo = settings.override(topic=settings.topic + "x")
    sent = cli(typo, "publish", "--skill-id", "sk_1", "--kind", "download")
    assert sent.returncode == 2, sent.stderr
    assert f"counts topic {settings.topic!r} (windows), not {typo.topic!r}" in sent.stderr, sent.stderr
    refused = cli(typo, "init")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"counts topic {settings.topic!r}" in refused.stderr and "--new-topic" in refused.stderr
    assert typo.topic not in list_topic_names(settings)
    assert cli(settings, "init").returncode == 0  # the counted topic itself: exists, fine
    made = cli(typo, "init", "--new-topic")
    assert made.returncode == 0, made.stderr
    assert typo.topic in list_topic_names(settings)


def test_jsonl_line_with_a_member_twice_is_refused(settings: Settings, tmp_path: Path) -> None:
    path = tmp_path / "dup.jsonl"
    path.write_text('{"skill_id": "sk_1", "kind": "download", "kind": "install_new", "occurred_at": 1764460800000}\n')
    result = cli(settings, "publish", "--file", str(path))
    assert result.returncode == 2
    assert "line 1: malformed" in result.stderr and "'kind' appears twice" in result.stderr


@SQLITE_ONLY
def test_demo_traffic_is_valid_and_stops_where_told(settings: Settings) -> None:
    result = cli(settings, "publish", "--demo", "100", "--demo-events", "150")
    assert result.returncode == 0, result.stderr
    assert "published 150 event(s)" in result.stdout
    assert published(settings) == 150
    records = read_topic(settings, settings.topic)
    assert len(records) == 150
    assert not [value for key, value, _ in records if isinstance(decode(key, value, int(time.time() * 1000)), Invalid)]
    for wrong in (
        ["--demo", "5", "--skill-id", "sk_1"],
        ["--demo-events", "5", "--skill-id", "sk_1", "--kind", "star"],
    ):
        refused = cli(settings, "publish", *wrong)
        assert refused.returncode == 2 and "--demo" in refused.stderr
    assert published(settings) == 150
