"""Usage mistakes a newcomer makes, refused at once with exit status 2 and a message that says what to do;
and docs/operations.md's exit-status table, walked example by example.

Run as a user runs the CLI: a subprocess, its output and exit code. Nothing
here needs a Kafka broker: each mistake is caught before connecting, and an
unreachable Kafka is a closed loopback port.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from skillstats.cli.common import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from skillstats.shutdown import EXIT_SHUTDOWN_OVERRUN
from skillstats.streams.docsync import parse_interval
from tests.conftest import record_metric
from tests.helpers import free_port


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SKILLSTATS_KAFKA_BOOTSTRAP": "127.0.0.1:1", "SKILLSTATS_DATABASE_URL": "sqlite:///unused.db"}
    return subprocess.run(
        [sys.executable, "-m", "skillstats.cli", *args], env=env, capture_output=True, text=True, timeout=20
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["publish", "--bogus"], "skillstats publish: unrecognized arguments: --bogus"),
        (["windows", "--batch-size", "zero"], "skillstats windows: argument --batch-size"),
        (["fences", "reset"], "skillstats fences reset: the following arguments are required"),
        (["dlq", "list", "--again"], "skillstats dlq: unrecognized arguments: --again"),
        (["ingest", "--publish-timeout", "0"], "skillstats ingest: argument --publish-timeout"),
        (["top", "--by", "stars"], "skillstats top: argument --by: invalid choice"),
    ],
)
def test_a_usage_mistake_is_one_line_that_points_to_the_help(args: list[str], said: str) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert result.stderr.startswith(said) and "--help lists the options" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("every", ["6", "0s", "-5m", "6 hours", "h", "nans"])
def test_docsync_every_needs_a_positive_interval_with_a_unit(every: str) -> None:
    result = run_cli("docsync", f"--every={every}")
    assert result.returncode == 2, result.stderr
    assert "e.g. 30s, 15m, 6h" in result.stderr or "positive" in result.stderr
    assert "Traceback" not in result.stderr


def test_intervals_with_units() -> None:
    assert [parse_interval(t) for t in ("30s", "15m", "6h", "1d", "1.5h")] == [30, 900, 21600, 86400, 5400]


@pytest.mark.parametrize("kind", ["download", "install_new", "star"])
def test_a_delta_on_a_kind_without_one_is_refused(kind: str) -> None:
    result = run_cli("publish", "--skill-id", "sk_1", "--kind", kind, "--delta-all-time", "5")
    assert result.returncode == 2
    assert "install_clear only" in result.stderr and kind in result.stderr


@pytest.mark.parametrize(
    "command", [["status"], ["docsync"], ["windows"], ["fences", "show"], ["prune"], ["top"]], ids=" ".join
)
def test_commands_before_init_say_so_exit_2_and_leave_no_database_file_behind(
    tmp_path: object, command: list[str]
) -> None:
    """A missing database is a setting to fix or `init` to run, not a failure to retry: exit 2, one line."""
    path = f"{tmp_path}/never.db"
    result = subprocess.run(
        [sys.executable, "-m", "skillstats.cli", *command],
        env={
            **os.environ,
            "SKILLSTATS_DATABASE_URL": f"sqlite:///{path}",
            "SKILLSTATS_KAFKA_BOOTSTRAP": "127.0.0.1:1",
            "SKILLSTATS_METRICS_PORT": "0",
        },
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.returncode == 2, result.stderr
    said = result.stderr.strip().splitlines()[-1]  # the windows worker logs its start first
    assert said == (
        f"skillstats {command[0]}: no database at {path}: run 'skillstats init' (it creates it), or check "
        "SKILLSTATS_DATABASE_URL (--database-url)"
    ), result.stderr
    assert not os.path.exists(path)


@pytest.mark.parametrize(
    ("url", "said"),
    [
        # Three slashes: relative to the working directory, as a newcomer typing sqlite:///tmp/x.db finds out.
        ("sqlite:///tmp/x.db", "{cwd}/tmp/x.db: the directory {cwd}/tmp does not exist"),
        ("sqlite:///{cwd}", "{cwd}: it is a directory"),
        ("mysql://app@db/stats", "unsupported database 'mysql'"),
        ("not a url", "the database URL is not a URL"),
    ],
)
def test_a_database_url_that_cannot_work_is_exit_2_and_nothing_is_created(
    tmp_path: object, url: str, said: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "skillstats.cli", "init", "--timeout", "2"],
        env={
            **os.environ,
            "SKILLSTATS_DATABASE_URL": url.format(cwd=tmp_path),
            "SKILLSTATS_KAFKA_BOOTSTRAP": "127.0.0.1:1",
        },
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and said.format(cwd=tmp_path) in lines[0], result.stderr
    assert "four slashes" in lines[0] and "SKILLSTATS_DATABASE_URL" in lines[0], lines[0]
    assert "topic" not in result.stdout  # the database is checked before any topic is created
    assert os.listdir(str(tmp_path)) == []


@pytest.mark.parametrize(
    ("command", "bootstrap"),
    [
        (["publish", "--skill-id", "sk_1", "--kind", "download"], "127.0.0.1:1"),
        # The same wait behind other commands: in the fault suite (each waits out the broker's timeout).
        pytest.param(["status"], "127.0.0.1:1", marks=pytest.mark.faults),
        pytest.param(["init", "--skip-schema"], "127.0.0.1:1", marks=pytest.mark.faults),
        (["status", "--json"], "no-such-host.invalid:9092"),  # a name that cannot resolve
    ],
)
def test_an_unreachable_broker_is_one_clear_line(tmp_path: object, command: list[str], bootstrap: str) -> None:
    """Exit 1 and the reason in one line; `status` prints what the database says first (tests/test_status_offline.py
    has its content)."""
    env = {
        **os.environ,
        "SKILLSTATS_DATABASE_URL": f"sqlite:///{tmp_path}/s.db",
        "SKILLSTATS_KAFKA_BOOTSTRAP": bootstrap,
    }
    init = subprocess.run(
        [sys.executable, "-m", "skillstats.cli", "init", "--skip-topics"], env=env, capture_output=True, timeout=20
    )
    assert init.returncode == 0, init.stderr
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "skillstats.cli", *command], env=env, capture_output=True, text=True, timeout=20
    )
    record_metric(
        f"an unreachable broker ({bootstrap}), `{' '.join(command)}` answered in {time.monotonic() - began:.1f} s"
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]  # no librdkafka FAIL lines, no traceback
    assert f"cannot reach Kafka at {bootstrap}" in lines[0] and "SKILLSTATS_KAFKA_BOOTSTRAP" in lines[0]
    if command == ["status"]:
        assert "Kafka: unreachable" in result.stdout.splitlines()[0], result.stdout
        assert f"database sqlite:///{tmp_path}/s.db" in result.stdout and "recent docsync runs:" in result.stdout
    elif command == ["status", "--json"]:
        report = json.loads(result.stdout)
        assert f"cannot reach Kafka at {bootstrap}" in report["kafka_unreachable"], report
        assert [(g["state"], g["applied"]) for g in report["groups"]] == [(None, 0), (None, 0)], report
    else:
        assert result.stdout == ""


def test_docsync_against_an_unreachable_broker_says_so_without_a_traceback(tmp_path: object) -> None:
    env = {
        **os.environ,
        "SKILLSTATS_DATABASE_URL": f"sqlite:///{tmp_path}/s.db",
        "SKILLSTATS_KAFKA_BOOTSTRAP": "127.0.0.1:1",
    }
    subprocess.run([sys.executable, "-m", "skillstats.cli", "init", "--skip-topics"], env=env, timeout=20, check=True)
    result = subprocess.run(
        [sys.executable, "-m", "skillstats.cli", "docsync"], env=env, capture_output=True, text=True, timeout=20
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr + result.stdout
    assert "cannot reach Kafka at 127.0.0.1:1" in result.stdout  # the run's summary names the error


@pytest.mark.parametrize("command", [["windows"], ["lag-exporter"], ["docsync", "--every", "1h"]])
def test_a_taken_metrics_port_is_one_line_that_names_the_setting(tmp_path: object, command: list[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "skillstats.cli",
                *command,
                "--metrics-host",
                "127.0.0.1",
                "--metrics-port",
                str(port),
            ],
            env={
                **os.environ,
                "SKILLSTATS_DATABASE_URL": f"sqlite:///{tmp_path}/s.db",
                "SKILLSTATS_KAFKA_BOOTSTRAP": "127.0.0.1:1",
            },
            capture_output=True,
            text=True,
            timeout=10,  # the bound for a user mistake: answered within 10 s
        )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "--metrics-port" in lines[0], result.stderr


# ---------------------------------------------------------------------- the exit-status table

OPERATIONS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
CODE_NAMES = {
    EXIT_OK: "EXIT_OK",
    EXIT_FAILED: "EXIT_FAILED",
    EXIT_USAGE: "EXIT_USAGE",
    EXIT_SHUTDOWN_OVERRUN: "EXIT_SHUTDOWN_OVERRUN",
    EXIT_INTERRUPTED: "EXIT_INTERRUPTED",
}


def exit_table() -> dict[int, list[str]]:
    """docs/operations.md's exit-status table: each status and its examples (the third column, split at '; ')."""
    rows: dict[int, list[str]] = {}
    for line in OPERATIONS.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3 and cells[0].isdigit():
            rows[int(cells[0])] = [example for example in cells[2].split("; ") if example]
    return rows


