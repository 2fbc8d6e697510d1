"""Engines for the two supported databases, tuned for a single fenced writer per partition."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

CONNECT_TIMEOUT_S = 10
STATEMENT_TIMEOUT_S = 120
LOCK_TIMEOUT_S = 60

# Said after every database URL that cannot work, so the fix is named where the problem is.
_URL_FORMS = (
    "check SKILLSTATS_DATABASE_URL (--database-url): postgresql://user:pass@host/db, or sqlite:////abs/path.db "
    "(four slashes; sqlite:///relative/path.db is relative to the current directory)"
)


class DatabaseUrlError(ValueError):
    """A database URL that cannot work as written: a setting to fix, never worth retrying (the CLI exits 2).

    A ValueError, so the callers that stop at a URL that cannot be (skillstats/startup.py) keep stopping."""


def open_engine(url: str, *, lock_timeout_s: float = LOCK_TIMEOUT_S, **kwargs: Any) -> Engine:
    """An engine for `url`; `postgresql://` means psycopg 3, `sqlite:///path` a local file.

    Connects to nothing (so creates no SQLite file): a URL that cannot work (unparsable, another database, a
    SQLite path in a directory that does not exist or naming a directory) is DatabaseUrlError here, at once."""
    parsed = parse_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() == "sqlite":
        path = sqlite_path(url)
        if path is not None and not path.parent.is_dir():
            raise DatabaseUrlError(
                f"cannot open the SQLite database {path}: the directory {path.parent} does not exist; {_URL_FORMS}"
            )
        if path is not None and path.is_dir():
            raise DatabaseUrlError(f"cannot open the SQLite database {path}: it is a directory; {_URL_FORMS}")
        return _sqlite_engine(parsed, lock_timeout_s, **kwargs)
    if parsed.get_backend_name() != "postgresql":
        raise DatabaseUrlError(f"unsupported database {parsed.get_backend_name()!r}; {_URL_FORMS}")
    # Bounded waits, so a hung database becomes an error the retry loop sees (and the
    # worker reports degraded) instead of a thread stuck for ever: connecting, any
    # one statement, and waiting for a row lock another worker holds.
    connect_args = {
        "connect_timeout": CONNECT_TIMEOUT_S,
        "options": f"-c statement_timeout={STATEMENT_TIMEOUT_S * 1000} -c lock_timeout={int(lock_timeout_s * 1000)}",
    }
    return create_engine(parsed, pool_pre_ping=True, connect_args=connect_args, **kwargs)


def parse_url(url: str) -> URL:
    """`url` parsed; DatabaseUrlError (without the URL, which may hold a password) when it is not a URL."""
    try:
        return make_url(url)
    except ArgumentError:
        raise DatabaseUrlError(f"the database URL is not a URL; {_URL_FORMS}") from None


def sqlite_path(url: str) -> Path | None:
    """The absolute file a sqlite:/// URL names (None for another database or an in-memory one)."""
    parsed = parse_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return None
    return Path(parsed.database).resolve()


PAGE_SIZE = 16384  # bytes per page of a SQLite file skillstats creates
CHECKPOINT_BYTES = 40 * 1024 * 1024  # WAL written between automatic checkpoints


def _sqlite_engine(url: Any, lock_timeout_s: float, **kwargs: Any) -> Engine:
    engine = create_engine(url, connect_args={"timeout": lock_timeout_s}, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's begin() decide when a transaction starts (pysqlite's own
        # implicit BEGIN would be DEFERRED, see below).
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        # 16 KiB pages rather than SQLite's 4: a backfill's batch dirties pages all over the windows tables, and
        # each commit writes every page it touched to the WAL; fewer, fuller pages cut that work (with the tables
        # WITHOUT ROWID, 10-12% of a worker's CPU on a backfill: docs/performance.md). Only a file not yet
        # written takes it, so it must come before WAL; an existing file keeps the size it was made with.
        cursor.execute(f"PRAGMA page_size={PAGE_SIZE}")
        # WAL lets `status` and tests read while a worker writes; NORMAL sync keeps
        # commits durable across a process kill (only an OS crash can lose the tail).
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        # A checkpoint every 40 MiB of WAL pages (a WAL file of that size kept on disk) rather than SQLite's
        # 1,000 pages: a page rewritten by several commits in between is copied into the database once, not
        # once per checkpoint. On a backfill, where a batch touches pages all over both tables, that halved the
        # CPU of the commits (docs/performance.md). Counted in pages of the file's own size.
        page_size = cursor.execute("PRAGMA page_size").fetchone()[0]
        cursor.execute(f"PRAGMA wal_autocheckpoint={CHECKPOINT_BYTES // page_size}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        # DEFERRED, so readers (`status`, the DLQ marks, tests) never queue behind a
        # worker's write lock. Writers stay serialized: every writing transaction
        # starts with a write (the fence rows' INSERT ... ON CONFLICT DO NOTHING, in
        # PartitionFences.lock), which takes SQLite's write lock before any fence is
        # read, so two writers can never both read one fence and both apply past it.
        connection.exec_driver_sql("BEGIN")

    return engine


@contextmanager
def connected(source: Connection | Engine) -> Iterator[Connection]:
    """A connection to read with: `source` itself (inside its transaction), or a new one of the engine `source` is,
    closed after. For the reads that run both on their own and inside a caller's transaction."""
    if isinstance(source, Engine):
        with source.connect() as connection:
            yield connection
    else:
        yield source
