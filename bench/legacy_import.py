"""`skillstats bench`, case j: `skillstats legacy import` of a synthetic Convex export, events/s and peak RSS.

The export is the old deployment's history as bench/legacy_export.py's `Deployment` makes it (events
created over time, the daily processor run up to a cursor, the doc sync marking most processed, a
prune), `--import-events` events long, written once as a ZIP. Into each database (a fresh SQLite
file, and a fresh database on the PostgreSQL server of `--postgres`, created and dropped here: an
import records its export's marks, so a database that held an earlier run's would refuse the next),
the registry's `skills` rows are loaded with the old totals, as the runbook does, then
`skillstats legacy import EXPORT --history --confirm IMPORT_LEGACY --allow-unknown-skills` runs as a
process of its own, timed from its start to its exit: the plan's pass (reading and validating every
line) and the applying pass, a transaction per 2,000 events. `wait4` gives its CPU time, /proc its peak
RSS (bench/measure.py, `Watched`).

What the import reports and what the tables then hold are checked against the model before a
figure is reported (RuntimeError otherwise): a benchmark of an import that counted wrong is no
benchmark.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.engine import make_url

from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.schema import legacy_manifest, skill_daily_stats, skill_hourly_stats, skills

from .legacy_export import Deployment, load_registry
from .measure import Watched, log

DAYS = 30  # the history's length: events created over a month


@dataclass
class ImportRun:
    """One timed `skillstats legacy import` into one database."""

    database: str
    events: int  # in the export
    wall_seconds: float  # process start to exit
    cpu_seconds: float  # user + system
    peak_rss_mb: float
    applied: dict[str, int]  # per target, from the import's own summary
    unknown_skill_events: int
    manifest_rows: int

    @property
    def rate(self) -> float:
        return self.events / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def cpu_per_million(self) -> float:
        return self.cpu_seconds * 1_000_000 / self.events if self.events else 0.0


@dataclass
class Built:
    """The synthetic export: its model (figures, registry, old totals), its file, how long writing it took."""

    deployment: Deployment
    path: Path
    seconds: float
    size_bytes: int


def build_export(scratch: Path, events: int, *, skills: int = 20_000, seed: int = 29) -> Built:
    deployment = Deployment(events, seed=seed, skills=skills, days=DAYS)
    log(f"j. writing a synthetic Convex export of {events:,} events")
    started = time.monotonic()
    path = deployment.write(scratch / "legacy-export", as_zip=True)
    return Built(deployment, path, time.monotonic() - started, path.stat().st_size)


def import_into(label: str, url: str, built: Built, scratch: Path) -> ImportRun:
    """Load the registry with its old totals into the (fresh) database `url`, then time the import of the export
    into it; check what it reports and what the tables hold against the model."""
    deployment, figures = built.deployment, built.deployment.figures
    engine = open_engine(url)
    try:
        upgrade(engine)
        load_registry(engine, deployment.registry, deployment.totals)
    finally:
        engine.dispose()
    argv = [
        *(sys.executable, "-m", "skillstats.cli", "legacy", "import", str(built.path), "--history"),
        *("--confirm", "IMPORT_LEGACY", "--allow-unknown-skills", "--json"),
    ]
    out, err = scratch / f"import-{label}.out", scratch / f"import-{label}.err"
    log(f"j. skillstats legacy import ({label}): starting")
    with out.open("wb") as stdout, err.open("wb") as stderr:
        started = time.monotonic()
        process = subprocess.Popen(
            argv, env={**os.environ, "SKILLSTATS_DATABASE_URL": url}, stdout=stdout, stderr=stderr
        )
        status, cpu, peak = Watched(process).wait()
        wall = time.monotonic() - started
    if status != 0:
        raise RuntimeError(f"skillstats legacy import ({label}) exited with {status}: {err.read_text()[-1000:]}")
    summary = json.loads(out.read_text().strip().splitlines()[-1])["import"]
    run = ImportRun(
        label,
        figures.exported,
        wall,
        cpu,
        peak,
        summary["applied"],
        summary["unknown_skill_events"],
        0,
    )
    owed = {"windows": figures.owed_windows, "skills": figures.owed_skills, "history": figures.history_rows}
    if run.applied != owed or run.unknown_skill_events != figures.unknown_skill_events or summary["stopped"]:
        raise RuntimeError(
            f"skillstats legacy import ({label}) applied {run.applied} ({run.unknown_skill_events} for skills with "
            f"no row), the model owes {owed} ({figures.unknown_skill_events})"
        )
    held = table_sums(url)
    run.manifest_rows = held.pop("manifest rows")
    want = {"daily": figures.daily, "hourly": figures.hourly, "skills": figures.skills}
    if held != want or run.manifest_rows != sum(owed.values()):
        raise RuntimeError(
            f"after skillstats legacy import ({label}) the tables hold {held} and {run.manifest_rows:,} manifest "
            f"rows; one system counting every event once holds {want} and {sum(owed.values()):,}"
        )
    log(
        f"j. skillstats legacy import ({label}): {run.rate:,.0f} events/s, {run.wall_seconds:.1f} s, "
        f"{run.peak_rss_mb:.0f} MiB peak RSS"
    )
    return run


def table_sums(url: str) -> dict[str, Any]:
    """What the tables hold, summed: (downloads, installs) of the daily and hourly rows, the skills' three
    totals, and the manifest's rows."""
    engine = open_engine(url)
    try:
        with engine.connect() as connection:

            def sums(*columns: Any) -> list[int]:
                row = connection.execute(select(*(func.coalesce(func.sum(c), 0) for c in columns))).one()
                return [int(value) for value in row]

            return {
                "daily": sums(skill_daily_stats.c.downloads, skill_daily_stats.c.installs),
                "hourly": sums(skill_hourly_stats.c.downloads, skill_hourly_stats.c.installs),
                "skills": sums(skills.c.downloads, skills.c.installs_all_time, skills.c.installs_current),
                "manifest rows": int(
                    connection.execute(select(func.count()).select_from(legacy_manifest)).scalar_one()
                ),
            }
    finally:
        engine.dispose()


