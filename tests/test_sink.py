"""The fenced transactional apply and the schema, on real SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from pathlib import Path

import hypothesis
import pytest
from hypothesis import strategies as st
from sqlalchemy import inspect, select, text
from sqlalchemy.exc import OperationalError

from skillstats.contract import EPOCH_2000_MS, MAX_OCCURRED_AT_MS, StatEvent, make_event
from skillstats.retry import Backoff
from skillstats.sinks.batch import ApplyOutcome, ConsumedRecord, FencedSink
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import HEAD_REVISION, current_revision, head_revision, upgrade
from skillstats.sinks.recovery import Abandoned, apply_with_recovery
from skillstats.sinks.schema import skill_daily_stats
from skillstats.sinks.windows import WindowsSink

NOW = 1_764_460_800_000


@pytest.fixture
def sink(database_url: str) -> WindowsSink:
    engine = open_engine(database_url)
    upgrade(engine)
    return WindowsSink(engine, "g", "t")


def downloads(partition: int, offsets: range, skill: str = "sk_1") -> list[ConsumedRecord]:
    return [ConsumedRecord(partition, o, make_event(skill, "download", NOW - 1, now_ms=NOW)) for o in offsets]


def total_downloads(sink: WindowsSink) -> int:
    with sink.engine.connect() as connection:
        return connection.execute(select(skill_daily_stats.c.downloads)).scalar() or 0


def test_replayed_and_overlapping_batches_count_once(sink: WindowsSink) -> None:
    assert sink.apply(downloads(0, range(10))).applied == 10
    again = sink.apply(downloads(0, range(10)))
    assert (again.applied, again.replayed) == (0, 10)
    overlap = sink.apply(downloads(0, range(5, 15)) + downloads(1, range(3)))
    assert (overlap.applied, overlap.replayed) == (8, 5)
    assert total_downloads(sink) == 18
    assert sink.fences() == {0: 15, 1: 3}


def test_concurrent_writers_of_one_partition_count_once(sink: WindowsSink) -> None:
    # Consumers holding the same partition for a moment (a rebalance): whichever
    # commits later finds the fence moved and skips what the others applied. Each
    # batch starts at or below the fence of when it was read, as a consumer's does
    # (it resumes from a committed offset, never past the fence); a batch starting
    # above the fence would be taken as skipping absent offsets (sinks/batch.py).
    assert sink.apply(downloads(0, range(0, 200))).applied == 200
    batches = [downloads(0, range(0, 400)), downloads(0, range(200, 600)), downloads(0, range(100, 600))]
    outcomes: list[ApplyOutcome] = []
    threads = [threading.Thread(target=lambda b=b: outcomes.append(sink.apply(b))) for b in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(outcomes) == 3
    assert total_downloads(sink) == 600
    assert sum(o.applied for o in outcomes) == 400


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_rejected_record_is_isolated_and_parked(sink: WindowsSink) -> None:
    # PostgreSQL refuses NUL inside TEXT: a valid event the database cannot store.
    records = downloads(3, range(0, 40))
    poison = ConsumedRecord(3, 40, make_event("sk_\x00bad", "download", NOW - 1, now_ms=NOW))
    records += [poison, *downloads(3, range(41, 64))]
    parked: list[ConsumedRecord] = []
    outcome = apply_with_recovery(sink, records, lambda record, _exc: parked.append(record))
    assert parked == [poison]
    assert outcome.parked == 1
    assert total_downloads(sink) == 63
    assert sink.fences() == {3: 64}


class FlakySink(FencedSink):
    """A unit-test fake: fails `failures` times with a transient error, then applies nothing."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.topic = "t"

    def fold(self, events: list[StatEvent]) -> object:
        raise NotImplementedError

    def write(self, connection: object, folded: object, now: object) -> dict[str, int]:
        raise NotImplementedError

    def apply(self, records: object, dlq_marks: object = None, rejected: object = ()) -> ApplyOutcome:
        if self.failures:
            self.failures -= 1
            raise OperationalError("UPDATE ...", {}, Exception("server closed the connection unexpectedly"))
        return ApplyOutcome(applied=sum(len(part.offsets) for part in records))  # type: ignore[attr-defined]


