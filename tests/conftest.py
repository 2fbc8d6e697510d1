"""Fixtures: the real local Kafka broker, SQLite files and PostgreSQL databases.

Start the services with the README's test command (deploy/local/test.sh), or
by hand with deploy/local/kafka.sh and deploy/local/postgres.sh; a missing
service fails the tests that need it, loudly, rather than skipping them.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient
from sqlalchemy import create_engine, text

from skillstats.config import Settings
from skillstats.dlq import DLQ_TOPIC_CONFIG
from skillstats.kafka import ensure_topics
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade

KAFKA = os.environ.get("SKILLSTATS_TEST_KAFKA", "127.0.0.1:19092")
PG_ADMIN_URL = os.environ.get("SKILLSTATS_TEST_PG", "postgresql://postgres@127.0.0.1:55432/postgres")
METRICS_FILE = Path(os.environ.get("SKILLSTATS_TEST_METRICS", ".local/test-metrics.txt"))


def record_metric(line: str) -> None:
    """Figures measured by the tests (never asserted on), collected for the run's summary."""
    METRICS_FILE.parent.mkdir(parents=True, exist_ok=True)
    with METRICS_FILE.open("a") as handle:
        handle.write(line.rstrip() + "\n")


@pytest.fixture(autouse=True)
def _no_worker_outlives_its_test() -> Iterator[None]:
    from tests.helpers import WorkerProcess

    yield
    while WorkerProcess.started:
        worker = WorkerProcess.started.pop()
        if worker.process.poll() is None:
            worker.process.kill()
            worker.process.wait(30)


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    try:
        AdminClient({"bootstrap.servers": KAFKA}).list_topics(timeout=10)
    except Exception as exc:
        pytest.fail(f"no Kafka broker at {KAFKA} ({exc}); start it: KAFKA_PORT=19092 deploy/local/kafka.sh start")
    return KAFKA


@pytest.fixture(scope="session")
def postgres_admin_url() -> str:
    try:
        with create_engine(PG_ADMIN_URL.replace("postgresql://", "postgresql+psycopg://")).connect():
            pass
    except Exception as exc:
        pytest.fail(f"no PostgreSQL at {PG_ADMIN_URL} ({exc}); start it: deploy/local/postgres.sh start")
    return PG_ADMIN_URL


def _fresh_postgres_database(admin_url: str) -> Iterator[str]:
    name = f"skillstats_test_{uuid.uuid4().hex[:12]}"
    # pool_pre_ping: a fault test restarts the server, and the drop below must not use a dead connection.
    admin = create_engine(
        admin_url.replace("postgresql://", "postgresql+psycopg://"), isolation_level="AUTOCOMMIT", pool_pre_ping=True
    )
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin_url.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/skillstats.db"
    else:
        yield from _fresh_postgres_database(request.getfixturevalue("postgres_admin_url"))


@pytest.fixture
def settings(kafka_bootstrap: str, database_url: str) -> Settings:
    """Settings with a topic, DLQ and groups of this test's own; topics created, schema migrated."""
    run = uuid.uuid4().hex[:10]
    configured = Settings(
        kafka_bootstrap=kafka_bootstrap,
        database_url=database_url,
        topic=f"events-{run}",
        dlq_topic=f"events-{run}.dlq",
        windows_group=f"windows-{run}",
        docsync_group=f"docsync-{run}",
    )
    ensure_topics(
        configured,
        {configured.topic: 12, configured.dlq_topic: 3},
        configs={configured.dlq_topic: DLQ_TOPIC_CONFIG},
    )
    upgrade(open_engine(database_url))
    return configured


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that points a `skillstats` subprocess at these settings."""
    # No metrics port unless a test asks for one (--metrics-port): workers of one test share a host.
    return settings.child_env({**os.environ, "SKILLSTATS_METRICS_PORT": "0", "SKILLSTATS_METRICS_HOST": "127.0.0.1"})


@pytest.fixture
def registry_rows(settings: Settings) -> dict[str, str | None]:
    """The registry's skills and owners (tests.helpers.registry), seeded for the doc-stat tables."""
    from tests.helpers import registry, seed_registry

    rows = registry(seed=11)
    seed_registry(settings, rows)
    return rows
