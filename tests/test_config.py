"""Settings from the environment, and back."""

from __future__ import annotations

from skillstats.config import Settings


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
