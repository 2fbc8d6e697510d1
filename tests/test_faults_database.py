"""PostgreSQL stopped for 20 seconds under a running windows worker, events arriving meanwhile (docs/reliability.md).

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
from skillstats.workload import generate
from tests.conftest import PG_ADMIN_URL, record_metric
from tests.helpers import (
    WorkerProcess,
    actual_windows,
    caught_up,
    expected_windows,
    free_port,
    get,
    local_service,
    publish,
    wait_until,
)

pytestmark = pytest.mark.faults
OUTAGE_S = 20


def postgres(action: str) -> None:
    local_service("postgres.sh", action, PG_PORT=str(urlparse(PG_ADMIN_URL).port))


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_windows_rides_out_a_database_outage(settings: Settings, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    now = int(time.time() * 1000)
    before = list(generate(3000, now_ms=now, skills=200, seed=21, invalid_ratio=0.01))
    during = list(generate(3000, now_ms=now, skills=200, seed=22, invalid_ratio=0.01))
    worker = WorkerProcess(settings, tmp_path / "worker.log", "--metrics-port", str(port))
    publish(settings, before)
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to apply the first events")

    postgres("stop")
    stopped = time.monotonic()
    try:
        publish(settings, during)  # Kafka takes them; the database cannot
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
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to apply the rest")
    record_metric(
        f"database outage of {restarted - stopped:.0f}s: the worker recovered and caught up "
        f"{time.monotonic() - restarted:.1f}s after the server was back; {len(before) + len(during)} events"
    )
    assert worker.terminate() == 0
    assert actual_windows(settings) == expected_windows(before + during)
    assert "recovered after" in (tmp_path / "worker.log").read_text()