def test_transient_errors_are_retried_with_backoff() -> None:
    outcome = apply_with_recovery(FlakySink(3), downloads(0, range(5)), _never, backoff=Backoff(base=0.001))
    assert (outcome.applied, outcome.retries) == (5, 3)


def test_shutdown_abandons_a_batch_waiting_for_retry() -> None:
    stop = threading.Event()
    stop.set()
    with pytest.raises(Abandoned):
        apply_with_recovery(FlakySink(1), downloads(0, range(5)), _never, stop=stop)


def test_bounded_retries_give_up_with_the_error() -> None:
    with pytest.raises(OperationalError):
        apply_with_recovery(
            FlakySink(5), downloads(0, range(5)), _never, backoff=Backoff(base=0.001), max_transient_retries=2
        )


def _never(record: ConsumedRecord, exc: BaseException) -> None:
    raise AssertionError(f"nothing should be parked, got {record} ({exc})")


def test_the_start_up_checks_head_is_the_newest_migration() -> None:
    # require_current compares the database with HEAD_REVISION, without Alembic: a migration added without
    # moving it would have every command refuse a database `skillstats init` has just migrated.
    assert head_revision() == HEAD_REVISION, "move HEAD_REVISION in sinks/migrate.py to the newest migration"


def test_the_start_up_check_passes_only_a_database_at_this_versions_head(database_url: str) -> None:
    from sqlalchemy import text

    from skillstats.sinks.migrate import VERSION_TABLE, SchemaOutdated, require_current

    engine = open_engine(database_url)

    def refused(*revisions: str) -> str:
        with engine.begin() as connection:
            connection.execute(text(f"DELETE FROM {VERSION_TABLE}"))
            for revision in revisions:
                connection.execute(text(f"INSERT INTO {VERSION_TABLE} (version_num) VALUES ('{revision}')"))
        with pytest.raises(SchemaOutdated) as refusal:
            require_current(engine)
        return str(refusal.value)

    try:
        with engine.connect():
            pass  # an empty database (SQLite's file created): no version table yet
        with pytest.raises(SchemaOutdated, match="at revision none"):
            require_current(engine)
        upgrade(engine)
        require_current(engine)
        assert f"at revision 0007, this skillstats needs {HEAD_REVISION}: run 'skillstats init'" in refused("0007")
        assert "at revision 9999," in refused("9999")  # migrated by a newer skillstats: not this one's tables
        assert "at revision 0009, 0010," in refused("0010", "0009")  # a version table that is not one row
        assert "at revision none," in refused()
    finally:
        engine.dispose()


def test_migrations_are_idempotent(database_url: str) -> None:
    engine = open_engine(database_url)
    assert upgrade(engine) == (None, head_revision())
    assert upgrade(engine) == (head_revision(), head_revision())
    assert current_revision(engine) == head_revision()
    tables = set(inspect(engine).get_table_names())
    assert {"skill_daily_stats", "skill_hourly_stats", "skills", "user_skill_stats"} <= tables


def test_registry_owned_skills_table_is_kept(database_url: str, tmp_path: Path) -> None:
    engine = open_engine(database_url)
    with engine.begin() as connection:
        connection.execute(
            text("CREATE TABLE skills (id TEXT PRIMARY KEY, owner_id TEXT, title TEXT, downloads BIGINT)")
        )
        connection.execute(text("INSERT INTO skills (id, owner_id, title, downloads) VALUES ('sk_1', 'u1', 'A', 41)"))
    upgrade(engine)
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO skills (id, owner_id) VALUES ('sk_2', 'u1')"))
        rows = connection.execute(
            text("SELECT id, title, downloads, installs_all_time, installs_current FROM skills ORDER BY id")
        ).all()
    # The registry's own `downloads` column (no default) is left exactly as it was;
    # only the stat columns it lacked are added, with their defaults.
    assert [tuple(r) for r in rows] == [("sk_1", "A", 41, 0, 0), ("sk_2", None, None, 0, 0)]


