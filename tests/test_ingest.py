"""`skillstats ingest` as a process, against the real broker and databases: what it accepts is counted exactly by
both groups, what it refuses publishes nothing, and each bad input gets its answer (docs/contract.md, HTTP)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

from skillstats.config import Settings
from skillstats.contract import make_event
from skillstats.kafka import end_offsets
from skillstats.workload import Record, generate
from tests.conftest import record_metric
from tests.helpers import (
    WorkerProcess,
    actual_docstats,
    actual_windows,
    caught_up,
    expected_docstats,
    expected_windows,
    free_port,
    get,
    murmur2_partition,
    read_records,
    run_docsync,
    wait_until,
)

TOKEN = "ingest-test-token"
NDJSON = "application/x-ndjson"


class IngestProcess(WorkerProcess):
    command = ("ingest", "-v")


def start_ingest(
    settings: Settings, tmp_path: Path, *extra: str, tokens: str = TOKEN + "\n", port: int | None = None
) -> tuple[IngestProcess, str]:
    port = port or free_port()
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(tokens)
    ingest = IngestProcess(
        settings,
        tmp_path / f"ingest-{port}.log",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tokens-file",
        str(tokens_file),
        *extra,
    )
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: ingest.assert_alive() or get(url + "/readyz")[0] == 200, 90, "ingest to be ready")
    return ingest, url


def post(
    url: str,
    body: bytes,
    *,
    token: str | None = TOKEN,
    content_type: str = NDJSON,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], Any]:
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    sent = {"Content-Type": content_type, **(headers or {})}
    if token is not None:
        sent["Authorization"] = f"Bearer {token}"
    try:
        connection.request("POST", "/v1/events", body=body, headers=sent)
        response = connection.getresponse()
        raw = response.read()
        is_json = response.headers.get("Content-Type", "").startswith("application/json")
        answer = json.loads(raw) if raw and is_json else raw
        return response.status, dict(response.headers), answer
    finally:
        connection.close()


def lines(records: list[Record]) -> bytes:
    return b"".join(r.value + b"\n" for r in records if r.value is not None)


def published(settings: Settings) -> int:
    return sum(end_offsets(settings, settings.topic).values())


def counted(settings: Settings) -> int:
    return len(read_records(settings, settings.topic))  # read_committed: what the consumers are handed


def test_what_ingest_accepts_both_groups_count_exactly(
    settings: Settings, registry_rows: dict[str, str | None], tmp_path: Path
) -> None:
    """NDJSON, a JSON array and a single JSON object, in many requests at once: every 202's events counted once by
    windows and docsync, and each record on the partition the Python publisher would choose for its key."""
    now = int(time.time() * 1000)
    records = [r for r in generate(6000, now_ms=now, skills=2000, seed=5, days=3) if r.valid]
    ingest, url = start_ingest(settings, tmp_path)
    chunks = [records[i : i + 500] for i in range(0, 5000, 500)]
    answers: list[tuple[int, Any]] = []

    def send(chunk: list[Record]) -> None:
        status, _headers, answer = post(url, lines(chunk))
        answers.append((status, answer))

    threads = [threading.Thread(target=send, args=(chunk,)) for chunk in chunks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(answers, key=str) == [(202, {"accepted": 500})] * 10
    array = [orjson.loads(r.value or b"") for r in records[5000:5999]]
    assert post(url, orjson.dumps(array), content_type="application/json")[::2] == (202, {"accepted": 999})
    single = orjson.loads(records[5999].value or b"")
    assert post(url, orjson.dumps(single), content_type="application/json; charset=utf-8")[::2] == (
        202,
        {"accepted": 1},
    )
    assert published(settings) >= len(records)  # and the transaction markers

    on_disk = read_records(settings, settings.topic)
    assert len(on_disk) == len(records)
    assert all(r.partition == murmur2_partition(r.key or b"", 12) for r in on_disk)
    worker = WorkerProcess(settings, tmp_path / "windows.log")
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "windows to apply what ingest published")
    assert worker.terminate() == 0
    assert actual_windows(settings) == expected_windows(records)
    code, _summaries = run_docsync(settings)
    assert code == 0
    skill_stats, owner_stats, _unknown = expected_docstats(records, registry_rows)
    assert actual_docstats(settings) == (skill_stats, owner_stats)
    assert ingest.terminate() == 0


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_every_bad_input_gets_its_answer_and_publishes_nothing(settings: Settings, tmp_path: Path) -> None:
    ingest, url = start_ingest(
        settings, tmp_path, "--max-body-bytes", "4096", "--max-events", "5", "--read-timeout", "1"
    )
    now = int(time.time() * 1000)
    good = make_event("sk_1", "download", now).encode()
    tried: dict[str, tuple[int, Any]] = {}

    def answer(name: str, body: bytes, **options: Any) -> tuple[int, Any]:
        status, _headers, said = post(url, body, **options)
        tried[name] = (status, said)
        return status, said

    status, said = answer("one invalid line among valid ones", good + b"\n" + b'{"v": 1, "kind": "x"}\n' + good)
    assert status == 400 and said["rejected"] == [
        {"line": 2, "reason": "bad_field", "message": "event_id must be a string of 1-128 characters"}
    ]
    status, said = answer(
        "an unknown kind in a JSON array",
        orjson.dumps([orjson.loads(good), {**orjson.loads(good), "kind": "upvote"}]),
        content_type="application/json",
    )
    assert status == 400 and [(r["index"], r["reason"]) for r in said["rejected"]] == [(1, "unknown_kind")]
    status, said = answer("malformed JSON", b'{"v": 1,', content_type="application/json")
    assert status == 400 and "line 1 column" in said["error"]
    status, said = answer("a member twice", b'{"v": 1, "v": 1}', content_type="application/json")
    assert status == 400 and "more than once" in said["error"]
    assert answer("an empty body", b"")[0] == 400
    assert answer("plain text", good, content_type="text/plain")[0] == 415
    assert answer("latin-1", good, content_type="application/x-ndjson; charset=latin-1")[0] == 415
    assert answer("over --max-body-bytes", good + b"\n" + b" " * 5000)[0] == 413
    assert answer("over --max-events", b"\n".join([good] * 6))[0] == 413
    unauthorized = answer("no token", good, token=None)
    assert unauthorized == answer("a wrong token", good, token="guess") == (401, {"error": "unauthorized"})
    assert answer("a bad Idempotency-Key", good, headers={"Idempotency-Key": "has space"})[0] == 400

    # A client that sends its body too slowly is answered 408 and cut off after --read-timeout.
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30) as slow:
        slow.sendall(
            b"POST /v1/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n"
            b"Content-Type: application/x-ndjson\r\nContent-Length: 100\r\n\r\n" + good[:10]
        )
        reply = b""
        while chunk := slow.recv(65536):  # until the server closes the connection
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    tried["a body too slow"] = (408, reply.split(b"\r\n\r\n", 1)[-1].decode())

    assert published(settings) == 0, "nothing of a refused request may be published"
    assert get(url + "/healthz")[0] == 200
    metrics = get(url + "/metrics")[1]
    assert 'skillstats_ingest_requests_total{status="400"} 6.0' in metrics
    assert 'skillstats_ingest_events_rejected_total{reason="unknown_kind"} 1.0' in metrics
    assert ingest.terminate() == 0
    assert TOKEN not in ingest.log_path.read_text() and "guess" not in ingest.log_path.read_text()
    for name, (status, said) in tried.items():
        record_metric(f"ingest, {name}: {status} {str(said)[:140]}")


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_tokens_are_re_read_when_the_file_changes(settings: Settings, tmp_path: Path) -> None:
    ingest, url = start_ingest(settings, tmp_path, tokens="# the registry's services\nfirst\n")
    good = make_event("sk_1", "download", int(time.time() * 1000)).encode()
    assert post(url, good, token="first")[0] == 202
    assert post(url, good, token="second")[0] == 401
    (tmp_path / "tokens").write_text("second\n")  # rotated: the old one goes, the new one works
    wait_until(lambda: post(url, good, token="second")[0] == 202, 30, "the new token to be taken")
    assert post(url, good, token="first")[0] == 401
    assert counted(settings) == 2
    assert ingest.terminate() == 0


def test_a_retry_with_an_idempotency_key_is_answered_the_same_and_published_once(
    settings: Settings, tmp_path: Path
) -> None:
    ingest, url = start_ingest(settings, tmp_path)
    now = int(time.time() * 1000)
    body = b"\n".join(make_event(f"sk_{i}", "download", now).encode() for i in range(3))
    key = {"Idempotency-Key": "order-7431"}
    first = post(url, body, headers=key)
    again = post(url, body, headers=key)
    assert first[0] == again[0] == 202 and first[2] == again[2] == {"accepted": 3}
    assert again[1].get("Idempotent-Replayed") == "true" and "Idempotent-Replayed" not in first[1]
    assert post(url, body + b"\n" + body, headers=key)[0] == 422  # the same key, another body
    assert post(url, body, token="other-caller", headers=key)[0] == 401
    # Many copies at once: one publishes, the others are told it is in flight (409) or answered from it.
    statuses: list[int] = []
    threads = [
        threading.Thread(target=lambda: statuses.append(post(url, body, headers={"Idempotency-Key": "burst"})[0]))
        for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert statuses.count(202) >= 1 and set(statuses) <= {202, 409}, statuses
    assert post(url, body, headers={"Idempotency-Key": "burst"})[0] == 202
    assert counted(settings) == 6  # "order-7431" once, "burst" once
    # A refused body gives its key back: fixed and sent again under the same key, it is published.
    bad = {"Idempotency-Key": "fixed-later"}
    assert post(url, b'{"v": 2}', headers=bad)[0] == 400
    assert post(url, body, headers=bad)[0] == 202
    assert counted(settings) == 9
    assert ingest.terminate() == 0


def test_kafka_away_is_503_and_nothing_of_those_requests_counts(settings: Settings, tmp_path: Path) -> None:
    from tests.test_positions import Gate

    host, port = settings.kafka_bootstrap.split(",")[0].rsplit(":", 1)
    gate = Gate((host, int(port)))
    away = settings.override(kafka_bootstrap=f"127.0.0.1:{gate.port}")
    ingest_port = free_port()
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    ingest = IngestProcess(
        away,
        tmp_path / "ingest.log",
        "--host",
        "127.0.0.1",
        "--port",
        str(ingest_port),
        "--tokens-file",
        str(tokens),
        "--publish-timeout",
        "3",
    )
    url = f"http://127.0.0.1:{ingest_port}"
    try:
        wait_until(lambda: ingest.assert_alive() or get(url + "/readyz")[0] == 503, 60, "readiness to say Kafka")
        now = int(time.time() * 1000)
        refused = post(url, make_event("sk_away", "download", now).encode())
        assert refused[0] == 503 and refused[1]["Retry-After"].isdigit(), refused
        assert "send it again" in refused[2]["error"]
        gate.open()
        wait_until(lambda: get(url + "/readyz")[0] == 200, 90, "readiness once Kafka answers")
        assert post(url, make_event("sk_back", "download", int(time.time() * 1000)).encode())[0] == 202
        assert [r.key for r in read_records(settings, settings.topic)] == [b"sk_back"]
        assert ingest.terminate() == 0
    finally:
        gate.close()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_sigterm_finishes_the_request_in_flight_then_exits_0(settings: Settings, tmp_path: Path) -> None:
    ingest, url = start_ingest(settings, tmp_path, "--read-timeout", "30")
    good = make_event("sk_1", "download", int(time.time() * 1000)).encode()
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
        head = (
            b"POST /v1/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\n"
            b"Content-Type: application/x-ndjson\r\nContent-Length: " + str(len(good)).encode() + b"\r\n\r\n"
        )
        client.sendall(head + good[:5])
        in_flight = "skillstats_ingest_requests_in_flight 1.0"
        wait_until(lambda: in_flight in get(url + "/metrics")[1], 30, "the request to be in flight")
        ingest.process.send_signal(signal.SIGTERM)
        wait_until(lambda: get(url + "/readyz")[0] != 200, 30, "readiness to fail while shutting down")
        client.sendall(good[5:])
        reply = client.recv(65536)
    assert reply.startswith(b"HTTP/1.1 202"), reply[:200]
    assert ingest.process.wait(60) == 0
    assert "skillstats ingest: stopped" in ingest.log_path.read_text()
    assert counted(settings) == 1


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_https_with_the_certificate_given(settings: Settings, tmp_path: Path) -> None:
    import ssl

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    openssl = "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=127.0.0.1"
    openssl += " -addext subjectAltName=IP:127.0.0.1"
    subprocess.run([*openssl.split(), "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    port = free_port()
    tokens = tmp_path / "tokens"
    tokens.write_text(TOKEN + "\n")
    listen = ["--host", "127.0.0.1", "--port", str(port), "--tokens-file", str(tokens)]
    ingest = IngestProcess(settings, tmp_path / "ingest.log", *listen, "--tls-cert", str(cert), "--tls-key", str(key))
    context = ssl.create_default_context(cafile=str(cert))

    def status() -> int:
        ingest.assert_alive()
        try:
            connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=10)
            connection.request("GET", "/readyz")
            return connection.getresponse().status
        except OSError:
            return 0

    wait_until(lambda: status() == 200, 90, "ingest to answer over TLS")
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=30)
    good = make_event("sk_tls", "download", int(time.time() * 1000)).encode()
    connection.request(
        "POST", "/v1/events", body=good, headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": NDJSON}
    )
    assert connection.getresponse().status == 202
    assert ingest.terminate() == 0


def test_settings_that_cannot_work_exit_2_in_a_line(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "SKILLSTATS_KAFKA_BOOTSTRAP": "127.0.0.1:1", "SKILLSTATS_DATABASE_URL": "sqlite://"}
        env.pop("SKILLSTATS_INGEST_TOKENS_FILE", None)
        return subprocess.run(
            [sys.executable, "-m", "skillstats.cli", "ingest", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )

    empty = tmp_path / "empty"
    empty.write_text("# no token yet\n")
    for args, said in (
        ((), "no tokens: give --tokens-file"),
        (("--no-auth", "--host", "0.0.0.0"), "loopback address only"),
        (("--tokens-file", str(empty)), "holds no token"),
        (("--tokens-file", str(tmp_path / "missing")), "cannot read the tokens file"),
        (("--no-auth", "--tls-cert", str(empty)), "--tls-cert and --tls-key go together"),
        (("--no-auth", "--publish-timeout", "0"), "--publish-timeout"),
        (("--no-auth", "--shutdown-budget", "10"), "a request in flight could be cut off"),
    ):
        result = run(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert said in result.stderr and len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)


def test_a_process_killed_between_commit_and_keeping_the_key_is_the_documented_gap(
    settings: Settings, tmp_path: Path
) -> None:
    """In-process (the process "dies" where a test can aim): the request's transaction committed, its answer never
    reached SQL. Within the lease the same key is answered 409; after it, the request is published again."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from skillstats.ingest.idempotency import IdempotencyStore
    from skillstats.ingest.server import IngestApp, Limits
    from skillstats.ingest.transactions import TransactionalPublisher
    from skillstats.sinks.db import open_engine

    engine = open_engine(settings.database_url)
    body = make_event("sk_gap", "download", int(time.time() * 1000)).encode()
    headers = {"Idempotency-Key": "cut-off", "Content-Type": NDJSON}

    class Died(Exception):
        pass

    async def scenario() -> list[int]:
        statuses = []
        for life in range(3):
            publisher = TransactionalPublisher(settings, f"skillstats-ingest-gap-{life}", publish_timeout=10)
            store = IdempotencyStore(engine, ttl=timedelta(hours=1), lease=timedelta(seconds=2))
            app = IngestApp(publisher, None, store, Limits())
            if life == 0:

                async def die(*_args: object) -> None:
                    raise Died("killed after the commit, before the key was kept")

                app._answered = die  # type: ignore[method-assign]
            async with TestClient(TestServer(app.app)) as client:
                if life == 2:
                    await asyncio.sleep(2.5)  # the lease runs out
                try:
                    response = await client.post("/v1/events", data=body, headers=headers)
                    statuses.append(response.status)
                except Exception:
                    statuses.append(-1)
            await asyncio.to_thread(publisher.close, 10)
        return statuses

    statuses = asyncio.run(scenario())
    engine.dispose()
    # life 0 died after committing (the client saw the connection fail), life 1 within the lease: 409,
    # life 2 after it: published again. The event is in the topic twice: the gap docs/contract.md states.
    assert statuses[1:] == [409, 202], statuses
    assert [r.key for r in read_records(settings, settings.topic)] == [b"sk_gap", b"sk_gap"]
