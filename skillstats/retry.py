"""Capped exponential backoff, the one retry policy for databases and brokers alike."""

from __future__ import annotations

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
