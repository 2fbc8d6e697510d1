"""`skillstats ingest` while Kafka goes away and comes back (issue 28), as an operator sees it: its answers, its
probes, its metrics and its log, run at its default log level.

The broker is one of the test's own (deploy/local/kafka.sh on a free port, data under the test's directory),
stopped and started while clients keep sending: the shared broker is never touched. A TCP forwarder would not
do: Kafka's metadata hands out the broker's advertised address, so a client cut off at the forwarder goes on
talking to the broker itself.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from skillstats.config import Settings
from skillstats.contract import make_event
from skillstats.kafka import ensure_topics
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from tests.conftest import record_metric
from tests.helpers import WorkerProcess, free_port, get, local_service, read_records, wait_until
from tests.test_ingest import TOKEN, post

ROOT = Path(__file__).resolve().parent.parent
PUBLISH_TIMEOUT_S = 4.0


class QuietIngest(WorkerProcess):
    """`skillstats ingest` at its default log level (WARNING): the log an operator reads."""

    command = ("ingest",)


@dataclass
class OwnKafka:
    bootstrap: str
    env: dict[str, str]

    def stop(self) -> None:
        local_service("kafka.sh", "stop", **self.env)

    def start(self) -> None:
        local_service("kafka.sh", "start", **self.env)


@pytest.fixture
def own_kafka(tmp_path: Path) -> Iterator[OwnKafka]:
    """A single-node Kafka of this test's own, so the test can take it away and bring it back."""
    port = free_port()
    state = tmp_path / "state"
    state.mkdir()
    os.symlink(ROOT / ".local" / "kafka-libs", state / "kafka-libs")
    env = {"KAFKA_PORT": str(port), "KAFKA_NODES": "1", "SKILLSTATS_STATE_DIR": str(state)}
    local_service("kafka.sh", "start", **env)
    try:
        yield OwnKafka(f"127.0.0.1:{port}", env)
    finally:
        local_service("kafka.sh", "reset", **env)


@dataclass
class Answer:
    skill: str
    sent: float
    answered: float
    status: int | None  # None: no answer (the connection failed)
    error: str = ""


class Senders:
    """Clients posting one keyed event per request, back to back, each with a skill id of its own: what became
    of every request can then be checked against what the consumers are handed."""

    def __init__(self, url: str, threads: int = 3) -> None:
        self.url = url
        self.answers: list[Answer] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._send, args=(n,), daemon=True) for n in range(threads)]
        for thread in self._threads:
            thread.start()

    def _send(self, sender: int) -> None:
        for n in range(1_000_000):
            if self._stop.is_set():
                return
            skill = f"sk_{sender}_{n}"
            body = make_event(skill, "download", int(time.time() * 1000)).encode()
            sent = time.monotonic()
            try:
                status, _headers, said = post(self.url, body, headers={"Idempotency-Key": skill})
                answer = Answer(skill, sent, time.monotonic(), status, str(said)[:200] if status != 202 else "")
            except OSError as exc:
                answer = Answer(skill, sent, time.monotonic(), None, str(exc))
            with self._lock:
                self.answers.append(answer)

    def seen(self) -> list[Answer]:
        with self._lock:
            return list(self.answers)

    def stop(self) -> list[Answer]:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)
        assert not any(thread.is_alive() for thread in self._threads), "a request was never answered"
        return self.seen()


