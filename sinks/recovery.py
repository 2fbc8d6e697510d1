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

import gc
import logging
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy.exc import DBAPIError, StatementError

from skillstats.retry import Backoff
from skillstats.sinks.batch import (
    ApplyOutcome,
    ConsumedRecord,
    FencedSink,
    PartitionBatch,
    Prepared,
    by_partition,
    canonical,
    split_in_two,
)
from skillstats.sinks.fences import DlqMark
from skillstats.sinks.identity import IdentityMismatch

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
    # psycopg as already loaded: an error of its classes exists only once it is, and not importing it saves a
    # worker on SQLite 0.1-0.2 CPU seconds of start-up.
    psycopg = sys.modules.get("psycopg")
    if psycopg is not None and isinstance(cause, psycopg.Error):
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
    target: str = "the database"  # what is failing, as the log names it (a masked URL)

    @property
    def degraded(self) -> bool:
        return self.degraded_since is not None

    def failing(self, exc: BaseException) -> None:
        self.retries += 1
        self.last_error = describe(exc)
        if self.degraded_since is None:
            self.degraded_since = time.monotonic()
            log.error(
                "degraded: %s is failing (%s); retrying with backoff, nothing is parked", self.target, self.last_error
            )

    def ok(self) -> None:
        if self.degraded_since is not None:
            log.warning(
                "recovered: %s answers again after %.1fs degraded (%d retries)",
                self.target,
                time.monotonic() - self.degraded_since,
                self.retries,
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
            log.debug("%s failed, retry %d: %s", what, attempt + 1, describe(exc))  # Health says it once
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
    range, applied in that order, so each fence still moves only over what is in SQL
    (sinks/batch.py, split_in_two). `records` as ConsumedRecords: each partition's
    read is taken to start at its lowest offset (by_partition).

    `NotOwned` raised by `park_rejected` (the partition was revoked meanwhile) ends
    the batch there: what was applied stays, the rest is left to the next owner.
    """
    backoff = backoff or Backoff()
    health = health or Health()
    outcome = ApplyOutcome()
    first: Sequence[PartitionBatch] | Prepared = records if isinstance(records, Prepared) else by_partition(records)
    # (a chunk, the records in it the database refused and that were parked)
    pending: list[tuple[Sequence[PartitionBatch] | Prepared, tuple[tuple[int, int], ...]]] = [(first, ())]
    marks = dlq_marks
    attempt = 0
    while pending:
        chunk, refused = pending.pop()
        try:
            outcome.merge(sink.apply(chunk, marks, rejected=refused))
            marks = None
            attempt = 0
            health.ok()
            continue
        except IdentityMismatch:
            raise  # not this batch's fault, and no retry cures it: the worker stops (exit 2)
        except Exception as exc:
            parts = canonical(chunk.parts if isinstance(chunk, Prepared) else chunk)
            size = sum(len(part.offsets) for part in parts)
            isolatable = is_data_error(exc) and any(e is not None for part in parts for e in part.events)
            if not isolatable:
                if max_transient_retries is not None and attempt >= max_transient_retries:
                    raise
                health.failing(exc)
                # Health logs the outage once (and its end); each retry only at debug level.
                log.debug("database error, retry %d of a batch of %d: %s", attempt + 1, size, describe(exc))
                outcome.retries += 1
                pending.append((chunk, refused))
                # A failed statement leaves its parameters (the batch's rows) in a reference cycle through
                # the exception's traceback, which only the cyclic collector frees; the windows worker runs
                # it rarely (streams/windows.py), so each retry collects what the previous ones left.
                gc.collect()
                if backoff.sleep(attempt, stop):
                    raise Abandoned("shutdown while retrying a batch") from exc
                attempt += 1
                continue
            health.ok()
            # The batch's DLQ marks assume its fences reach the batch end; a half may
            # not, so they are not stored (the lower marks already stored stay: safe).
            marks = None
            if size == 1:
                (part,) = [part for part in parts if part.offsets]
                record = ConsumedRecord(part.partition, part.offsets[0], part.events[0])
                log.error(
                    "database rejected %s partition %d offset %d: %s",
                    sink.topic,
                    record.partition,
                    record.offset,
                    describe(exc),
                )
                try:
                    parked_marks = park_rejected(record, exc)
                except NotOwned as lost:
                    log.info("%s; %d chunk(s) of the batch left to the next owner", lost, len(pending))
                    return outcome
                outcome.parked += 1
                # The same chunk, the record now counting nothing: the fence moves past it, and the
                # transaction that moves it records the record as refused (skipped, not counted).
                pending.append(
                    (
                        [
                            PartitionBatch(p.partition, p.offsets, [None] * len(p.offsets), p.since, p.until)
                            for p in parts
                        ],
                        (*refused, (record.partition, record.offset)),
                    )
                )
                if parked_marks:
                    marks = {**(marks or {}), **parked_marks}
                continue
            lower, upper = split_in_two(parts)
            pending.append((upper, refused))
            pending.append((lower, refused))
    return outcome


class NotOwned(Exception):
    """The partition a record must be parked for was revoked: parking it now could park it twice.

    Not a RuntimeError: the DLQ's retry loop retries those, and this one must end it."""