def test_upserts_meet_rows_stored_through_sqlalchemy(sink: WindowsSink) -> None:
    # The upserts render key values themselves (sinks/upserts.py); a row an earlier
    # version stored through SQLAlchemy's own insert must still be the row they add to.
    from datetime import timedelta

    from sqlalchemy import insert

    from skillstats.contract import MS_PER_DAY, MS_PER_HOUR
    from skillstats.sinks.schema import skill_hourly_stats
    from skillstats.sinks.upserts import utc_naive

    at = NOW - 1
    hour, day = utc_naive(at - at % MS_PER_HOUR), utc_naive(at - at % MS_PER_DAY).date()
    with sink.engine.begin() as connection:
        connection.execute(
            insert(skill_hourly_stats).values(skill_id="sk_1", hour=hour, downloads=5, installs=1, updated_at=hour)
        )
        connection.execute(
            insert(skill_daily_stats).values(skill_id="sk_1", day=day, downloads=7, installs=2, updated_at=hour)
        )
    sink.apply(downloads(0, range(3)))
    with sink.engine.connect() as connection:
        hourly = connection.execute(select(skill_hourly_stats.c.hour, skill_hourly_stats.c.downloads)).all()
        daily = connection.execute(select(skill_daily_stats.c.day, skill_daily_stats.c.downloads)).all()
        touched = connection.execute(select(skill_hourly_stats.c.updated_at)).scalar_one()
    assert [tuple(r) for r in hourly] == [(hour, 8)]
    assert [tuple(r) for r in daily] == [(day, 10)]
    assert touched > hour - timedelta(seconds=1)  # read back as a datetime: stored in SQLAlchemy's format


