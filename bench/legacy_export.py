"""Synthetic Convex exports of the legacy system, for the benchmark (case j) and the tests, made one way.

- `write_export`: what `npx convex export` writes (a folder per table, `documents.jsonl` in each,
  one JSON document a line), as a ZIP file or the directory it unpacks to. Streaming: each table's
  documents are written as they come, so an export of millions of events holds none of them in
  memory. tests/test_legacy.py's `OldSystem` (the old deployment kept in memory, for any sequence of
  writes, cron runs and exports) writes its exports with it too.
- `Deployment`: a long history of the old deployment, generated in `_creationTime` order and never
  held in memory, for exports of any size: events created over time; the prune of processed events
  at an early cursor; the daily processor run up to a cursor (its `skillDailyStats` rows); the doc
  sync marking most events processed (adding them to the skills' totals), and the last events
  created after both crons stopped. What it keeps is per skill and day: the daily rows, the old
  totals, a few figures.
- `skill_deltas`, `KINDS`: the old doc sync's effect of one event on a skill's totals, and the kind
  mix, in the old system's terms (../shared/seeds/000_*.txt), for both models.

The model restates the old crons; it does not compute what skillstats must hold afterwards (the
tests do that with tests/helpers.py's own restatement of the contract). It keeps sums of what the
tables must hold only for the benchmark's check that an import it times imported everything.
"""

from __future__ import annotations

import itertools
import random
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

import orjson
from sqlalchemy import Engine, insert

from skillstats.legacy.export import CURSOR_KEY, CURSORS, DAILY, DOCUMENTS, EVENTS, TABLES
from skillstats.sinks.schema import skills, user_skill_stats
from skillstats.sinks.upserts import now_utc_naive
from skillstats.workload import skill_ids

START: Final = 1_764_460_800_000.0  # 2025-11-30T00:00Z: the first event's _creationTime
MS_PER_DAY: Final = 86_400_000
# The old system's kinds, drawn with these weights (a kind listed twice is drawn twice as often).
KINDS: Final = (
    "download",
    "download",
    "download",
    "install_new",
    "install_new",
    "install_reactivate",
    "install_deactivate",
    "install_clear",
    "star",
    "unstar",
    "comment",
    "uncomment",
)
# What the old doc sync added to (statsDownloads, statsInstallsAllTime, statsInstallsCurrent) per kind.
_DOC_SYNC: Final = {
    "download": (1, 0, 0),
    "install_new": (0, 1, 1),
    "install_reactivate": (0, 0, 1),
    "install_deactivate": (0, 0, -1),
}
# The daily processor's skillDailyStats column per kind (and its index in (downloads, installs)).
_DAILY_COLUMN: Final = {"download": ("downloads", 0), "install_new": ("installs", 1)}

Documents = Iterable[Mapping[str, Any]]


def write_export(where: Path, tables: Iterable[tuple[str, Documents]], *, as_zip: bool) -> Path:
    """Write `tables` ((name, documents), in order) as `npx convex export` does: the ZIP `where`.zip, or the
    directory `where`. A table's documents may be a generator that reads what writing an earlier table found."""
    if as_zip:
        path = where.with_suffix(".zip")
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
            for name, documents in tables:
                with archive.open(f"{name}/{DOCUMENTS}", "w", force_zip64=True) as member:
                    _write_lines(member, documents)
        return path
    for name, documents in tables:
        (where / name).mkdir(parents=True, exist_ok=True)
        with (where / name / DOCUMENTS).open("wb") as file:
            _write_lines(file, documents)
    return where


def _write_lines(out: IO[bytes], documents: Documents) -> None:
    lines: list[bytes] = []
    for document in documents:
        lines.append(orjson.dumps(document, option=orjson.OPT_APPEND_NEWLINE))
        if len(lines) >= 4096:
            out.write(b"".join(lines))
            lines.clear()
    out.write(b"".join(lines))


def listed_tables() -> list[dict[str, Any]]:
    """The export's `_tables` documents for the tables the legacy import reads."""
    return [{"name": n, "id": i} for i, n in enumerate([EVENTS, CURSORS, DAILY], start=10001)]


def cursor_documents(cursor: float | None, ids: Iterator[str], updated: float) -> list[dict[str, Any]]:
    """`skillStatUpdateCursors`: another key's document, and the daily processor's (no cursorCreationTime: it
    never ran)."""
    return [
        {"_id": next(ids), "_creationTime": START, "key": "skill_doc_stat_sync", "updatedAt": START},
        {
            "_id": next(ids),
            "_creationTime": START,
            "key": CURSOR_KEY,
            "updatedAt": updated,
            **({} if cursor is None else {"cursorCreationTime": cursor}),
        },
    ]