def outward_address() -> str | None:
    """This machine's address on its default route, or None (no route but loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("198.51.100.1", 9))  # TEST-NET-2; a UDP connect sends nothing
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if address.startswith("127.") else address


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.faults  # a broker (or a process) stopped mid-run: the fault suite
def test_ingest_rides_out_a_broker_stopped_and_started(own_kafka: OwnKafka, tmp_path: Path) -> None:
    """While clients keep sending: the requests in flight when the broker goes are answered 503 within about one
    --publish-timeout (they waited for the message timeout, twice as long, and more); /readyz is 503 within that
    bound too (it stayed 200 for ~20 s) while /healthz stays 200; the transactions are counted
    by outcome (the counter was never incremented); the log says the outage in a few lines. Once the broker is
    back, the first request is answered 202 (it got 503 "skipped sequence numbers" from a producer that had to
    be rebuilt), and exactly the events answered 202 are what read_committed consumers are handed."""
    settings = Settings(
        kafka_bootstrap=own_kafka.bootstrap,
        database_url=f"sqlite:///{tmp_path}/keys.db",
        topic="events",
        dlq_topic="events.dlq",
        windows_group="windows",
        docsync_group="docsync",
    )
    ensure_topics(settings, {settings.topic: 12})
    upgrade(open_engine(settings.database_url))
    port = free_port()
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    ingest = QuietIngest(
        settings,
        tmp_path / "ingest.log",
        *("--port", str(port), "--tokens-file", str(tokens), "--publish-timeout", str(PUBLISH_TIMEOUT_S)),
    )
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: ingest.assert_alive() or get(url + "/readyz")[0] == 200, 90, "ingest to be ready")
    senders = Senders(url)
    try:
        wait_until(lambda: sum(a.status == 202 for a in senders.seen()) >= 10, 60, "requests to be answered 202")

        own_kafka.stop()
        gone = time.monotonic()
        readiness = wait_until(
            lambda: (status := get(url + "/readyz"))[0] == 503 and status, 1.5 * PUBLISH_TIMEOUT_S, "/readyz 503"
        )
        unready_after = time.monotonic() - gone
        assert f"Kafka at {own_kafka.bootstrap}" in readiness[1], readiness
        assert get(url + "/healthz")[0] == 200, "Kafka away is no reason to restart ingest"
        wait_until(
            lambda: sum(a.status == 503 and a.sent > gone for a in senders.seen()) >= 6,
            60,
            "requests sent while Kafka is away to be answered 503",
        )
        during = get(url + "/metrics")[1]
        assert get(url + "/readyz")[0] == 503

        own_kafka.start()
        back = time.monotonic()
        wait_until(lambda: get(url + "/readyz")[0] == 200, 60, "/readyz 200 once Kafka is back")
        ready_after = time.monotonic() - back
        wait_until(
            lambda: sum(a.status == 202 and a.sent > back for a in senders.seen()) >= 10,
            60,
            "requests to be answered 202 again",
        )
    finally:
        answers = senders.stop()
    after = get(url + "/metrics")[1]
    assert ingest.terminate() == 0
    log = ingest.log_path.read_text()

    assert [a for a in answers if a.status not in (202, 503)] == []
    refused = [a for a in answers if a.status == 503]
    slowest = max(a.answered - a.sent for a in refused)
    # The bound: answered within about one publish timeout (1.5 of it), not two and more.
    assert slowest <= 1.5 * PUBLISH_TIMEOUT_S, [(a.skill, round(a.answered - a.sent, 1), a.error) for a in refused]
    after_back = sorted((a for a in answers if a.sent > back), key=lambda a: a.sent)
    assert after_back[0].status == 202, after_back[0]
    assert {a.status for a in after_back} == {202}, [a for a in after_back if a.status != 202]

    # 202: counted once; 503: never (the transactions they were in aborted, or never began).
    counted = [(r.key or b"").decode() for r in read_records(settings, settings.topic)]
    assert sorted(counted) == sorted(a.skill for a in answers if a.status == 202)

    # Group commit: a transaction may hold several requests, so transactions are at most the requests.
    aborted = metric(during, 'skillstats_ingest_transactions_total{outcome="aborted"}')
    # A 503 may come from a transaction that never began (the producer could not start one with Kafka away), so
    # none aborted is possible: only the upper bound holds in every run (one CI run saw 0 aborted).
    assert 0 <= aborted <= metric(during, 'skillstats_ingest_requests_total{status="503"}')
    committed = metric(after, 'skillstats_ingest_transactions_total{outcome="committed"}')
    assert metric(during, 'skillstats_ingest_transactions_total{outcome="committed"}') >= 1
    assert (
        metric(after, 'skillstats_ingest_requests_total{status="202"}')
        >= committed
        > metric(during, 'skillstats_ingest_transactions_total{outcome="committed"}')
    )

    lines = [line for line in log.splitlines() if " WARNING " in line or " ERROR " in line]
    assert any("no broker answers" in line for line in lines), log
    assert any("works again" in line for line in lines), log
    assert len(lines) <= 8, "\n".join(lines)  # an outage of ~20 s and ~60 requests refused: a few lines
    assert "Traceback" not in log

    record_metric(
        f"ingest outage ({len(answers)} requests of 3 clients, --publish-timeout {PUBLISH_TIMEOUT_S:g}): /readyz 503 "
        f"{unready_after:.1f} s after the broker stopped, 200 again {ready_after:.1f} s after it started; slowest "
        f"503 {slowest:.1f} s; {len(refused)} answered 503, none counted; {len(lines)} WARNING lines"
    )


def test_a_dead_bootstrap_is_served_at_once_and_said_by_readiness(tmp_path: Path) -> None:
    """A broker address where nothing listens: the port opens before any Kafka check (it stayed closed for
    15 s), /healthz 200, /readyz 503 naming Kafka, publishes 503 within about one publish timeout. Started with
    the shared SKILLSTATS_SHUTDOWN_BUDGET=10 of the other commands (ingest refused to start with it) and no
    --host: it listens on 127.0.0.1 only (it took every interface)."""
    dead = free_port()
    port = free_port()
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    settings = Settings(kafka_bootstrap=f"127.0.0.1:{dead}", database_url="sqlite://")
    env = settings.child_env({**os.environ, "SKILLSTATS_SHUTDOWN_BUDGET": "10"})
    for name in ("SKILLSTATS_INGEST_HOST", "SKILLSTATS_INGEST_SHUTDOWN_BUDGET"):
        env.pop(name, None)
    began = time.monotonic()
    ingest = QuietIngest(
        settings,
        tmp_path / "ingest.log",
        *("--port", str(port), "--tokens-file", str(tokens), "--no-idempotency"),
        *("--publish-timeout", str(PUBLISH_TIMEOUT_S)),
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: ingest.assert_alive() or get(url + "/healthz")[0] == 200, 60, "ingest's port to answer")
    listening_after = time.monotonic() - began
    said = wait_until(
        lambda: (answer := get(url + "/readyz"))[0] == 503 and "is away" in answer[1] and answer,
        30,
        "/readyz to say Kafka is away",
    )
    assert f"Kafka at 127.0.0.1:{dead}" in said[1], said
    sent = time.monotonic()
    status, headers, answer = post(url, make_event("sk_1", "download", int(time.time() * 1000)).encode())
    took = time.monotonic() - sent
    assert status == 503 and headers["Retry-After"].isdigit() and "send it again" in answer["error"], answer
    assert took <= 1.5 * PUBLISH_TIMEOUT_S, took
    assert get(url + "/healthz")[0] == 200

    # Loopback only, unless told: the machine's outward address gets no answer (where it has one).
    address = outward_address()
    if address is not None:
        with pytest.raises(OSError), socket.create_connection((address, port), timeout=5):
            pass

    ingest.process.send_signal(signal.SIGTERM)
    assert ingest.process.wait(60) == 0
    log = ingest.log_path.read_text()
    # The port opened (the listening line) before Kafka was asked anything: its first answer is said after.
    listening = log.index(f"skillstats ingest: http://127.0.0.1:{port}/v1/events")
    assert log.index(f"Kafka at 127.0.0.1:{dead} does not answer") > listening, log
    assert "Traceback" not in log
    record_metric(
        f"ingest, dead bootstrap: port answering {listening_after:.1f} s after the start (process start included); "
        f"a publish answered 503 in {took:.1f} s (--publish-timeout {PUBLISH_TIMEOUT_S:g})"
    )
