"""Engines for the two supported databases, tuned for a single fenced writer per partition."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError


def open_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for `url`; `postgresql://` means psycopg 3, `sqlite:///path` a local file."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed, **kwargs)
    if parsed.get_backend_name() != "postgresql":
        raise ValueError(f"unsupported database {parsed.get_backend_name()!r}: use postgresql:// or sqlite:///")
    return create_engine(parsed, pool_pre_ping=True, **kwargs)


def _sqlite_engine(url: Any, **kwargs: Any) -> Engine:
    engine = create_engine(url, connect_args={"timeout": 30}, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's begin() decide when a transaction starts (pysqlite's own
        # implicit BEGIN would be DEFERRED, see below).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        # WAL lets `status` and tests read while a worker writes; NORMAL sync keeps
        # commits durable across a process kill (only an OS crash can lose the tail).
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        # IMMEDIATE takes the write lock before the fence is read, so two writers can
        # never both read the same fence and both apply the records above it.
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def is_transient(exc: BaseException) -> bool:
    """Worth retrying as is: connection loss, lock timeouts, serialization failures.

    Everything else the database raises (constraint, data, syntax errors) is a
    rejection of the batch's content, which a retry cannot fix.
    """
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return True
    return isinstance(exc, OperationalError | InterfaceError)
