"""The main job on one machine: publish a demo workload, let the windows worker
count it into SQLite, print the daily and hourly rows, and check them.

Run through deploy/local/demo.sh, which brings up Kafka first. Each run uses
topics and a consumer group of its own, so runs never see each other's events.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import orjson
from sqlalchemy import func, select
from tqdm import tqdm

from skillstats.config import LIBRDKAFKA_LOG, Settings
from skillstats.kafka import end_offsets, ensure_topics
from skillstats.publisher import Publisher
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade
from skillstats.sinks.schema import skill_daily_stats, skill_hourly_stats
from skillstats.sinks.windows import WindowsSink
from skillstats.workload import generate

EVENTS = int(os.environ.get("DEMO_EVENTS", "20000"))


def main() -> int:
    # librdkafka's own lines (a coordinator still loading, brokers connecting) would cut
    # through the progress bars: the CLI shows them only with -v, and so does this.
    LIBRDKAFKA_LOG.setLevel(logging.CRITICAL)
    state = Path(os.environ.get("SKILLSTATS_STATE_DIR", Path(__file__).resolve().parents[2] / ".local"))
    state.mkdir(parents=True, exist_ok=True)
    database = state / "demo.db"
    for leftover in state.glob("demo.db*"):
        leftover.unlink()
    run = time.strftime("%Y%m%d-%H%M%S")
    settings = Settings.from_env().override(
        database_url=f"sqlite:///{database}",
        topic=f"demo-{run}",
        dlq_topic=f"demo-{run}.dlq",
        windows_group=f"demo-{run}-windows",
    )
    print(f"Kafka {settings.kafka_bootstrap}, topic {settings.topic}, SQLite {database}")
    ensure_topics(settings, {settings.topic: 12, settings.dlq_topic: 3})
    engine = open_engine(settings.database_url)
    upgrade(engine)

    log_path = state / "demo-worker.log"
    env = settings.child_env()
    with log_path.open("wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "skillstats.cli", "windows", "--log-level", "info", "--metrics-port", "0"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    print(f"windows worker started (pid {worker.pid}, log {log_path})")
    try:
        records = list(generate(EVENTS, now_ms=int(time.time() * 1000), skills=300, invalid_ratio=0.002))
        started = time.monotonic()
        with Publisher(settings) as publisher:
            for record in tqdm(records, desc="publishing", unit="ev", mininterval=0.5):
                publisher.send_raw(record.key, record.value)
        sink = WindowsSink(engine, settings.windows_group, settings.topic)
        ends = end_offsets(settings, settings.topic)
        with tqdm(total=sum(ends.values()), desc="applying  ", unit="ev", mininterval=0.5) as bar:
            while (applied := sum(min(sink.fences().get(p, 0), end) for p, end in ends.items())) < bar.total:
                if worker.poll() is not None:
                    print(f"the worker exited ({worker.returncode}); see {log_path}", file=sys.stderr)
                    return 1
                bar.update(applied - bar.n)
                time.sleep(0.2)
            bar.update(applied - bar.n)
        elapsed = time.monotonic() - started
        print(f"\n{len(records)} events published and counted in {elapsed:.1f}s\n")
        show(engine)
        return check(engine, records, sum(end_offsets(settings, settings.dlq_topic).values()))
    finally:
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(60)
        print(f"windows worker stopped (exit status {code})")


def show(engine: object) -> None:
    with engine.connect() as connection:  # type: ignore[attr-defined]
        print("skill_daily_stats, busiest 8 rows:")
        print(f"  {'skill_id':<12} {'day':<12} {'downloads':>9} {'installs':>8}")
        for row in connection.execute(
            select(skill_daily_stats)
            .order_by(skill_daily_stats.c.downloads.desc(), skill_daily_stats.c.skill_id)
            .limit(8)
        ):
            print(f"  {row.skill_id:<12} {row.day!s:<12} {row.downloads:>9} {row.installs:>8}")
        print("\nskill_hourly_stats, the 8 most recent hours of the busiest skill:")
        busiest = connection.execute(
            select(skill_hourly_stats.c.skill_id)
            .group_by(skill_hourly_stats.c.skill_id)
            .order_by(func.sum(skill_hourly_stats.c.downloads).desc())
            .limit(1)
        ).scalar()
        print(f"  {'skill_id':<12} {'hour (UTC)':<20} {'downloads':>9} {'installs':>8}")
        for row in connection.execute(
            select(skill_hourly_stats)
            .where(skill_hourly_stats.c.skill_id == busiest)
            .order_by(skill_hourly_stats.c.hour.desc())
            .limit(8)
        ):
            print(f"  {row.skill_id:<12} {row.hour!s:<20} {row.downloads:>9} {row.installs:>8}")


def check(engine: object, records: list, parked: int) -> int:
    kinds = Counter(orjson.loads(r.value)["kind"] for r in records if r.valid)
    with engine.connect() as connection:  # type: ignore[attr-defined]
        downloads, installs = connection.execute(
            select(func.sum(skill_daily_stats.c.downloads), func.sum(skill_daily_stats.c.installs))
        ).one()
        hourly = connection.execute(select(func.sum(skill_hourly_stats.c.downloads))).scalar()
    invalid = sum(1 for r in records if not r.valid)
    ok = downloads == hourly == kinds["download"] and installs == kinds["install_new"] and parked == invalid
    print(
        f"\ncheck: {kinds['download']} download and {kinds['install_new']} install_new events published; "
        f"SQL counts {downloads} downloads and {installs} installs by day, {hourly} downloads by hour"
        f"; {invalid} invalid records published, {parked} parked in the DLQ -> {'exact' if ok else 'MISMATCH'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
