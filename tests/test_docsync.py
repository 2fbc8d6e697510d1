"""The doc-stats drain on real Kafka, SQLite and PostgreSQL, against an independent expectation."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from skillstats.config import Settings
from skillstats.sinks.db import open_engine
from skillstats.sinks.schema import docsync_runs
from skillstats.streams.docsync import DocSync, DrainBudget, DrainSummary
from skillstats.workload import Record, generate
from tests.conftest import record_metric, settings_env
from tests.helpers import (
    actual_docstats,
    expected_docstats,
    free_port,
    get,
    publish,
    registry,
    run_docsync,
    seed_registry,
    wait_until,
)
from tests.test_publish import cli

EVENTS = 60_000
SKILLS = 2000


@pytest.fixture
def loaded(settings: Settings) -> tuple[Settings, list[Record], dict[str, str | None]]:
    rows = registry(seed=5)
    seed_registry(settings, rows)
    records = list(generate(EVENTS, now_ms=int(time.time() * 1000), skills=SKILLS, seed=21, invalid_ratio=0.01))
    assert sum(1 for r in records if r.valid and b"install_clear" in (r.value or b"")) > 100
    assert publish(settings, records) == EVENTS
    return settings, records, rows


def assert_exact(settings: Settings, records: list[Record], rows: dict[str, str | None]) -> None:
    want_skills, want_owners, _unknown = expected_docstats(records, rows)
    got_skills, got_owners = actual_docstats(settings)
    assert got_skills == want_skills
    assert got_owners == want_owners


def test_drain_is_exact_and_idempotent(loaded: tuple[Settings, list[Record], dict[str, str | None]]) -> None:
    settings, records, rows = loaded
    started = time.monotonic()
    status, [summary] = run_docsync(settings)
    elapsed = time.monotonic() - started
    assert status == 0, summary
    record_metric(
        f"docsync {settings.database_url.split(':')[0]}: {EVENTS} events drained in {elapsed:.1f}s "
        f"(process start to exit) = {EVENTS / elapsed:,.0f} events/s"
    )
    _skills, _owners, unknown = expected_docstats(records, rows)
    assert summary["stopped_reason"] == "caught_up"
    assert summary["events_read"] == EVENTS
    assert summary["invalid_skipped"] == sum(1 for r in records if not r.valid)
    assert summary["unknown_skill_events"] == unknown > 0
    assert_exact(settings, records, rows)
    # Negative deltas made it through (install_clear, install_deactivate), unclamped.
    skill_stats = actual_docstats(settings)[0].values()
    assert min(v[2] for v in skill_stats) < 0 or any(v[1] < 0 for v in skill_stats)

    status, [again] = run_docsync(settings)
    assert status == 0 and again["events_read"] == 0 and again["stopped_reason"] == "caught_up"
    assert_exact(settings, records, rows)
    engine = open_engine(settings.database_url)
    with engine.connect() as connection:
        runs = connection.execute(select(docsync_runs).order_by(docsync_runs.c.id)).all()
    engine.dispose()
    assert [(r.stopped_reason, r.events_read) for r in runs] == [("caught_up", EVENTS), ("caught_up", 0)]
    assert all(r.finished_at is not None and r.last_error is None for r in runs)


def test_budget_then_the_rest(loaded: tuple[Settings, list[Record], dict[str, str | None]]) -> None:
    settings, records, rows = loaded
    status, [first] = run_docsync(settings, "--max-events", "10000")
    assert status == 0
    assert (first["stopped_reason"], first["events_read"]) == ("budget", 10000)
    status, [second] = run_docsync(settings)
    assert status == 0
    assert (second["stopped_reason"], second["events_read"]) == ("caught_up", EVENTS - 10000)
    assert_exact(settings, records, rows)


@pytest.mark.faults  # two drains racing over the whole topic: in the longer suite
def test_two_drains_at_once_apply_everything_once(
    loaded: tuple[Settings, list[Record], dict[str, str | None]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second drain joins the group while the first is reading: the partitions are split, nothing counts twice.

    Unslowed, one drain reads these 60,000 events in well under a second, before a
    second process has even joined, and "at once" would be luck. So the first drain
    runs here, reading at about 0.2 ms a record, and the second (a real process) is
    started only once the first has read a thousand records.
    """
    from skillstats.sinks.docstats import PartitionDeltas

    settings, records, rows = loaded
    real_add_records = PartitionDeltas.add_records
    decoded = [0]

    def slow_add_records(part: PartitionDeltas, keys: Any, values: Any, timestamps: Any) -> None:
        decoded[0] += len(keys)
        time.sleep(0.0002 * len(keys))
        real_add_records(part, keys, values, timestamps)

    monkeypatch.setattr(PartitionDeltas, "add_records", slow_add_records)
    first: list[DrainSummary] = []
    reader = threading.Thread(target=lambda: first.append(DocSync(settings).drain()), daemon=True)
    reader.start()
    try:
        wait_until(lambda: decoded[0] >= 1000, 60, "the first drain to be reading")
        read_before = decoded[0]
        status, [second] = run_docsync(settings)
    finally:
        reader.join(300)
    assert first and not reader.is_alive()
    assert status == 0 and second["stopped_reason"] == "caught_up", second
    assert first[0].stopped_reason == "caught_up", first[0].error
    # The second drain took partitions the first had been reading (the first drops what it
    # read from them), so more than EVENTS records were read between the two.
    assert second["events_read"] > 0
    assert first[0].events_read + second["events_read"] > EVENTS
    assert read_before < EVENTS
    assert_exact(settings, records, rows)
    # Their runs (each opened before its drain reads, closed after it applied) overlap.
    engine = open_engine(settings.database_url)
    with engine.connect() as connection:
        runs = connection.execute(select(docsync_runs).order_by(docsync_runs.c.id)).all()
    engine.dispose()
    assert [r.id for r in runs] == [first[0].run_id, second["run_id"]]
    assert all(r.finished_at is not None and r.stopped_reason == "caught_up" for r in runs)
    assert max(r.started_at for r in runs) < min(r.finished_at for r in runs), [
        (r.started_at, r.finished_at) for r in runs
    ]


