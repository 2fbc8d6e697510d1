"""Reading a Convex export (`npx convex export`) of the legacy tables, streaming, and refusing what does not fit.

Why streaming: a production export holds millions of events, so each `documents.jsonl` is read a
line at a time, straight out of the ZIP member or the file, and nothing is kept per document:
memory stays flat whatever the size of the export (what it costs instead: every pass re-reads and
re-inflates the file; a plan is one pass, an import two). Why so strict: these documents become
counts that can never be taken back, so any line that does not fit the old schema (see
`parse_event`) stops everything before the first write, in one line naming the file and the line.

Numbers in Convex are float64: an integral value may be written `12` or `12.0`, and both are taken;
`12.5` where a count belongs is refused. The event itself is checked by the contract's own rules
(`skillstats.contract.from_mapping`: ids, kinds, time range, delta bounds), so an imported event is
one the consumers would have counted; the bound on `occurredAt` against a Kafka timestamp does not
apply (there is no record).

Outside the contract's ranges, not refused: an `occurredAt` before 2000-01-01 or after 9999-12-31,
an install_clear `delta` over 1e9 in size (the contract's `bad_timestamp` and `bad_delta` bounds),
and a `skillDailyStats` row of a day outside those years. The old system counted such events, the
live consumers would not (they are invalid there, sent to the DLQ): they are well-formed documents
of the old schema, so they come back marked (`outside`, saying why), for `legacy plan` to count and
`legacy import` to refuse, or with --skip-out-of-contract to leave uncounted (skillstats/legacy/plan.py).
"""

from __future__ import annotations

import io
import math
import sqlite3
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final

import orjson

from skillstats.contract import (
    EFFECTS,
    EPOCH_2000_MS,
    KINDS,
    MAX_ID_CHARS,
    MAX_OCCURRED_AT_MS,
    MS_PER_DAY,
    Invalid,
    Reason,
    StatEvent,
    from_mapping,
)

EVENTS: Final = "skillStatEvents"
CURSORS: Final = "skillStatUpdateCursors"
DAILY: Final = "skillDailyStats"
TABLES: Final = "_tables"
DOCUMENTS: Final = "documents.jsonl"
CURSOR_KEY: Final = "skill_stat_events"  # the daily processor's document in skillStatUpdateCursors
MAX_EXACT: Final = 2**53  # the largest integer every float64 holds exactly: a larger count is not a count
FIRST_DAY: Final = EPOCH_2000_MS // MS_PER_DAY
LAST_DAY: Final = MAX_OCCURRED_AT_MS // MS_PER_DAY

Progress = Callable[[int], object]  # called with the bytes read since the last call


class ExportError(Exception):
    """The export cannot be imported as it is: one line, naming the file (and the line); nothing was written."""


@dataclass(frozen=True, slots=True)
class LegacyEvent:
    """One `skillStatEvents` document, checked: its id, creation time, whether the doc sync applied it."""

    id: str
    created: float  # `_creationTime`, milliseconds (a float in Convex)
    processed: bool  # has `processedAt`: the doc sync applied it to the skill's totals
    event: StatEvent | None  # None when `outside`
    line: int = 0  # its line in documents.jsonl (for a refusal naming it)
    outside: str | None = None  # outside the contract's ranges: why (the event then counts nowhere)


@dataclass(frozen=True, slots=True)
class HistoryRow:
    """One `skillDailyStats` document: the old daily counts of one skill and UTC day."""

    id: str
    created: float
    skill_id: str
    day: int  # whole UTC days since 1970-01-01
    downloads: int
    installs: int
    line: int = 0
    outside: str | None = None  # a day outside the contract's years: why (the row then counts nowhere)