def _status_of(tmp_path: Path, *args: str, url: str | None = None) -> int:
    env = {
        **os.environ,
        "SKILLSTATS_DATABASE_URL": url or f"sqlite:///{tmp_path}/unused.db",
        "SKILLSTATS_KAFKA_BOOTSTRAP": "127.0.0.1:1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "skillstats.cli", *args], env=env, capture_output=True, text=True, timeout=20
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode


def _an_old_schema(tmp_path: Path, _monkeypatch: pytest.MonkeyPatch) -> int:
    from sqlalchemy import text

    from skillstats.sinks.db import open_engine
    from skillstats.sinks.migrate import VERSION_TABLE, upgrade

    url = f"sqlite:///{tmp_path}/old.db"
    engine = open_engine(url)
    upgrade(engine)
    with engine.begin() as connection:
        connection.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = '0007'"))
    engine.dispose()
    return _status_of(tmp_path, "status", url=url)


def _interrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    from skillstats.cli import main
    from skillstats.cli import status as command

    def interrupt(*_args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "run", interrupt)
    monkeypatch.setenv("SKILLSTATS_DATABASE_URL", f"sqlite:///{tmp_path}/unused.db")
    return main(["status"])


# What each example in the table is: run here (a function of tmp_path and monkeypatch giving the exit status), or
# the test elsewhere that asserts it (which must exist and assert that status).
RUN = Callable[[Path, pytest.MonkeyPatch], int]
EXAMPLES: dict[str, RUN | str] = {
    "`dlq replay --dry-run` with nothing replayable": (
        "tests/test_dlq_admin.py::test_a_dry_run_with_nothing_replayable_exits_0_and_says_so"
    ),
    "Kafka unreachable (`status` still prints what the database says)": (
        "tests/test_cli_usage.py::test_an_unreachable_broker_is_one_clear_line"
    ),
    "a database that does not answer": lambda tmp, _mp: _status_of(
        tmp, "status", url=f"postgresql://skillstats@127.0.0.1:{free_port()}/skillstats"
    ),
    "`status` finding a group that would refuse to run": (
        "tests/test_fences.py::test_windows_refuses_a_fence_ahead_of_the_log_until_reset"
    ),
    "a partition docsync holds back": (
        "tests/test_docsync_held.py::test_a_partition_the_database_refuses_is_held_back_and_every_other_moves"
    ),
    "a bad flag or value": lambda tmp, _mp: _status_of(tmp, "publish", "--bogus"),
    "a port that is taken": "tests/test_cli_usage.py::test_a_taken_metrics_port_is_one_line_that_names_the_setting",
    "no database at the SQLite path (run `skillstats init`)": lambda tmp, _mp: _status_of(tmp, "status"),
    "a SQLite path in a directory that does not exist": lambda tmp, _mp: _status_of(
        tmp, "status", url=f"sqlite:///{tmp}/no/such/dir/x.db"
    ),
    "a schema older than this skillstats (run `skillstats init`)": _an_old_schema,
    "a topic that does not exist": "tests/test_cli.py::test_a_topic_that_does_not_exist_is_exit_2_in_one_line",
    "a recreated topic": "tests/test_positions.py::test_a_topic_recreated_under_a_running_worker_stops_both_groups",
    "a group or topic that is not the database's": (
        "tests/test_positions.py::test_a_renamed_group_is_refused_until_it_takes_over"
    ),
    "a fence past its log end": "tests/test_fences.py::test_windows_refuses_a_fence_ahead_of_the_log_until_reset",
    "`init` on a compacted events topic": (
        "tests/test_cli.py::test_init_refuses_a_compacted_events_topic_and_notes_log_append_time"
    ),
    "`init` refusing to drop an index, trigger or column of the operator's own": (
        "tests/test_sqlite_layout.py::test_what_the_copy_would_drop_is_refused_before_anything_changes"
    ),
    "a shutdown past its budget": "tests/test_shutdown_watchdog.py::test_a_hanging_shutdown_exits_3_with_a_message",
    "Ctrl-C": _interrupted,
}
TABLE = exit_table()


def test_the_exit_status_table_lists_the_codes_statuses_and_only_examples_shown_here() -> None:
    assert sorted(TABLE) == sorted(CODE_NAMES), TABLE
    listed = [example for examples in TABLE.values() for example in examples]
    assert sorted(listed) == sorted(EXAMPLES), "docs/operations.md's examples and EXAMPLES differ"


@pytest.mark.parametrize(
    ("status", "example"), [(s, e) for s, examples in TABLE.items() for e in examples], ids=lambda v: str(v)[:40]
)
def test_each_example_in_the_exit_status_table_exits_with_its_status(
    status: int, example: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shown = EXAMPLES[example]
    if callable(shown):
        assert shown(tmp_path, monkeypatch) == status, example
        return
    where, name = shown.split("::")
    source = (OPERATIONS.parent.parent / where).read_text(encoding="utf-8")
    assert f"\ndef {name}(" in source, shown
    body = source.split(f"\ndef {name}(", 1)[1].split("\ndef ", 1)[0]
    assert f"== {status}" in body or f"== {CODE_NAMES[status]}" in body, (shown, status)
