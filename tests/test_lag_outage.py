"""`skillstats lag-exporter` without Kafka: it serves at once, says an outage once each way, never at start.

The exporter as a process (skillstats/cli/lag_exporter.py, skillstats/lag.py): against an address no broker
answers, and against a single-node broker of the test's own stopped and started under it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from skillstats.config import Settings
from skillstats.kafka import ensure_topics
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from tests import test_windows_outage
from tests.conftest import settings_env
from tests.helpers import free_port, get, wait_until
from tests.test_windows_outage import own_broker
from tests.test_worker_health import metric

restartable_kafka = test_windows_outage.restartable_kafka  # the fixture: a broker to stop and start
FAILED = 'skillstats_lag_exporter_measurements_total{result="failed"}'


class Exporter:
    """`skillstats lag-exporter` measuring every second, each Kafka request bounded by `timeout` seconds."""

    def __init__(self, settings: Settings, log_path: Path, timeout: float, *extra: str) -> None:
        self.port = free_port()
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(
            [
                *(sys.executable, "-m", "skillstats.cli", "lag-exporter", "--metrics-port", str(self.port)),
                *("--interval", "1", "--timeout", str(timeout), *extra),
            ],
            env=settings_env(settings),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def get(self, path: str) -> tuple[int, str]:
        if self.process.poll() is not None:
            raise AssertionError(f"the exporter exited with {self.process.returncode}:\n{self.log_path.read_text()}")
        return get(f"http://127.0.0.1:{self.port}{path}")

    def value(self, name: str) -> float:
        return metric(self.get("/metrics")[1], name) or 0.0

    def stop(self) -> list[str]:
        """SIGTERM; the lines it printed (the exit status checked)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            assert self.process.wait(60) == 0, self.log_path.read_text()
        finally:
            self._log.close()
        return self.log_path.read_text().splitlines()


def test_without_kafka_at_start_it_serves_at_once_and_says_so_once(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    upgrade(open_engine(url))
    settings = Settings(kafka_bootstrap="127.0.0.1:1", database_url=url)
    exporter = Exporter(settings, tmp_path / "exporter.log", 1)
    # The database is read, and Kafka tried again and again, without waiting for Kafka first.
    wait_until(lambda: exporter.value("skillstats_lag_exporter_database_up") == 1, 30, "the database to be read")
    wait_until(lambda: exporter.value(FAILED) >= 3, 60, "three failed measurements")
    assert exporter.value("skillstats_lag_exporter_up") == 0
    assert exporter.get("/healthz") == (200, "ok\n")  # an unreachable broker is a metric, not a restart
    lines = exporter.stop()
    assert lines[0].startswith("skillstats lag-exporter: measuring "), lines[:3]
    unreachable = [line for line in lines if "cannot reach Kafka at 127.0.0.1:1" in line]
    assert len(unreachable) == 1 and " WARNING " in unreachable[0], lines


@pytest.mark.faults  # a broker (or a process) stopped mid-run: the fault suite
def test_a_broker_stopped_and_started_is_said_once_each_way(restartable_kafka: str, tmp_path: Path) -> None:
    settings = Settings(
        kafka_bootstrap=restartable_kafka,
        database_url=f"sqlite:///{tmp_path}/s.db",
        topic="events",
        dlq_topic="events.dlq",
        windows_group="windows",
        docsync_group="docsync",
    )
    ensure_topics(settings, {settings.topic: 2, settings.dlq_topic: 1})
    upgrade(open_engine(settings.database_url))
    exporter = Exporter(settings, tmp_path / "exporter.log", 2, "-v")
    wait_until(lambda: exporter.value("skillstats_lag_exporter_up") == 1, 60, "a first measurement")
    started = [line for line in exporter.log_path.read_text().splitlines() if "measuring lag of events" in line]
    assert len(started) == 1 and " INFO " in started[0] and "again" not in started[0], started  # not a recovery

    own_broker("stop", restartable_kafka, tmp_path)
    wait_until(lambda: exporter.value(FAILED) >= 3, 60, "three failed measurements")
    assert exporter.value("skillstats_lag_exporter_up") == 0
    assert exporter.value("skillstats_lag_exporter_database_up") == 1  # the database is read all the same
    assert exporter.get("/healthz") == (200, "ok\n")

    own_broker("start", restartable_kafka, tmp_path)
    wait_until(lambda: exporter.value("skillstats_lag_exporter_up") == 1, 60, "a measurement once Kafka is back")
    assert "skillstats_consumer_lag_records{" in exporter.get("/metrics")[1]
    lines = exporter.stop()
    down = [line for line in lines if "cannot measure lag" in line]
    up = [line for line in lines if "measuring lag of events" in line and "again" in line]
    assert len(down) == 1 and " WARNING " in down[0], lines
    assert len(up) == 1 and " WARNING " in up[0], lines
    assert "failed measurement(s)" in up[0]