class Export:
    """A Convex export, a ZIP file or the directory it unpacks to, read one table at a time."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.name = str(path)
        self._zip: zipfile.ZipFile | None = None
        if self.path.is_dir():
            present = {p.parent.name for p in self.path.glob(f"*/{DOCUMENTS}")}
        elif self.path.is_file():
            try:
                self._zip = zipfile.ZipFile(self.path)
            except (zipfile.BadZipFile, OSError) as exc:
                raise ExportError(
                    f"{self.name}: not a ZIP file, or a truncated one ({exc}): an export is the ZIP file "
                    f"`npx convex export --path FILE.zip` writes, whole, or the directory it unpacks to"
                ) from None
            present = {n.rsplit("/", 1)[0] for n in self._zip.namelist() if n.endswith(f"/{DOCUMENTS}")}
        else:
            raise ExportError(f"{self.name}: no such file or directory")
        if EVENTS not in present and TABLES not in present:
            raise ExportError(
                f"{self.name}: not a Convex export (no {TABLES}/{DOCUMENTS} and no {EVENTS}/{DOCUMENTS}): make one "
                f"with `npx convex export --path FILE.zip` on the legacy deployment"
            )
        self._present = present
        self._listed = self._listed_tables() if TABLES in present else set()

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()

    def __enter__(self) -> Export:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def where(self, table: str) -> str:
        return f"{self.name}:{table}/{DOCUMENTS}"

    def has(self, table: str) -> bool:
        """Whether the export holds `table` (listed in _tables with no file: an empty table)."""
        return table in self._present or table in self._listed

    def require(self, table: str, why: str) -> None:
        if not self.has(table):
            raise ExportError(f"{self.name}: the export has no table {table} ({why}); export the whole deployment")

    def size(self, table: str) -> int:
        """Bytes of the table's documents.jsonl (uncompressed), for a progress bar; 0 when it has none."""
        if table not in self._present:
            return 0
        if self._zip is not None:
            return self._zip.getinfo(f"{table}/{DOCUMENTS}").file_size
        return (self.path / table / DOCUMENTS).stat().st_size

    def lines(self, table: str, progress: Progress | None = None) -> Iterator[tuple[int, bytes]]:
        """(line number, line) of the table's documents, blank lines left out; a read error names the line."""
        if table not in self._present:
            return
        where = self.where(table)
        number = 0
        try:
            with self._open(table) as handle:
                for number, line in enumerate(handle, start=1):
                    if progress is not None:
                        progress(len(line))
                    if line.strip():
                        yield number, line
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:
            raise ExportError(
                f"{where}:{number + 1}: cannot be read ({exc}): the file is damaged or truncated; export again"
            ) from None

    def _open(self, table: str) -> IO[bytes]:
        if self._zip is not None:
            return io.BufferedReader(self._zip.open(f"{table}/{DOCUMENTS}"), buffer_size=1 << 20)  # type: ignore[arg-type]
        return (self.path / table / DOCUMENTS).open("rb", buffering=1 << 20)

    def _listed_tables(self) -> set[str]:
        names = set()
        for number, line in self.lines(TABLES):
            document = _document(line, self.where(TABLES), number)
            if isinstance(document.get("name"), str):
                names.add(document["name"])
        return names

    # ------------------------------------------------------------------ the tables

    def cursor(self) -> float | None:
        """The daily processor's `cursorCreationTime` (None: it processed nothing); its document must be there."""
        self.require(CURSORS, "the daily processor's cursor")
        where = self.where(CURSORS)
        found: tuple[int, float | None] | None = None
        for number, line in self.lines(CURSORS):
            document = _document(line, where, number)
            if document.get("key") != CURSOR_KEY:
                continue  # other keys' documents: not ours
            if found is not None:
                raise ExportError(
                    f"{where}:{number}: a second document with key {CURSOR_KEY!r} (the first: line "
                    f"{found[0]}): which one the daily processor read is unknown"
                )
            value = document.get("cursorCreationTime")
            if value is not None and not _is_number(value):
                raise ExportError(f"{where}:{number}: cursorCreationTime must be a number, got {_show(value)}")
            found = (number, None if value is None else float(value))
        if found is None:
            raise ExportError(
                f"{where}: no document with key {CURSOR_KEY!r}, the daily processor's cursor: without it, which "
                f"events skillDailyStats and the hourly stats already hold cannot be known. Export the deployment "
                f"the events come from, after its daily processor ran at least once"
            )
        return found[1]

    def events(self, progress: Progress | None = None) -> Iterator[LegacyEvent]:
        self.require(EVENTS, "the stat events")
        where = self.where(EVENTS)
        for number, line in self.lines(EVENTS, progress):
            yield parse_event(_document(line, where, number), where, number)

    def history(self, progress: Progress | None = None) -> Iterator[HistoryRow]:
        self.require(DAILY, "the old daily rows --history reads")
        where = self.where(DAILY)
        for number, line in self.lines(DAILY, progress):
            yield parse_history(_document(line, where, number), where, number)


