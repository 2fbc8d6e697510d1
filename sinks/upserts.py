"""Additive upserts, the one way counters reach SQL, and the time values the schema stores."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from datetime import UTC, date, datetime, timedelta
from typing import Any

from sqlalchemy import Column, Connection, Table, bindparam, func, update
from sqlalchemy.dialects import postgresql

_EPOCH = datetime(1970, 1, 1)


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
    ordered: bool = False,
    rendered: bool = False,
) -> None:
    """INSERT ... ON CONFLICT DO UPDATE adding `counters`; each row is its key values, then its counts.

    Rows are written in key order: two transactions touching overlapping rows then
    lock them in the same order and cannot deadlock each other. They are sorted
    here unless the caller says they are `ordered` already (the windows sink sorts
    them while their bucket starts are still ints). Keys must be unique within
    `rows` (they are: rows come out of a fold). With `rendered`, on SQLite, the
    rows' values are already as the driver takes them (each key column's value
    through `renderer`, as the windows sink's fold makes them there) and are bound
    as they come; PostgreSQL ignores it.
    """
    if not rows:
        return
    if not ordered:
        rows.sort()
    if connection.dialect.name == "postgresql":
        # One statement over arrays: no bound-parameter limit, one round trip, and the
        # server does the row-by-row work (executemany of VALUES lists measured ~2x slower).
        # Each array goes as its text literal, built with a few string joins: psycopg's
        # list dumper walks the elements in Python and was a fifth of the worker's CPU
        # on a backfill. A column it cannot spell (a text holding NUL) goes as a list,
        # for psycopg to refuse as it always did.
        columns = list(zip(*rows, strict=True))
        parameters = {f"c{i}": _pg_array_literal(column) or list(column) for i, column in enumerate(columns)}
        connection.exec_driver_sql(
            _pg_unnest_upsert(table, tuple(keys), tuple(counters), touched), {**parameters, "touched": now}
        )
        return
    # SQLite: one prepared statement run by the driver's executemany, SQLITE_ROWS_PER_STATEMENT rows a step.
    # Through SQLAlchemy's compiled insert, every row became a dict and every datetime
    # went through the dialect's bind processor: a third of the worker's CPU on a
    # backfill. The processors still render the values (so stored text is exactly what
    # SQLAlchemy would store, and conflicts match), but once per distinct value.
    touched_value = renderer(table.c[touched], connection.dialect)(now)
    upsert = functools.partial(_sqlite_upsert, table, tuple(keys), tuple(counters), touched)
    if rendered and isinstance(touched_value, str):
        # The rows bound as they come and the touched time written into the statement (new
        # statement texts per batch, each prepared once): no Python object per row. Taking
        # the rows apart and building them again around a bound touched time (below) cost
        # about 0.34 µs a row: 0.15 CPU s per million events of the bench's SQLite backfill
        # (docs/performance.md, "The windows rows bound as they come").
        literal = "'" + touched_value.replace("'", "''") + "'"
        _sqlite_run(connection, functools.partial(upsert, literal), rows)
        return
    names = [*keys, *counters]
    columns: list[Sequence[Any]] = list(zip(*rows, strict=True))
    for index, name in enumerate(names):
        process = None if rendered else _bind_processor(table.c[name].type, connection.dialect)
        if process is not None:
            # Once per distinct value (key columns repeat a few values), then a C-level map.
            spelled = {value: process(value) for value in set(columns[index])}
            columns[index] = list(map(spelled.__getitem__, columns[index]))
    # strict=False: the repeat is endless, the columns (all of one length) decide.
    bound = list(zip(*columns, itertools.repeat(touched_value), strict=False))
    _sqlite_run(connection, functools.partial(upsert, "?"), bound)


def add_to_existing(
    connection: Connection,
    table: Table,
    key: str,
    counters: Sequence[str],
    rows: list[tuple[Any, ...]],
    touched: str,
    now: datetime,
) -> None:
    """UPDATE adding `counters` to the rows of `table` whose `key` is each row's first value, then its counts;
    a key with no row is left alone (nothing inserted: the table is someone else's, docs/contract.md). A NULL
    counter counts from 0: a table created by its owner may have left a column without a default, and NULL + 1
    would lose the count.

    PostgreSQL: the rows are locked in key order by one SELECT ... FOR NO KEY UPDATE (two writers that lock this
    way cannot deadlock each other over these rows), then added by one UPDATE joined to the columns as arrays,
    each spelled as its text literal (`_pg_array_literal`). NO KEY UPDATE is the lock the UPDATE itself takes: a
    plain FOR UPDATE would also block the owner's inserts of rows referencing these keys (a foreign key's KEY
    SHARE), and deadlock with them, where the UPDATE alone never did. A statement per row (psycopg's
    executemany, SQLAlchemy building a parameter dict per row) cost 0.3 CPU s per 20,000 rows in the client, a
    drain's largest cost after its records. SQLite (one writer at a time, its statements run in the process): one
    UPDATE per row, in key order, as before. Keys must be unique (refused otherwise): PostgreSQL's UPDATE ... FROM
    would add only one of a key's rows."""
    if not rows:
        return
    if len({row[0] for row in rows}) != len(rows):
        raise ValueError("add_to_existing: a key is given more than once")
    if connection.dialect.name == "postgresql":
        columns = list(zip(*rows, strict=True))
        parameters = {f"c{i}": _pg_array_literal(column) or list(column) for i, column in enumerate(columns)}
        locking, adding = _pg_unnest_update(table, key, tuple(counters), touched)
        connection.exec_driver_sql(locking, {"c0": parameters["c0"]})
        connection.exec_driver_sql(adding, {**parameters, "touched": now})
        return
    rows = sorted(rows)
    statement = (
        update(table)
        .where(table.c[key] == bindparam("k0"))
        .values(
            {
                **{name: func.coalesce(table.c[name], 0) + bindparam(f"k{i + 1}") for i, name in enumerate(counters)},
                touched: now,
            }
        )
    )
    connection.execute(statement, [{f"k{i}": value for i, value in enumerate(row)} for row in rows])


