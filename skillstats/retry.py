"""Capped exponential backoff, the one retry policy for databases and brokers alike."""

from __future__ import annotations

import logging
import random
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """0.2 s, 0.4 s, 0.8 s ... capped at `cap`, each with up to 50% jitter so that
    workers that failed together do not all retry in the same instant."""

    base: float = 0.2
    cap: float = 30.0

    def delay(self, attempt: int) -> float:
        return min(self.cap, self.base * 2**attempt) * random.uniform(0.5, 1.0)

    def sleep(self, attempt: int, stop: threading.Event | None = None) -> bool:
        """Wait before retry `attempt`; True when `stop` was set meanwhile (give up)."""
        return (stop or threading.Event()).wait(self.delay(attempt))


@dataclass
class Outage:
    """How a dependency's failure and recovery are logged: once each, not once per retry.

    The first failure of a streak at WARNING, saying what is failing (with a masked
    target) and why; a reminder at INFO on the 2nd, 4th, 8th ... attempt, so a long
    outage stays visible in the log (with -v) without filling it; one line when it
    works again, at WARNING like the failure, so a process logging only warnings (the
    default) shows both ends. A different failure (another target, another reason)
    is said at once.
    """

    log: logging.Logger
    attempts: int = 0
    said: str | None = None

    def failed(self, what: str, problem: str, retry_in: float) -> None:
        """`what` names the dependency and target ("waiting for Kafka at host:9092"), `problem` the cause."""
        self.attempts += 1
        if self.said != f"{what}: {problem}":
            self.said = f"{what}: {problem}"
            self.log.warning("%s: %s (attempt %d, again in %.1fs)", what, problem, self.attempts, retry_in)
        elif self.attempts & (self.attempts - 1) == 0:
            self.log.info("%s: %s (still, after %d attempts)", what, problem, self.attempts)

    def recovered(self, message: str) -> None:
        """`message` (at WARNING) if this was failing; either way the streak is over."""
        if self.said is not None:
            self.log.warning("%s (after %d attempt(s))", message, self.attempts + 1)
        self.attempts, self.said = 0, None
