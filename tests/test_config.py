"""Settings from the environment, and back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from skillstats.config import Settings, SettingsError, redact_url


def test_defaults_are_the_spec_defaults() -> None:
    settings = Settings.from_env({})
    assert settings.kafka_bootstrap == "127.0.0.1:9092"
    assert settings.database_url == "sqlite:///skillstats.db"
    assert (settings.topic, settings.dlq_topic) == ("skill-stat-events", "skill-stat-events.dlq")
    assert (settings.windows_group, settings.docsync_group) == ("skillstats-windows", "skillstats-docsync")


def test_environment_round_trip_including_security() -> None:
    env = {
        "SKILLSTATS_KAFKA_BOOTSTRAP": "k1:9093,k2:9093",
        "SKILLSTATS_DATABASE_URL": "postgresql://u@db/x",
        "SKILLSTATS_TOPIC": "t",
        "SKILLSTATS_DLQ_TOPIC": "t.dlq",
        "SKILLSTATS_WINDOWS_GROUP": "w",
        "SKILLSTATS_DOCSYNC_GROUP": "d",
        "SKILLSTATS_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "SKILLSTATS_KAFKA_SASL_USERNAME": "svc",
    }
    settings = Settings.from_env(env)
    assert settings.kafka_config()["security.protocol"] == "SASL_SSL"
    assert settings.kafka_config()["sasl.username"] == "svc"
    assert settings.to_env() == env
    assert Settings.from_env(settings.to_env()) == settings


def test_flags_override_only_what_is_given() -> None:
    settings = Settings.from_env({"SKILLSTATS_TOPIC": "from-env"}).override(topic=None, dlq_topic="flag")
    assert (settings.topic, settings.dlq_topic) == ("from-env", "flag")


def test_security_settings_reach_the_faust_worker() -> None:
    import faust

    from skillstats.streams.windows import faust_credentials

    assert faust_credentials(Settings()) is None
    sasl = Settings(
        kafka_security={
            "security.protocol": "SASL_PLAINTEXT",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.username": "svc",
            "sasl.password": "pw",
        }
    )
    credentials = faust_credentials(sasl)
    assert isinstance(credentials, faust.SASLCredentials)
    assert (credentials.username, credentials.password, credentials.ssl_context) == ("svc", "pw", None)
    assert str(credentials.mechanism.value) == "SCRAM-SHA-512"
    assert isinstance(faust_credentials(Settings(kafka_security={"security.protocol": "SSL"})), faust.SSLCredentials)


def test_repr_masks_every_secret() -> None:
    settings = Settings(
        database_url="postgresql://worker:pa:ss@w0rd@db.internal:5432/stats",
        kafka_security={"sasl.username": "svc", "sasl.password": "kafka-s3cret", "ssl.key.password": "k3y-pass"},
    )
    for text in (repr(settings), str(settings), f"{settings}", repr([settings])):
        assert "w0rd" not in text and "pa:ss" not in text
        assert "kafka-s3cret" not in text and "k3y-pass" not in text
        assert "worker:***@db.internal" in text and "svc" in text


def test_redact_url_masks_unencoded_passwords() -> None:
    from skillstats.config import redact_url

    assert redact_url("postgresql://u:a/b@c@host/db") == "postgresql://u:***@host/db"
    assert redact_url("postgresql://u@host/db") == "postgresql://u@host/db"
    assert redact_url("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"


def test_a_failing_command_never_prints_a_secret() -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "SKILLSTATS_DATABASE_URL": "postgresql://u:Sup3r-Secret@[bad-host/db"}
    env["SKILLSTATS_KAFKA_SASL_PASSWORD"] = "kafka-Secret-9"
    result = subprocess.run(
        [sys.executable, "-m", "skillstats.cli", "init", "--skip-topics", "-vv"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert "Traceback" in output  # -vv logs the traceback: it is masked too
    assert "Sup3r-Secret" not in output and "kafka-Secret-9" not in output, output[-2000:]


def test_log_records_and_their_tracebacks_are_masked() -> None:
    import logging

    from skillstats.config import MaskSecrets

    settings = Settings(database_url="postgresql://u:pw-123@h/db", kafka_security={"sasl.password": "k-456"})
    try:
        raise RuntimeError("connect to postgresql://u:pw-123@h/db with k-456 failed")
    except RuntimeError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed: %s", ("k-456",), exc_info=sys_exc_info())
    assert MaskSecrets(settings.secrets()).filter(record)
    text = logging.Formatter().format(record)
    assert "pw-123" not in text and "k-456" not in text and "failed: ***" in text


def sys_exc_info() -> object:
    import sys

    return sys.exc_info()


def test_secrets_from_files_as_a_mounted_secret_hands_them_over(tmp_path: Path) -> None:
    (tmp_path / "kafka").write_text("s3cret-with-trailing-newline\n")
    (tmp_path / "db").write_text("postgresql://u:pw@db/x")  # no newline: taken as it is
    settings = Settings.from_env(
        {
            "SKILLSTATS_KAFKA_SASL_PASSWORD_FILE": str(tmp_path / "kafka"),
            "SKILLSTATS_DATABASE_URL_FILE": str(tmp_path / "db"),
        }
    )
    assert settings.kafka_security == {"sasl.password": "s3cret-with-trailing-newline"}
    assert settings.database_url == "postgresql://u:pw@db/x"
    assert set(settings.secrets()) == {"s3cret-with-trailing-newline", "pw"}
    assert "s3cret" not in repr(settings) and "pw@" not in repr(settings)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SKILLSTATS_KAFKA_SASL_PASSWORD": "a", "SKILLSTATS_KAFKA_SASL_PASSWORD_FILE": "/x"}, "keep one"),
        ({"SKILLSTATS_DATABASE_URL_FILE": "/no/such/file"}, "cannot read /no/such/file"),
    ],
)
def test_a_secret_file_that_cannot_be_used_is_a_clear_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env)
    done = subprocess.run(
        [sys.executable, "-m", "skillstats.cli", "status"], env={**os.environ, **env}, capture_output=True, text=True
    )
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_database_passwords_are_masked_wherever_the_url_holds_them() -> None:
    url = "postgresql+psycopg://app:p%40ss@db/sk?sslmode=require&password=hunter22&sslpassword=k%2Fey"
    assert redact_url(url) == "postgresql+psycopg://app:***@db/sk?sslmode=require&password=***&sslpassword=***"
    # As written and percent-decoded: a driver's message may show either.
    assert set(Settings(database_url=url).secrets()) == {"p%40ss", "p@ss", "hunter22", "k%2Fey", "k/ey"}


def test_an_empty_database_url_is_an_error_not_a_local_sqlite_file() -> None:
    with pytest.raises(SettingsError, match="is empty"):
        Settings.from_env({"SKILLSTATS_DATABASE_URL": ""})


def test_a_common_word_password_is_masked_where_it_stands_and_nowhere_else() -> None:
    """Issue 28.5: `status` as a password turned `skillstats status:` into `skill*** ***:`, garbling every line
    and giving the password away by elimination. It is masked in a URL's password position and as the value
    of a password-named setting, whoever's, and the words around it are left alone."""
    from skillstats.config import mask

    settings = Settings(database_url="postgresql://app:status@db/x", kafka_security={"sasl.password": "status"})
    text = (
        "skillstats status: cannot reach postgresql://app:status@db/x?password=status "
        "(conninfo password='status', {'sasl.password': 'status'}, PGPASSWORD=status)"
    )
    assert mask(text, settings.secrets()) == (
        "skillstats status: cannot reach postgresql://app:***@db/x?password=*** "
        "(conninfo password='***', {'sasl.password': '***'}, PGPASSWORD=***)"
    )
    # What a short common word still costs: printed bare, it is not masked (masking every "status" would be
    # no secret either). A distinctive secret is masked wherever it appears, as before.
    assert mask("status: 3 partitions", ["status"]) == "status: 3 partitions"
    assert mask("got k-456 and Sup3r-Secret", ["k-456", "Sup3r-Secret"]) == "got *** and ***"
    # By position, a password of nobody's settings too: every URL's, every password-named value.
    assert mask("to postgresql://u:p%40ss@h/db", []) == "to postgresql://u:***@h/db"
    # Not what only looks like it: a traceback's source line, a URL without user info, a path with an "@".
    plain = "render_as_string(hide_password=False) http://127.0.0.1:9320/v1/events sqlite:////tmp/a@b.db"
    assert mask(plain, ["status"]) == plain