def renderer(column: Column[Any], dialect: Any) -> Callable[[Any], Any]:
    """A value of `column` as `dialect`'s driver takes it: SQLAlchemy's own bind processor (the text SQLite stores
    for a datetime or date, what an upsert's conflict compares), or the value itself where the type has none."""
    process = _bind_processor(column.type, dialect)
    return process if process is not None else _as_is


def _as_is(value: Any) -> Any:
    return value


def _bind_processor(column_type: Any, dialect: Any) -> Callable[[Any], Any] | None:
    """The column type's bind processor for `dialect`; None when it has none (the driver takes the value as is)."""
    return column_type.dialect_impl(dialect).bind_processor(dialect)


# Rows per SQLite INSERT: a VALUES list of this many rows, so one statement step adds them all. Row by row, the
# driver's executemany paid a step, a reset, its own checks and the interpreter's lock given up and taken back for
# every row: about a tenth of a SQLite backfill's SQL stage (0.05-0.1 of its 1.0 CPU s per million events, the
# worker's 2.7 to 2.5-2.7), where more rows a statement gained nothing more (docs/performance.md, "The SQLite
# upserts 64 rows a statement"). Fewer where a row's values would take a statement past SQLite's oldest limit on
# bound values.
SQLITE_ROWS_PER_STATEMENT = 64
SQLITE_MAX_BOUND_VALUES = 999  # SQLITE_MAX_VARIABLE_NUMBER before SQLite 3.32


