"""The command line: init is idempotent, every command explains itself."""

from __future__ import annotations

import uuid

import pytest

from skillstats.config import Settings
from skillstats.kafka import partition_count
from skillstats.sinks.migrate import head_revision
from tests.test_publish import cli

KAFKA_COMMANDS = [
    ["init"],
    ["publish"],
    ["windows"],
    ["docsync"],
    ["status"],
    ["bench"],
    ["fences", "show"],
    ["fences", "reset"],
    ["fences", "takeover"],
    ["dlq", "list"],
    ["dlq", "replay"],
    ["prune"],
    ["lag-exporter"],
]


@pytest.mark.parametrize("command", KAFKA_COMMANDS, ids=" ".join)
def test_every_command_has_help(command: list[str]) -> None:
    result = cli(Settings(), *command, "--help")
    assert result.returncode == 0
    assert "--bootstrap" in result.stdout and "SKILLSTATS_" in result.stdout


def test_a_command_lists_only_the_options_it_uses() -> None:
    top = cli(Settings(), "top", "--help")
    assert top.returncode == 0 and "--database-url" in top.stdout and "--bootstrap" not in top.stdout
    listing = cli(Settings(), "dlq", "list", "--help")
    assert "--again" not in listing.stdout and "--limit" in listing.stdout
    assert cli(Settings(), "dlq", "list", "--all", "--again").returncode == 2


def test_a_bare_command_lists_the_commands_and_a_typo_names_the_nearest() -> None:
    bare = cli(Settings())
    assert bare.returncode == 0 and all(name in bare.stdout for name in ("windows", "docsync", "fences", "dlq"))
    typo = cli(Settings(), "statsu")
    assert typo.returncode == 2 and "did you mean 'status'?" in typo.stderr


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


def test_init_refuses_a_compacted_events_topic_and_notes_log_append_time(
    kafka_bootstrap: str, tmp_path: object
) -> None:
    """Compaction keeps one record per key (per skill): it would delete events no group counted. LogAppendTime
    stamps records with the broker's clock, which bounds occurred_at (docs/contract.md): said, not refused."""
    from confluent_kafka.admin import AdminClient, NewTopic

    run = uuid.uuid4().hex[:8]
    compacted = Settings(
        kafka_bootstrap=kafka_bootstrap,
        database_url=f"sqlite:///{tmp_path}/c.db",
        topic=f"compacted-{run}",
        dlq_topic=f"compacted-{run}.dlq",
    )
    stamped = Settings(
        kafka_bootstrap=kafka_bootstrap,
        database_url=f"sqlite:///{tmp_path}/s.db",
        topic=f"stamped-{run}",
        dlq_topic=f"stamped-{run}.dlq",
    )
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    futures = admin.create_topics(
        [
            NewTopic(compacted.topic, 3, 1, config={"cleanup.policy": "compact"}),
            NewTopic(stamped.topic, 3, 1, config={"message.timestamp.type": "LogAppendTime"}),
        ]
    )
    for future in futures.values():
        future.result(30)
    refused = cli(compacted, "init")
    assert refused.returncode == 2, refused.stderr
    assert "cleanup.policy is 'compact'" in refused.stderr and "cleanup.policy=delete" in refused.stderr
    status = cli(compacted, "status")
    assert "TOPIC CONFIGURATION: cleanup.policy is 'compact'" in status.stdout, status.stdout + status.stderr
    noted = cli(stamped, "init")
    assert noted.returncode == 0, noted.stderr
    assert "LogAppendTime" in noted.stderr and "bad_timestamp" in noted.stderr
