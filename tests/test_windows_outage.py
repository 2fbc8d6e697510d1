"""A windows worker cut off from Kafka says so, once, and reads again when Kafka answers (streams/windows.py).

Against a single-node broker of the test's own, stopped and started under the
worker (`restartable_kafka`, also tests/test_lag_outage.py's): a TCP forwarder
would not do, since Kafka's metadata hands the client the broker's own address
after its first connection.
"""

from __future__ import annotations

import inspect
import logging
import os
import random
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, client, conn
from aiokafka.consumer import fetcher, group_coordinator
from faust.transport.drivers import aiokafka as aiokafka_driver

from skillstats.config import Settings
from skillstats.kafka import ensure_topics
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from skillstats.streams.windows import _KAFKA_CLIENT_NOISE, KAFKA_SILENCE_SECONDS, KafkaClientNoise, KafkaReach
from skillstats.workload import generate
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
from tests.test_worker_health import metric

ROOT = Path(__file__).resolve().parent.parent


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_no_one_is_handed() -> int:
    """A free broker port below the ephemeral range (with its controller's, 1000 above it).

    tests.helpers.free_port's ports come from that range, which is what any
    process gets from bind(0) or a connect(): once the broker is stopped its port
    may be handed to another test's server (the tests of a run share the
    machine), and the broker cannot come back, or the worker talks Kafka to a
    stranger. Below it, only an explicit bind takes the port. Clear of the suite's
    brokers (19092, 29092-29094 and their controllers)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(21000, 28000)
        if _bindable(port) and _bindable(port + 1000):
            return port
    raise AssertionError("no free port pair between 21000 and 29000")


def own_broker(action: str, bootstrap: str, tmp_path: Path) -> None:
    """`kafka.sh <action>` on the test's own broker (`restartable_kafka`'s)."""
    port = bootstrap.rsplit(":", 1)[1]
    local_service("kafka.sh", action, KAFKA_PORT=port, KAFKA_NODES="1", SKILLSTATS_STATE_DIR=str(tmp_path / "state"))


@pytest.fixture
def restartable_kafka(tmp_path: Path) -> Iterator[str]:
    """A single-node Kafka of the test's own, to stop and start under it (`own_broker`); reset afterwards."""
    bootstrap = f"127.0.0.1:{port_no_one_is_handed()}"
    (tmp_path / "state").mkdir()
    os.symlink(ROOT / ".local" / "kafka-libs", tmp_path / "state" / "kafka-libs")
    own_broker("start", bootstrap, tmp_path)
    try:
        yield bootstrap
    finally:
        own_broker("reset", bootstrap, tmp_path)


@pytest.mark.faults  # a broker (or a process) stopped mid-run: the fault suite
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_worker_cut_off_from_kafka_says_so_once_and_reads_again(
    database_url: str, restartable_kafka: str, tmp_path: Path
) -> None:
    settings = Settings(
        kafka_bootstrap=restartable_kafka,
        database_url=database_url,
        topic="events",
        dlq_topic="events.dlq",
        windows_group="windows",
        docsync_group="docsync",
    )
    ensure_topics(settings, {settings.topic: 4, settings.dlq_topic: 1})
    upgrade(open_engine(database_url))
    first = list(generate(400, now_ms=int(time.time() * 1000), skills=20, seed=1))
    publish(settings, first)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "worker.log"
    worker = WorkerProcess(settings, log_path, "--metrics-port", str(port), "--log-level", "info")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to apply the events")
    wait_until(lambda: get(url + "/readyz") == (200, "ok\n"), 60, "the worker to be ready")
    assert metric(get(url + "/metrics")[1], "skillstats_kafka_unreachable") == 0

    own_broker("stop", restartable_kafka, tmp_path)
    _status, body = wait_until(
        lambda: (answer := get(url + "/readyz"))[0] == 503 and answer, 60, "/readyz to say Kafka is unreachable"
    )
    assert f"Kafka at {restartable_kafka} unreachable since " in body, body
    assert get(url + "/healthz") == (200, "ok\n")  # liveness never looks at Kafka: no restart for an outage
    scraped = get(url + "/metrics")[1]
    assert metric(scraped, "skillstats_kafka_unreachable") == 1
    assert metric(scraped, "skillstats_degraded") == 0  # the database is fine: not the same state
    # aiokafka retries every 100 ms, a line each time: let a few hundred pile up before counting the log.
    wait_until(
        lambda: (metric(get(url + "/metrics")[1], "skillstats_kafka_client_errors_total") or 0) >= 300,
        60,
        "aiokafka's connection errors to pile up",
    )

    own_broker("start", restartable_kafka, tmp_path)
    second = list(generate(400, now_ms=int(time.time() * 1000), skills=20, seed=2))
    publish(settings, second)
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to apply what came after")
    wait_until(lambda: get(url + "/readyz") == (200, "ok\n"), 60, "/readyz to pass once Kafka answers")
    scraped = get(url + "/metrics")[1]
    assert metric(scraped, "skillstats_kafka_unreachable") == 0
    errors = metric(scraped, "skillstats_kafka_client_errors_total") or 0
    assert worker.terminate() == 0
    assert actual_windows(settings) == expected_windows(first + second)

    lines = log_path.read_text().splitlines()
    down = [line for line in lines if "unreachable since" in line]
    up = [line for line in lines if "answers again: reading again" in line]
    assert len(down) == 1 and " WARNING " in down[0], down
    assert len(up) == 1 and " WARNING " in up[0], up
    # Hundreds of failed attempts, a handful of lines: aiokafka's own are folded into the two above.
    client_lines = [line for line in lines if " aiokafka" in line]
    assert errors >= 300 and len(client_lines) <= 3, "\n".join(client_lines[:20])
    assert [line for line in lines if " ERROR " in line or " CRITICAL " in line] == []