def _sqlite_run(connection: Connection, statement: Callable[[int], str], rows: Sequence[Sequence[Any]]) -> None:
    """`rows` through `statement(n)` (the upsert of n rows, its values one row after another): whole runs of
    SQLITE_ROWS_PER_STATEMENT by one executemany, what is left by one statement of its own length. Rows laid end
    to end would hide one of the wrong width (its values would shift into the next row's columns), so every row
    must have the first one's width, as row by row the driver refused any other."""
    if not rows:
        return
    widths = set(map(len, rows))
    if len(widths) != 1:
        raise ValueError(f"upsert rows of different widths: {sorted(widths)}")
    per = max(1, min(SQLITE_ROWS_PER_STATEMENT, SQLITE_MAX_BOUND_VALUES // max(1, widths.pop())))
    whole = len(rows) - len(rows) % per
    flat = itertools.chain.from_iterable
    if whole:
        runs = [tuple(flat(rows[start : start + per])) for start in range(0, whole, per)]
        connection.exec_driver_sql(statement(per), runs)
    if whole < len(rows):
        connection.exec_driver_sql(statement(len(rows) - whole), [tuple(flat(rows[whole:]))])


def _sqlite_upsert(
    table: Table, keys: tuple[str, ...], counters: tuple[str, ...], touched: str, touched_sql: str, rows: int = 1
) -> str:
    """The upsert of `rows` rows, `touched_sql` (a placeholder or a quoted literal) the touched column's value.
    Keys are unique within a statement's rows (a row's conflict with one of the same statement would add to
    it, which is still right, but nothing hands such rows)."""
    names = [*keys, *counters]
    updates = ", ".join(f"{name} = {table.name}.{name} + excluded.{name}" for name in counters)
    row = f"({', '.join('?' for _ in names)}, {touched_sql})"
    return (
        f"INSERT INTO {table.name} ({', '.join(names)}, {touched}) "
        f"VALUES {', '.join(itertools.repeat(row, rows))} "
        f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {updates}, {touched} = excluded.{touched}"
    )


def _pg_array_literal(values: Sequence[Any]) -> str | None:
    """PostgreSQL's text form of a one-dimensional array of str, int, date or naive datetime values.

    None when the values cannot be spelled that way (the caller then hands psycopg
    the list, which adapts or refuses it as it always did): mixed types, a str
    holding NUL (PostgreSQL text cannot hold it either), a bool, an aware datetime.
    """
    kinds = set(map(type, values))  # one pass in C; the rows are all one type per column
    if len(kinds) != 1:
        return None
    kind = kinds.pop()
    if kind is str:
        joined = "\x00".join(values)
        if joined.count("\x00") != len(values) - 1:
            return None
        # Every element quoted; inside quotes only backslash and double quote are special.
        return '{"' + joined.replace("\\", "\\\\").replace('"', '\\"').replace("\x00", '","') + '"}'
    if kind is int:
        return "{" + ",".join(map(str, values)) + "}"
    if kind is date or kind is datetime:
        distinct = set(values)  # a batch spans a few hundred hours or days at most
        if any(getattr(value, "tzinfo", None) is not None for value in distinct):
            return None  # str() would carry an offset the timestamp column drops
        spelled = {value: str(value) for value in distinct}  # the ISO form, read whatever PostgreSQL's DateStyle
        return '{"' + '","'.join(map(spelled.__getitem__, values)) + '"}'
    return None


@functools.cache
def _pg_unnest_update(table: Table, key: str, counters: tuple[str, ...], touched: str) -> tuple[str, str]:
    """`add_to_existing`'s two statements on PostgreSQL: the rows locked in key order, then the UPDATE."""
    dialect = postgresql.dialect()
    names = [key, *counters]
    arrays = ", ".join(f"%(c{i})s::{table.c[name].type.compile(dialect=dialect)}[]" for i, name in enumerate(names))
    key_array = f"%(c0)s::{table.c[key].type.compile(dialect=dialect)}[]"
    locking = (
        f"SELECT count(*) FROM (SELECT 1 FROM {table.name} WHERE {key} = ANY({key_array}) "
        f"ORDER BY {key} FOR NO KEY UPDATE) AS locked"
    )
    updates = ", ".join(f"{name} = COALESCE({table.name}.{name}, 0) + u.{name}" for name in counters)
    adding = (
        f"UPDATE {table.name} SET {updates}, {touched} = %(touched)s "
        f"FROM unnest({arrays}) AS u({', '.join(names)}) WHERE {table.name}.{key} = u.{key}"
    )
    return locking, adding


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