def test_database_errors_are_retried_then_recorded(
    loaded: tuple[Settings, list[Record], dict[str, str | None]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from skillstats.retry import Backoff
    from skillstats.sinks.docstats import DocStatsSink

    settings, records, rows = loaded
    real = DocStatsSink.apply_partitions
    failures = {"left": 3, "sizes": []}

    def flaky(self: DocStatsSink, drained: list, **options: Any) -> object:  # failure injection around the real sink
        failures["sizes"].append(len(drained))
        if failures["left"]:
            failures["left"] -= 1
            raise OperationalError("UPDATE skills", {}, Exception("connection reset"))
        return real(self, drained, **options)

    monkeypatch.setattr(DocStatsSink, "apply_partitions", flaky)
    summary = DocSync(settings, DrainBudget(chunk_partitions=8, backoff=Backoff(base=0.01))).drain()
    assert summary.stopped_reason == "caught_up", summary.error
    assert failures["sizes"][:4] == [8, 4, 2, 1]  # halved after each failure
    assert_exact(settings, records, rows)

    failures["left"] = 100
    publish(settings, records[:1000])
    broken = DocSync(settings, DrainBudget(max_attempts=3, backoff=Backoff(base=0.01))).drain()
    assert broken.stopped_reason == "error" and "connection reset" in (broken.error or "")
    monkeypatch.setattr(DocStatsSink, "apply_partitions", real)
    resumed = DocSync(settings).drain()
    assert resumed.stopped_reason == "caught_up" and resumed.events_read == 1000
    assert_exact(settings, records + records[:1000], rows)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_status_shows_lag_and_runs(loaded: tuple[Settings, list[Record], dict[str, str | None]]) -> None:
    settings, _records, _rows = loaded
    status, _ = run_docsync(settings, "--max-events", "25000")
    assert status == 0
    result = subprocess.run(
        [sys.executable, "-m", "skillstats.cli", "status", "--json"],
        env=settings_env(settings),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    groups = {g["group"]: g for g in report["groups"]}
    assert groups[settings.docsync_group]["applied"] == 25000
    assert groups[settings.docsync_group]["lag_records"] == EVENTS - 25000
    assert groups[settings.docsync_group]["lag_seconds"] > 0
    assert groups[settings.windows_group]["lag_records"] == EVENTS  # no windows worker ran
    assert groups[settings.windows_group]["state"] == "DEAD" and groups[settings.windows_group]["members"] == 0
    assert [r["stopped_reason"] for r in report["docsync_runs"]] == ["budget"]


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_skill_id_postgres_cannot_store_is_an_unknown_skill(settings: Settings) -> None:
    from skillstats.contract import make_event

    seed_registry(settings, {"sk_ok": "u1"})
    now = int(time.time() * 1000)
    events = [make_event("sk_\x00nul", "download", now), make_event("sk_ok", "download", now)]
    publish(settings, [Record(e.key, e.encode(), True) for e in events])
    summary = DocSync(settings).drain()
    assert summary.stopped_reason == "caught_up", summary.error
    assert (summary.unknown_skill_events, summary.skills_updated) == (1, 1)
    assert actual_docstats(settings) == ({"sk_ok": (1, 0, 0)}, {"u1": (1, 0, 0)})


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_every_repeats_drains_until_sigterm(settings: Settings) -> None:
    from skillstats.contract import make_event

    seed_registry(settings, {"sk_1": "u1"})
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "skillstats.cli", "docsync", "--every", "0.5s", "--json", "--metrics-port", str(port)],
        env=settings_env(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    first = json.loads(process.stdout.readline())
    publish(settings, [Record(b"sk_1", make_event("sk_1", "download", int(time.time() * 1000)).encode(), True)])
    later = [json.loads(process.stdout.readline()) for _ in range(3)]
    # The long-running form serves its runs' metrics.
    status, body = get(f"http://127.0.0.1:{port}/metrics")
    group = settings.docsync_group
    assert status == 200
    assert f'skillstats_docsync_runs_total{{group="{group}",result="caught_up"}}' in body
    assert f'skillstats_events_total{{group="{group}",kind="download",outcome="applied"}} 1.0' in body
    assert get(f"http://127.0.0.1:{port}/healthz") == (200, "ok\n")
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0
    assert first["events_read"] == 0 and sum(s["events_read"] for s in later) == 1
    assert actual_docstats(settings)[0] == {"sk_1": (1, 0, 0)}


def test_summary_says_events_for_missing_skills_are_skipped_for_good(settings: Settings) -> None:
    records = list(generate(200, now_ms=int(time.time() * 1000), skills=5, seed=3))
    assert publish(settings, records) == 200
    result = cli(settings, "docsync", "--allow-empty-registry")
    assert result.returncode == 0, result.stderr
    assert "caught_up" in result.stdout
    assert "events were for skills with no row in `skills`; they are skipped for good" in result.stdout


def test_an_empty_registry_is_refused_and_the_event_waits_for_its_row(settings: Settings) -> None:
    """Issue 28.8: a first drain before any `skills` row exists would skip every event for good. It is refused
    (exit 2, nothing read or applied, the message says how to make rows), and once the rows are there the
    same event counts."""
    from skillstats.contract import make_event
    from tests.helpers import fences

    quiet, [nothing] = run_docsync(settings)  # an empty topic: nothing would be skipped, nothing refused
    assert quiet == 0 and nothing["events_read"] == 0, nothing
    event = make_event("sk_1", "download", int(time.time() * 1000))
    publish(settings, [Record(event.key, event.encode(), True)])
    refused = cli(settings, "docsync", "--json")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    [summary] = [json.loads(line) for line in refused.stdout.splitlines() if line.startswith("{")]
    assert summary["refused"] and summary["events_read"] == 0, summary
    assert "EmptyRegistry" in summary["error"] and "INSERT INTO skills" in summary["error"], summary["error"]
    assert "--allow-empty-registry" in summary["error"] and "Traceback" not in refused.stderr
    assert fences(settings, settings.docsync_group) == {}  # nothing applied, nothing passed over
    assert actual_docstats(settings) == ({}, {})

    seed_registry(settings, {"sk_1": "u1"})
    status, [after] = run_docsync(settings)
    assert status == 0 and (after["events_read"], after["unknown_skill_events"]) == (1, 0), after
    assert actual_docstats(settings) == ({"sk_1": (1, 0, 0)}, {"u1": (1, 0, 0)})


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_allow_empty_registry_drains_and_says_the_events_are_skipped(settings: Settings) -> None:
    records = list(generate(50, now_ms=int(time.time() * 1000), skills=5, seed=3))
    assert publish(settings, records) == 50
    result = cli(settings, "docsync", "--allow-empty-registry")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "caught_up" in result.stdout
    assert "events were for skills with no row in `skills`; they are skipped for good" in result.stdout
