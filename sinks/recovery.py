"""What to do when the database fails a batch (docs/contract.md, failures): retry it, or isolate and park one record.

Only an error about the data itself can be cured by taking a record out: the
SQL standard's class 22 (data exception: a value out of range, a NUL byte in
text) and class 23 (integrity constraint violation), and SQLite's equivalents
(TOOBIG, CONSTRAINT, MISMATCH), plus a value the driver could not even bind.
Everything else is about the database, not the record: connection loss, a
read-only standby after failover (25006), a revoked grant (42501), a missing
table (42P01), lock timeouts, disk full. Parking records for those would empty
the stream into the DLQ while the database is sick, so they are retried with
capped, jittered exponential backoff, for ever, while the worker reports
itself degraded; it resumes by itself when the database is back.

An unknown exception is treated as transient too: it stalls the partition
(alerting through the degraded state and lag) rather than parking good records.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import psycopg
from sqlalchemy.exc import DBAPIError, StatementError

from skillstats.retry import Backoff
from skillstats.sinks.batch import ApplyOutcome, ConsumedRecord, FencedSink, Prepared, in_offset_order
from skillstats.sinks.fences import DlqMark

log = logging.getLogger(__name__)
T = TypeVar("T")

# SQLite primary result codes that reject a value: SQLITE_TOOBIG, SQLITE_CONSTRAINT, SQLITE_MISMATCH.
_SQLITE_DATA_CODES = frozenset({18, 19, 20})
_PG_DATA_CLASSES = frozenset({"22", "23"})


def is_data_error(exc: BaseException) -> bool:
    """True when the database refused the records' content (retrying as is cannot help)."""
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return False
    cause = exc.orig if isinstance(exc, StatementError) and exc.orig is not None else exc
    if isinstance(cause, psycopg.Error):
        if cause.sqlstate:
            return cause.sqlstate[:2] in _PG_DATA_CLASSES
        # Raised by psycopg itself before sending, e.g. a NUL character in a text value.
        return isinstance(cause, psycopg.DataError | psycopg.IntegrityError)
    if isinstance(cause, sqlite3.Error):
        code = getattr(cause, "sqlite_errorcode", None)
        if code is not None:
            return code & 0xFF in _SQLITE_DATA_CODES
        return isinstance(cause, sqlite3.IntegrityError | sqlite3.DataError)
    # A value the driver could not bind (an int past 64 bits, a lone surrogate in text).
    return isinstance(cause, OverflowError | UnicodeError)


def describe(exc: BaseException) -> str:
    """One line for logs: the SQLSTATE or SQLite code when there is one, and the driver's message."""
    cause = exc.orig if isinstance(exc, StatementError) and exc.orig is not None else exc
    code = getattr(cause, "sqlstate", None) or getattr(cause, "sqlite_errorname", None)
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    return f"{type(cause).__name__}{f' [{code}]' if code else ''}: {text}"


@dataclass
class Health:
    """Whether a worker is degraded (its database is failing), since when, and why.

    Thread-safe enough for what it is: one sink thread writes, anyone reads.
    """

    degraded_since: float | None = None
    last_error: str | None = None
    retries: int = 0

    @property
    def degraded(self) -> bool:
        return self.degraded_since is not None

    def failing(self, exc: BaseException) -> None:
        self.retries += 1
        self.last_error = describe(exc)
        if self.degraded_since is None:
            self.degraded_since = time.monotonic()
            log.error(
                "degraded: the database is failing (%s); retrying with backoff, nothing is parked", self.last_error
            )

    def ok(self) -> None:
        if self.degraded_since is not None:
            log.warning(
                "recovered after %.1fs degraded (%d retries)", time.monotonic() - self.degraded_since, self.retries
            )
            self.degraded_since = None


def retrying(
    action: Callable[[], T], what: str, health: Health, stop: threading.Event | None, backoff: Backoff | None = None
) -> T:
    """Run a database read until it succeeds (capped backoff, degraded meanwhile), or raise Abandoned at stop."""
    backoff = backoff or Backoff()
    attempt = 0
    while True:
        try:
            result = action()
        except Exception as exc:
            health.failing(exc)
            log.warning("%s failed, retry %d: %s", what, attempt + 1, describe(exc))
            if backoff.sleep(attempt, stop):
                raise Abandoned(f"shutdown while retrying {what}") from exc
            attempt += 1
            continue
        health.ok()
        return result


class Abandoned(RuntimeError):
    """Shutdown was requested while a batch was waiting to be retried; nothing of it is applied."""


Marks = Mapping[int, tuple[DlqMark | None, DlqMark]]
# Parks one record the database refused; returns only once it is safely parked, with
# the DLQ marks to store beside the fence that moves past it.
ParkRejected = Callable[[ConsumedRecord, BaseException], Marks | None]


def apply_with_recovery(
    sink: FencedSink,
    records: Sequence[ConsumedRecord] | Prepared,
    park_rejected: ParkRejected,
    *,
    stop: threading.Event | None = None,
    backoff: Backoff | None = None,
    max_transient_retries: int | None = None,
    health: Health | None = None,
    dlq_marks: Marks | None = None,
) -> ApplyOutcome:
    """Apply a batch so that nothing is dropped and nothing is stuck (docs/contract.md, failures).

    Errors that are not about the data are retried with capped backoff (for ever,
    unless bounded by `max_transient_retries`, or until `stop` is set). A batch with
    a data error is put in offset order and halved until the offending record is
    alone; that record is handed to `park_rejected` and the fence is moved past it.
    Halves of a batch in offset order hold, per partition, a lower and a higher
    range, applied in that order, so each fence still moves only over what is in SQL.
    """
    backoff = backoff or Backoff()
    health = health or Health()
    outcome = ApplyOutcome()
    pending: list[Sequence[ConsumedRecord] | Prepared] = [records]
    marks = dlq_marks
    attempt = 0
    while pending:
        chunk = pending.pop()
        try:
            outcome.merge(sink.apply(chunk, marks))
            marks = None
            attempt = 0
            health.ok()
            continue
        except Exception as exc:
            items = chunk.records if isinstance(chunk, Prepared) else chunk
            isolatable = is_data_error(exc) and any(r.event is not None for r in items)
            if not isolatable:
                if max_transient_retries is not None and attempt >= max_transient_retries:
                    raise
                health.failing(exc)
                log.warning("database error, retry %d of a batch of %d: %s", attempt + 1, len(items), describe(exc))
                outcome.retries += 1
                pending.append(chunk)
                if backoff.sleep(attempt, stop):
                    raise Abandoned("shutdown while retrying a batch") from exc
                attempt += 1
                continue
            health.ok()
            # The batch's DLQ marks assume its fences reach the batch end; a half may
            # not, so they are not stored (the lower marks already stored stay: safe).
            marks = None
            ordered = in_offset_order(items)
            if len(ordered) == 1:
                record = ordered[0]
                log.error(
                    "database rejected %s partition %d offset %d: %s",
                    sink.topic,
                    record.partition,
                    record.offset,
                    describe(exc),
                )
                parked_marks = park_rejected(record, exc)
                outcome.parked += 1
                pending.append([ConsumedRecord(record.partition, record.offset, None)])
                if parked_marks:
                    marks = {**(marks or {}), **parked_marks}
                continue
            middle = len(ordered) // 2
            pending.append(ordered[middle:])
            pending.append(ordered[:middle])
    return outcome
