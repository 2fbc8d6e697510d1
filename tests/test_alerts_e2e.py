"""The lag alert, end to end, through a real Prometheus (Debian's package, on loopback).

Prometheus scrapes `skillstats lag-exporter` and a windows worker every second
and evaluates deploy/prometheus/skillstats-rules.yml, with the windows lag
rule's threshold and `for` shortened so the test takes seconds, not minutes.
Events keep arriving while the test stops the worker: the alert must go
pending, then fire, and resolve once a worker is back and has caught up.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from skillstats.config import Settings
from skillstats.contract import make_event
from skillstats.publisher import Publisher
from tests.conftest import settings_env
from tests.helpers import WorkerProcess, caught_up, free_port, get, wait_until

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "skillstats-rules.yml"
ALERT = "SkillstatsWindowsLagHigh"
THRESHOLD_S, FOR = 5, "5s"


def fast_rules(target: Path) -> None:
    """The production rules, with the windows lag rule's threshold and `for` cut to seconds."""
    document = yaml.safe_load(RULES.read_text())
    rules = [rule for group in document["groups"] for rule in group["rules"] if rule.get("alert") == ALERT]
    assert len(rules) == 1
    rule = rules[0]
    assert rule["expr"].rstrip().endswith("> 120"), rule["expr"]
    rule["expr"] = rule["expr"].rstrip()[: -len("120")] + str(THRESHOLD_S)
    rule["for"] = FOR
    target.write_text(yaml.safe_dump(document))


class Prometheus:
    def __init__(self, workdir: Path, targets: dict[str, int]) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("no prometheus on PATH: the README's test command installs Debian's package")
        fast_rules(workdir / "rules.yml")
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "rule_files": ["rules.yml"],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                for job, port in targets.items()
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (workdir / "prometheus.log").open("wb")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            cwd=workdir,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_until(lambda: self.alive() and get(self.url + "/-/ready")[0] == 200, 60, "Prometheus to be ready")

    def alive(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.process.returncode}")
        return True

    def api(self, path: str) -> Any:
        status, body = get(self.url + path)
        assert status == 200, (status, body)
        return json.loads(body)["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        return self.api("/api/v1/query?query=" + urllib.request.quote(promql))["result"]

    def alert_state(self) -> str | None:
        alerts = [a for a in self.api("/api/v1/alerts")["alerts"] if a["labels"]["alertname"] == ALERT]
        return alerts[0]["state"] if alerts else None

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)
        self.log.close()


class SteadyPublisher:
    """One valid event every 100 ms, stamped now, until stopped."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.stopping = threading.Event()
        self.sent = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with Publisher(self.settings) as publisher:
            while not self.stopping.wait(0.1):
                publisher.send(make_event(f"sk_{self.sent % 7}", "download", occurred_at=int(time.time() * 1000)))
                publisher.flush(10)
                self.sent += 1

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(30)


@pytest.fixture
def exporter_port(settings: Settings, tmp_path: Path) -> Iterator[int]:
    port = free_port()
    log = (tmp_path / "exporter.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "skillstats.cli", "lag-exporter", "--metrics-port", str(port), "--interval", "1"],
        env=settings_env(settings),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    yield port
    process.terminate()
    assert process.wait(30) == 0, (tmp_path / "exporter.log").read_text()
    log.close()


@pytest.mark.faults  # a real Prometheus waiting out the alert's pending time: slow, in the fault suite
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_windows_lag_alert_pends_fires_and_resolves(settings: Settings, exporter_port: int, tmp_path: Path) -> None:
    worker_port = free_port()
    worker = WorkerProcess(settings, tmp_path / "worker.log", "--metrics-port", str(worker_port))
    worker_url = f"http://127.0.0.1:{worker_port}"
    wait_until(lambda: worker.assert_alive() or get(worker_url + "/readyz")[0] == 200, 90, "the worker to be ready")
    assert get(worker_url + "/healthz") == (200, "ok\n")

    prometheus = Prometheus(tmp_path, {"lag-exporter": exporter_port, "windows": worker_port})
    publisher = SteadyPublisher(settings)
    try:
        wait_until(
            lambda: prometheus.query(f'skillstats_events_total{{job="windows",group="{settings.windows_group}"}} > 0'),
            90,
            "Prometheus to scrape applied events from the worker",
        )
        wait_until(
            lambda: prometheus.query(f'skillstats_consumer_lag_seconds{{group="{settings.windows_group}"}}'),
            60,
            "Prometheus to scrape the windows group's lag from the exporter",
        )
        assert prometheus.alert_state() is None

        assert worker.terminate() == 0
        states: list[str | None] = []

        def firing() -> bool:
            states.append(prometheus.alert_state())
            return states[-1] == "firing"

        wait_until(firing, 90, f"{ALERT} to fire while the worker is stopped", interval=0.25)
        assert "pending" in states, states  # it went pending first, for its `for`

        restarted = WorkerProcess(settings, tmp_path / "worker2.log", "--metrics-port", str(worker_port))
        wait_until(lambda: restarted.assert_alive() or prometheus.alert_state() is None, 120, f"{ALERT} to resolve")
        publisher.stop()
        wait_until(caught_up(settings, settings.windows_group, restarted), 60, "the worker to apply every event")
        assert restarted.terminate() == 0
    finally:
        publisher.stop()
        prometheus.stop()
