"""`skillstats top`: the skills most downloaded (or installed) over the last few UTC days.

Why it reads `skill_daily_stats`: that table exists for trending. The system
skillstats replaces wrote its daily rows ("skillDailyStats, for
trending/leaderboards") on a 15-minute cron and computed trending from them;
the windows worker keeps the same rows, exact, within seconds. The columns in
`skills` cannot answer "this week" (they are all-time totals, patched every 6
hours), and the hourly table would give the same sums from 24 times as many
rows. What that costs:

- The window is whole UTC days, today included, so `--days 7` read at 00:05 UTC
  is six full days and five minutes. A rolling 168 hours would take
  `skill_hourly_stats`; a leaderboard does not need that precision.
- Days after `until` (today) are left out, so the header's range is true: a row
  dated tomorrow (an `occurred_at` may run up to 10 minutes ahead of its record,
  or `today` is passed in the past) waits for its day.
- The primary key leads with `skill_id` and nothing indexes `day` alone, so the
  query scans the table and groups per skill. Fine for an operator's command on
  a table of skills x days; a page served per request would want an index on
  `day` (a migration) or a rollup.
- Ties in the chosen column are broken by skill id in code-point order, on
  PostgreSQL through `COLLATE "C"`: SQLite and PostgreSQL (whatever locale the
  database was created with) then list the same skills in the same order, and a
  tie at the `limit` cuts the same way on both. The cost is that ids sort as
  bytes (`sk_B` before `sk_a`), not as a person would.
- Skills with nothing in the chosen column are left out: a skill installed but
  never downloaded is not "ranked 40th by downloads".
- It is only as fresh as the windows worker (`skillstats status` shows its lag);
  nothing here reads Kafka.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from sqlalchemy import Engine, func, select

from skillstats.sinks.schema import skill_daily_stats

ORDERS = ("downloads", "installs")
FULL_BLOCK = "█"
# One eighth to seven eighths of a block, for the fractional part of a bar.
EIGHTHS = ("", "▏", "▎", "▍", "▌", "▋", "▊", "▉")


def _window(days: int, today: datetime.date) -> tuple[datetime.date, datetime.date]:
    try:
        return today - datetime.timedelta(days=days - 1), today
    except OverflowError:
        raise ValueError(f"days must reach no further back than year 1, got {days}") from None


def leaderboard(
    engine: Engine,
    *,
    days: int = 7,
    by: str = "downloads",
    limit: int = 20,
    today: datetime.date | None = None,
) -> dict[str, Any]:
    """The top `limit` skills by `by`, summed over the UTC days `today - (days - 1)` .. `today`.

    Returns a JSON-friendly dict: days, by, since and until (ISO dates), and rows
    of rank, skill_id, downloads and installs (ints), best first.
    """
    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise ValueError(f"days must be a whole number of at least 1, got {days!r}")
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit must be a whole number of at least 1, got {limit!r}")
    if by not in ORDERS:
        raise ValueError(f"by must be one of {', '.join(ORDERS)}, got {by!r}")
    if today is None:
        today = datetime.datetime.now(datetime.UTC).date()
    since, until = _window(days, today)

    table = skill_daily_stats
    downloads = func.sum(table.c.downloads)
    installs = func.sum(table.c.installs)
    chosen = downloads if by == "downloads" else installs
    skill_order = table.c.skill_id.collate("C") if engine.dialect.name == "postgresql" else table.c.skill_id
    statement = (
        select(table.c.skill_id, downloads.label("total_downloads"), installs.label("total_installs"))
        .where(table.c.day >= since, table.c.day <= until)
        .group_by(table.c.skill_id)
        .having(chosen > 0)
        .order_by(chosen.desc(), skill_order.asc())
        .limit(limit)
    )
    with engine.connect() as connection:
        found = connection.execute(statement).all()
    # PostgreSQL's SUM of BIGINT is NUMERIC (a Decimal here); SQLite's is an int.
    rows = [
        {"rank": rank, "skill_id": skill_id, "downloads": int(total_downloads), "installs": int(total_installs)}
        for rank, (skill_id, total_downloads, total_installs) in enumerate(found, start=1)
    ]
    return {"days": days, "by": by, "since": since.isoformat(), "until": until.isoformat(), "rows": rows}


def bar(value: int, top: int, width: int) -> str:
    """`width` blocks for `top`, proportionally fewer (in eighths, rounded down) for `value`; a nonzero value shows."""
    if value <= 0 or top <= 0:
        return ""
    eighths = max(1, min(value, top) * width * 8 // top)
    return FULL_BLOCK * (eighths // 8) + EIGHTHS[eighths % 8]


def render(report: dict[str, Any], as_json: bool, width: int = 40) -> str:
    """The report as one JSON line (sorted keys) or as a text table with a bar per skill; no colour."""
    if as_json:
        return json.dumps(report, sort_keys=True)
    if width < 1:
        raise ValueError(f"width must be at least 1, got {width}")
    by, rows = report["by"], report["rows"]
    window = f"{report['since']} .. {report['until']} (UTC days)"
    if not rows:
        return (
            f"no {by} counted in {window}: skill_daily_stats holds none for that window "
            f"(the windows worker, `skillstats windows`, fills it)"
        )
    noun = "skill" if len(rows) == 1 else "skills"
    lines = [f"top {len(rows)} {noun} by {by}, {window}"]
    rank_width = len(str(rows[-1]["rank"]))
    id_width = max(len(row["skill_id"]) for row in rows)
    downloads_width = max(len(f"{row['downloads']:,}") for row in rows)
    installs_width = max(len(f"{row['installs']:,}") for row in rows)
    top = max(row[by] for row in rows)
    for row in rows:
        line = (
            f"{row['rank']:>{rank_width}}. {row['skill_id']:<{id_width}}"
            f"  {row['downloads']:>{downloads_width},} downloads"
            f"  {row['installs']:>{installs_width},} installs"
            f"  {bar(row[by], top, width)}"
        )
        lines.append(line.rstrip())
    return "\n".join(lines)