def test_what_kafka_reach_relies_on_in_this_aiokafka_and_faust() -> None:
    """The templates KafkaClientNoise folds are aiokafka's own (an upgrade that rewords them fails here, not by
    flooding the log again); every fetch answer is stamped, records or not, and the public last_poll_timestamp
    reads that stamp; faust has an idle fetch answered well within KAFKA_SILENCE_SECONDS."""
    source = "".join(inspect.getsource(module) for module in (client, conn, fetcher, group_coordinator))
    for text in _KAFKA_CLIENT_NOISE:
        assert text in source, text
    answer = inspect.getsource(fetcher.Fetcher._proc_fetch_request)
    assert answer.index("tp_state.timestamp = now_ms") < answer.index("records = MemoryRecords(")
    assert "state_value(partition).timestamp" in inspect.getsource(AIOKafkaConsumer.last_poll_timestamp)
    assert callable(AIOKafkaConsumer.paused)
    created = inspect.getsource(aiokafka_driver.AIOKafkaConsumerThread._create_worker_consumer)
    waits = [int(ms) for ms in re.findall(r"fetch_max_wait_ms=(\d+)", created)]
    assert waits and max(waits) / 1000 * 3 < KAFKA_SILENCE_SECONDS, waits


def test_outside_an_outage_one_client_line_a_minute_is_shown_and_none_during_one() -> None:
    reach = KafkaReach("127.0.0.1:1", silence=0.0)
    noise = KafkaClientNoise(reach, logging.INFO)

    def line(message: str) -> logging.LogRecord:
        return logging.LogRecord("aiokafka", logging.ERROR, __file__, 1, message, ("1", "refused"), None)

    shown = [noise.filter(record := line("Unable connect to node with id %s: %s")) for _ in range(50)]
    assert shown == [True] + [False] * 49 and record.levelno == logging.DEBUG
    own = logging.LogRecord("skillstats", logging.WARNING, __file__, 1, "Unable connect to the moon", None, None)
    assert noise.filter(own) and own.levelno == logging.WARNING  # not aiokafka's: untouched
    reach.fetching(True)
    reach.fetched(records=False, polled=None)  # silence (0 s allowed here): the outage is declared
    assert reach.unreachable and "Unable connect to node with id 1: refused" in (reach.problem() or "")
    reach._shown_at = float("-inf")  # a minute later: still folded, the outage is said already
    assert not noise.filter(line("Unable connect to node with id %s: %s"))
    assert reach.client_errors == 51
    reach.fetched(records=False, polled=1)  # a fetch answered
    assert not reach.unreachable and reach.problem() is None
    # A broker refusing our TLS or SASL is no outage to fold: its ERROR passes as it is (review finding).
    refused = logging.LogRecord(
        "aiokafka", logging.ERROR, __file__, 1, "Unable connect to node with id %s: %s", ("2", "[SSL] cert"), None
    )
    assert noise.filter(refused) and refused.levelno == logging.ERROR