def skill_deltas(event: Mapping[str, Any]) -> tuple[int, int, int]:
    """What the old doc sync added to a skill's (downloads, installs all time, installs current) for one event
    (an install_clear without a delta: nothing, `if (event.delta)`)."""
    kind = event["kind"]
    if kind == "install_clear":
        delta = event.get("delta") or {"allTime": 0, "current": 0}
        return (0, int(delta["allTime"]), int(delta["current"]))
    return _DOC_SYNC.get(kind, (0, 0, 0))


def load_registry(engine: Engine, registry: Mapping[str, str | None], totals: Mapping[str, Sequence[int]]) -> None:
    """The registry's `skills` rows with the old totals the doc sync added, and each owner's sums in
    `user_skill_stats`: what the runbook loads before the import (docs/operations.md, step 4)."""
    owners: dict[str, list[int]] = {}
    rows = []
    for skill, owner in registry.items():
        counts = list(totals.get(skill, (0, 0, 0)))
        rows.append(
            {
                "id": skill,
                "owner_id": owner,
                "downloads": counts[0],
                "installs_all_time": counts[1],
                "installs_current": counts[2],
            }
        )
        if owner is not None:
            summed = owners.setdefault(owner, [0, 0, 0])
            for column, amount in enumerate(counts):
                summed[column] += amount
    now = now_utc_naive()
    owner_rows = [
        {"owner_id": o, "downloads": d, "installs_all_time": a, "installs_current": c, "updated_at": now}
        for o, (d, a, c) in sorted(owners.items())
        if d or a or c
    ]
    with engine.begin() as connection:
        if rows:
            connection.execute(insert(skills), rows)
        if owner_rows:
            connection.execute(insert(user_skill_stats), owner_rows)


@dataclass
class Figures:
    """What one pass over a `Deployment` found: the export's counts, and what an import of it owes."""

    exported: int = 0  # events in the export's skillStatEvents
    pruned: int = 0  # events created, processed and pruned before the export (counted by the old crons)
    unprocessed: int = 0  # exported without processedAt: owed to the skill totals
    processed_recent: int = 0  # exported, processed, above the daily cursor
    owed_windows: int = 0  # exported above the daily cursor
    unknown_skill_events: int = 0  # owed to the skill totals, for a skill with no row in the registry
    history_rows: int = 0  # skillDailyStats documents
    # Sums the tables must hold after `load_registry` and an import with --history (the bench's check):
    # (downloads, installs) over every event ever created, and over those above the cursor; the skills'
    # (downloads, installs all time, installs current) over every event ever created for a registered skill.
    daily: list[int] = field(default_factory=lambda: [0, 0])
    hourly: list[int] = field(default_factory=lambda: [0, 0])
    skills: list[int] = field(default_factory=lambda: [0, 0, 0])

    @property
    def owed_skills(self) -> int:
        return self.unprocessed


