"""Usage mistakes a newcomer makes, refused at once with exit status 2 and a message that says what to do.

Run as a user runs the CLI: a subprocess, its output and exit code. Nothing
here needs Kafka or a database: each mistake is caught before connecting.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from skillstats.streams.docsync import parse_interval
from tests.conftest import record_metric


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


def test_commands_before_init_leave_no_database_file_behind(tmp_path: object) -> None:
    path = f"{tmp_path}/never.db"
    for command in ("status", "docsync", "windows"):
        result = subprocess.run(
            [sys.executable, "-m", "skillstats.cli", command],
            env={
                **os.environ,
                "SKILLSTATS_DATABASE_URL": f"sqlite:///{path}",
                "SKILLSTATS_KAFKA_BOOTSTRAP": "127.0.0.1:1",
            },
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert result.returncode != 0, command
        assert f"there is no database at {path}" in result.stderr and "skillstats init" in result.stderr, result.stderr
        assert not os.path.exists(path), command


def test_a_sqlite_path_in_a_missing_directory_is_named_and_nothing_is_created(tmp_path: object) -> None:
    # Three slashes: relative to the working directory, as a newcomer typing sqlite:///tmp/x.db finds out.
    result = subprocess.run(
        [sys.executable, "-m", "skillstats.cli", "init", "--timeout", "2"],
        env={
            **os.environ,
            "SKILLSTATS_DATABASE_URL": "sqlite:///tmp/x.db",
            "SKILLSTATS_KAFKA_BOOTSTRAP": "127.0.0.1:1",
        },
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.returncode == 1
    assert f"{tmp_path}/tmp/x.db" in result.stderr and "four slashes" in result.stderr, result.stderr
    assert "topic" not in result.stdout  # the database is checked before any topic is created


@pytest.mark.parametrize(
    ("command", "bootstrap"),
    [
        (["publish", "--skill-id", "sk_1", "--kind", "download"], "127.0.0.1:1"),
        (["status"], "127.0.0.1:1"),
        (["init", "--skip-schema"], "127.0.0.1:1"),
        (["status"], "no-such-host.invalid:9092"),  # a name that cannot resolve
    ],
)
def test_an_unreachable_broker_is_one_clear_line(tmp_path: object, command: list[str], bootstrap: str) -> None:
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