class Duplicates:
    """Refuses an `_id` seen before in the same table (ExportError naming the second line and the first).

    Convex never writes one `_id` twice; an export that does was spliced or damaged, and its copies
    may differ (one processed, one not), so which one counts is unknowable: refused, not guessed.
    Why a temporary SQLite file: the ids seen must be kept for the whole pass, and memory must not
    grow with the export; the file does (about 60 bytes per id, deleted on close), memory stays at
    SQLite's page cache. One indexed insert per chunk of ids."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._dir = tempfile.TemporaryDirectory(prefix="skillstats-legacy-")
        self._db = sqlite3.connect(Path(self._dir.name) / "ids.sqlite")
        self._db.execute("PRAGMA journal_mode=OFF")
        self._db.execute("PRAGMA synchronous=OFF")
        self._db.execute("CREATE TABLE seen (id TEXT PRIMARY KEY, line INTEGER NOT NULL) WITHOUT ROWID")

    def check(self, chunk: list[tuple[str, int]]) -> None:
        """(id, line) of the next documents, in file order."""
        first: dict[str, int] = {}
        for doc_id, number in chunk:
            if doc_id in first:
                self._refuse(doc_id, number, first[doc_id])
            first[doc_id] = number
        ids = list(first)
        for start in range(0, len(ids), 500):  # SQLite's bound-parameter limit
            part = ids[start : start + 500]
            marks = ",".join("?" * len(part))
            for doc_id, earlier in self._db.execute(f"SELECT id, line FROM seen WHERE id IN ({marks})", part):
                self._refuse(doc_id, first[doc_id], earlier)
        self._db.executemany("INSERT INTO seen VALUES (?, ?)", first.items())

    def _refuse(self, doc_id: str, number: int, earlier: int) -> None:
        self.close()
        raise ExportError(
            f"{self.where}:{number}: _id {doc_id!r} again (first at line {earlier}): Convex never writes an _id "
            f"twice, so the export is spliced or damaged and which copy counts is unknown; export again"
        )

    def close(self) -> None:
        self._db.close()
        self._dir.cleanup()


def _document(line: bytes, where: str, number: int) -> dict[str, Any]:
    try:
        document = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ExportError(f"{where}:{number}: not a JSON document ({exc})") from None
    if not isinstance(document, dict):
        raise ExportError(f"{where}:{number}: not a JSON object")
    return document


def _is_number(value: object) -> bool:
    return (type(value) is int or type(value) is float) and math.isfinite(value)  # type: ignore[arg-type]


def _integral(value: object, field: str, where: str, number: int) -> int:
    """A count or time Convex wrote as a float64: `12` or `12.0` is 12; anything else is refused."""
    if type(value) is int and abs(value) <= MAX_EXACT:
        return value
    if type(value) is float and value.is_integer() and abs(value) <= MAX_EXACT:
        return int(value)
    raise ExportError(f"{where}:{number}: {field} must be an integral number, got {_show(value)}")


def _whole(value: object, field: str, where: str, number: int) -> int:
    """A time or delta Convex wrote as a float64, judged against the contract's ranges afterwards: any integral
    value (`12`, `12.0`, `1e300`) is taken whatever its size; anything else is refused."""
    if type(value) is int:
        return value
    if type(value) is float and value.is_integer():  # finite: inf and nan are not integral
        return int(value)
    raise ExportError(f"{where}:{number}: {field} must be an integral number, got {_show(value)}")


def _show(value: object) -> str:
    if type(value) is int:
        text = str(value)  # any size (an integral float64 made int): at most 309 digits
    else:
        text = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode() if value is not None else "nothing"
    return text if len(text) <= 60 else text[:60] + "..."


def _header(document: dict[str, Any], where: str, number: int) -> tuple[str, float]:
    doc_id = document.get("_id")
    if type(doc_id) is not str or not doc_id:
        raise ExportError(f"{where}:{number}: a document without _id (a string): not a Convex export's document")
    created = document.get("_creationTime")
    if not _is_number(created):
        raise ExportError(f"{where}:{number}: _creationTime must be a number, got {_show(created)}")
    return doc_id, float(created)  # type: ignore[arg-type]


_LEGACY_NAMES = (("event_id", "_id"), ("skill_id", "skillId"), ("occurred_at", "occurredAt"), ("all_time", "allTime"))


def parse_event(document: dict[str, Any], where: str, number: int) -> LegacyEvent:
    """A `skillStatEvents` document as a LegacyEvent, or ExportError naming the line and what is wrong."""
    doc_id, created = _header(document, where, number)
    kind = document.get("kind")
    if type(kind) is not str or kind not in EFFECTS:
        raise ExportError(f"{where}:{number}: unknown kind {_show(kind)} (not one of {', '.join(KINDS)})")
    body: dict[str, Any] = {
        "v": 1,
        "event_id": doc_id,
        "skill_id": document.get("skillId"),
        "kind": kind,
        "occurred_at": _whole(document.get("occurredAt"), "occurredAt", where, number),
    }
    delta = document.get("delta")
    if EFFECTS[kind].uses_delta:
        if delta is None:
            # The schema makes it optional and the old processors counted nothing without one
            # (`if (event.delta)`): neither does the import.
            body["delta"] = {"all_time": 0, "current": 0}
        elif not isinstance(delta, dict):
            raise ExportError(f"{where}:{number}: delta must be an object {{allTime, current}}, got {_show(delta)}")
        else:
            body["delta"] = {
                "all_time": _whole(delta.get("allTime"), "delta.allTime", where, number),
                "current": _whole(delta.get("current"), "delta.current", where, number),
            }
    elif "delta" in document:
        raise ExportError(f"{where}:{number}: a delta on a {kind!r} event (only install_clear has one)")
    processed = document.get("processedAt")
    if processed is not None and not _is_number(processed):
        raise ExportError(f"{where}:{number}: processedAt must be a number or absent, got {_show(processed)}")
    if "processedAt" in document and processed is None:
        raise ExportError(f"{where}:{number}: processedAt is null (the schema has a number or nothing)")
    event = from_mapping(body, None, check_key=False)
    if isinstance(event, Invalid):
        message = event.message
        for wire, legacy in _LEGACY_NAMES:
            message = message.replace(wire, legacy)
        # Both fields are integers here and install_clear always has a delta, and there is no record timestamp:
        # these two reasons can only be the ranges (before 2000, after 9999, |delta| over 1e9). Everything else
        # (an id, the kind) was checked before them, so a document wrong in shape is refused whatever its range.
        if event.reason in (Reason.BAD_TIMESTAMP, Reason.BAD_DELTA):
            if event.reason is Reason.BAD_DELTA:
                all_time, current = body["delta"]["all_time"], body["delta"]["current"]
                message += f", got allTime {_show(all_time)}, current {_show(current)}"
            return LegacyEvent(doc_id, created, processed is not None, None, number, outside=message)
        raise ExportError(f"{where}:{number}: {message}")
    return LegacyEvent(doc_id, created, processed is not None, event, number)


def parse_history(document: dict[str, Any], where: str, number: int) -> HistoryRow:
    """A `skillDailyStats` document as a HistoryRow, or ExportError naming the line and what is wrong."""
    doc_id, created = _header(document, where, number)
    skill_id = document.get("skillId")
    if type(skill_id) is not str or not 1 <= len(skill_id) <= MAX_ID_CHARS:
        raise ExportError(f"{where}:{number}: skillId must be a string of 1-{MAX_ID_CHARS} characters")
    day = _whole(document.get("day"), "day", where, number)
    downloads = _integral(document.get("downloads"), "downloads", where, number)
    installs = _integral(document.get("installs"), "installs", where, number)
    outside = None
    if not FIRST_DAY <= day <= LAST_DAY:  # the old daily row of events outside the contract's years
        outside = f"day {_show(day)} is not a UTC day from 2000-01-01 to 9999-12-31"
    return HistoryRow(doc_id, created, skill_id, day, downloads, installs, number, outside)
