"""The cut-over as it happens: new events flow through Kafka into a live `windows` worker and a `docsync` drain
while the legacy import runs on the same database; afterwards the tables hold what one system counting every
event once (the old ones and the live ones) would hold, on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from skillstats.config import Settings
from skillstats.legacy.export import Export
from skillstats.legacy.importer import Importer
from skillstats.sinks.db import open_engine
from skillstats.workload import generate
from tests.helpers import WorkerProcess, caught_up, fences, publish, run_docsync, wait_until
from tests.test_legacy import check_moved, history_of_a_registry


@pytest.mark.faults  # a broker (or a process) stopped mid-run: the fault suite
def test_an_import_beside_live_windows_and_docsync_adds_up(settings: Settings, tmp_path: Path) -> None:
    old = history_of_a_registry(31)
    old.move_registry(settings.database_url)
    live = list(generate(3000, now_ms=int(time.time() * 1000), skills=30, seed=31))
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    publish(settings, live[:1500])
    docsync_before = fences(settings, settings.docsync_group)

    engine = open_engine(settings.database_url)
    importer = Importer(engine, chunk_size=20)
    failures: list[BaseException] = []

    def run_import() -> None:
        try:
            with Export(old.export(tmp_path / "snapshot", as_zip=True)) as export:
                plan = importer.plan(export, history=True)
                importer.check(plan, allow_older_rows=False, allow_empty_registry=False, allow_unknown_skills=True)
                outcome = importer.run(export, plan, history=True)
                assert outcome.chunks > 5 and not outcome.stopped
        except BaseException as exc:  # handed to the test thread
            failures.append(exc)

    importing = threading.Thread(target=run_import)
    importing.start()
    publish(settings, live[1500:])
    importing.join(300)
    engine.dispose()
    assert not importing.is_alive() and not failures, failures
    assert fences(settings, settings.docsync_group) == docsync_before  # the import moved no fence
    status, summaries = run_docsync(settings)
    assert status == 0 and summaries[-1]["events_read"] == len(live)
    wait_until(caught_up(settings, settings.windows_group, worker), 180, "the windows worker to catch up")
    assert worker.terminate() == 0
    check_moved(old, settings.database_url, hourly_from=old.cursor, live=live)
