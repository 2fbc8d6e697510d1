"""PostgreSQL stopped for 20 seconds under a running windows worker, events arriving throughout (docs/reliability.md).

The worker must report itself degraded (not ready, still live: no restart),
retry by itself, and once the server is back apply everything exactly once.
The test stops and restarts the test server itself (deploy/local/postgres.sh),
so it runs in the fault suite only.
"""

from __future__ import annotations

import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from skillstats.config import Settings
from tests.conftest import PG_ADMIN_URL
from tests.helpers import WorkerProcess, caught_up, free_port, get, local_service, wait_until
from tests.scenario import ScenarioReport, SteadyPublisher, seconds_to_recover, started_applying

pytestmark = pytest.mark.faults
OUTAGE_S = 20
RATE = 1000  # events/s, before, during and after the outage


def postgres(action: str) -> None:
    local_service("postgres.sh", action, PG_PORT=str(urlparse(PG_ADMIN_URL).port))


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_windows_rides_out_a_database_outage(
    settings: Settings, registry_rows: dict[str, str | None], tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    report = ScenarioReport(f"PostgreSQL stopped for {OUTAGE_S}s", "postgresql")
    with SteadyPublisher(settings, RATE, seed=21) as publisher:
        worker = WorkerProcess(settings, tmp_path / "worker.log", "--metrics-port", str(port))
        started_applying(settings, worker)

        postgres("stop")
        stopped = time.monotonic()
        report.fault(f"PostgreSQL stopped for {OUTAGE_S}s")
        try:
            # Kafka takes the events; the database cannot.
            wait_until(lambda: worker.assert_alive() or get(url + "/readyz")[0] == 503, 60, "the worker to be degraded")
            assert "degraded" in get(url + "/readyz")[1]
            # The rest of the outage: live throughout (Kubernetes would not restart it), never exits.
            while time.monotonic() - stopped < OUTAGE_S:
                worker.assert_alive()
                assert get(url + "/healthz") == (200, "ok\n")
                time.sleep(0.5)
        finally:
            postgres("start")
        restarted = time.monotonic()
        wait_until(lambda: worker.assert_alive() or get(url + "/readyz")[0] == 200, 120, "the worker to recover")
        report.recoveries.append(seconds_to_recover(settings, settings.windows_group, restarted, worker, publisher))
        sent = publisher.stop()
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to apply the rest")
    assert worker.terminate() == 0
    assert "answers again after" in (tmp_path / "worker.log").read_text()
    report.finish(settings, sent, registry_rows)