@dataclass
class Deployment:
    """The old deployment's history, `events` exported events long, generated in creation order.

    Shares of the exported events, in creation order: the first 10% were created before the prune
    (half of those created then were processed and pruned: they are not in the export, and count in
    the old totals and daily rows only), up to 50% at or below the daily cursor, up to 80% before the
    doc sync's last run (80% processed), the rest after both crons stopped. A pass (`write`,
    `created`) always gives the same history for the same fields."""

    events: int
    seed: int = 29
    skills: int = 300
    days: float = 20.0  # from the first event created to the last
    prefix: str = "j"  # the ids' first characters: another deployment, other ids
    cursor: float | None = field(default=None, init=False)
    figures: Figures = field(default_factory=Figures, init=False)
    daily_rows: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict, init=False, repr=False)
    totals: dict[str, list[int]] = field(default_factory=dict, init=False, repr=False)
    last_created: float = field(default=START, init=False)  # the newest event's _creationTime

    def __post_init__(self) -> None:
        owners = max(1, self.skills // 10)
        self.skill_ids = skill_ids(self.skills)
        # Two skills in three have a row; a skill without one was deleted (its events only marked by the doc sync).
        self.registry: dict[str, str | None] = {
            skill: None if index % 17 == 0 else f"user_{index % owners:04d}"
            for index, skill in enumerate(self.skill_ids)
            if index % 3 != 2
        }

    def write(self, where: Path, *, as_zip: bool) -> Path:
        """The export, streaming; `figures`, `cursor`, `daily_rows` and `totals` are then this history's."""
        ids = (f"{self.prefix}c{serial:024x}" for serial in itertools.count())
        return write_export(
            where,
            [
                (TABLES, listed_tables()),
                (EVENTS, (document for document, pruned in self.created() if not pruned)),
                (CURSORS, self._cursors(ids)),
                (DAILY, self._daily()),
            ],
            as_zip=as_zip,
        )

    def _cursors(self, ids: Iterator[str]) -> Iterator[dict[str, Any]]:
        yield from cursor_documents(self.cursor, ids, self.last_created)

    def _daily(self) -> Iterator[dict[str, Any]]:
        for row in self.daily_rows.values():
            yield {**row, "downloads": float(row["downloads"])}  # Convex's float64: 12.0 as well as 12

    def created(self) -> Iterator[tuple[dict[str, Any], bool]]:
        """Every event the deployment ever created, in creation order, as its document (with `processedAt` if the
        doc sync applied it), and whether the prune removed it before the export. Resets and fills `figures`,
        `cursor`, `daily_rows` and `totals` as it goes (complete once it is exhausted)."""
        rng = random.Random(self.seed)
        figures = self.figures = Figures()
        self.cursor, self.daily_rows, self.totals = None, {}, {}
        gap = self.days * MS_PER_DAY / (self.events * 1.1)  # mean spacing: ~10% more events are created than kept
        prune_end, cursor_end, sync_end = (int(self.events * share) for share in (0.1, 0.5, 0.8))
        clock = START
        while figures.exported < self.events:
            clock += rng.uniform(1.0, 2 * gap)
            kind = rng.choice(KINDS)
            skill = self.skill_ids[rng.randrange(self.skills)]
            occurred = int(clock) - (rng.randrange(3 * MS_PER_DAY) if rng.random() < 0.2 else 0)
            document: dict[str, Any] = {
                "_id": f"{self.prefix}{rng.getrandbits(96):024x}",
                "_creationTime": clock,
                "skillId": skill,
                "kind": kind,
                "occurredAt": float(occurred) if rng.random() < 0.3 else occurred,
            }
            if kind == "install_clear" and rng.random() < 0.9:
                document["delta"] = {"allTime": -rng.randrange(3), "current": float(-rng.randrange(3))}
            at = figures.exported
            below_cursor = at < cursor_end
            processed = at < sync_end and rng.random() < (0.5 if at < prune_end else 0.8)
            if processed:
                document["processedAt"] = clock + rng.uniform(0, 6 * 3_600_000)
            pruned = processed and at < prune_end
            self._count(document, below_cursor, processed, pruned)
            if below_cursor:
                self.cursor = clock
            yield document, pruned
        self.last_created = clock
        figures.history_rows = len(self.daily_rows)

    def _count(self, document: dict[str, Any], below_cursor: bool, processed: bool, pruned: bool) -> None:
        figures, kind, skill = self.figures, document["kind"], document["skillId"]
        column, index = _DAILY_COLUMN.get(kind, (None, 0))
        if column is not None:
            figures.daily[index] += 1
            if not below_cursor:
                figures.hourly[index] += 1
        if skill in self.registry:
            for total, amount in enumerate(skill_deltas(document)):
                figures.skills[total] += amount
        if below_cursor and column is not None:  # the daily processor counted it
            day = int(document["occurredAt"]) // MS_PER_DAY
            row = self.daily_rows.get((skill, day))
            if row is None:
                row = self.daily_rows[(skill, day)] = {
                    "_id": f"{self.prefix}h{len(self.daily_rows):024x}",
                    "_creationTime": document["_creationTime"] + 1.0,
                    "skillId": skill,
                    "day": day,
                    "downloads": 0,
                    "installs": 0,
                }
            row[column] += 1
        if processed and skill in self.registry:  # the doc sync added it to the skill's totals
            totals = self.totals.setdefault(skill, [0, 0, 0])
            for total, amount in enumerate(skill_deltas(document)):
                totals[total] += amount
        if pruned:
            figures.pruned += 1
            return
        figures.exported += 1
        if not below_cursor:
            figures.owed_windows += 1
            if processed:
                figures.processed_recent += 1
        if not processed:
            figures.unprocessed += 1
            if skill not in self.registry:
                figures.unknown_skill_events += 1
