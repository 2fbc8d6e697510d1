"""The windows worker's metrics port: /healthz, /readyz and /metrics, idle and with its database failing."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlalchemy import text

from skillstats.config import Settings
from skillstats.contract import make_event
from skillstats.publisher import Publisher
from skillstats.sinks.db import open_engine
from skillstats.sinks.recovery import Health
from skillstats.sinks.schema import metadata, skill_hourly_stats
from skillstats.streams.windows import LOOP_STALL_SECONDS, KafkaReach, WindowsApp
from tests.helpers import WorkerProcess, caught_up, free_port, get, wait_until


def metric(body: str, name: str) -> float | None:
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


@pytest.mark.faults  # waits out the worker's idle and outage timers: in the longer suite
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_idle_worker_is_live_ready_and_quiet_and_a_failing_database_only_unreadies_it(
    settings: Settings, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    worker = WorkerProcess(settings, tmp_path / "worker.log", "--metrics-port", str(port), "--log-level", "info")
    wait_until(lambda: worker.assert_alive() or get(url + "/readyz")[0] == 200, 90, "the worker to be ready")

    # Idle for a while (past faust's livelock checks, which run every 7 s): live and ready throughout.
    deadline = time.monotonic() + 16
    while time.monotonic() < deadline:
        assert get(url + "/healthz") == (200, "ok\n")
        assert get(url + "/readyz") == (200, "ok\n")
        time.sleep(0.5)
    status, body = get(url + "/metrics")
    assert status == 200
    assert metric(body, "skillstats_assigned_partitions") == 12
    assert metric(body, "skillstats_degraded") == 0
    assert get(url + "/nope")[0] == 404

    # The database fails: not ready (taken out of rotation), still live (no restart).
    engine = open_engine(settings.database_url)
    with engine.begin() as connection:
        connection.execute(text("DROP TABLE skill_hourly_stats"))
    with Publisher(settings) as publisher:
        publisher.send(make_event("sk_1", "download", occurred_at=int(time.time() * 1000)))
    wait_until(lambda: get(url + "/readyz")[0] == 503, 60, "/readyz to fail while the database fails")
    assert "degraded" in get(url + "/readyz")[1]
    assert get(url + "/healthz") == (200, "ok\n")
    assert metric(get(url + "/metrics")[1], "skillstats_degraded") == 1

    # The database is back: ready again, and the event counted.
    metadata.create_all(engine, tables=[skill_hourly_stats])
    engine.dispose()
    wait_until(lambda: get(url + "/readyz")[0] == 200, 90, "/readyz to pass once the database is back")
    wait_until(caught_up(settings, settings.windows_group, worker), 60, "the event to be applied")
    assert worker.terminate() == 0

    # Nothing above INFO while idle and healthy (the outage's own lines aside).
    lines = (tmp_path / "worker.log").read_text().splitlines()
    outage = next(i for i, line in enumerate(lines) if "degraded: " in line and " is failing (" in line)
    noisy = [line for line in lines[:outage] if any(f" {level} " in line for level in ("WARNING", "ERROR"))]
    assert noisy == [], noisy


def test_readiness_and_liveness_rules() -> None:
    health = Health()
    kafka = KafkaReach("kafka-0:9092", silence=0.0)
    app = SimpleNamespace(
        refusal=None,
        joined=False,
        heartbeat=time.monotonic(),
        kafka=kafka,
        reads=SimpleNamespace(problem=None),
        batch_sink=SimpleNamespace(pipeline=SimpleNamespace(health=health)),
    )
    assert WindowsApp.ready(app) == "not yet joined the consumer group"  # type: ignore[arg-type]
    app.joined = True
    assert WindowsApp.ready(app) is None  # type: ignore[arg-type]
    app.reads.problem = "cannot position the assigned partitions at their SQL fences: Kafka away"
    assert "cannot position" in (WindowsApp.ready(app) or "")  # type: ignore[arg-type]
    app.reads.problem = None
    app.refusal = RuntimeError("topic replaced")
    assert "refused: topic replaced" in (WindowsApp.ready(app) or "")  # type: ignore[arg-type]
    app.refusal = None
    health.failing(RuntimeError("connection refused"))
    assert "degraded" in (WindowsApp.ready(app) or "")  # type: ignore[arg-type]
    health.ok()
    assert WindowsApp.ready(app) is None  # type: ignore[arg-type]
    # Kafka silent while partitions are fetched: not ready, with since when; alive all the same.
    kafka.fetching(True)
    kafka.fetched(records=False, polled=None)
    assert (WindowsApp.ready(app) or "").startswith("Kafka at kafka-0:9092 unreachable since ")  # type: ignore[arg-type]
    assert WindowsApp.live(app) is None  # type: ignore[arg-type]
    kafka.fetched(records=True, polled=None)  # records handed on: it hears from Kafka again
    assert WindowsApp.ready(app) is None  # type: ignore[arg-type]
    assert WindowsApp.live(app) is None  # type: ignore[arg-type]
    app.heartbeat = time.monotonic() - LOOP_STALL_SECONDS - 1
    assert "event loop silent" in (WindowsApp.live(app) or "")  # type: ignore[arg-type]
