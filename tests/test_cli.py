"""The command line: init is idempotent, every command explains itself."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from skillstats.config import Settings
from skillstats.kafka import partition_count
from skillstats.sinks.db import open_engine
from skillstats.sinks.identity import WINDOWS, Owner, claim
from skillstats.sinks.migrate import head_revision, upgrade
from skillstats.sinks.upserts import now_utc_naive
from tests.test_publish import cli

KAFKA_COMMANDS = [
    ["init"],
    ["publish"],
    ["ingest"],
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


@pytest.mark.parametrize("argv", [[], ["--help"], ["publish", "--help"], ["windows", "--help"], ["status", "--help"]])
def test_help_imports_neither_the_benchmark_nor_a_consumer(argv: list[str]) -> None:
    """The command list and a command's help load only the CLI: the benchmark, faust, SQL and librdkafka stay out."""
    probe = (
        "import sys\n"
        "from skillstats.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = {'skillstats_bench', 'faust', 'sqlalchemy', 'confluent_kafka'}\n"
        "print('LOADED', sorted(heavy & {m.split('.')[0] for m in sys.modules}), file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "LOADED []" in result.stderr, result.stderr


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
    # Log ends, fences and lag are offsets (a transaction's marker takes one and holds no record): said so.
    assert "0 offsets ever written" in status.stdout and "lag offsets" in status.stdout, status.stdout
    assert "records" not in status.stdout.split("windows tables:")[0], status.stdout
    noted = cli(stamped, "init")
    assert noted.returncode == 0, noted.stderr
    assert "LogAppendTime" in noted.stderr and "bad_timestamp" in noted.stderr


def test_a_topic_that_does_not_exist_is_exit_2_in_one_line(kafka_bootstrap: str, tmp_path: Path) -> None:
    """`status` and `dlq list` said `LookupError` with exit 1 (issue 28): like every command, they say the one line
    and exit 2. Only the events topic gets the database's hint: the DLQ topic is not one the database counts."""
    run = uuid.uuid4().hex[:8]
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap,
        database_url=f"sqlite:///{tmp_path}/s.db",
        topic=f"missing-{run}",
        dlq_topic=f"missing-{run}.dlq",
        windows_group=f"windows-{run}",
        docsync_group=f"docsync-{run}",
    )
    engine = open_engine(settings.database_url)
    upgrade(engine)
    claim(engine, Owner(WINDOWS, settings.windows_group, f"counted-{run}", None), now_utc_naive())
    engine.dispose()
    for command, topic in ((["status"], settings.topic), (["dlq", "list"], settings.dlq_topic)):
        result = cli(settings, *command)
        assert result.returncode == 2, result.stdout + result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "LookupError" not in lines[0], result.stderr
        assert lines[0].startswith(f"skillstats {command[0]}: topic {topic!r} does not exist on {kafka_bootstrap}")
        hinted = f"counts topic 'counted-{run}' (windows), not {topic!r}" in lines[0]
        assert hinted == (topic == settings.topic), lines[0]
        assert result.stdout == ""


def _parsers() -> list[tuple[str, object]]:
    """Every (sub)command's parser, named, from the CLI's own registry."""
    import argparse

    from skillstats.cli import build_parser

    found: list[tuple[str, object]] = []

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        found.append((name, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    walk(f"{name} {sub}".strip(), child)

    walk("", build_parser())
    return found


def test_every_default_a_help_text_names_is_the_default_the_code_uses() -> None:
    """A figure in --help is derived from the code or checked against it: never a text fixed once."""
    import re

    checked = 0
    for name, parser in _parsers():
        for action in parser._actions:  # type: ignore[attr-defined]
            said = re.search(r"\(default (-?[\d,]+(?:\.\d+)?)(?![\d.])", action.help or "")
            if said is None or action.default is None or isinstance(action.default, bool):
                continue
            default = action.type(action.default) if isinstance(action.default, str) and action.type else action.default
            assert float(said.group(1).replace(",", "")) == float(default), (name, action.dest, action.help, default)
            checked += 1
    assert checked >= 15


def test_the_demo_registry_gives_the_demo_publishers_skills_rows_docsync_updates(settings: Settings) -> None:
    """`init --demo-registry` then `publish --demo`: docsync finds a row for every skill the demo publishes."""
    from sqlalchemy import select

    from skillstats.sinks.db import open_engine
    from skillstats.sinks.schema import skills
    from tests.helpers import actual_docstats, run_docsync, seed_registry

    seed_registry(settings, {"sk_000001": "someone_else"})  # a row that exists already is left as it is
    first = cli(settings, "init", "--skip-topics", "--demo-registry")
    assert first.returncode == 0, first.stderr
    assert "demo registry: 499 skill row(s) added, 1 already there" in first.stdout
    again = cli(settings, "init", "--skip-topics", "--demo-registry")
    assert "demo registry: 0 skill row(s) added, 500 already there" in again.stdout
    published = cli(settings, "publish", "--demo", "2000", "--demo-events", "2000")
    assert published.returncode == 0, published.stderr
    code, (summary,) = run_docsync(settings)
    assert code == 0
    assert summary["events_read"] == 2000 and summary["unknown_skill_events"] == 0, summary
    skill_rows, _owner_rows = actual_docstats(settings)
    assert sum(downloads for downloads, _, _ in skill_rows.values()) > 0
    engine = open_engine(settings.database_url)
    with engine.connect() as connection:
        owner = connection.execute(select(skills.c.owner_id).where(skills.c.id == "sk_000001")).scalar_one()
        demo_owner = connection.execute(select(skills.c.owner_id).where(skills.c.id == "sk_000002")).scalar_one()
    engine.dispose()
    assert (owner, demo_owner) == ("someone_else", "user_002")
    # Without the schema step there is nothing to write to: said, not ignored.
    refused = cli(settings, "init", "--skip-schema", "--demo-registry")
    assert refused.returncode == 2 and "--demo-registry" in refused.stderr