@pytest.mark.parametrize("rendered", [True, False])
def test_upserts_add_every_row_whatever_the_runs_of_rows_a_statement_takes(sink: WindowsSink, rendered: bool) -> None:
    # SQLite takes the rows SQLITE_ROWS_PER_STATEMENT a statement, what is left in one of its own length; every
    # count around those lengths, added twice over keys that overlap, must land on its own row exactly once.
    from datetime import date, datetime, timedelta

    from skillstats.sinks.upserts import SQLITE_ROWS_PER_STATEMENT, renderer, upsert_adding

    per = SQLITE_ROWS_PER_STATEMENT
    table = skill_daily_stats
    first, second = datetime(2026, 12, 1, 10), datetime(2026, 12, 1, 11)
    expected: dict[tuple[str, date], tuple[int, int]] = {}
    touched: dict[tuple[str, date], datetime] = {}
    with sink.engine.begin() as connection:
        spell = renderer(table.c.day, connection.dialect) if rendered else (lambda value: value)
        for size in (0, 1, per - 1, per, per + 1, 2 * per + 1, 3 * per):
            skill = f"sk_{size}"
            for now, shift in ((first, 0), (second, size // 2)):
                days = [date(2026, 1, 1) + timedelta(days=shift + i) for i in range(size)]
                rows = [(skill, spell(day), i + 1, size - i) for i, day in enumerate(days)]
                upsert_adding(
                    connection,
                    table,
                    ("skill_id", "day"),
                    ("downloads", "installs"),
                    rows,
                    "updated_at",
                    now,
                    rendered=rendered,
                )
                for i, day in enumerate(days):
                    was = expected.get((skill, day), (0, 0))
                    expected[skill, day] = (was[0] + i + 1, was[1] + size - i)
                    touched[skill, day] = now
    with sink.engine.connect() as connection:
        stored = connection.execute(
            select(table.c.skill_id, table.c.day, table.c.downloads, table.c.installs, table.c.updated_at)
        ).all()
    assert {(skill, day): (d, i) for skill, day, d, i, _ in stored} == expected
    assert {(skill, day): at for skill, day, _, _, at in stored} == touched


@pytest.mark.parametrize("rendered", [True, False])
def test_upserts_refuse_rows_of_different_widths(sink: WindowsSink, rendered: bool) -> None:
    # Laid end to end into one statement, a short row would shift the next row's values into its columns.
    from datetime import datetime

    from skillstats.sinks.upserts import upsert_adding

    rows: list[tuple[object, ...]] = [("sk_1", "2026-01-01", 1), ("sk_1", "2026-01-02", 2, 3, 99)]
    with pytest.raises(ValueError), sink.engine.begin() as connection:
        upsert_adding(
            connection,
            skill_daily_stats,
            ("skill_id", "day"),
            ("downloads", "installs"),
            rows,
            "updated_at",
            datetime(2026, 12, 1),
            rendered=rendered,
        )
    assert total_downloads(sink) == 0


@hypothesis.settings(
    max_examples=60, deadline=None, suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture]
)
@hypothesis.given(at=st.integers(EPOCH_2000_MS, MAX_OCCURRED_AT_MS))
def test_the_sinks_rows_meet_rows_of_every_other_writer_at_any_time(sink: WindowsSink, at: int) -> None:
    # On SQLite the sink's fold spells hours and days as the stored text itself and binds its rows as they come
    # (sinks/windows.py, Starts); SQLAlchemy's insert, and a writer that does not fold through the sink (a
    # rebuild's corrections, `write_buckets`), render datetimes at write time. At any instant the contract
    # allows, all of them must meet on one row per key.
    from sqlalchemy import func, insert

    from skillstats.contract import MS_PER_DAY, MS_PER_HOUR
    from skillstats.sinks.schema import skill_hourly_stats
    from skillstats.sinks.upserts import utc_naive
    from skillstats.sinks.windows import fold, write_buckets

    hour, day = utc_naive(at - at % MS_PER_HOUR), utc_naive(at - at % MS_PER_DAY).date()
    with sink.engine.begin() as connection:
        for table in (skill_hourly_stats, skill_daily_stats):
            connection.execute(table.delete())
        connection.execute(text("DELETE FROM skillstats_partition_fences"))
        connection.execute(
            insert(skill_hourly_stats).values(skill_id="sk_1", hour=hour, downloads=5, installs=0, updated_at=hour)
        )
        connection.execute(
            insert(skill_daily_stats).values(skill_id="sk_1", day=day, downloads=7, installs=0, updated_at=hour)
        )
    event = make_event("sk_1", "download", at, now_ms=MAX_OCCURRED_AT_MS)
    assert sink.apply([ConsumedRecord(0, 0, event)]).applied == 1
    with sink.engine.begin() as connection:
        write_buckets(connection, sink.tables, fold([event]), utc_naive(NOW))
    with sink.engine.connect() as connection:
        hourly = connection.execute(select(skill_hourly_stats.c.hour, skill_hourly_stats.c.downloads)).all()
        daily = connection.execute(select(skill_daily_stats.c.day, skill_daily_stats.c.downloads)).all()
        distinct_hours = connection.execute(select(func.count(func.distinct(skill_hourly_stats.c.hour)))).scalar()
    assert [tuple(r) for r in hourly] == [(hour, 7)]
    assert [tuple(r) for r in daily] == [(day, 9)]
    assert distinct_hours == 1


@hypothesis.settings(
    max_examples=40, deadline=None, suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture]
)
@hypothesis.given(
    ids=st.lists(
        st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), min_size=1, max_size=128),
        min_size=1,
        max_size=30,
        unique=True,
    )
)
def test_any_skill_id_is_stored_as_given(sink: WindowsSink, ids: list[str]) -> None:
    # Quotes, backslashes, braces, commas, spaces, "NULL": the upserts spell the key
    # columns themselves (sinks/upserts.py), so every id must come back byte for byte.
    with sink.engine.begin() as connection:
        connection.execute(skill_daily_stats.delete())
        connection.execute(text("DELETE FROM skillstats_partition_fences"))
    records = [
        ConsumedRecord(0, offset, make_event(skill, "download", NOW - 1, now_ms=NOW))
        for offset, skill in enumerate(ids + ids[:1])
    ]
    sink.apply(records)
    with sink.engine.connect() as connection:
        stored = dict(connection.execute(select(skill_daily_stats.c.skill_id, skill_daily_stats.c.downloads)).all())
    assert stored == {skill: 1 + (skill == ids[0]) for skill in ids}


