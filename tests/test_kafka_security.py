"""Authenticated and encrypted Kafka for every client, and secrets that never reach a user's screen.

Against a broker of the test's own (tests/secure_kafka.py) with SASL_PLAINTEXT
and SASL_SSL (SCRAM-SHA-512 and PLAIN) and SSL with client certificates:

- each way in works end to end for both groups: `init` creates the topics, the
  publisher sends, the windows worker (faust, aiokafka) and a docsync drain
  (confluent-kafka) count exactly; passwords come from `..._FILE` variables;
- wrong credentials, or no client certificate, fail fast: a non-zero exit and a
  line that says Kafka refused the connection, for every command, never a hang;
- no password (Kafka's, the TLS key's, the database URL's, the wrong ones tried)
  appears anywhere in what whole runs print, failing ones included.

Each needs a secured broker started for it and whole runs of the commands: all of it is in the fault suite
(deploy/local/test-faults.sh), to keep the default run inside its 15 minutes.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from skillstats.config import Settings
from skillstats.workload import generate
from tests.conftest import settings_env
from tests.helpers import (
    WorkerProcess,
    actual_docstats,
    actual_windows,
    caught_up,
    expected_docstats,
    expected_windows,
    free_port,
    get,
    publish,
    registry,
    run_docsync,
    seed_registry,
    wait_until,
)
from tests.secure_kafka import (
    CLIENT_KEY_PASSWORD,
    PLAIN_PASSWORD,
    PLAIN_USER,
    SCRAM_PASSWORD,
    SCRAM_USER,
    SecureKafka,
    start,
    stop,
)

WRONG_PASSWORD = "wrong-Pa55-Uy7Td"
DATABASE_PASSWORD = "db-Pa55-Ve4Mn"  # the test PostgreSQL trusts loopback, so any password connects


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureKafka]:
    kafka, env = start(tmp_path_factory.mktemp("secure-kafka"))
    try:
        yield kafka
    finally:
        stop(env)


def access(kafka: SecureKafka, mode: str) -> tuple[str, dict[str, str]]:
    """(bootstrap, librdkafka security settings) for one way into the broker."""
    scram = {"sasl.mechanism": "SCRAM-SHA-512", "sasl.username": SCRAM_USER, "sasl.password": SCRAM_PASSWORD}
    if mode == "sasl_plaintext-scram":
        return kafka.sasl_plaintext, {"security.protocol": "SASL_PLAINTEXT", **scram}
    if mode == "sasl_plaintext-plain":
        plain = {"sasl.mechanism": "PLAIN", "sasl.username": PLAIN_USER, "sasl.password": PLAIN_PASSWORD}
        return kafka.sasl_plaintext, {"security.protocol": "SASL_PLAINTEXT", **plain}
    if mode == "sasl_ssl-scram":
        return kafka.sasl_ssl, {"security.protocol": "SASL_SSL", "ssl.ca.location": str(kafka.ca), **scram}
    assert mode == "ssl-client-certificate"
    return kafka.ssl, {
        "security.protocol": "SSL",
        "ssl.ca.location": str(kafka.ca),
        "ssl.certificate.location": str(kafka.client_cert),
        "ssl.key.location": str(kafka.client_key),
        "ssl.key.password": CLIENT_KEY_PASSWORD,
    }


def secured(kafka: SecureKafka, mode: str, database_url: str, run: str) -> Settings:
    bootstrap, security = access(kafka, mode)
    return Settings(
        kafka_bootstrap=bootstrap,
        database_url=database_url,
        topic=f"events-{run}",
        dlq_topic=f"events-{run}.dlq",
        windows_group=f"windows-{run}",
        docsync_group=f"docsync-{run}",
        kafka_security=security,
    )


def with_secret_files(settings: Settings, directory: Path) -> dict[str, str]:
    """settings_env, but every password handed over in a file (SKILLSTATS_..._FILE), as a mounted Secret is."""
    env = settings_env(settings)
    for name in ("SKILLSTATS_KAFKA_SASL_PASSWORD", "SKILLSTATS_KAFKA_SSL_KEY_PASSWORD"):
        if name in env:
            path = directory / name.lower()
            path.write_text(env.pop(name) + "\n")
            env[name + "_FILE"] = str(path)
    return env


def skillstats(env: dict[str, str], *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skillstats.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.faults  # a secured broker of its own, a run per mode: in the fault suite with the rest of this file
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    "mode", ["sasl_plaintext-scram", "sasl_plaintext-plain", "sasl_ssl-scram", "ssl-client-certificate"]
)
def test_both_groups_end_to_end(secure: SecureKafka, database_url: str, mode: str, tmp_path: Path) -> None:
    settings = secured(secure, mode, database_url, mode)
    env = with_secret_files(settings, tmp_path)
    init = skillstats(env, "init", "--partitions", "4", "--dlq-partitions", "1")
    assert init.returncode == 0, init.stderr
    rows = registry(seed=3, skills=300)
    seed_registry(settings, rows)
    records = list(generate(3000, now_ms=int(time.time() * 1000), skills=300, seed=7, invalid_ratio=0.01))
    assert publish(settings, records) == len(records)

    worker = WorkerProcess(settings, tmp_path / "worker.log", env=env)
    wait_until(caught_up(settings, settings.windows_group, worker), 120, f"the worker to apply everything ({mode})")
    assert worker.terminate() == 0, worker.log_tail()
    assert actual_windows(settings) == expected_windows(records)
    status, summaries = run_docsync(settings)
    assert status == 0 and summaries[-1]["stopped_reason"] == "caught_up", summaries
    want_skills, want_owners, _unknown = expected_docstats(records, rows)
    assert actual_docstats(settings) == (want_skills, want_owners)


def refused_env(kafka: SecureKafka, how: str, database_url: str) -> dict[str, str]:
    if how == "wrong password":
        settings = secured(kafka, "sasl_plaintext-scram", database_url, "refused")
        settings.kafka_security["sasl.password"] = WRONG_PASSWORD
    elif how == "unknown mechanism user":
        settings = secured(kafka, "sasl_ssl-scram", database_url, "refused")
        settings.kafka_security.update({"sasl.mechanism": "PLAIN", "sasl.password": WRONG_PASSWORD})
    else:
        assert how == "no client certificate"
        settings = secured(kafka, "ssl-client-certificate", database_url, "refused")
        for key in ("ssl.certificate.location", "ssl.key.location", "ssl.key.password"):
            settings.kafka_security.pop(key)
    return settings_env(settings)


COMMANDS = {
    "windows": ["windows"],
    "docsync": ["docsync"],
    "publish": ["publish", "--skill-id", "sk_000001", "--kind", "download"],
    "status": ["status"],
    "init": ["init", "--skip-schema"],
    "lag-exporter": ["lag-exporter", "--metrics-port", "PORT"],
    "dlq list": ["dlq", "list"],
    "prune": ["prune"],
}


@pytest.mark.faults  # every command refused, per way of being refused: slow, in the fault suite
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize("how", ["wrong password", "unknown mechanism user", "no client certificate"])
def test_refused_credentials_fail_fast_and_say_so(secure: SecureKafka, database_url: str, how: str) -> None:
    env = refused_env(secure, how, database_url)
    assert skillstats(env, "init", "--skip-topics").returncode == 0
    # Every command once; both groups' commands for every way of being refused.
    commands = COMMANDS if how == "wrong password" else {k: COMMANDS[k] for k in ("windows", "docsync")}
    for name, command in commands.items():
        args = [str(free_port()) if a == "PORT" else a for a in command]
        started = time.monotonic()
        done = skillstats(env, *args, timeout=120)
        output = done.stdout + done.stderr
        assert done.returncode not in (0, None), f"{name} ({how}) exited 0:\n{output[-2000:]}"
        assert "refused the connection" in output, f"{name} ({how}):\n{output[-2000:]}"
        assert "Traceback" not in output, f"{name} ({how}):\n{output[-3000:]}"
        assert WRONG_PASSWORD not in output
        # Bounded well below the time a hang would take (the subprocess timeout above).
        assert time.monotonic() - started < 60, f"{name} ({how}) took {time.monotonic() - started:.0f}s"


@pytest.mark.faults  # a whole run of every command over TLS and SASL: the longest here, in the fault suite
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_no_secret_in_anything_a_whole_run_prints(secure: SecureKafka, database_url: str, tmp_path: Path) -> None:
    database_url = database_url.replace("postgres@", f"postgres:{DATABASE_PASSWORD}@", 1)
    settings = secured(secure, "sasl_ssl-scram", database_url, "leak")
    env = settings_env(settings)
    secrets = [SCRAM_PASSWORD, DATABASE_PASSWORD, WRONG_PASSWORD, CLIENT_KEY_PASSWORD, PLAIN_PASSWORD]
    printed: list[tuple[str, str]] = []

    def run(what: str, command_env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
        done = skillstats(command_env, *args)
        printed.append((what, done.stdout + done.stderr))
        return done

    assert run("init", env, "init", "--partitions", "2", "--dlq-partitions", "1").returncode == 0
    seed_registry(settings, {"sk_000001": "user_1"})  # docsync refuses an empty registry (issue 28.8)
    assert run("publish", env, "publish", "--skill-id", "sk_000001", "--kind", "download").returncode == 0
    bad = subprocess.run(
        [sys.executable, "-m", "skillstats.cli", "publish", "--file", "-"],
        input='{"skill_id": "sk_000002", "kind": "nope"}\n',
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    printed.append(("publish a bad line", bad.stdout + bad.stderr))
    port = free_port()
    worker = WorkerProcess(settings, tmp_path / "worker.log", "--metrics-port", str(port), env=env)
    wait_until(caught_up(settings, settings.windows_group, worker), 120, "the worker to apply the event")
    printed.append(("/metrics", get(f"http://127.0.0.1:{port}/metrics")[1]))
    worker.process.send_signal(signal.SIGTERM)
    assert worker.process.wait(60) == 0
    printed.append(("windows --log-level debug", worker.log_path.read_text(errors="replace")))
    for args in (["docsync"], ["docsync", "--json"], ["status"], ["status", "--json"], ["dlq", "list"], ["prune"]):
        assert run(" ".join(args), env, *args).returncode == 0, printed[-1][1][-2000:]
    exporter_port = free_port()
    exporter = subprocess.Popen(
        [sys.executable, "-m", "skillstats.cli", "lag-exporter", "--metrics-port", str(exporter_port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until(lambda: "skillstats_consumer_lag" in get(f"http://127.0.0.1:{exporter_port}/metrics")[1], 60, "lag")
        printed.append(("lag-exporter /metrics", get(f"http://127.0.0.1:{exporter_port}/metrics")[1]))
    finally:
        exporter.send_signal(signal.SIGTERM)
        printed.append(("lag-exporter", exporter.communicate(timeout=60)[0]))
    for command in ("windows", "docsync", "status", "publish", "prune", "dlq", "lag-exporter", "init", "top"):
        run(f"{command} --help", env, command, "--help")

    # The other ways in, each with its own secret: mutual TLS with an encrypted key, PLAIN, the
    # passwords handed over in files, and a database password given as a query parameter.
    for mode in ("ssl-client-certificate", "sasl_plaintext-plain"):
        other = secured(secure, mode, database_url, "leak")
        assert run(f"status over {mode}", settings_env(other), "status").returncode == 0, printed[-1][1][-2000:]
        assert run(f"docsync over {mode}", with_secret_files(other, tmp_path), "docsync").returncode == 0
    in_query = settings_env(settings)
    in_query["SKILLSTATS_DATABASE_URL"] = (
        database_url.replace(f":{DATABASE_PASSWORD}@", "@") + f"?password={DATABASE_PASSWORD}"
    )
    assert run("status, password in the URL's query", in_query, "status").returncode == 0, printed[-1][1][-2000:]

    # Failing runs, verbose (tracebacks at debug level): a wrong Kafka password, a database that is away.
    wrong = {**env, "SKILLSTATS_KAFKA_SASL_PASSWORD": WRONG_PASSWORD}
    for args in (
        ["docsync", "-vv"],
        ["status", "-vv"],
        ["windows", "-vv"],
        ["publish", "--skill-id", "s", "--kind", "download"],
    ):
        assert run(f"{args} with a wrong password", wrong, *args).returncode != 0
    away = {**env, "SKILLSTATS_DATABASE_URL": f"postgresql://postgres:{DATABASE_PASSWORD}@127.0.0.1:1/nowhere"}
    for args in (["docsync", "-vv"], ["status", "-vv"], ["top"]):
        assert run(f"{args} with the database away", away, *args).returncode != 0
    # The worker waits for its database (a warning, then reminders), then stops on SIGTERM.
    waiting = WorkerProcess(settings, tmp_path / "waiting.log", env=away)
    wait_until(lambda: waiting.log_path.read_text().count("waiting for the database") >= 2, 60, "two attempts")
    assert waiting.terminate() == 0
    printed.append(("windows with the database away", waiting.log_path.read_text(errors="replace")))

    assert len(printed) > 25
    leaks = [(what, secret) for what, text in printed for secret in secrets if secret in text]
    assert leaks == [], leaks
    assert any("***" in text for _what, text in printed)  # masked, not missing: status names the database
