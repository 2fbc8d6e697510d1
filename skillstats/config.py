"""Settings from the environment (README, operations); the CLI's flags override them."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote_plus

# librdkafka's own log lines (connection failures by the hundred while a broker is
# away) go through Python logging under this name; the CLI shows them only with -v.
LIBRDKAFKA_LOG = logging.getLogger("skillstats.librdkafka")

# How long a command waits for the cluster's first answer (metadata) before saying it cannot reach Kafka:
# long enough for a slow cluster's reply, short enough that a wrong address or a stopped broker is said,
# with Python's start, within ten seconds of the command being run.
FIRST_ANSWER_S = 8.0

# librdkafka names for the security settings, read from SKILLSTATS_KAFKA_<NAME>
# (dots as underscores), e.g. SKILLSTATS_KAFKA_SASL_USERNAME, or from the file
# SKILLSTATS_KAFKA_<NAME>_FILE names (SKILLSTATS_KAFKA_SASL_PASSWORD_FILE).
_KAFKA_SECURITY_KEYS = (
    "security.protocol",
    "sasl.mechanism",
    "sasl.username",
    "sasl.password",
    "ssl.ca.location",
    "ssl.certificate.location",
    "ssl.key.location",
    "ssl.key.password",
)


class SettingsError(ValueError):
    """The environment's settings contradict themselves or name a file that cannot be read."""


# One broker address of a bootstrap list: host:port, [IPv6]:port, optionally with a listener's scheme.
_BROKER_ADDRESS = re.compile(r"(?:[A-Za-z_]+://)?(?:\[[0-9A-Fa-f:.]+\]|[^\s:/\[\],]+):\d{1,5}")


def _check_bootstrap(bootstrap: str) -> None:
    """SettingsError unless every address of the bootstrap list names its port.

    Kafka clients take a bare host as host:9092, and on a shared machine 9092 may
    be someone else's broker: `init` would create topics there, `publish` send
    there. The local scripts take their port from KAFKA_PORT, so the address is
    said in full (deploy/local/kafka.sh bootstrap prints it). Costs one regular
    expression match per address, once per Settings.
    """
    missing = [address for address in bootstrap.split(",") if not _BROKER_ADDRESS.fullmatch(address.strip())]
    if missing:
        named = ", ".join(repr(address.strip()) for address in missing)
        whole = "" if missing == [bootstrap] else f" (of {bootstrap!r})"
        raise SettingsError(
            f"SKILLSTATS_KAFKA_BOOTSTRAP (or --bootstrap): {named}{whole} has no port; give every broker as "
            f"host:port, e.g. 'kafka-1:9092,kafka-2:9092' (a client would take port 9092, on a shared machine maybe "
            f"someone else's broker); for the local one: export SKILLSTATS_KAFKA_BOOTSTRAP=$(deploy/local/kafka.sh "
            f"bootstrap)"
        )


def _env_or_file(env: dict[str, str], name: str) -> str | None:
    """`name` from the environment, or the contents of the file `<name>_FILE` names (one, not both).

    The _FILE form is how Kubernetes and Docker hand over a mounted secret: the
    value never sits in the process environment (which `ps e`, /proc and crash
    reporters show). One trailing newline, as editors and `echo` leave it, is dropped.
    """
    path = env.get(name + "_FILE")
    if path is None:
        return env.get(name)
    if name in env:
        raise SettingsError(f"both {name} and {name}_FILE are set; keep one")
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SettingsError(f"{name}_FILE: cannot read {path}: {exc.strerror or exc}") from None
    return text[:-1] if text.endswith("\n") else text


def _database_url(env: dict[str, str], default: str) -> str:
    url = _env_or_file(env, "SKILLSTATS_DATABASE_URL")
    if url is None:
        return default
    if not url.strip():
        # Not the default: an empty mounted Secret must not quietly become a local SQLite file.
        raise SettingsError("SKILLSTATS_DATABASE_URL (or the file SKILLSTATS_DATABASE_URL_FILE names) is empty")
    return url


