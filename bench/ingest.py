"""`skillstats bench`, case i: `skillstats ingest` beside the direct Python publisher, on the same machine.

Two figures (docs/performance.md): events/s through ingest with 1,000-event NDJSON
requests from a few keep-alive clients, against the `Publisher` sending the same
events straight to Kafka; and the accept latency (request sent -> 202) of
single-event requests offered at a fixed rate, measured from when each request
was due, not when it went out, so a stalled server cannot hide its stall by
delaying the requests that would have seen it (coordinated omission).

The client runs on the same cores as the server and the broker: on a small
machine it takes CPU the server would otherwise have.
"""

from __future__ import annotations

import http.client
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from skillstats.config import Settings
from skillstats.contract import make_event
from skillstats.kafka import end_offsets, ensure_topics
from skillstats.publisher import Publisher
from skillstats.workload import generate

from .measure import free_port

TOKEN = "bench-token"


def _ready(url: str, process: subprocess.Popen[bytes], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"skillstats ingest exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("skillstats ingest did not become ready")


def _post(connection: http.client.HTTPConnection, body: bytes) -> int:
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/x-ndjson"}
    connection.request("POST", "/v1/events", body=body, headers=headers)
    response = connection.getresponse()
    response.read()
    return response.status


def measure(
    settings: Settings, events: int, clients: Sequence[int] = (4, 16), rate: int = 500, seconds: int = 20
) -> str:
    """The markdown lines of case i: the throughput part once per number of concurrent `clients`.

    One ingest process commits one transaction at a time (transactions.py), and a
    request is answered only after its commit, so a single client waits a commit per
    request: throughput grows with the requests in flight until the producer or the
    CPU is the limit. Hence more than one figure."""
    run = f"bench-ingest-{int(time.time())}"
    direct = settings.override(topic=f"{run}-direct", dlq_topic=f"{run}-direct.dlq")
    over_http = settings.override(topic=f"{run}-http", dlq_topic=f"{run}-http.dlq")
    for target in (direct, over_http):
        ensure_topics(target, {target.topic: 12, target.dlq_topic: 1})
    # The records are made first: only sending them is measured, on both sides.
    records = [r for r in generate(events, now_ms=int(time.time() * 1000), skills=20_000, seed=17) if r.valid]
    values = [r.value or b"" for r in records]

    began = time.monotonic()
    with Publisher(direct, flush_timeout=300) as publisher:
        for record in records:
            publisher.send_raw(record.key, record.value)
    direct_rate = len(values) / (time.monotonic() - began)

    with tempfile.TemporaryDirectory(prefix="skillstats-bench-ingest-") as scratch:
        tokens = Path(scratch) / "tokens"
        tokens.write_text(TOKEN + "\n")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen(
            [
                *(sys.executable, "-m", "skillstats.cli", "ingest", "--host", "127.0.0.1", "--port", str(port)),
                *("--tokens-file", str(tokens), "--no-idempotency", "--instance-id", run),
            ],
            env=over_http.child_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _ready(url, server)
            statuses: list[int] = []
            rates: dict[int, float] = {}
            for concurrent in clients:
                rates[concurrent] = _throughput(port, values, concurrent, statuses)
            refused = sum(1 for s in statuses if s != 202)

            latencies, failed = _latency(port, rate, seconds)
        finally:
            server.terminate()
            server.wait(60)
    published = sum(end_offsets(over_http, over_http.topic).values())
    p50 = statistics.median(latencies) * 1000
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1000
    rows = [
        f"| `skillstats ingest`, 1,000-event requests, {n} clients | {r:,.0f} | {r / direct_rate:.2f} |"
        for n, r in rates.items()
    ]
    return "\n".join(
        [
            "### HTTP ingest (case i)",
            "",
            f"{len(values):,} events; direct: the Python `Publisher` straight to Kafka; ingest: keep-alive clients "
            "posting 1,000-event NDJSON requests at once to one `skillstats ingest` (no Idempotency-Key), every "
            "event once per row.",
            "",
            "| publisher | events/s | ratio to direct |",
            "|---|---:|---:|",
            f"| direct `Publisher` | {direct_rate:,.0f} | 1.00 |",
            *rows,
            "",
            f"Single-event requests offered at {rate} requests/s for {seconds} s: accept latency (due -> 202) "
            f"p50 {p50:.1f} ms, p99 {p99:.1f} ms; {failed} not answered 202; {refused} throughput requests not "
            f"202; {published:,} offsets on the ingest topic (records and transaction markers).",
        ]
    )


def _throughput(port: int, values: list[bytes], clients: int, statuses: list[int]) -> float:
    """Events/s of every value posted in 1,000-event requests by `clients` keep-alive connections at once."""
    bodies: queue.Queue[bytes] = queue.Queue()
    for start in range(0, len(values), 1000):
        bodies.put(b"\n".join(values[start : start + 1000]))

    def client() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            while True:
                try:
                    body = bodies.get_nowait()
                except queue.Empty:
                    return
                statuses.append(_post(connection, body))
        finally:
            connection.close()

    began = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(values) / (time.monotonic() - began)


def _latency(port: int, rate: int, seconds: int) -> tuple[list[float], int]:
    """Offer `rate` single-event requests a second; the latency of each from when it was due."""
    local = threading.local()
    latencies: list[float] = []
    failed = 0
    lock = threading.Lock()

    def one(due: float, index: int) -> None:
        nonlocal failed
        connection = getattr(local, "connection", None)
        if connection is None:
            connection = local.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        body = make_event(f"lat-{index % 5000}", "download", int(time.time() * 1000)).encode()
        try:
            status = _post(connection, body)
        except OSError:
            local.connection = None
            status = 0
        with lock:
            if status == 202:
                latencies.append(time.monotonic() - due)
            else:
                failed += 1

    with ThreadPoolExecutor(max_workers=64) as pool:
        started = time.monotonic()
        for index in range(rate * seconds):
            due = started + index / rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            pool.submit(one, due, index)
    latencies.sort()
    if not latencies:
        raise RuntimeError("no single-event request was answered 202")
    return latencies, failed
