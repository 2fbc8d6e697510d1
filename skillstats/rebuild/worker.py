"""What the windows worker does differently when it fills a rebuild's shadow tables (`windows --rebuild`).

Everything but two things is the live worker's: the group and role are the
rebuild's (fences and a claim of its own, checked in every transaction, which
also stops it once the rebuild is swapped in or dropped: sinks/rebuild.py), and
it parks nothing. An invalid record of the log was parked by the live group when
it first read it; parking it again from a rebuild would put a second parcel in
the DLQ for one record, and a replay of both would count it twice. So the
rebuild's invalid records move its fences and count nothing, as the live
group's do, and leave the DLQ alone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from skillstats.dlq import MarkUpdates


class NotParked:
    """The rebuild's DeadLetters: parks nothing, moves no DLQ mark."""

    def park(
        self,
        parcels: Sequence[Any],
        marks: Mapping[int, Any],
        batch_end: Mapping[int, int],
        stop: threading.Event | None = None,
        health: Any = None,
        owns: Callable[[int], bool] | None = None,
    ) -> MarkUpdates:
        return {}

    def close(self) -> None:
        return None