def test_pg_array_literal_spells_only_what_it_can() -> None:
    # What it cannot spell goes to psycopg as a list, which adapts or refuses it.
    from datetime import UTC, date, datetime

    from skillstats.sinks.upserts import _pg_array_literal

    assert _pg_array_literal([3, -1, 0]) == "{3,-1,0}"
    assert _pg_array_literal(['a"b\\c', "NULL", " {x, y} "]) == '{"a\\"b\\\\c","NULL"," {x, y} "}'
    assert _pg_array_literal([date(2026, 1, 2), datetime(2026, 1, 2, 3)]) is None  # mixed types
    assert _pg_array_literal([datetime(2026, 1, 2, 3), datetime(2026, 1, 2, 3)]) == (
        '{"2026-01-02 03:00:00","2026-01-02 03:00:00"}'
    )
    for unspellable in ([1, True], [True], ["a", None], ["a\x00b"], [datetime(2026, 1, 2, tzinfo=UTC)]):
        assert _pg_array_literal(unspellable) is None, unspellable


def test_a_read_that_starts_above_a_missing_fence_is_not_applied_and_creates_no_row(sink: WindowsSink) -> None:
    """A fence row lost with the database's last transactions: the read that started above it claims nothing
    about the offsets below, so nothing is applied and no row is made up at 0 (the consumer positions the
    partition again: a row at the log start, PartitionFences.begin_reading)."""
    outcome = sink.apply(downloads(0, range(5, 10)), since={0: 5})
    assert outcome.behind == {0: (-1, 5)} and outcome.applied == 0
    assert sink.fences() == {}
    assert total_downloads(sink) == 0
    # A read from the very start needs no fence row: it covers everything.
    assert sink.apply(downloads(0, range(0, 3)), since={0: 0}).applied == 3
    assert sink.fences() == {0: 3}


def test_a_fence_moves_over_markers_only_when_a_read_vouches_for_them(sink: WindowsSink) -> None:
    from skillstats.sinks.batch import PartitionBatch

    first = [PartitionBatch(0, [0, 1], [r.event for r in downloads(0, range(2))], 0, 5)]  # markers at 2..4
    outcome = sink.apply(first)
    assert sink.fences() == {0: 5} and outcome.undelivered == 3
    # A position beyond the fence with nothing read in between vouches for nothing.
    gap = sink.apply([PartitionBatch(0, [9], [downloads(0, range(9, 10))[0].event], 9)])
    assert gap.behind == {0: (5, 9)} and sink.fences() == {0: 5}


def test_sqlite_connections_are_set_up_for_the_sink(tmp_path: Path) -> None:
    """WAL (readers beside the worker), NORMAL sync (durable across a process kill), 16 KiB pages in a new file and
    a checkpoint every 40 MiB of WAL pages (sinks/db.py says what it costs and gains; tests/test_sqlite_layout.py
    a file made with other pages)."""
    engine = open_engine(f"sqlite:///{tmp_path / 'tuned.db'}")
    try:
        with engine.connect() as connection:
            pragmas = [
                connection.exec_driver_sql(f"PRAGMA {name}").scalar()
                for name in ("journal_mode", "synchronous", "page_size", "wal_autocheckpoint")
            ]
        assert pragmas == ["wal", 1, 16384, 2560]
    finally:
        engine.dispose()