def test_a_failing_command_keeps_its_words_when_the_password_is_one() -> None:
    env = {**os.environ, "SKILLSTATS_DATABASE_URL": "postgresql://u:init@[bad-host/db"}
    result = subprocess.run(
        [sys.executable, "-m", "skillstats.cli", "init", "--skip-topics", "-vv"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" in output  # -vv: the traceback is shown, masked
    assert "skillstats init:" in output and "u:init@" not in output, output[-2000:]
    assert "skillstats ***" not in output and "***:" not in output.replace("u:***@", ""), output[-2000:]


def test_a_bootstrap_without_a_port_is_refused_naming_the_setting() -> None:
    """Issue 28.7: a client takes a bare host as host:9092, on a shared machine maybe someone else's broker."""
    for bootstrap in ("localhost", "kafka-1:9092,kafka-2", "", "kafka:port"):
        with pytest.raises(SettingsError, match=r"SKILLSTATS_KAFKA_BOOTSTRAP .* has no port"):
            Settings.from_env({"SKILLSTATS_KAFKA_BOOTSTRAP": bootstrap})
    for bootstrap in ("127.0.0.1:9092", "k1:9093, k2:9093", "[::1]:9092", "SASL_SSL://kafka:9093"):
        assert Settings.from_env({"SKILLSTATS_KAFKA_BOOTSTRAP": bootstrap}).kafka_bootstrap == bootstrap
    done = subprocess.run(
        [sys.executable, "-m", "skillstats.cli", "status", "--bootstrap", "kafka-1:9092,kafka-2"],
        env={**os.environ, "SKILLSTATS_DATABASE_URL": "sqlite:///unused.db"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "SKILLSTATS_KAFKA_BOOTSTRAP (or --bootstrap): 'kafka-2'" in done.stderr, done.stderr
    assert "kafka.sh bootstrap" in done.stderr and "Traceback" not in done.stderr


def test_masking_keeps_a_secret_whole_and_masks_a_common_word_where_it_stands() -> None:
    """Review findings on redaction by position: a value the positional pass cut short at "," leaked its tail; a
    URL password holding a quote, and the keystore and OAuth secrets, were not masked at all."""
    from skillstats.config import mask

    assert mask("password=Summer,2024! then", ["Summer,2024!"]) == "password=*** then"
    assert mask("postgresql://u:it's@db/x failed", ["it's"]) == "postgresql://u:***@db/x failed"
    shown = mask("ssl.keystore.password=abc sasl.oauthbearer.client.secret=zz", [])
    assert shown == "ssl.keystore.password=*** sasl.oauthbearer.client.secret=***"
    assert mask("skillstats status: postgresql://u:status@h/db", ["status"]) == (
        "skillstats status: postgresql://u:***@h/db"
    )