def measure(databases: Mapping[str, str], built: Built, scratch: Path) -> list[ImportRun]:
    """The import timed into each of `databases` (label -> URL of a fresh database, migrated or empty)."""
    return [import_into(label, url, built, scratch) for label, url in databases.items()]


def render(built: Built, runs: list[ImportRun]) -> str:
    """Case j's markdown section."""
    deployment, figures = built.deployment, built.deployment.figures
    rows = [
        f"| {r.database} | {r.events:,} | {r.rate:,.0f} | {r.wall_seconds:.1f} s | {r.cpu_per_million:.1f} "
        f"| {r.peak_rss_mb:.0f} MiB | {r.applied['windows']:,} | {r.applied['skills']:,} | {r.applied['history']:,} "
        f"| {r.manifest_rows:,} |"
        for r in runs
    ]
    return "\n".join(
        [
            "### Moving in: legacy import (case j)",
            "",
            f"A synthetic Convex export of the legacy system (bench/legacy_export.py): {figures.exported:,} events "
            f"over {deployment.skills:,} skills (2 in 3 with a row in `skills`) created in {deployment.days:.0f} days, "
            f"{figures.owed_windows:,} above the daily cursor, {figures.unprocessed:,} without processedAt, "
            f"{figures.history_rows:,} skillDailyStats rows; a {built.size_bytes / 2**20:.1f} MiB ZIP, "
            f"written in {built.seconds:.1f} s. `skillstats legacy import --history` into a fresh database holding "
            "the registry's rows with the old totals, process start to exit: the plan's pass (every line read and "
            "validated) and the applying pass, a transaction per 2,000 events.",
            "",
            "| database | events | events/s | wall | CPU s per million events | peak RSS | windows applied "
            "| skills applied | history applied | manifest rows |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "Each import applied what the model owes, and the daily, hourly and skills totals then equalled those of "
            "one system counting every event once.",
        ]
    )


@contextlib.contextmanager
def fresh_databases(databases: Mapping[str, str], scratch: Path) -> Iterator[dict[str, str]]:
    """A fresh database per one of the bench's: a new SQLite file in `scratch`; a new database on the PostgreSQL
    server (dropped on the way out)."""
    fresh: dict[str, str] = {}
    created: list[tuple[Any, str]] = []
    try:
        for label, url in databases.items():
            parsed = make_url(url)
            if parsed.get_backend_name() == "sqlite":
                fresh[label] = f"sqlite:///{scratch / f'legacy-{len(fresh)}.db'}"
                continue
            name = f"skillstats_bench_legacy_{uuid.uuid4().hex[:10]}"
            admin = open_engine(url, isolation_level="AUTOCOMMIT")
            with admin.connect() as connection:
                connection.execute(text(f'CREATE DATABASE "{name}"'))
            created.append((admin, name))
            fresh[label] = parsed.set(database=name).render_as_string(hide_password=False)
        yield fresh
    finally:
        for admin, name in created:
            with admin.connect() as connection:
                connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            admin.dispose()


def bench_case(databases: Mapping[str, str], events: int, skills: int = 20_000) -> str:
    """Case j as `skillstats bench` runs it: the export written, imported into a fresh database per database."""
    with tempfile.TemporaryDirectory(prefix="skillstats-bench-legacy-") as directory:
        scratch = Path(directory)
        built = build_export(scratch, events, skills=skills)
        with fresh_databases(databases, scratch) as fresh:
            runs = measure(fresh, built, scratch)
    return render(built, runs)