@hypothesis.settings(
    max_examples=40, deadline=None, suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture]
)
@hypothesis.given(
    rows=st.lists(
        st.tuples(
            st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)), min_size=1, max_size=64),
            st.booleans(),
            st.integers(-(10**12), 10**12),
            st.integers(-(10**12), 10**12),
            st.integers(-(10**12), 10**12),
        ),
        min_size=1,
        max_size=30,
        unique_by=lambda row: row[0],
    )
)
def test_adding_to_existing_rows_adds_to_each_and_inserts_none(
    sink: WindowsSink, rows: list[tuple[str, bool, int, int, int]]
) -> None:
    # docsync's UPDATE of the registry's `skills` (sinks/upserts.py, add_to_existing): on PostgreSQL one statement
    # over arrays spelled by `_pg_array_literal`, so any id must meet its own row, and an id with no row must stay
    # without one (the registry owns that table).
    from datetime import datetime

    from skillstats.sinks.schema import skills
    from skillstats.sinks.upserts import add_to_existing

    at = datetime(2026, 12, 4, 5, 6, 7)
    with sink.engine.begin() as connection:
        connection.execute(skills.delete())
        present = [skill for skill, exists, *_ in rows if exists]
        if present:
            connection.execute(
                skills.insert(),
                [
                    {"id": s, "owner_id": None, "downloads": 5, "installs_all_time": 6, "installs_current": 7}
                    for s in present
                ],
            )
        add_to_existing(
            connection,
            skills,
            "id",
            ("downloads", "installs_all_time", "installs_current"),
            [(skill, d, a, c) for skill, _exists, d, a, c in rows],
            "stats_updated_at",
            at,
        )
    with sink.engine.connect() as connection:
        stored = {
            row[0]: tuple(row[1:])
            for row in connection.execute(
                select(
                    skills.c.id,
                    skills.c.downloads,
                    skills.c.installs_all_time,
                    skills.c.installs_current,
                    skills.c.stats_updated_at,
                )
            )
        }
    assert stored == {skill: (5 + d, 6 + a, 7 + c, at) for skill, exists, d, a, c in rows if exists}


def test_adding_to_existing_rows_waits_for_no_insert_that_references_them(database_url: str) -> None:
    # The registry inserting a row that references a skill (a foreign key: a KEY SHARE lock on the skill's row)
    # while a drain adds to that skill: the drain's row locks must be the UPDATE's own (NO KEY UPDATE), which do
    # not conflict with it; FOR UPDATE would wait for the registry's transaction (here: time out after 1 s).
    # And a key given twice is refused, where PostgreSQL's UPDATE ... FROM would add only one of its rows.
    from datetime import datetime

    from skillstats.sinks.schema import skills
    from skillstats.sinks.upserts import add_to_existing

    engine = open_engine(database_url, lock_timeout_s=1)
    upgrade(engine)
    counters = ("downloads", "installs_all_time", "installs_current")
    at = datetime(2026, 12, 4, 5, 6, 7)
    with engine.begin() as connection:
        connection.execute(skills.insert(), [{"id": "a", "owner_id": None}, {"id": "b", "owner_id": None}])
        with pytest.raises(ValueError, match="more than once"):
            add_to_existing(
                connection, skills, "id", counters, [("a", 1, 0, 0), ("a", 1, 0, 0)], "stats_updated_at", at
            )
    if engine.dialect.name != "postgresql":
        return  # SQLite has no row locks
    with engine.begin() as connection:
        connection.execute(text("CREATE TABLE skill_stars (skill_id TEXT NOT NULL REFERENCES skills (id))"))
    with engine.connect() as registry:
        pending = registry.begin()
        registry.execute(text("INSERT INTO skill_stars VALUES ('b')"))
        with engine.begin() as connection:
            add_to_existing(
                connection, skills, "id", counters, [("a", 1, 0, 0), ("b", 2, 0, 0)], "stats_updated_at", at
            )
        registry.execute(text("UPDATE skills SET owner_id = 'u' WHERE id = 'a'"))
        pending.commit()
    with engine.connect() as connection:
        stored = dict(connection.execute(select(skills.c.id, skills.c.downloads)).all())
    assert stored == {"a": 1, "b": 2}
