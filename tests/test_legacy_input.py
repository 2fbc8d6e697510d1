"""`skillstats legacy` refuses an export that does not fit the old schema: one line naming the file and the line,
exit status 2, and nothing written (every line is validated before the first write; the bad lines here sit past
the first chunks, so an import that wrote as it read would have written)."""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from sqlalchemy import func, select

from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.schema import legacy_manifest, skill_daily_stats, skill_hourly_stats, skills
from tests.test_legacy import OldSystem, legacy

EVENTS = "skillStatEvents/documents.jsonl"
CURSORS = "skillStatUpdateCursors/documents.jsonl"
DAILY = "skillDailyStats/documents.jsonl"


def _old() -> OldSystem:
    old = OldSystem(7)
    old.write(300)
    old.daily_run(0.5)
    old.doc_sync(0.5)
    return old


def _rewrite(path: Path, table: str, change: Callable[[list[bytes]], list[bytes]]) -> None:
    file = path / table
    file.write_bytes(b"".join(change(file.read_bytes().splitlines(keepends=True))))


def _event_at(line: int, change: Callable[[dict[str, Any]], None]) -> Callable[[list[bytes]], list[bytes]]:
    def edit(lines: list[bytes]) -> list[bytes]:
        document = orjson.loads(lines[line - 1])
        change(document)
        lines[line - 1] = orjson.dumps(document) + b"\n"
        return lines

    return edit


def _set(**values: Any) -> Callable[[dict[str, Any]], None]:
    return lambda document: document.update(values)


def _drop(name: str) -> Callable[[dict[str, Any]], None]:
    return lambda document: document.pop(name)


CASES: dict[str, tuple[str, Callable[[list[bytes]], list[bytes]], str]] = {
    # name: (file, how it is spoiled, what the one line says after "file:line: ")
    "unknown kind": (EVENTS, _event_at(250, _set(kind="like")), 'unknown kind "like"'),
    "delta on the wrong kind": (
        EVENTS,
        _event_at(250, _set(kind="download", delta={"allTime": 1, "current": 1})),
        "a delta on a 'download' event (only install_clear has one)",
    ),
    "non-integral occurredAt": (EVENTS, _event_at(250, _set(occurredAt=1764460800000.5)), "occurredAt must be an"),
    "non-integral delta": (
        EVENTS,
        _event_at(250, _set(kind="install_clear", delta={"allTime": -1.5, "current": 0})),
        "delta.allTime must be an integral number, got -1.5",
    ),
    "document without _id": (EVENTS, _event_at(250, _drop("_id")), "a document without _id"),
    "not JSON": (EVENTS, lambda lines: [*lines[:249], b'{"_id": "x",\n', *lines[250:]], "not a JSON document"),
    "non-integral count": (DAILY, _event_at(2, _set(installs=0.25)), "installs must be an integral number, got 0.25"),
    # Outside the contract's ranges as well, but wrong in shape: refused (the ranges alone are not:
    # tests/test_legacy_ranges.py).
    "skillId too long, occurredAt before 2000": (
        EVENTS,
        _event_at(250, _set(skillId="s" * 129, occurredAt=5)),
        "skillId must be a string of 1-128 characters",
    ),
    "non-integral delta over 1e9": (
        EVENTS,
        _event_at(250, _set(kind="install_clear", delta={"allTime": -2e9 - 0.5, "current": 0})),
        "delta.allTime must be an integral number",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_line_that_does_not_fit_is_refused_naming_file_and_line(tmp_path: Path, case: str) -> None:
    table, spoil, said = CASES[case]
    url = f"sqlite:///{tmp_path}/db.sqlite"
    upgrade(open_engine(url))
    old = _old()
    old.move_registry(url)
    export = old.export(tmp_path / "export", as_zip=False)
    _rewrite(export, table, spoil)
    line = 2 if table == DAILY else 250
    for action in (["plan", "--history"], ["import", "--history", "--confirm", "IMPORT_LEGACY", "--chunk-size", "10"]):
        status, out, err = legacy(action[0], str(export), *action[1:], url=url)
        assert status == 2, (out, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"skillstats legacy: {export}:{table}:{line}: "), err
        assert said in lines[0]
    assert _written(url) == (0, 0, 0, 0)


def _written(url: str) -> tuple[int, int, int, int]:
    """Manifest rows, hourly rows, daily rows, and skills whose totals moved off the old ones (none here)."""
    engine = open_engine(url)
    with engine.connect() as connection:
        counts = [
            int(connection.execute(select(func.count()).select_from(t)).scalar_one())
            for t in (legacy_manifest, skill_hourly_stats, skill_daily_stats)
        ]
        stamped = connection.execute(select(func.count()).where(skills.c.stats_updated_at.is_not(None))).scalar_one()
    engine.dispose()
    return (*counts, int(stamped))  # type: ignore[return-value]


def test_an_export_spoiled_past_the_first_chunks_writes_nothing_on_either_database(
    database_url: str, tmp_path: Path
) -> None:
    upgrade(open_engine(database_url))
    old = _old()
    old.move_registry(database_url)
    export = old.export(tmp_path / "export", as_zip=False)
    _rewrite(export, EVENTS, _event_at(299, _set(kind="Download")))
    status, _out, err = legacy(
        "import", str(export), "--confirm", "IMPORT_LEGACY", "--chunk-size", "5", url=database_url
    )
    assert status == 2 and f"{export}:{EVENTS}:299: unknown kind" in err
    assert _written(database_url) == (0, 0, 0, 0)


def _zip(tmp_path: Path) -> Path:
    return _old().export(tmp_path / "export", as_zip=True)


def _truncated(tmp_path: Path) -> Path:
    path = _zip(tmp_path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])
    return path


def _not_an_export(tmp_path: Path) -> Path:
    path = tmp_path / "notes.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes/readme.txt", "hello")
    return path


def _text_file(tmp_path: Path) -> Path:
    path = tmp_path / "events.jsonl"
    path.write_text('{"_id": "a"}\n')
    return path


def _no_cursor(tmp_path: Path) -> Path:
    path = _old().export(tmp_path / "export", as_zip=False)
    _rewrite(path, CURSORS, lambda lines: [line for line in lines if b'"skill_stat_events"' not in line])
    return path


def _no_events_table(tmp_path: Path) -> Path:
    path = tmp_path / "export.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("_tables/documents.jsonl", b'{"name": "skills", "id": 1}\n')
        archive.writestr(CURSORS, b'{"_id": "c", "_creationTime": 1.0, "key": "skill_stat_events"}\n')
    return path


WHOLE_FILE: dict[str, tuple[Callable[[Path], Path], str]] = {
    "truncated zip": (_truncated, "not a ZIP file, or a truncated one"),
    "zip that is not an export": (_not_an_export, "not a Convex export"),
    "a text file": (_text_file, "not a ZIP file"),
    "no cursor document": (_no_cursor, f"{CURSORS}: no document with key 'skill_stat_events'"),
    "no events table": (_no_events_table, "the export has no table skillStatEvents"),
}


@pytest.mark.parametrize("case", list(WHOLE_FILE))
def test_a_file_that_is_not_a_whole_export_is_refused_in_one_line(tmp_path: Path, case: str) -> None:
    make, said = WHOLE_FILE[case]
    url = f"sqlite:///{tmp_path}/db.sqlite"
    upgrade(open_engine(url))
    path = make(tmp_path)
    status, _out, err = legacy("import", str(path), "--confirm", "IMPORT_LEGACY", url=url)
    assert status == 2
    assert len(err.strip().splitlines()) == 1 and said in err and str(path) in err
    assert _written(url) == (0, 0, 0, 0)
