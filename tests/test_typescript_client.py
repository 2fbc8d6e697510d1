"""clients/typescript, run with Node: its unit tests, its verdicts against Python's on one corpus, and its two
transports against the real broker and a real `skillstats ingest`, counted exactly by both groups.

The README's test command builds the package first (`npm ci`, `tsc`: deploy/local/test.sh).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest

from skillstats.config import Settings
from skillstats.contract import Invalid, decode, make_event
from skillstats.kafka import ensure_topics
from skillstats.workload import Record, generate
from tests.helpers import (
    WorkerProcess,
    actual_docstats,
    actual_windows,
    caught_up,
    expected_docstats,
    expected_windows,
    murmur2_partition,
    read_records,
    run_docsync,
    wait_until,
)
from tests.test_ingest import TOKEN, start_ingest

CLIENT = Path(__file__).resolve().parent.parent / "clients" / "typescript"


def node_test(*files: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    node = shutil.which("node")
    if node is None or not (CLIENT / "dist" / "test").is_dir():
        pytest.fail("no built TypeScript client: run the README's test command (it runs npm ci and tsc)")
    return subprocess.run(
        [node, "--test", *(str(CLIENT / "dist" / "test" / f) for f in files)],
        cwd=CLIENT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )


def corpus(now: int) -> list[tuple[Any, str]]:
    """Events and near-events, each with Python's verdict: "valid" or the contract's reason.

    Only what JavaScript can hold: a float with an integral value (1.0) is the integer 1 once JSON.parse has
    read it, and JSON.stringify writes it back as 1, so a TypeScript publisher can never send "1.0"."""
    good = orjson.loads(make_event("sk_1", "download", now - 1000, event_id="e1", now_ms=now).encode())
    clear = {**good, "kind": "install_clear", "delta": {"all_time": -3, "current": 2}}
    cases: list[Any] = [good, clear, 5, "x", [good], None]
    for field, values in {
        "v": [2, 0, "1", None, True, 1.5],
        "event_id": ["", "x" * 128, "x" * 129, 7, None, "é" * 128, "😀" * 128, "😀" * 129],
        "skill_id": ["", "s" * 129, 0, ["a"], "ok-🙂"],
        "kind": ["upvote", "Download", 3, None, *("star", "unstar", "comment", "uncomment", "install_new")],
        "occurred_at": [
            0, 946_684_799_999, 946_684_800_000, now + 10 * 60_000, now + 10 * 60_000 + 1, 253_402_300_799_999,
            253_402_300_800_000, 1.5, "2026-12-01T00:00:00Z", None, True,
        ],
    }.items():  # fmt: skip
        cases += [{**good, field: value} for value in values]
    for delta in [None, {}, {"all_time": 1}, {"all_time": 10**9, "current": -(10**9)}, {"all_time": 10**9 + 1,
                  "current": 0}, {"all_time": 1.5, "current": 0}, {"all_time": "1", "current": 0}, [1, 2]]:  # fmt: skip
        cases.append({**clear, "delta": delta})
    cases += [{k: v for k, v in good.items() if k != missing} for missing in good]
    cases.append({**good, "extra": "fields are allowed"})
    verdicts = []
    for case in cases:
        value = orjson.dumps(case)
        key = case["skill_id"].encode() if isinstance(case, dict) and isinstance(case.get("skill_id"), str) else None
        result = decode(key, value, now)
        verdicts.append((case, result.reason.value if isinstance(result, Invalid) else "valid"))
    return verdicts


def test_the_clients_unit_tests_and_its_verdicts_on_the_contract_corpus(tmp_path: Path) -> None:
    now = int(time.time() * 1000)
    path = tmp_path / "corpus.json"
    cases = corpus(now)
    path.write_text(json.dumps({"now": now, "cases": cases}))
    assert len({verdict for _c, verdict in cases}) >= 6  # the corpus covers most reasons
    result = node_test("contract.test.js", "http.test.js", env={"SKILLSTATS_CONTRACT_CORPUS": str(path)})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "# fail 0" in result.stdout and "# skipped 0" in result.stdout, result.stdout[-2000:]


def test_both_transports_are_counted_exactly_on_the_contracts_partitions(
    settings: Settings, registry_rows: dict[str, str | None], tmp_path: Path
) -> None:
    now = int(time.time() * 1000)
    records = [r for r in generate(4000, now_ms=now, skills=2000, seed=9, days=2) if r.valid]
    # And one event for each of 3,000 more skills, so that the partitions are checked on thousands of keys.
    for index in range(3000):
        event = make_event(f"spread-{index}", "download", now - index)
        records.append(Record(event.key, event.encode(), True))
    events = tmp_path / "events.jsonl"
    events.write_bytes(b"".join((r.value or b"") + b"\n" for r in records))
    ingest, url = start_ingest(settings, tmp_path)
    result = node_test(
        "live.test.js",
        env={
            "SKILLSTATS_INGEST_URL": url,
            "SKILLSTATS_INGEST_TOKEN": TOKEN,
            "SKILLSTATS_KAFKA": settings.kafka_bootstrap,
            "SKILLSTATS_TOPIC": settings.topic,
            "SKILLSTATS_EVENTS_FILE": str(events),
        },
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "# pass 1" in result.stdout, result.stdout[-2000:]
    assert ingest.terminate() == 0

    on_topic = read_records(settings, settings.topic)
    assert sorted(r.value or b"" for r in on_topic) == sorted(r.value or b"" for r in records)  # once each
    keys = {r.key for r in on_topic}
    assert len(keys) > 3000
    wrong = [r for r in on_topic if r.partition != murmur2_partition(r.key or b"", 12)]
    assert wrong == [], f"{len(wrong)} of {len(on_topic)} records off the contract's partition"

    worker = WorkerProcess(settings, tmp_path / "windows.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "windows to apply both transports' events")
    assert worker.terminate() == 0
    assert actual_windows(settings) == expected_windows(records)
    code, _ = run_docsync(settings)
    assert code == 0
    skill_stats, owner_stats, _unknown = expected_docstats(records, registry_rows)
    assert actual_docstats(settings) == (skill_stats, owner_stats)


def test_the_kafka_transport_recovers_when_kafka_comes_back_and_loses_nothing_after_a_cut_publish(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """clients/typescript/test/kafka-faults.test.ts, through a TCP proxy in front of the real broker: a publisher
    whose first connect failed publishes once Kafka is back; a publish whose answer was cut after the broker wrote
    it rejects, and every event published after it is on the topic, once (kafkajs' idempotent producer rolls a
    partition's sequence back after a failed request: the next batch of the same size would be taken for a
    duplicate and dropped, acknowledged, unless the publisher makes a new producer)."""
    run = uuid.uuid4().hex[:10]
    settings = Settings(kafka_bootstrap=kafka_bootstrap, topic=f"ts-faults-{run}", dlq_topic=f"ts-faults-{run}.dlq")
    ensure_topics(settings, {settings.topic: 3})
    result = node_test(
        "kafka-faults.test.js", env={"SKILLSTATS_KAFKA": kafka_bootstrap, "SKILLSTATS_FAULTS_TOPIC": settings.topic}
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "# pass 3" in result.stdout and "# skipped 0" in result.stdout, result.stdout[-2000:]

    written = Counter(orjson.loads(r.value or b"")["event_id"] for r in read_records(settings, settings.topic))
    expected = Counter(
        ["back-1", "back-2", "back-3"]  # "away-1" and "away-2" never reached the broker
        + ["cut-before", "cut-unanswered"]  # the second one rejected, yet written: what a rejected publish means
        + [f"cut-after-{i}" for i in range(1, 5)]
        + ["many-first"]
        + [f"many-{i}" for i in range(200)]
    )
    assert written == expected
