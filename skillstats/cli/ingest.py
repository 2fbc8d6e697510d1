"""`skillstats ingest`: an HTTP endpoint that publishes stat events for services without a Kafka client.

Settings that cannot work are refused at start (exit 2), not found out by every
request: an `--idempotency-hours` shorter than a claim's lease (a key would
expire while its request may still commit), a shutdown budget too short for a
request in flight, and a `--publish-timeout` whose transaction timeout (+ 10 s)
the broker's `transaction.max.timeout.ms` refuses (read from the broker; Kafka's
default, 15 min, when it cannot be read: a broker with a larger limit and no
DescribeConfigs right for ingest then refuses a timeout it would have taken,
the safe side).

The port listens at once, before Kafka is asked anything: a pod whose broker is
away is alive (/healthz 200) and says why it is not ready (/readyz 503, "Kafka
at ... is away"), and a publish is answered 503, instead of a closed port for
the 15 s a first answer could take. What Kafka is asked at start (whether it
refuses our credentials, its transaction limit) is asked from a thread then,
and the publisher starts talking to Kafka only after it: a refusal still ends
the command in one line, never after a log of failed transactions.

It listens on 127.0.0.1 unless told otherwise (`--host`,
SKILLSTATS_INGEST_HOST): the API takes events from anyone holding a token, and
its /metrics is for the cluster's Prometheus; a container or pod gives the
address its Service reaches (the manifests give 0.0.0.0).

Its shutdown budget is its own (`--shutdown-budget`,
SKILLSTATS_INGEST_SHUTDOWN_BUDGET), not the SKILLSTATS_SHUTDOWN_BUDGET of the
other commands: their 10 s would cut off a request that began just before
SIGTERM, so a shared setting made ingest refuse to start.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import socket
import ssl
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from skillstats.cli.common import (
    EXIT_OK,
    UsageError,
    budget,
    database_options,
    kafka_options,
    positive,
    verbosity,
)
from skillstats.config import FIRST_ANSWER_S, Settings, redact_url
from skillstats.ingest import DRAIN_RESERVE_S

if TYPE_CHECKING:
    from skillstats.ingest.idempotency import IdempotencyStore

DEFAULT_PORT = 9320
DEFAULT_HOST = "127.0.0.1"
log = logging.getLogger("skillstats.ingest")


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError("must be more than 0 and at most 3600 seconds")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Serve POST /v1/events: v1 stat events as application/x-ndjson (one a line) or application/json (an "
        "object, or an array), validated by the contract's own code, all or nothing (400 lists each invalid "
        'event), and answered 202 {"accepted": N} only once Kafka committed the transaction holding them; 503 '
        "(Retry-After) means nothing of the request will count. Bearer tokens from --tokens-file; an "
        "Idempotency-Key makes a retry answer as the first request did, published once (keys kept in SQL). "
        "/healthz, /readyz and /metrics on the same port. The HTTP API: docs/contract.md."
    )
    kafka_options(parser)
    database_options(parser)
    verbosity(parser)
    env = os.environ.get
    parser.add_argument(
        "--host",
        default=env("SKILLSTATS_INGEST_HOST", DEFAULT_HOST),
        metavar="ADDRESS",
        help=f"address to listen on [SKILLSTATS_INGEST_HOST] (default {DEFAULT_HOST}, this machine only; in a "
        "container or pod the address its Service reaches, e.g. 0.0.0.0)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=env("SKILLSTATS_INGEST_PORT", str(DEFAULT_PORT)),
        help=f"TCP port [SKILLSTATS_INGEST_PORT] (default {DEFAULT_PORT}; 0 picks a free one)",
    )
    parser.add_argument(
        "--tokens-file",
        type=Path,
        default=env("SKILLSTATS_INGEST_TOKENS_FILE"),
        metavar="PATH",
        help="bearer tokens, one a line, re-read when the file changes [SKILLSTATS_INGEST_TOKENS_FILE]",
    )
    parser.add_argument(
        "--no-auth",
        action="store_true",
        help="take requests without a token: only on a loopback address (for local development)",
    )
    parser.add_argument("--max-body-bytes", type=positive, default=1 << 20, help="413 past this (default 1048576)")
    parser.add_argument("--max-events", type=positive, default=10_000, help="413 past this many (default 10000)")
    parser.add_argument(
        "--read-timeout", type=_seconds, default=10.0, help="seconds to receive a body; past it 408 (default 10)"
    )
    parser.add_argument(
        "--publish-timeout",
        type=_seconds,
        default=10.0,
        help="seconds for Kafka to commit a request's events; past it 503 and nothing counts (default 10; plus "
        "10 s, at most the broker's transaction.max.timeout.ms, 900 s by default)",
    )
    parser.add_argument(
        "--idempotency-hours",
        type=positive,
        default=24,
        help="how long an Idempotency-Key's answer is kept (default 24; at least a claim's lease, twice "
        "--publish-timeout + 40 s)",
    )
    parser.add_argument(
        "--no-idempotency",
        action="store_true",
        help="keep no keys (no database needed); a request with an Idempotency-Key is then refused (400)",
    )
    parser.add_argument("--tls-cert", type=Path, metavar="PEM", help="serve HTTPS with this certificate chain")
    parser.add_argument("--tls-key", type=Path, metavar="PEM", help="the certificate's private key")
    parser.add_argument(
        "--instance-id",
        default=env("SKILLSTATS_INSTANCE_ID"),
        help="names this process's Kafka transactional id, stable across its restarts, e.g. the pod name "
        "[SKILLSTATS_INSTANCE_ID] (default: host name and port)",
    )
    parser.add_argument(
        "--shutdown-budget",
        type=float,
        default=env("SKILLSTATS_INGEST_SHUTDOWN_BUDGET"),  # a string default goes through `type`
        metavar="SECONDS",
        help="on SIGTERM: answer 503 to new requests, finish those in flight, flush, exit; past it, exit 3 "
        f"[SKILLSTATS_INGEST_SHUTDOWN_BUDGET: ingest's own, not the other commands' SKILLSTATS_SHUTDOWN_BUDGET] "
        f"(default and least: --read-timeout + --publish-timeout + {DRAIN_RESERVE_S:g}, 22 s with their defaults, "
        "so no request in flight is cut off)",
    )


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.ingest.server import IngestApp, Limits, serve_until
    from skillstats.ingest.tokens import TokenFile, TokensUnreadable
    from skillstats.ingest.transactions import TransactionalPublisher
    from skillstats.shutdown import ShutdownWatchdog

    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port: not a TCP port: {args.port}")
    host = args.host or DEFAULT_HOST
    if args.no_auth:
        if args.tokens_file is not None:
            raise UsageError("--no-auth and --tokens-file: choose one")
        if not _loopback(host):
            raise UsageError(f"--no-auth listens on a loopback address only, not {host}: give a --tokens-file")
        tokens = None
    else:
        if args.tokens_file is None:
            raise UsageError(
                "no tokens: give --tokens-file (SKILLSTATS_INGEST_TOKENS_FILE), one bearer token a line, or "
                "--no-auth on a loopback address"
            )
        try:
            tokens = TokenFile(args.tokens_file)
        except TokensUnreadable as exc:
            raise UsageError(str(exc)) from None
    tls = _tls(args.tls_cert, args.tls_key)
    shutdown_budget = _shutdown_budget(args)

    lease = _lease(args.publish_timeout)
    if not args.no_idempotency and timedelta(hours=args.idempotency_hours) < lease:
        raise UsageError(
            f"--idempotency-hours {args.idempotency_hours} is shorter than a claim's lease with --publish-timeout "
            f"{args.publish_timeout:g} ({lease.total_seconds():g} s): a key could expire while its request may still "
            f"commit; give more hours or a shorter --publish-timeout"
        )
    store = None
    if not args.no_idempotency:
        store = _store(settings, lease, args.idempotency_hours)

    receipts = None
    if store is not None:
        from skillstats.ingest.receipts import Receipts

        receipts = Receipts(settings, store.ttl)
    instance = args.instance_id or f"{socket.gethostname()}-{args.port}"
    publisher = TransactionalPublisher(
        settings, f"skillstats-ingest-{instance}", args.publish_timeout, receipts=receipts, start=False
    )
    limits = Limits(args.max_body_bytes, args.max_events, args.read_timeout)
    ingest = IngestApp(publisher, tokens, store, limits)
    watchdog = ShutdownWatchdog(
        "ingest",
        shutdown_budget,
        "Requests not yet answered are not counted unless their transaction committed; their clients send them "
        "again (with an Idempotency-Key, published once).",
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, lambda: (watchdog.start(), stop.set()))
        purging = asyncio.create_task(_purge_expired(store)) if store is not None else None
        failed: list[BaseException] = []
        checking: list[asyncio.Task[None]] = []

        async def check_then_publish() -> None:
            try:
                await asyncio.to_thread(_check_kafka_at_start, settings, args.publish_timeout)
            except Exception as exc:  # a setting Kafka refuses: said in one line, exit 2 (or 1), as before
                failed.append(exc)
                await asyncio.to_thread(publisher.close, 0.5)  # whatever waits is answered 503 now
                stop.set()
                return
            publisher.start()

        def listening(port: int) -> None:
            scheme = "https" if tls else "http"
            auth = f"{len(tokens)} token(s) from {tokens.path}" if tokens else "no auth (loopback only)"
            keys = (
                f"Idempotency-Keys in {redact_url(settings.database_url)} for {args.idempotency_hours}h"
                if store
                else "no Idempotency-Keys"
            )
            print(
                f"skillstats ingest: {scheme}://{host}:{port}/v1/events -> {settings.topic} on "
                f"{settings.kafka_bootstrap} (transactional id {publisher.transactional_id}); {auth}; {keys}",
                flush=True,
            )
            checking.append(asyncio.create_task(check_then_publish()))

        try:
            await serve_until(ingest, host, args.port, tls, shutdown_budget, stop.wait, listening)
        finally:
            if purging is not None:
                purging.cancel()
            if receipts is not None:
                receipts.close()
        if failed:
            raise failed[0]

    try:
        asyncio.run(main())
    except OSError as exc:
        if exc.errno is None:
            raise
        raise UsageError(f"cannot listen on {host}:{args.port}: {exc.strerror}; choose another --port") from None
    print("skillstats ingest: stopped", flush=True)
    return EXIT_OK


def _tls(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise UsageError("--tls-cert and --tls-key go together")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise UsageError(f"cannot load the TLS certificate {cert} and key {key}: {exc}") from None
    return context


def _lease(publish_timeout: float) -> timedelta:
    """A claim's lease after its last renewal: outlasts any transaction of the claim's request, the queue
    (publish timeout), then Kafka's transaction timeout (publish timeout + 10 s), and a margin for the broker's
    abort of a timed-out transaction and for clocks (skillstats/ingest/idempotency.py)."""
    return timedelta(seconds=2 * publish_timeout + 10 + 30)


def _shutdown_budget(args: argparse.Namespace) -> float:
    """Ingest's own budget: a request that began just before SIGTERM may take its read and its publish
    timeouts, and a budget that cannot wait that long would cut off requests whose events may already be
    published. So its default is that least, and a smaller one is refused, saying what to set."""
    least = args.read_timeout + args.publish_timeout + DRAIN_RESERVE_S
    if args.shutdown_budget is None:
        shared = os.environ.get("SKILLSTATS_SHUTDOWN_BUDGET")
        if shared:
            log.info(
                "SKILLSTATS_SHUTDOWN_BUDGET=%s is the other commands'; ingest's budget is %g s "
                "(--shutdown-budget, SKILLSTATS_INGEST_SHUTDOWN_BUDGET)",
                shared,
                least,
            )
        return budget(least)
    shutdown_budget = budget(args.shutdown_budget)
    if shutdown_budget < least:
        raise UsageError(
            f"--shutdown-budget (SKILLSTATS_INGEST_SHUTDOWN_BUDGET) {shutdown_budget:g} is less than --read-timeout "
            f"+ --publish-timeout + {DRAIN_RESERVE_S:g} = {least:g} s: a request in flight could be cut off after it "
            f"was published; set {least:g} or more"
        )
    return shutdown_budget


def _check_kafka_at_start(settings: Settings, publish_timeout: float) -> None:
    """What Kafka is asked before the publisher starts (the server listening meanwhile): KafkaRefused at once
    when it refuses our credentials or TLS, UsageError for a publish timeout over its transaction limit. Kafka
    away is no error: said once, as soon as librdkafka knows no broker answers (a refused connection: within a
    second) or after FIRST_ANSWER_S; requests are answered 503 until it answers."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient

    from skillstats.kafka import RefusalWatch

    refusals = RefusalWatch()
    away: list[str] = []

    def on_error(error: KafkaError) -> None:
        refusals(error)
        if error.code() == KafkaError._ALL_BROKERS_DOWN:
            away.append(error.str())

    admin = AdminClient(settings.kafka_config(error_cb=on_error))
    deadline = time.monotonic() + FIRST_ANSWER_S
    while True:
        try:
            admin.list_topics(timeout=max(0.1, min(0.5, deadline - time.monotonic())))
            answered = True
            break
        except KafkaException as exc:
            admin.poll(0)  # serves error_cb
            refusals.raise_if_refused(settings)
            if away or time.monotonic() >= deadline:
                log.warning(
                    "Kafka at %s does not answer (%s); serving anyway: /readyz says so, and requests are answered "
                    "503 until it answers",
                    settings.kafka_bootstrap,
                    away[0] if away else exc,
                )
                answered = False
                break
    _refuse_transaction_timeout(settings, publish_timeout, ask=answered)


