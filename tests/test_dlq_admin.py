"""`skillstats dlq list` and `dlq replay` against a real broker and a real windows worker (skillstats/dlq_admin.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from skillstats.config import Settings
from skillstats.contract import make_event
from skillstats.dlq import H_REPLAYED_FROM
from skillstats.workload import Record
from tests.conftest import settings_env
from tests.helpers import WorkerProcess, actual_windows, caught_up, publish, read_topic, wait_until


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
    malformed = listed(settings, "--reason", "malformed")["records"]
    assert len(malformed) == 1
    source = f"{malformed[0]['source_partition']}:{malformed[0]['source_offset']}"
    assert listed(settings, "--source-offsets", source)["records"] == malformed
    assert listed(settings, "--since", str(now + 3_600_000))["records"] == []

    # Replay needs a selection; a dry run publishes nothing.
    assert cli(settings, "replay").returncode == 2
    dry = cli(settings, "replay", "--reason", "malformed", "--dry-run")
    assert dry.returncode == 0 and "1 record(s) would be replayed" in dry.stdout
    assert len(read_topic(settings, settings.topic)) == 3

    # The malformed record replayed: the copy carries where it came from, is parked again with
    # that kept, and is not replayed again without --again; nor is the original.
    replayed = cli(settings, "replay", "--reason", "malformed")
    assert replayed.returncode == 0, replayed.stderr
    assert "replayed 1 record(s)" in replayed.stdout
    copies = [h for _k, _v, h in read_topic(settings, settings.topic) if H_REPLAYED_FROM in h]
    origin = f"{settings.dlq_topic}:{malformed[0]['dlq_partition']}:{malformed[0]['dlq_offset']}".encode()
    assert [c[H_REPLAYED_FROM] for c in copies] == [origin]
    wait_until(caught_up(settings, settings.windows_group, worker), 60, "the worker to read the copy")
    wait_until(lambda: listed(settings)["counts_by_reason"].get("malformed") == 2, 30, "the copy parked again")
    parked_again = [r for r in listed(settings, "--reason", "malformed")["records"] if r["replayed_from"]]
    assert [r["replayed_from"] for r in parked_again] == [origin.decode()]

    twice = cli(settings, "replay", "--reason", "malformed")
    assert twice.returncode == 2 and "--again" in twice.stderr
    assert len(read_topic(settings, settings.topic)) == 4  # nothing more was published

    # --again does replay the original (once more) and the parked copy.
    again = cli(settings, "replay", "--reason", "malformed", "--again")
    assert again.returncode == 0 and "replayed 2 record(s)" in again.stdout, again.stderr
    wait_until(caught_up(settings, settings.windows_group, worker), 60, "the worker to read the copies")
    assert worker.terminate() == 0
    # Through all of it only the valid event counted.
    daily, _hourly = actual_windows(settings)
    assert {skill for skill, _day in daily} == {"sk_ok"}


def test_source_offsets_must_be_partition_offset_pairs(settings: Settings) -> None:
    result = cli(settings, "list", "--source-offsets", "3-1200")
    assert result.returncode == 2 and "partition:offset" in result.stderr
