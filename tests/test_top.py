"""`skillstats top` (skillstats/top.py): the leaderboard over skill_daily_stats, on real SQLite and PostgreSQL."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, delete, insert, text

from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.schema import skill_daily_stats
from skillstats.top import EIGHTHS, FULL_BLOCK, bar, leaderboard, render
from tests.conftest import _fresh_postgres_database

TODAY = datetime.date(2026, 11, 30)


def _migrated(url: str) -> Iterator[Engine]:
    engine = open_engine(url)
    upgrade(engine)
    yield engine
    engine.dispose()


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def migrated_engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """conftest's databases, one per module: a fresh PostgreSQL database and migration per test cost ~0.5 s each."""
    if request.param == "sqlite":
        yield from _migrated(f"sqlite:///{tmp_path_factory.mktemp('top')}/skillstats.db")
    else:
        for url in _fresh_postgres_database(request.getfixturevalue("postgres_admin_url")):
            yield from _migrated(url)


@pytest.fixture
def engine(migrated_engine: Engine) -> Engine:
    with migrated_engine.begin() as connection:
        connection.execute(delete(skill_daily_stats))
    return migrated_engine


def day(days_ago: int) -> datetime.date:
    return TODAY - datetime.timedelta(days=days_ago)


def put(engine: Engine, *rows: tuple[str, int, int, int]) -> None:
    """Daily rows as (skill_id, days before TODAY (negative: after), downloads, installs)."""
    now = datetime.datetime(2026, 12, 1)
    with engine.begin() as connection:
        connection.execute(
            insert(skill_daily_stats),
            [
                {"skill_id": s, "day": day(ago), "downloads": d, "installs": i, "updated_at": now}
                for s, ago, d, i in rows
            ],
        )


def ranking(report: dict[str, object]) -> list[tuple[int, str, int, int]]:
    return [(r["rank"], r["skill_id"], r["downloads"], r["installs"]) for r in report["rows"]]  # type: ignore[index,attr-defined]


def test_window_is_the_last_days_utc_days_today_included(engine: Engine) -> None:
    put(
        engine,
        ("sk_today", 0, 5, 0),
        ("sk_first_day", 6, 4, 0),  # today - (days - 1): the window's first day
        ("sk_just_before", 7, 1000, 0),  # one day before it
        ("sk_tomorrow", -1, 1000, 0),  # after `until`
    )
    report = leaderboard(engine, days=7, today=TODAY)
    assert [report[key] for key in ("days", "by", "since", "until")] == [7, "downloads", "2026-11-24", "2026-11-30"]
    assert ranking(report) == [(1, "sk_today", 5, 0), (2, "sk_first_day", 4, 0)]

    # One day wider takes in the day before; one day is today alone.
    assert [r["skill_id"] for r in leaderboard(engine, days=8, today=TODAY)["rows"]] == [
        "sk_just_before",
        "sk_today",
        "sk_first_day",
    ]
    one = leaderboard(engine, days=1, today=TODAY)
    assert (one["since"], one["until"]) == ("2026-11-30", "2026-11-30")
    assert ranking(one) == [(1, "sk_today", 5, 0)]


def test_sums_across_days_are_plain_ints(engine: Engine) -> None:
    big = 3_000_000_000  # past 32 bits: BIGINT sums, NUMERIC on PostgreSQL
    put(
        engine,
        ("sk_a", 0, big, 1),
        ("sk_a", 3, big, 2),
        ("sk_a", 6, 7, 3),
        ("sk_a", 7, 100, 100),  # outside: not summed
        ("sk_b", 1, 10, 20),
    )
    report = leaderboard(engine, today=TODAY)
    assert ranking(report) == [(1, "sk_a", 2 * big + 7, 6), (2, "sk_b", 10, 20)]
    assert all(type(r[key]) is int for r in report["rows"] for key in ("rank", "downloads", "installs"))


