"""The command line: init is idempotent, every command explains itself."""

from __future__ import annotations

import uuid

import pytest

from skillstats.config import Settings
from skillstats.kafka import partition_count
from skillstats.sinks.migrate import head_revision
from tests.test_publish import cli


@pytest.mark.parametrize("command", ["init", "publish", "windows", "docsync", "status", "bench", "fences"])
def test_every_command_has_help(command: str) -> None:
    result = cli(Settings(), command, "--help")
    assert result.returncode == 0
    assert "--bootstrap" in result.stdout and "SKILLSTATS_" in result.stdout


def test_init_creates_topics_and_schema_once(kafka_bootstrap: str, database_url: str) -> None:
    run = uuid.uuid4().hex[:8]
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap, database_url=database_url, topic=f"init-{run}", dlq_topic=f"init-{run}.dlq"
    )
    first = cli(settings, "init", "--partitions", "6")
    assert first.returncode == 0, first.stderr
    assert f"topic init-{run}: created, 6 partitions" in first.stdout
    assert f"migrated empty -> {head_revision()}" in first.stdout
    second = cli(settings, "init", "--partitions", "6")
    assert second.returncode == 0, second.stderr
    assert f"topic init-{run}: exists, 6 partitions" in second.stdout and "up to date" in second.stdout
    assert partition_count(settings, settings.dlq_topic) == 3


def test_init_against_a_missing_broker_fails_with_a_message(tmp_path: object) -> None:
    settings = Settings(kafka_bootstrap="127.0.0.1:1", database_url="sqlite:///:memory:")
    result = cli(settings, "init", "--timeout", "2")
    assert result.returncode == 1
    assert "skillstats init:" in result.stderr and "Traceback" not in result.stderr
