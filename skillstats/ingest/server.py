"""The HTTP server: `POST /v1/events`, and `/healthz`, `/readyz`, `/metrics` on the same port (aiohttp).

aiohttp because faust already brings it in (no new dependency), and because one
event loop serves thousands of idle keep-alive connections at no cost, while the
work of a request is short: read the body, validate it (microseconds per event),
hand the records to the publisher's thread and wait for its transaction.

A request, in order (docs/contract.md, HTTP): shutting down -> 503; the token ->
401; the media type -> 415; its size (Content-Length, then what arrives) -> 413;
the body within `--read-timeout` -> 408 (the connection is closed); an
Idempotency-Key answered before -> that answer, in flight -> 409, with another
body -> 422, left by a request whose process died -> the answer its committed
receipt holds, or (no receipt) taken over, or 503 when Kafka cannot tell yet;
the events -> 400 listing each invalid one, or 413 past `--max-events`; the
transaction -> 202 once it committed, 503 when it did not (nothing of the
request will count: send it again), 500 when its outcome is unknown. The 503
comes at the request's deadline (`--publish-timeout` after it was handed over)
at the latest, Kafka gone included, unless its commit was already asked for.
Every 4xx is logged, a line a minute per client and reason (refusals.py).

A keyed request renews its claim while it waits on its commit, from a task of
its own rather than the handler's, so that a handler cut off by the shutdown
does not stop it: only a process that stops altogether stops renewing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import ssl
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from skillstats.config import redact_url
from skillstats.ingest import DRAIN_RESERVE_S
from skillstats.ingest.body import CONTENT_TYPES, media_type, parse
from skillstats.ingest.idempotency import (
    MAX_KEY_CHARS,
    Answered,
    Claimed,
    IdempotencyStore,
    InProgress,
    Mismatch,
    Stale,
    body_digest,
)
from skillstats.ingest.receipts import Receipts, ReceiptsLost
from skillstats.ingest.refusals import RefusalLog
from skillstats.ingest.tokens import TokenFile
from skillstats.ingest.transactions import OutcomeUnknown, TransactionalPublisher, Unavailable
from skillstats.metrics import INGEST_IN_FLIGHT, IngestMetrics
from skillstats.retry import Outage

log = logging.getLogger(__name__)
RETRY_AFTER_S = 2
# How long a request waits at most for the receipts topic's id when the process does not know it yet.
TOPIC_ID_READ_S = 2.0
_KEY = re.compile(rf"[\x21-\x7e]{{1,{MAX_KEY_CHARS}}}")  # visible ASCII, as HTTP header values go


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    max_events: int = 10_000
    read_timeout: float = 10.0


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json", headers=headers)


_REFUSAL = "skillstats.refusal"  # a 4xx answer's reason, for the log (refusals.py), kept on the response


def _refused(status: int, reason: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    """A 4xx answer, with the fixed phrase the log line names it by."""
    response = _json(status, body, headers)
    response[_REFUSAL] = reason
    return response


class IngestApp:
    """The application and its state: whether it is shutting down, what Kafka and the database say."""

    def __init__(
        self,
        publisher: TransactionalPublisher,
        tokens: TokenFile | None,
        store: IdempotencyStore | None,
        limits: Limits,
    ) -> None:
        if store is not None and publisher.receipts is None:
            raise ValueError("Idempotency-Keys need a publisher that writes receipts (skillstats/ingest/receipts.py)")
        self.publisher = publisher
        self.tokens = tokens
        self.store = store
        self.receipts: Receipts | None = publisher.receipts if store is not None else None
        self.limits = limits
        self._renewing: set[asyncio.Task[None]] = set()
        self._receipt_reads = asyncio.Lock()
        self.shutting_down = False
        self.in_flight = 0
        self.metrics = IngestMetrics(publisher.queued_records)
        publisher.on_outcome = self.metrics.transaction
        self.refusals = RefusalLog(log)
        self._database = Outage(log)
        self.app = web.Application(client_max_size=limits.max_body_bytes)
        self.app.router.add_post("/v1/events", self.events)
        self.app.router.add_get("/healthz", self.healthz)
        self.app.router.add_get("/readyz", self.readyz)
        self.app.router.add_get("/metrics", self.metrics_page)

    # ------------------------------------------------------------------ probes

    def not_ready(self) -> str | None:
        if self.shutting_down:
            return "shutting down"
        return self.publisher.kafka_problem

    async def healthz(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok\n")  # the event loop answered: alive

    async def readyz(self, _request: web.Request) -> web.Response:
        problem = self.not_ready()
        return web.Response(status=200 if problem is None else 503, text=(problem or "ok") + "\n")

    async def metrics_page(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(REGISTRY), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ------------------------------------------------------------------ events

    async def events(self, request: web.Request) -> web.Response:
        began = time.monotonic()
        self.in_flight += 1
        try:
            with INGEST_IN_FLIGHT.track_inprogress():
                response, accepted, rejected = await self._events(request)
        finally:
            self.in_flight -= 1
        seconds = time.monotonic() - began if response.status == 202 else None
        self.metrics.answered(response.status, accepted, rejected, seconds)
        if 400 <= response.status < 500:
            self.refusals.refused(response.status, response.get(_REFUSAL, "refused"), self._client(request))
        return response

    def _client(self, request: web.Request) -> str:
        """Who sent a request, for the log: its peer address, and a fingerprint of its token once that token
        was found good (a wrong one is the caller's secret, or someone else's, and is not digested into logs)."""
        client = request.remote or "unknown"
        authorization = request.headers.get("Authorization")
        if self.tokens is not None and authorization is not None and self.tokens.allows(authorization):
            client += f" (token sha256:{TokenFile.scope(authorization)[:8]})"
        return client

    async def _events(self, request: web.Request) -> tuple[web.Response, int, dict[str, int]]:
        none: dict[str, int] = {}
        if self.shutting_down:
            return self._unavailable("shutting down"), 0, none
        authorization = request.headers.get("Authorization")
        if self.tokens is not None and not self.tokens.allows(authorization):
            headers = {"WWW-Authenticate": 'Bearer realm="skillstats"'}
            why = "unauthorized: no token" if authorization is None else "unauthorized: not one of the tokens"
            return _refused(401, why, {"error": "unauthorized"}, headers), 0, none
        kind = media_type(request.headers.get("Content-Type"))
        if kind is None:
            wanted = " or ".join(CONTENT_TYPES)
            message = f"Content-Type must be {wanted} (UTF-8)"
            return _refused(415, "unsupported Content-Type", {"error": message}), 0, none
        if (request.content_length or 0) > self.limits.max_body_bytes:
            return self._too_large(), 0, none
        try:
            body = await asyncio.wait_for(request.read(), self.limits.read_timeout)
        except web.HTTPRequestEntityTooLarge:
            return self._too_large(), 0, none
        except TimeoutError:
            message = f"the body did not arrive within {self.limits.read_timeout:g}s"
            slow = _refused(408, "body not received within --read-timeout", {"error": message})
            slow.force_close()  # answered, then cut off: the rest of its body is not waited for
            return slow, 0, none

        key = request.headers.get("Idempotency-Key")
        claim: Claimed | None = None
        if key is not None:
            if not _KEY.fullmatch(key):
                message = f"Idempotency-Key must be 1-{MAX_KEY_CHARS} visible ASCII characters"
                return _refused(400, "bad Idempotency-Key", {"error": message}), 0, none
            answer = await self._claim(TokenFile.scope(authorization) + ":" + key, body_digest(body))
            if isinstance(answer, web.Response):
                return answer, 0, none
            claim = answer

        now_ms = int(time.time() * 1000)
        parsed = parse(body, kind, now_ms, self.limits.max_events)
        if not parsed.ok:
            await self._release(claim)
            if parsed.too_many is not None:
                message = f"{parsed.too_many} events; at most {self.limits.max_events} a request"
                return _refused(413, "more events than --max-events", {"error": message}), 0, none
            if parsed.problem is not None:
                return _refused(400, "malformed body", {"error": parsed.problem}), 0, none
            reasons: dict[str, int] = {}
            for item in parsed.rejected:
                reasons[item.reason] = reasons.get(item.reason, 0) + 1
            message = f"{len(parsed.rejected)} invalid event(s); nothing was published"
            why = f"invalid events ({', '.join(sorted(reasons))})"  # the contract's reason codes, a fixed set
            answer = {"error": message, "rejected": [r.to_json() for r in parsed.rejected]}
            return _refused(400, why, answer), 0, reasons

        accepted = {"accepted": len(parsed.records)}
        response = orjson.dumps(accepted).decode()
        receipt = None
        if claim is not None and self.receipts is not None:
            receipt = self.receipts.record(claim, 202, response)
        published = self.publisher.submit(parsed.records, now_ms, receipt)
        if claim is not None:
            self._renew_while(claim, published)
        try:
            await self._outcome(published)
        except asyncio.CancelledError:
            if claim is not None:
                published.add_done_callback(functools.partial(self._keep_late, claim, len(parsed.records)))
            raise
        except Unavailable as exc:
            await self._release(claim)
            return self._unavailable(f"not published (nothing of it will count; send it again): {exc}"), 0, none
        except OutcomeUnknown as exc:  # the claim stays: after its lease, a retry finds its receipt or none
            return _json(500, {"error": str(exc), "outcome": "unknown"}), 0, none
        if claim is not None:
            await self._answered(claim, response)
        return _json(202, accepted), len(parsed.records), none

    # ------------------------------------------------------------------ helpers

    async def _outcome(self, published: Future[None]) -> None:
        """Wait for the publisher's answer; at the request's deadline, give up on one it has not begun.

        Shielded: a handler cancelled while waiting (the server closing past its drain) must not cancel the
        publishing, whose outcome the claim still has to keep. Bounded: a request still queued at its deadline
        (the publisher's thread busy with a transaction or a check that waits on a broker gone away) is
        cancelled, which the thread honours by never publishing it, and answered 503 then, not when the thread
        is free again. One that the thread has begun is waited for: its outcome is coming, within the deadline
        unless its commit was asked for and not yet answered.
        """
        waiting = asyncio.wrap_future(published)
        try:
            try:
                await asyncio.wait_for(asyncio.shield(waiting), self.publisher.publish_timeout)
                return
            except TimeoutError:
                if published.cancel():
                    raise Unavailable("not published within --publish-timeout (Kafka away or slow)") from None
            await asyncio.shield(waiting)
        except asyncio.CancelledError:
            if published.cancelled():  # stopped before it began: its claim was taken over (_renew_while)
                raise Unavailable("not published: another request with its Idempotency-Key took it over") from None
            raise

    def _too_large(self) -> web.Response:
        message = f"the body is over {self.limits.max_body_bytes} bytes"
        return _refused(413, "body over --max-body-bytes", {"error": message})

    def _unavailable(self, message: str) -> web.Response:
        return _json(503, {"error": message}, {"Retry-After": str(RETRY_AFTER_S)})

    async def _database_call(self, call: Callable[[], Any]) -> Any:
        try:
            result = await asyncio.to_thread(call)
        except Exception as exc:
            url = redact_url(self.store.engine.url.render_as_string(hide_password=False)) if self.store else "none"
            self._database.failed(f"the idempotency store {url}", str(exc).splitlines()[0], 0.0)
            raise
        self._database.recovered("the idempotency store answers again")
        return result

    async def _claim(self, key: str, digest: str) -> Claimed | web.Response:
        store = self.store
        if store is None:
            message = "this server keeps no Idempotency-Key (started with --no-idempotency)"
            return _refused(400, "Idempotency-Key sent to a server with --no-idempotency", {"error": message})
        receipts_topic = await self._receipts_topic_id()
        try:
            answer = await self._database_call(lambda: store.claim(key, digest, receipts_topic))
        except Exception:
            return self._unavailable("the idempotency store is unavailable; nothing was published")
        if isinstance(answer, Stale):
            return await self._take_over(store, answer)
        if isinstance(answer, Answered):
            return _replayed(answer.status, answer.response)
        if isinstance(answer, InProgress):
            message = "a request with this Idempotency-Key is in progress; ask again later"
            headers = {"Retry-After": str(answer.retry_after)}
            return _refused(409, "Idempotency-Key in flight", {"error": message}, headers)
        if isinstance(answer, Mismatch):
            message = "this Idempotency-Key was used with another body"
            return _refused(422, "Idempotency-Key used with another body", {"error": message})
        return answer

    async def _receipts_topic_id(self) -> str | None:
        """The receipts topic's id for a claim to name: read now if not known yet (a process just started, or the
        topic missing when last asked; at most once per TOPIC_ID_RETRY_S), None if it still cannot be read."""
        receipts = self.receipts
        if receipts is None:
            return None
        if receipts.known_topic_id() is None:
            await asyncio.to_thread(receipts.refresh_topic_id, TOPIC_ID_READ_S)
        return receipts.known_topic_id()

    async def _take_over(self, store: IdempotencyStore, stale: Stale) -> Claimed | web.Response:
        """A claim whose process stopped renewing it: answer from its committed receipt, or take it over."""
        receipts = self.receipts
        assert receipts is not None
        deadline = time.monotonic() + self.publisher.publish_timeout
        try:
            # One read at a time in the executor (the reader serialises them anyway): take-overs waiting on an
            # open transaction must not hold every executor thread, which the database calls need.
            async with asyncio.timeout(self.publisher.publish_timeout):
                await self._receipt_reads.acquire()
            try:
                found = await asyncio.to_thread(receipts.find, stale, max(0.5, deadline - time.monotonic()))
            finally:
                self._receipt_reads.release()
        except ReceiptsLost as exc:
            log.error("Idempotency-Key left by a stopped request: nothing published again: %s", exc)
            message = (
                "whether an earlier request with this Idempotency-Key was published cannot be known (the receipts "
                "topic was deleted or created again since it was claimed); nothing was published now. Send it with "
                "a new Idempotency-Key only if it must be counted and was not"
            )
            return _refused(409, "Idempotency-Key outcome unknown", {"error": message})
        except Exception as exc:
            log.warning("Idempotency-Key left by a stopped request: its receipt cannot be looked up: %s", exc)
            message = "cannot tell yet whether an earlier request with this Idempotency-Key was published; nothing was"
            return self._unavailable(message + " published: send it again")
        if found is not None:
            log.info("Idempotency-Key left by a stopped request: answered from the receipt its transaction committed")
            try:
                await self._database_call(lambda: store.settle(stale, found.status, found.response))
            except Exception:  # the answer stands (its transaction committed); the next retry reads it again
                log.warning("the answer of a committed receipt could not be kept for its Idempotency-Key")
            return _replayed(found.status, found.response)
        try:
            receipts_topic = await self._receipts_topic_id()
            taken = await self._database_call(lambda: store.take_over(stale, receipts_topic))
        except Exception:
            return self._unavailable("the idempotency store is unavailable; nothing was published")
        if taken is None:
            message = "a request with this Idempotency-Key is in progress; ask again later"
            return _refused(409, "Idempotency-Key in flight", {"error": message}, {"Retry-After": "1"})
        log.info("Idempotency-Key left by a stopped request: no receipt committed; published again")
        return taken

    def _renew_while(self, claim: Claimed, published: Future[None]) -> None:
        """Renew the claim's lease until its request's transaction is decided, in a task of its own."""
        store = self.store
        assert store is not None
        loop = asyncio.get_running_loop()
        decided = asyncio.Event()

        def wake(_future: Future[None]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed first: nothing left to renew from
                loop.call_soon_threadsafe(decided.set)

        async def renew() -> None:
            every = store.renew_every.total_seconds()
            while True:
                try:
                    await asyncio.wait_for(decided.wait(), every)
                    return
                except TimeoutError:
                    pass
                try:
                    mine = await self._database_call(lambda: store.renew(claim))
                except Exception:
                    continue  # said by _database_call; the next renewal may pass
                if not mine:
                    if not decided.is_set():  # answered meanwhile is no news; taken over is
                        # Another request holds the key now and may publish it: this one must not, if it can
                        # still be stopped (a submission not begun is never published; one begun goes on, and
                        # its late answer says so).
                        stopped = published.cancel()
                        log.warning(
                            "an Idempotency-Key's claim was taken over while its request waited on its commit; %s",
                            "its events were not published" if stopped else "its transaction had begun",
                        )
                    return

        task = asyncio.create_task(renew())
        self._renewing.add(task)
        task.add_done_callback(self._renewing.discard)
        published.add_done_callback(wake)

    async def _release(self, claim: Claimed | None) -> None:
        if claim is not None and self.store is not None:
            store = self.store
            # If this fails the claim's lease runs out instead: a retry meanwhile gets 409.
            with contextlib.suppress(Exception):
                await self._database_call(lambda: store.release(claim))

    async def _answered(self, claim: Claimed, response: str) -> None:
        store = self.store
        assert store is not None
        try:
            kept = await self._database_call(lambda: store.answered(claim, 202, response))
        except Exception:
            # Published, and answered 202; a retry after the lease is answered from its receipt.
            log.warning("published, but the answer could not be kept for its Idempotency-Key (its receipt can)")
            return
        _said(kept)

    def _keep_late(self, claim: Claimed, accepted: int, published: Future[None]) -> None:
        """In the publisher's thread, for a request cut off before its answer: keep or release its claim, so a
        retry is answered as this request would have been."""
        store = self.store
        if store is None or published.cancelled():
            return
        try:
            if published.exception() is None:
                _said(store.answered(claim, 202, orjson.dumps({"accepted": accepted}).decode()))
            elif isinstance(published.exception(), Unavailable):
                store.release(claim)
        except Exception as exc:  # the lease decides instead
            log.warning("the outcome of a request cut off by the shutdown could not be kept: %s", exc)


def _replayed(status: int, response: str) -> web.Response:
    return web.Response(
        status=status, body=response.encode(), content_type="application/json", headers={"Idempotent-Replayed": "true"}
    )


def _said(kept: str) -> None:
    """Log what became of a committed request's answer when it was not simply its own claim's."""
    if kept == "late":
        log.error(
            "committed after this request's Idempotency-Key was taken over by another request (this process could "
            "not renew its claim for a whole lease): its events may be counted twice; its answer is kept "
            "(docs/contract.md, idempotency)"
        )
    elif kept == "answered":
        log.warning(
            "committed, but the Idempotency-Key had an answer already (from this request's receipt, or "
            "another request's publishing)"
        )
    elif kept == "lost":
        log.error("committed, but the answer could not be kept: the Idempotency-Key expired and was used again")


async def serve_until(
    ingest: IngestApp,
    host: str,
    port: int,
    tls: ssl.SSLContext | None,
    budget: float,
    stopped: Callable[[], Awaitable[None]],
    listening: Callable[[int], None],
) -> None:
    """Serve until `stopped` returns; then stop accepting, finish in-flight requests within `budget`, flush."""
    runner = web.AppRunner(ingest.app, shutdown_timeout=DRAIN_RESERVE_S / 2, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=tls)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    listening(runner.addresses[0][1] if runner.addresses else port)
    await stopped()
    # Draining first, with the listener still open: /readyz and every new request answer 503 (Retry-After),
    # while the requests in flight finish, their bodies included. aiohttp's own graceful shutdown stops
    # reading from a connection at once, so a request whose body was still arriving would be lost to it.
    ingest.shutting_down = True
    began = time.monotonic()
    drain_until = began + max(0.5, budget - DRAIN_RESERVE_S)
    while ingest.in_flight and time.monotonic() < drain_until:
        await asyncio.sleep(0.05)
    await runner.cleanup()  # closes the listener and the (now idle) connections
    await asyncio.to_thread(ingest.publisher.close, max(0.5, budget - (time.monotonic() - began)))