def test_order_is_the_chosen_column_desc_then_skill_id_by_code_point(engine: Engine) -> None:
    put(
        engine,
        ("sk_a", 0, 50, 1),
        ("sk_B", 0, 50, 1),  # ties with sk_a: "B" (U+0042) sorts before "a" (U+0061)
        ("sk_c", 0, 20, 9),
        ("sk_c", 1, 40, 0),  # 60 over two days: above the single-day 50s
        ("sk_0", 1, 1, 0),
    )
    assert [r["skill_id"] for r in leaderboard(engine, today=TODAY)["rows"]] == ["sk_c", "sk_B", "sk_a", "sk_0"]


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_tie_break_ignores_the_postgres_collation(database_url: str) -> None:
    # A database created under a linguistic locale sorts "sk_a" before "sk_B"; the
    # leaderboard must still agree with SQLite (and with itself across servers).
    # Its own database: the column's collation is changed for good.
    engine = next(_migrated(database_url))
    with engine.begin() as connection:
        connection.execute(text('ALTER TABLE skill_daily_stats ALTER COLUMN skill_id TYPE text COLLATE "und-x-icu"'))
        assert connection.execute(text("SELECT min(x) FROM (VALUES ('sk_a'), ('sk_B')) v(x)")).scalar() == "sk_B"
        linguistic = connection.execute(
            text("SELECT skill_id FROM (VALUES ('sk_a'), ('sk_B')) v(skill_id) ORDER BY skill_id COLLATE \"und-x-icu\"")
        ).scalars()
        assert list(linguistic) == ["sk_a", "sk_B"]
    put(engine, ("sk_a", 0, 5, 0), ("sk_B", 0, 5, 0), ("sk_c", 0, 5, 0))
    assert [r["skill_id"] for r in leaderboard(engine, today=TODAY, limit=2)["rows"]] == ["sk_B", "sk_a"]
    engine.dispose()


def test_limit_keeps_the_top_and_ranks_from_one(engine: Engine) -> None:
    put(engine, *[(f"sk_{n:02}", n % 3, 100 - n, 0) for n in range(30)])
    report = leaderboard(engine, limit=5, today=TODAY)
    assert ranking(report) == [(n + 1, f"sk_{n:02}", 100 - n, 0) for n in range(5)]
    assert len(leaderboard(engine, today=TODAY)["rows"]) == 20  # the default
    assert len(leaderboard(engine, limit=1000, today=TODAY)["rows"]) == 30
    # A tie across the cut keeps the lower skill id.
    put(engine, ("sk_zz", 0, 96, 0), ("sk_aa", 0, 96, 0))  # ties with sk_04's 96
    assert [r["skill_id"] for r in leaderboard(engine, limit=6, today=TODAY)["rows"]][-2:] == ["sk_04", "sk_aa"]


def test_by_installs_ranks_by_installs_and_leaves_out_skills_without_any(engine: Engine) -> None:
    put(
        engine,
        ("sk_downloaded", 0, 1000, 0),  # never installed in the window
        ("sk_installed", 0, 1, 30),
        ("sk_installed", 2, 0, 12),
        ("sk_some", 1, 500, 40),
        ("sk_old", 9, 0, 999),  # outside
    )
    report = leaderboard(engine, by="installs", today=TODAY)
    assert report["by"] == "installs"
    assert ranking(report) == [(1, "sk_installed", 1, 42), (2, "sk_some", 500, 40)]
    # And by downloads, the skill without downloads is the one left out.
    put(engine, ("sk_installs_only", 0, 0, 7))
    assert "sk_installs_only" not in [r["skill_id"] for r in leaderboard(engine, today=TODAY)["rows"]]


def test_no_rows_in_the_window(engine: Engine) -> None:
    empty = leaderboard(engine, today=TODAY)
    assert empty == {"days": 7, "by": "downloads", "since": "2026-11-24", "until": "2026-11-30", "rows": []}
    put(engine, ("sk_a", 30, 10, 10), ("sk_b", 0, 0, 0))  # too old; zero in the window
    assert leaderboard(engine, today=TODAY)["rows"] == []
    assert leaderboard(engine, by="installs", today=TODAY)["rows"] == []
    text_out = render(empty, as_json=False)
    assert "\n" not in text_out
    assert "no downloads" in text_out and "2026-11-24 .. 2026-11-30" in text_out
    assert "skill_daily_stats" in text_out and "windows" in text_out


