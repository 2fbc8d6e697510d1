"""`skillstats ingest` as a process, against the real broker and databases: what it accepts is counted exactly by
both groups, what it refuses publishes nothing, and each bad input gets its answer (docs/contract.md, HTTP)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import UTC, timedelta
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

    # A token that is not UTF-8 is a wrong token like any other (it used to be a 500, a traceback per request).
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30) as raw:
        raw.sendall(
            b"POST /v1/events HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer \xff\xfe"
            + TOKEN.encode()
            + b"\r\nContent-Type: application/x-ndjson\r\nContent-Length: "
            + str(len(good)).encode()
            + b"\r\n\r\n"
            + good
        )
        reply = b""
        while chunk := raw.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    assert b"WWW-Authenticate: Bearer" in reply and reply.endswith(b'{"error":"unauthorized"}'), reply
    tried["a token that is not UTF-8"] = (401, reply.split(b"\r\n\r\n", 1)[-1].decode())

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

    # Each refusal is logged (it was not at all), once per client and reason: the same ones again add no line.
    for _again in range(3):
        assert post(url, good, token="guess")[0] == 401
        assert post(url, b'{"v": 1,', content_type="application/json")[0] == 400
        assert post(url, b"\n".join([good] * 6))[0] == 413
    assert ingest.terminate() == 0
    assert TOKEN not in ingest.log_path.read_text() and "guess" not in ingest.log_path.read_text()
    assert "Traceback" not in ingest.log_path.read_text()
    said = r"refused a request from 127\.0\.0\.1( \(token sha256:[0-9a-f]{8}\))?: (\d{3}) (.+)"
    refusals = re.findall(said, ingest.log_path.read_text())
    fingerprint = f" (token sha256:{hashlib.sha256(TOKEN.encode()).hexdigest()[:8]})"
    assert sorted(refusals) == sorted(
        [
            ("", "401", "unauthorized: no token"),
            ("", "401", "unauthorized: not one of the tokens"),
            *(
                (fingerprint, status, reason)
                for status, reason in (
                    ("400", "invalid events (bad_field)"),
                    ("400", "invalid events (unknown_kind)"),
                    ("400", "malformed body"),
                    ("400", "bad Idempotency-Key"),
                    ("408", "body not received within --read-timeout"),
                    ("413", "body over --max-body-bytes"),
                    ("413", "more events than --max-events"),
                    ("415", "unsupported Content-Type"),
                )
            ),
        ]
    ), refusals
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
        (("--no-auth", "--publish-timeout", "1800", "--idempotency-hours", "1"), "shorter than a claim's lease"),
    ):
        result = run(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert said in result.stderr and len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_publish_timeout_the_broker_would_refuse_is_refused_at_start(settings: Settings) -> None:
    """Kafka refuses a transaction timeout (--publish-timeout + 10 s) above its transaction.max.timeout.ms: read
    from the broker at start, and said in a line (exit 2), rather than every request answered 503."""
    result = subprocess.run(
        [sys.executable, "-m", "skillstats.cli", "ingest", "--no-auth", "--no-idempotency", "--publish-timeout", "895"],
        env=settings.child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert "transaction.max.timeout.ms is 900000 ms: at most 890" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# ---------------------------------------------------------------------- a keyed request published at most once
# The server in this process, where a test can stop it at the point it wants (a process "dies" there: its
# event loop and its renewals end, its publisher's thread does nothing more), and the lease that would then run
# out moved into the past in SQL instead of waited for.


def in_process_app(settings: Settings, transactional_id: str, lease: timedelta, commit: Any = None) -> Any:
    from skillstats.ingest.idempotency import IdempotencyStore
    from skillstats.ingest.receipts import Receipts
    from skillstats.ingest.server import IngestApp, Limits
    from skillstats.ingest.transactions import TransactionalPublisher
    from skillstats.sinks.db import open_engine

    receipts = Receipts(settings, timedelta(hours=1))
    publisher = TransactionalPublisher(settings, transactional_id, publish_timeout=10, receipts=receipts)
    if commit is not None:
        publisher._commit = functools.partial(commit, publisher._commit)  # type: ignore[method-assign]
    store = IdempotencyStore(open_engine(settings.database_url), ttl=timedelta(hours=1), lease=lease)
    return IngestApp(publisher, None, store, Limits())


def keyed_rows(settings: Settings) -> list[Any]:
    from sqlalchemy import select

    from skillstats.ingest.idempotency import requests
    from skillstats.sinks.db import open_engine

    engine = open_engine(settings.database_url)
    try:
        with engine.connect() as connection:
            return list(connection.execute(select(requests)))
    finally:
        engine.dispose()


def lease_runs_out(settings: Settings, by: timedelta) -> None:
    """As if `by` had passed since every claim was made or last renewed."""
    from sqlalchemy import update

    from skillstats.ingest.idempotency import requests
    from skillstats.sinks.db import open_engine

    engine = open_engine(settings.database_url)
    try:
        with engine.begin() as connection:
            for row in connection.execute(requests.select()).all():
                connection.execute(
                    update(requests)
                    .where(requests.c.key == row.key)
                    .values(
                        claimed_at=row.claimed_at - by,
                        renewed_at=None,
                        lease_until=None if row.lease_until is None else row.lease_until - by,
                    )
                )
    finally:
        engine.dispose()


async def until(condition: Any, timeout: float, what: str) -> None:
    import asyncio

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("dies", ["after its commit", "before its commit"])
def test_a_process_killed_around_its_commit_publishes_a_keyed_request_once(
    settings: Settings, tmp_path: Path, dies: str
) -> None:
    """Once the documented gap (issue 27): a process that dies after Kafka committed a keyed request and before
    its answer reached SQL. Within the lease the key is answered 409; after it, the retry finds the receipt the
    committed transaction holds and is answered from it (Idempotent-Replayed), publishing nothing. A process
    that dies before its commit leaves an open transaction, which its restart (the same transactional id)
    aborts: no receipt is visible, and the retry publishes. Either way the event counts once."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    body = make_event("sk_once", "download", int(time.time() * 1000)).encode()
    headers = {"Idempotency-Key": "cut-off", "Content-Type": NDJSON}
    lease = timedelta(seconds=30)
    instance = "skillstats-ingest-restarted"  # a restarted pod keeps its name, so its transactional id

    class Died(Exception):
        pass

    buried = threading.Event()

    def hang(_real_commit: Any, _producer: Any, _deadline: float) -> None:
        buried.wait()  # never committed, never aborted: the process is gone (until the test ends)
        raise Died("the test is over")

    async def first_life() -> Any:
        app = in_process_app(settings, instance, lease, commit=hang if dies == "before its commit" else None)
        if dies == "after its commit":

            async def die(*_args: object) -> None:
                raise Died("killed after the commit, before the answer reached SQL")

            app._answered = die
        async with TestClient(TestServer(app.app)) as client:
            request = asyncio.ensure_future(client.post("/v1/events", data=body, headers=headers))
            if dies == "after its commit":
                await until(lambda: counted(settings) == 1, 30, "the transaction to commit")
            else:
                await until(lambda: published(settings) >= 1, 30, "the records to be produced, uncommitted")
            request.cancel()
            with contextlib.suppress(BaseException):
                await request
        return app

    async def next_life() -> list[tuple[int, str | None, Any]]:
        app = in_process_app(settings, instance, lease)
        answers = []
        async with TestClient(TestServer(app.app)) as client:
            await until(lambda: app.publisher.kafka_problem is None, 30, "the restarted publisher")

            async def send() -> None:
                response = await client.post("/v1/events", data=body, headers=headers)
                answers.append((response.status, response.headers.get("Idempotent-Replayed"), await response.json()))

            await send()  # within the lease: the first request might still commit
            lease_runs_out(settings, by=lease + timedelta(seconds=1))
            await send()  # after it: the receipt, or (none committed) published
            await send()  # and from then on, the answer SQL keeps
        await asyncio.to_thread(app.publisher.close, 10)
        app.receipts.close()
        return answers

    dead = asyncio.run(first_life())
    assert [row.status for row in keyed_rows(settings)] == [None], "the answer must not have reached SQL"
    answers = asyncio.run(next_life())
    assert answers[0][0] == 409, answers
    if dies == "after its commit":
        assert answers[1:] == [(202, "true", {"accepted": 1})] * 2, answers
    else:
        assert answers[1] == (202, None, {"accepted": 1}) and answers[2] == (202, "true", {"accepted": 1}), answers
    assert [r.key for r in read_records(settings, settings.topic)] == [b"sk_once"]
    buried.set()  # the dead process's leftovers, stopped
    dead.publisher.close(10)
    dead.receipts.close()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_commit_stuck_past_the_lease_keeps_its_key_and_its_answer(settings: Settings, tmp_path: Path) -> None:
    """One replica, a keyed request whose commit takes longer than its lease (Kafka slow to confirm it). Its claim
    is renewed while it waits, so a retry meanwhile is told 409 instead of taking the key over (which used to end
    in a 503 that gave the key back, and the next retry published again); the commit, when it comes, keeps its
    answer, and the next retry is answered from it. Published once."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    from skillstats.sinks.upserts import now_utc_naive

    body = make_event("sk_slow", "download", int(time.time() * 1000)).encode()
    headers = {"Idempotency-Key": "slow-commit", "Content-Type": NDJSON}
    lease = timedelta(seconds=1)
    stuck, confirmed = threading.Event(), threading.Event()

    def slow(real_commit: Any, producer: Any, _deadline: float) -> None:
        stuck.set()
        confirmed.wait(60)
        real_commit(producer, time.monotonic() + 10)

    def lease_passed_since_the_claim() -> bool:
        rows = keyed_rows(settings)
        return bool(rows) and rows[0].claimed_at + lease < now_utc_naive()

    async def scenario() -> list[tuple[int, str | None]]:
        app = in_process_app(settings, "skillstats-ingest-slow", lease, commit=slow)
        async with TestClient(TestServer(app.app)) as client:

            async def send() -> tuple[int, str | None]:
                response = await client.post("/v1/events", data=body, headers=headers)
                return response.status, response.headers.get("Idempotent-Replayed")

            first = asyncio.ensure_future(send())
            await until(
                lambda: stuck.is_set() and lease_passed_since_the_claim(), 30, "the commit to outlast the lease"
            )
            retry = asyncio.ensure_future(send())
            # The retry is answered at once, or (what this replaces) takes the key over and waits in the queue.
            await until(lambda: retry.done() or app.publisher._queue.qsize() > 0, 30, "the retry to be answered")
            confirmed.set()
            answers = [await retry, await first, await send()]
        await asyncio.to_thread(app.publisher.close, 10)
        app.receipts.close()
        return answers

    answers = asyncio.run(scenario())
    assert answers == [(409, None), (202, None), (202, "true")], answers
    assert [r.key for r in read_records(settings, settings.topic)] == [b"sk_slow"]


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_ingest_killed_between_the_commit_and_the_answer_is_answered_from_its_receipt(
    settings: Settings, tmp_path: Path
) -> None:
    """The real thing, SIGKILL: the answer's UPDATE is held in PostgreSQL (a trigger waits on an advisory lock the
    test holds) until Kafka has committed the request, and the process is killed there. Another replica, once the
    claim's lease has run out, answers the retry from the committed receipt: the event is in the topic once."""
    from sqlalchemy import text

    from skillstats.sinks.db import open_engine

    engine = open_engine(settings.database_url)
    hold = engine.connect()
    with engine.begin() as connection:
        connection.execute(
            text(
                "CREATE FUNCTION hold_answers() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN PERFORM pg_advisory_xact_lock(2727); RETURN NEW; END $$"
            )
        )
        connection.execute(
            text(
                "CREATE TRIGGER hold_answers BEFORE UPDATE ON skillstats_ingest_requests "
                "FOR EACH ROW EXECUTE FUNCTION hold_answers()"
            )
        )
    hold.execute(text("SELECT pg_advisory_lock(2727)"))
    first, url = start_ingest(settings, tmp_path, "--instance-id", "first")
    body = make_event("sk_killed", "download", int(time.time() * 1000)).encode()
    key = {"Idempotency-Key": "killed-mid-answer"}
    cut_off: list[BaseException] = []

    def send() -> None:
        try:
            post(url, body, headers=key)
        except OSError as exc:  # the connection dies with the process
            cut_off.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    wait_until(lambda: counted(settings) == 1, 30, "Kafka to commit the request")
    waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
    wait_until(lambda: hold.execute(text(waiting)).scalar() == 1, 30, "its answer to wait in PostgreSQL")
    first.kill9()
    others = (
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    hold.execute(text(others))  # the dead process's connections go with it
    hold.execute(text("SELECT pg_advisory_unlock(2727)"))
    hold.commit()
    hold.close()
    sender.join(30)
    assert cut_off, "the client must have lost its answer"
    with engine.begin() as connection:
        connection.execute(text("DROP TRIGGER hold_answers ON skillstats_ingest_requests"))
        # As if the lease had run out (twice the publish timeout + 40 s) since the claim.
        connection.execute(
            text(
                "UPDATE skillstats_ingest_requests SET claimed_at = claimed_at - interval '5 minutes', "
                "lease_until = lease_until - interval '5 minutes'"
            )
        )
        assert connection.execute(text("SELECT status FROM skillstats_ingest_requests")).all() == [(None,)]
    engine.dispose()

    second, url = start_ingest(settings, tmp_path, "--instance-id", "second")
    status, headers, answer = post(url, body, headers=key)
    assert (status, headers.get("Idempotent-Replayed"), answer) == (202, "true", {"accepted": 1})
    assert [r.key for r in read_records(settings, settings.topic)] == [b"sk_killed"]
    assert post(url, body, headers=key)[::2] == (202, {"accepted": 1})
    assert second.terminate() == 0
    assert "answered from the receipt its transaction committed" in second.log_path.read_text()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_receipts_are_found_by_key_and_lifetime_and_later_reads_see_later_commits(settings: Settings) -> None:
    """The reader keeps what it read of a partition for the next take-over: a receipt committed after one read is
    found by the next (it reads on from where the last stopped), a key never published has none, and a receipt
    of an earlier use of the key (another `expires_at`) is not this one's."""
    from datetime import datetime

    from skillstats.ingest.idempotency import Claimed, Stale
    from skillstats.ingest.receipts import Receipt, Receipts, receipt_partition
    from skillstats.ingest.transactions import TransactionalPublisher

    receipts = Receipts(settings, timedelta(hours=1))
    publisher = TransactionalPublisher(settings, "skillstats-ingest-receipts-test", 10, receipts=receipts)
    now = datetime.now(UTC).replace(tzinfo=None, microsecond=123456)
    same = [f"scope:k{i}" for i in range(200) if receipt_partition(f"scope:k{i}".encode()) == 0][:3]
    first, second, never = (Claimed(key, now, now + timedelta(hours=1), "digest") for key in same)

    def commit(claim: Claimed, accepted: int) -> None:
        receipt = receipts.record(claim, 202, f'{{"accepted": {accepted}}}')
        publisher.submit([], int(time.time() * 1000), receipt).result(30)

    def stale(claim: Claimed, expires_at: datetime | None = None) -> Stale:
        return Stale(claim.key, claim.claimed_at, None, expires_at or claim.expires_at, claim.digest)

    try:
        commit(first, 3)
        assert receipts.find(stale(first), 10) == Receipt(202, '{"accepted": 3}')
        assert receipts.find(stale(second), 10) is None
        commit(second, 5)  # after the partition was read up to its end
        assert receipts.find(stale(second), 10) == Receipt(202, '{"accepted": 5}')
        assert receipts.find(stale(never), 10) is None
        assert receipts.find(stale(first, expires_at=now), 10) is None  # the key's earlier use
        fresh = Receipts(settings, timedelta(hours=1))  # another replica, reading from the claim's time
        assert fresh.find(stale(second), 10) == Receipt(202, '{"accepted": 5}')
        fresh.close()

        # A transaction still open with a receipt in it (a process gone, its transaction not yet aborted): the
        # reader cannot tell, and says so (503), rather than take it for aborted. Aborted, there is none.
        from confluent_kafka import Producer

        from skillstats.ingest.receipts import ReceiptsUnknown

        zombie = Producer(settings.kafka_config(**{"transactional.id": "skillstats-ingest-zombie"}))
        zombie.init_transactions(10)
        zombie.begin_transaction()
        partition, key, value = receipts.record(never, 202, '{"accepted": 7}')
        zombie.produce(receipts.topic, value=value, key=key, partition=partition)
        zombie.flush(10)
        with pytest.raises(ReceiptsUnknown):
            receipts.find(stale(never), 1)
        zombie.abort_transaction(10)
        assert receipts.find(stale(never), 10) is None
    finally:
        publisher.close(10)
        receipts.close()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_take_over_never_reads_a_receipts_topic_other_than_its_claims_as_nothing_committed(
    settings: Settings,
) -> None:
    """The receipts topic deleted and created again under its name (an operator's tool, a restored cluster) has
    lost the receipts it held: a claim made against the old topic, with no receipt in the new one, is `Lost`
    (published nothing, its outcome cannot be known), whether its transaction had committed or not. A receipt
    in the new topic is still the answer; a claim made against the new topic, or with no id (an older row),
    reads it as before; and a topic missing that the claim named cannot tell (503), nor can a take-over whose
    topic changed while it read."""
    from datetime import datetime

    from confluent_kafka.admin import AdminClient

    from skillstats.ingest.idempotency import Claimed, Stale
    from skillstats.ingest.receipts import Receipt, Receipts, ReceiptsLost, ReceiptsUnknown, receipt_partition
    from skillstats.ingest.transactions import TransactionalPublisher
    from tests.helpers import recreate_topic

    receipts = Receipts(settings, timedelta(hours=1))
    publisher = TransactionalPublisher(settings, "skillstats-ingest-recreated-test", 10, receipts=receipts)
    now = datetime.now(UTC).replace(tzinfo=None, microsecond=0)
    keys = [f"scope:r{i}" for i in range(400) if receipt_partition(f"scope:r{i}".encode()) == 1][:6]

    def claim(key: str, topic_id: str | None) -> Claimed:
        return Claimed(key, now, now + timedelta(hours=1), "digest", topic_id)

    def commit(claimed: Claimed) -> None:
        receipt = receipts.record(claimed, 202, '{"accepted": 1}')
        publisher.submit([], int(time.time() * 1000), receipt).result(30)

    def stale(claimed: Claimed) -> Stale:
        return Stale(claimed.key, claimed.claimed_at, None, claimed.expires_at, claimed.digest, claimed.receipts_topic)

    receipts_topic = settings.override(topic=receipts.topic)
    try:
        commit(claim("scope:warm-up", None))  # the topic created, its id read
        old_id = receipts.known_topic_id()
        assert old_id is not None
        committed, uncommitted = claim(keys[0], old_id), claim(keys[1], old_id)
        commit(committed)
        assert receipts.find(stale(committed), 10) == Receipt(202, '{"accepted": 1}')
        assert receipts.find(stale(uncommitted), 10) is None

        recreate_topic(receipts_topic, 6)
        wait_until(lambda: receipts.topic_id(5) not in (None, old_id), 30, "the new topic's id")
        new_id = receipts.topic_id(5)
        with pytest.raises(ReceiptsLost):
            receipts.find(stale(committed), 10)  # its receipt went with the old topic
        with pytest.raises(ReceiptsLost):
            receipts.find(stale(uncommitted), 10)
        assert receipts.known_topic_id() == new_id  # what the next claims name

        late = claim(keys[2], old_id)  # claimed before the id was read again, committed into the new topic
        commit(late)
        assert receipts.find(stale(late), 10) == Receipt(202, '{"accepted": 1}')
        assert receipts.find(stale(claim(keys[3], new_id)), 10) is None
        assert receipts.find(stale(claim(keys[4], None)), 10) is None

        admin = AdminClient(settings.kafka_config())
        for future in admin.delete_topics([receipts.topic], operation_timeout=30).values():
            future.result(30)
        wait_until(lambda: receipts.topic_id(5) is None, 30, "the topic to be gone")
        with pytest.raises(ReceiptsUnknown):
            receipts.find(stale(claim(keys[5], new_id)), 5)
        assert receipts.find(stale(claim(keys[5], None)), 5) is None
    finally:
        publisher.close(10)
        receipts.close()


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_retry_whose_receipts_topic_was_created_again_is_refused_not_published_again(
    settings: Settings, tmp_path: Path
) -> None:
    """A request committed (its receipt in the receipts topic) whose answer never reached SQL, as when its process
    is killed between the two; then the receipts topic is deleted and created again. The retry, once the claim's
    lease has run out, finds no receipt in the new topic: it is answered 409 (outcome unknown) and nothing is
    published again, where reading the new topic as the old one would have counted the event twice."""
    from sqlalchemy import text

    from skillstats.ingest.receipts import receipts_topic
    from skillstats.sinks.db import open_engine
    from tests.helpers import recreate_topic

    ingest, url = start_ingest(settings, tmp_path)
    body = make_event("sk_recreated", "download", int(time.time() * 1000)).encode()
    key = {"Idempotency-Key": "recreated-receipts"}
    assert post(url, body, headers=key)[::2] == (202, {"accepted": 1})
    engine = open_engine(settings.database_url)
    with engine.begin() as connection:
        # As if the answer had not been kept, and the lease had run out (twice the publish timeout + 40 s).
        connection.execute(
            text(
                "UPDATE skillstats_ingest_requests SET status = NULL, response = NULL, "
                "claimed_at = datetime(claimed_at, '-5 minutes'), lease_until = datetime(lease_until, '-5 minutes')"
            )
        )
        assert connection.execute(text("SELECT receipts_topic FROM skillstats_ingest_requests")).scalar()
    engine.dispose()
    recreate_topic(settings.override(topic=receipts_topic(settings)), 6)
    answers: list[tuple[int, Any]] = []

    def answered() -> bool:  # 503 while the new topic's partitions have no leader yet: the client sends it again
        status, _headers, answer = post(url, body, headers=key)
        answers.append((status, answer))
        return status != 503

    wait_until(answered, 30, "an answer other than 503")
    status, answer = answers[-1]
    assert status == 409 and "cannot be known" in answer["error"], (status, answer)
    assert post(url, body, headers=key)[0] == 409  # the same answer again, and still nothing published
    assert [r.key for r in read_records(settings, settings.topic)] == [b"sk_recreated"]
    assert ingest.terminate() == 0
    assert "nothing published again" in ingest.log_path.read_text()