def _refuse_transaction_timeout(settings: Settings, publish_timeout: float, ask: bool = True) -> None:
    from skillstats.ingest.transactions import (
        KAFKA_DEFAULT_TRANSACTION_MAX_MS,
        TRANSACTION_MARGIN_S,
        transaction_limit_ms,
        transaction_timeout_ms,
    )

    limit = transaction_limit_ms(settings, timeout=2.0) if ask else None
    said = "Kafka's transaction.max.timeout.ms is"
    if limit is None:
        limit, said = KAFKA_DEFAULT_TRANSACTION_MAX_MS, "transaction.max.timeout.ms (not readable here) is by default"
    if transaction_timeout_ms(publish_timeout) > limit:
        most = limit / 1000 - TRANSACTION_MARGIN_S
        raise UsageError(
            f"--publish-timeout {publish_timeout:g}: a request's transaction may stay open --publish-timeout + "
            f"{TRANSACTION_MARGIN_S:g} s, and {said} {limit} ms: at most {most:g} (or raise the broker's limit)"
        )


def _store(settings: Settings, lease: timedelta, hours: int) -> IdempotencyStore:
    from skillstats.ingest.idempotency import IdempotencyStore
    from skillstats.sinks.db import open_engine
    from skillstats.sinks.migrate import SchemaOutdated, require_current

    engine = open_engine(settings.database_url)
    try:
        require_current(engine)
    except SchemaOutdated as exc:
        raise UsageError(f"Idempotency-Keys live in the database: {exc} (or start with --no-idempotency)") from None
    except Exception as exc:  # away now: requests with a key get 503 until it answers
        log.warning("the database %s does not answer (%s); starting anyway", redact_url(settings.database_url), exc)
    return IdempotencyStore(engine, timedelta(hours=hours), lease)


async def _purge_expired(store: IdempotencyStore) -> None:
    while True:
        try:
            gone = await asyncio.to_thread(store.purge)
            if gone:
                log.info("forgot %d expired Idempotency-Key(s)", gone)
        except Exception as exc:
            log.debug("purging expired Idempotency-Keys failed: %s", exc)
        await asyncio.sleep(600)