def test_today_defaults_to_the_utc_date(engine: Engine) -> None:
    before = datetime.datetime.now(datetime.UTC).date()
    report = leaderboard(engine, days=2)
    after = datetime.datetime.now(datetime.UTC).date()
    assert report["until"] in (before.isoformat(), after.isoformat())
    until = datetime.date.fromisoformat(report["until"])
    assert report["since"] == (until - datetime.timedelta(days=1)).isoformat()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"days": 0}, "days must be"),
        ({"days": -3}, "days must be"),
        ({"days": 2.5}, "days must be"),
        ({"days": 10_000_000}, "year 1"),
        ({"limit": 0}, "limit must be"),
        ({"by": "stars"}, "by must be one of downloads, installs"),
        ({"by": "Downloads"}, "by must be one of"),
    ],
)
def test_bad_arguments_are_a_clear_value_error(kwargs: dict[str, object], message: str, tmp_path: Path) -> None:
    unused = open_engine(f"sqlite:///{tmp_path}/never-read.db")
    with pytest.raises(ValueError, match=message):
        leaderboard(unused, today=TODAY, **kwargs)  # type: ignore[arg-type]


def test_render_text_table_and_bars(engine: Engine) -> None:
    put(
        engine,
        ("sk_alpha", 0, 12_345, 1_200),
        ("sk_b", 1, 6_000, 3),
        ("sk_a_much_longer_id", 2, 1, 0),
    )
    report = leaderboard(engine, today=TODAY, limit=20)
    out = render(report, as_json=False, width=40)
    lines = out.split("\n")
    assert lines[0] == "top 3 skills by downloads, 2026-11-24 .. 2026-11-30 (UTC days)"
    assert len(lines) == 4
    assert "\x1b" not in out
    assert "12,345 downloads" in lines[1] and "1,200 installs" in lines[1]
    assert lines[1].startswith("1. sk_alpha ")
    # Ids are padded to the longest, so the counts line up.
    assert len({line.index("downloads") for line in lines[1:]}) == 1
    bars = [line[len(line.rstrip(FULL_BLOCK + "".join(EIGHTHS))) :] for line in lines[1:]]
    assert bars[0] == FULL_BLOCK * 40
    assert 0 < len(bars[2]) < len(bars[1]) < len(bars[0])
    assert bars[1] == bar(6_000, 12_345, 40) == FULL_BLOCK * 19 + EIGHTHS[3]  # 6000/12345 * 40 = 19.44
    assert bars[2] == EIGHTHS[1]  # 1 of 12,345: still visible

    by_installs = render(leaderboard(engine, by="installs", today=TODAY), as_json=False, width=10)
    assert by_installs.split("\n")[0] == "top 2 skills by installs, 2026-11-24 .. 2026-11-30 (UTC days)"
    assert by_installs.split("\n")[1].endswith("installs  " + FULL_BLOCK * 10)


def test_render_json_is_one_line_and_round_trips(engine: Engine) -> None:
    put(engine, ("sk_é", 0, 3, 1), ("sk_b", 1, 2, 2))
    report = leaderboard(engine, today=TODAY)
    out = render(report, as_json=True)
    assert "\n" not in out
    assert json.loads(out) == report
    assert list(json.loads(out)) == sorted(report)


def test_bar_scale() -> None:
    assert bar(10, 10, 40) == FULL_BLOCK * 40
    assert bar(5, 10, 40) == FULL_BLOCK * 20
    assert bar(1, 10**9, 40) == EIGHTHS[1]
    assert bar(0, 10, 40) == ""
    assert len(bar(9, 10, 3)) == 3  # 2.7 blocks: two full and a partial
