"""The log of requests answered 4xx: one line per client and reason, at most once a minute each.

Why: a publisher whose requests are refused (a token not rotated in, events
that fail validation, batches over the limits) loses those events for good,
since a client that follows the API does not send a 4xx again. The metrics say
how many (`skillstats_ingest_requests_total` by status), not who: the log line
names the client (the peer's address and, once authorised, a fingerprint of
its token: the first 8 hex digits of the token's SHA-256, never the token) and
the reason (the status and a fixed reason word; never the request's content,
which is the caller's and could forge log lines).

What it costs and how it is bounded: a client failing every request is one
line a minute per reason, saying how many more there were since its last line;
across all clients at most `most` lines a minute, the rest summed in one line
when the next minute's first line is written; at most `keys` (client, reason)
pairs remembered, the least recently refused forgotten first. A scan from many
addresses therefore costs at most `most` lines a minute and a bounded dict.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Seen:
    logged_at: float
    since: int = 0  # refusals not logged since `logged_at`


class RefusalLog:
    """Logs `refused(...)` calls, rate-limited per (client, status, reason) and overall."""

    def __init__(
        self,
        log: logging.Logger,
        every: float = 60.0,
        most: int = 30,
        keys: int = 1000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.every = every
        self.most = most
        self.keys = keys
        self.clock = clock
        self._seen: OrderedDict[tuple[str, int, str], _Seen] = OrderedDict()
        self._window = clock()
        self._lines = 0  # lines written in the current window
        self._dropped = 0  # refusals of the previous windows no line was written for, over `most`

    def refused(self, status: int, reason: str, client: str) -> None:
        """`reason` is a fixed phrase of the server's (never the request's text); `client` who sent it."""
        now = self.clock()
        key = (client, status, reason)
        seen = self._seen.get(key)
        if seen is not None:
            self._seen.move_to_end(key)
            if now - seen.logged_at < self.every:
                seen.since += 1
                return
        if now - self._window >= self.every:
            self._window, self._lines = now, 0
            if self._dropped:
                self.log.warning(
                    "refused %d more request(s) not logged one by one (over %d lines a minute; "
                    "skillstats_ingest_requests_total counts them all)",
                    self._dropped,
                    self.most,
                )
                self._dropped, self._lines = 0, 1
        if self._lines >= self.most:
            self._dropped += 1 + (seen.since if seen is not None else 0)
            if seen is not None:
                seen.since = 0
            return
        self._lines += 1
        more = ""
        if seen is not None and seen.since:
            more = f"; and {seen.since} more like it since its last line {now - seen.logged_at:.0f} s ago"
        # 409 is the API working (a retry while its first attempt is in flight): said at INFO.
        self.log.log(
            logging.INFO if status == 409 else logging.WARNING,
            "refused a request from %s: %d %s%s",
            client,
            status,
            reason,
            more,
        )
        self._seen[key] = _Seen(now)
        self._seen.move_to_end(key)
        while len(self._seen) > self.keys:
            self._seen.popitem(last=False)