@dataclass(frozen=True)
class Settings:
    kafka_bootstrap: str = "127.0.0.1:9092"
    database_url: str = "sqlite:///skillstats.db"
    topic: str = "skill-stat-events"
    dlq_topic: str = "skill-stat-events.dlq"
    windows_group: str = "skillstats-windows"
    docsync_group: str = "skillstats-docsync"
    kafka_security: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.windows_group == self.docsync_group:
            # The fences are rows per (group, partition): one group for both roles would share them, and each
            # role would skip as "applied" what the other applied (docs/contract.md, "Whose counts these are").
            raise SettingsError(
                f"the windows and docsync groups are both {self.windows_group!r}: each role needs a consumer "
                f"group of its own (their fences are kept per group); set SKILLSTATS_WINDOWS_GROUP and "
                f"SKILLSTATS_DOCSYNC_GROUP (or --group) to two different names"
            )
        _check_bootstrap(self.kafka_bootstrap)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        defaults = cls()
        security = {
            key: value
            for key in _KAFKA_SECURITY_KEYS
            if (value := _env_or_file(env, "SKILLSTATS_KAFKA_" + key.replace(".", "_").upper())) is not None
        }
        return cls(
            kafka_bootstrap=env.get("SKILLSTATS_KAFKA_BOOTSTRAP", defaults.kafka_bootstrap),
            database_url=_database_url(env, defaults.database_url),
            topic=env.get("SKILLSTATS_TOPIC", defaults.topic),
            dlq_topic=env.get("SKILLSTATS_DLQ_TOPIC", defaults.dlq_topic),
            windows_group=env.get("SKILLSTATS_WINDOWS_GROUP", defaults.windows_group),
            docsync_group=env.get("SKILLSTATS_DOCSYNC_GROUP", defaults.docsync_group),
            kafka_security=security,
        )

    def to_env(self) -> dict[str, str]:
        """The environment that gives a `skillstats` subprocess these settings."""
        return {
            "SKILLSTATS_KAFKA_BOOTSTRAP": self.kafka_bootstrap,
            "SKILLSTATS_DATABASE_URL": self.database_url,
            "SKILLSTATS_TOPIC": self.topic,
            "SKILLSTATS_DLQ_TOPIC": self.dlq_topic,
            "SKILLSTATS_WINDOWS_GROUP": self.windows_group,
            "SKILLSTATS_DOCSYNC_GROUP": self.docsync_group,
            **{"SKILLSTATS_KAFKA_" + k.replace(".", "_").upper(): v for k, v in self.kafka_security.items()},
        }

    def child_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (this process's environment) with these settings, for a `skillstats` subprocess.

        A `..._FILE` variable of `base` whose value these settings now carry is left
        out: the child would otherwise see both forms and refuse to start.
        """
        ours = self.to_env()
        base = dict(os.environ if base is None else base)
        return {**{k: v for k, v in base.items() if not (k.endswith("_FILE") and k[:-5] in ours)}, **ours}

    def __repr__(self) -> str:
        """Secrets masked: a Settings may end up in a log line or a traceback."""
        shown = []
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name == "database_url":
                value = redact_url(value)
            elif item.name == "kafka_security":
                value = {k: ("***" if _is_secret(k) else v) for k, v in value.items()}
            shown.append(f"{item.name}={value!r}")
        return f"Settings({', '.join(shown)})"

    __str__ = __repr__

    def secrets(self) -> list[str]:
        """Every secret in these settings, to be masked wherever text reaches a user."""
        found = [v for k, v in self.kafka_security.items() if _is_secret(k) and v]
        return [*found, *_url_secrets(self.database_url)]

    def override(self, **changes: Any) -> Settings:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def kafka_config(self, **extra: Any) -> dict[str, Any]:
        """librdkafka configuration shared by every confluent-kafka client of ours."""
        return {"bootstrap.servers": self.kafka_bootstrap, "logger": LIBRDKAFKA_LOG, **self.kafka_security, **extra}


def redact_url(url: str) -> str:
    """A database URL with its password replaced by ***, in the user info and in the query.

    Everything between the user name's colon and the LAST "@" is masked, so a
    password written with a raw "@", ":" or "/" (not percent-encoded) is masked whole;
    so are `password=` and `sslpassword=` query parameters, which libpq also takes.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest, question, query = rest.partition("?")
    if question:
        query = "&".join(
            f"{name}=***" if name.lower() in _URL_SECRET_PARAMS else f"{name}{eq}{value}"
            for name, eq, value in (pair.partition("=") for pair in query.split("&"))
        )
    if "@" in rest:
        userinfo, _at, host = rest.rpartition("@")
        user, colon, _password = userinfo.partition(":")
        rest = f"{user}{':***' if colon else ''}@{host}"
    return f"{scheme}://{rest}{question}{query}"


_URL_SECRET_PARAMS = ("password", "sslpassword")


def _url_secrets(url: str) -> list[str]:
    """The database URL's passwords, as written and percent-decoded (either may reach a message)."""
    _scheme, sep, rest = url.partition("://")
    if not sep:
        return []
    rest, _question, query = rest.partition("?")
    found = []
    userinfo, at, _host = rest.rpartition("@")
    if at and ":" in userinfo:
        found.append(userinfo.partition(":")[2])
    for name, _eq, value in (pair.partition("=") for pair in query.split("&") if query):
        if name.lower() in _URL_SECRET_PARAMS:
            found.append(value)
    return [form for secret in found if secret for form in dict.fromkeys((secret, unquote_plus(secret)))]


# A secret is masked by where it stands, whatever its value: a URL's password (scheme://user:PASSWORD@host,
# up to the last "@" of the URL, as redact_url reads it) and the value of a password-named setting
# (password=, sslpassword=, PGPASSWORD=, sasl.password=, ssl.key.password: ..., SKILLSTATS_KAFKA_SASL_PASSWORD=,
# aiokafka's sasl_plain_password=; quoted or not, as libpq conninfo strings, query strings, librdkafka settings
# and dict reprs write them; not any name ending in "password", or a traceback's `hide_password=False` would be).
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/@?#'\"<>]*:)[^\s?#'\"<>]*@")
_PASSWORD_VALUE = re.compile(
    r"(?P<head>(?<![\w.-])(?:(?:sasl\.|sasl_plain_|ssl\.key\.|ssl\.keystore\.|ssl\.truststore\.|ssl|pg"
    r"|skillstats_kafka_sasl_|skillstats_kafka_ssl_key_)?password|sasl\.oauthbearer\.client\.secret)"
    r"['\"]?\s*[=:]\s*)"
    r"(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\s'\"&,;()\[\]{}<>]+)",
    re.IGNORECASE,
)


def _mask_positions(text: str) -> str:
    """`text` with every URL password and password-named value replaced by ***, known to us or not."""
    if "://" in text:
        text = _URL_PASSWORD.sub(r"\g<head>***@", text)
    if "assword" in text or "ASSWORD" in text:
        text = _PASSWORD_VALUE.sub(_masked_value, text)
    return text


def _masked_value(match: re.Match[str]) -> str:
    """The password-named setting of `match` with its value as ***, its quotes kept (so the text reads the same)."""
    value = match.group(0)[len(match.group("head")) :]
    quote = value[0] if value[:1] in ("'", '"') else ""
    return f"{match.group('head')}{quote}***{quote}"


def _distinctive(secret: str) -> bool:
    """A secret that can be masked wherever it appears without garbling ordinary text.

    At least 5 characters mixing two of letters, digits and other characters (`k-456`,
    `hunter22`), or 16 characters of any kind: such a string does not occur in a message
    by chance. A plain word (`status`), a number or a shorter string does: replacing it
    everywhere turned `skillstats status:` into `skill*** ***:`, which garbled every line
    and gave the password away by elimination.
    """
    if len(secret) >= 16:
        return True
    classes = (any(c.isalpha() for c in secret), any(c.isdigit() for c in secret), any(not c.isalnum() for c in secret))
    return len(secret) >= 5 and sum(classes) >= 2


def mask(text: str, secrets: list[str]) -> str:
    """`text` with its secrets replaced by ***: by position first, then the distinctive ones anywhere.

    Every URL password and password-named value is masked where it stands,
    whichever secret it is (so a password that is a common word is masked there
    and nowhere else); the secrets given that are distinctive (`_distinctive`) are
    masked wherever they appear too, for a driver or library that prints one bare.
    What a short or common-word password still costs: printed bare, outside a URL
    or a `password=` value, it would show. Masking it there would mask every
    occurrence of the word, and give it away all the same. No library of ours prints
    a password bare; a password that is a word is guessed from a dictionary anyway.
    Costs a regular expression pass over text holding "://" or "password", and one
    `str.replace` per distinctive secret.
    """
    # Distinctive secrets first: a value the positional pass cuts short (at a "," or ")") is then still whole.
    ordered = sorted(secrets, key=len, reverse=True)
    for secret in ordered:
        if _distinctive(secret):
            text = text.replace(secret, "***")
    # A common-word secret only where it stands as one, whatever characters the patterns below stop at (a URL
    # password with a quote or "#" in it): after "user:" before "@", and as a password-named setting's value.
    for secret in ordered:
        if secret and not _distinctive(secret) and secret in text:
            text = text.replace(f":{secret}@", ":***@")
            text = re.sub(
                r"((?:password|secret)['\"]?\s*[=:]\s*['\"]?)" + re.escape(secret) + r"(?![\w])",
                r"\g<1>***",
                text,
                flags=re.IGNORECASE,
            )
    return _mask_positions(text)


class MaskSecrets(logging.Filter):
    """A logging filter that masks secrets (see `mask`) in every record it passes, tracebacks included.

    It works without any secret given too: URL passwords and password-named values
    are masked wherever they stand, whoever's they are. Costs each record's message
    formatted once more (the handler formats it again) and `mask` over it, and a
    traceback formatted here rather than by the handler.
    """

    def __init__(self, secrets: list[str]) -> None:
        super().__init__()
        self.secrets = [s for s in secrets if s]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask(message, self.secrets)
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = mask(record.exc_text, self.secrets)
        if masked != message:
            record.msg, record.args = masked, None
        return True


def _is_secret(key: str) -> bool:
    return "password" in key or key.endswith(".pem") or "secret" in key
