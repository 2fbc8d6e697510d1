"""Additive upserts, the one way counters reach SQL, and the time values the schema stores."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Table
from sqlalchemy.dialects import postgresql, sqlite

_EPOCH = datetime(1970, 1, 1)
# Rows per multi-row upsert statement: well under SQLite's 32766 bound variables.
_UPSERT_CHUNK = 2000


def utc_naive(ms: int) -> datetime:
    """Event-time milliseconds as the naive-UTC datetime the schema stores."""
    return _EPOCH + timedelta(milliseconds=ms)


def now_utc_naive() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def upsert_adding(
    connection: Connection,
    table: Table,
    keys: Sequence[str],
    counters: Sequence[str],
    rows: list[tuple[Any, ...]],
    touched: str,
    now: datetime,
) -> None:
    """INSERT ... ON CONFLICT DO UPDATE adding `counters`; each row is its key values, then its counts.

    Rows are written in key order: two transactions touching overlapping rows then
    lock them in the same order and cannot deadlock each other. Keys must be unique
    within `rows` (they are: rows come out of a fold).
    """
    if not rows:
        return
    rows.sort()
    if connection.dialect.name == "postgresql":
        # One statement over arrays: no bound-parameter limit, one round trip, and the
        # server does the row-by-row work (executemany of VALUES lists measured ~2x slower).
        columns = list(zip(*rows, strict=True))
        parameters = {f"c{i}": list(column) for i, column in enumerate(columns)}
        connection.exec_driver_sql(
            _pg_unnest_upsert(table, tuple(keys), tuple(counters), touched), {**parameters, "touched": now}
        )
        return
    statement = sqlite.insert(table)
    statement = statement.on_conflict_do_update(
        index_elements=list(keys),
        set_={
            **{name: table.c[name] + statement.excluded[name] for name in counters},
            touched: statement.excluded[touched],
        },
    )
    names = [*keys, *counters]
    dicts = [{**dict(zip(names, row, strict=True)), touched: now} for row in rows]
    for start in range(0, len(dicts), _UPSERT_CHUNK):
        connection.execute(statement, dicts[start : start + _UPSERT_CHUNK])


@functools.cache
def _pg_unnest_upsert(table: Table, keys: tuple[str, ...], counters: tuple[str, ...], touched: str) -> str:
    dialect = postgresql.dialect()
    names = [*keys, *counters]
    arrays = ", ".join(f"%(c{i})s::{table.c[name].type.compile(dialect=dialect)}[]" for i, name in enumerate(names))
    updates = ", ".join(f"{name} = {table.name}.{name} + EXCLUDED.{name}" for name in counters)
    return (
        f"INSERT INTO {table.name} ({', '.join(names)}, {touched}) "
        f"SELECT {', '.join(f'u.{n}' for n in names)}, %(touched)s FROM unnest({arrays}) AS u({', '.join(names)}) "
        f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {updates}, {touched} = EXCLUDED.{touched}"
    )
