"""A single-node Kafka with every listener an operator might give skillstats: SASL and TLS.

deploy/local/kafka.sh starts it with extra listeners (KAFKA_EXTRA_LISTENERS) and
their settings (KAFKA_EXTRA_CONFIG), written here:

- SASL_PLAINTEXT and SASL_SSL, each taking SCRAM-SHA-512 (users created through
  the admin API, as a cluster operator would) and PLAIN (users in the JAAS line);
- SSL with client certificates required (mutual TLS);
- PLAINTEXT, for the test's own administration only.

The certificates (a CA, the broker's for 127.0.0.1, a client's, and a client key
encrypted with a password) are made with openssl in the test's directory, so no
key material is kept in the repository.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka.admin import AdminClient, ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

from tests.helpers import free_port, local_service

ROOT = Path(__file__).resolve().parent.parent

SCRAM_USER, SCRAM_PASSWORD = "stats-scram", "scram-Pa55-zq8Wv"
PLAIN_USER, PLAIN_PASSWORD = "stats-plain", "plain-Pa55-Lk3Rt"
CLIENT_KEY_PASSWORD = "key-Pa55-Hn6Xc"


@dataclass(frozen=True)
class SecureKafka:
    plaintext: str
    sasl_plaintext: str
    ssl: str
    sasl_ssl: str
    ca: Path
    client_cert: Path
    client_key: Path  # encrypted with CLIENT_KEY_PASSWORD


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(directory: Path) -> None:
    """ca.pem; server.pem (PKCS#8 key + certificate, for the broker); client.crt + client.key (encrypted)."""
    directory.mkdir(parents=True, exist_ok=True)
    days = ("-days", "2")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-subj", "/CN=skillstats-test-ca", *days, cwd=directory)  # fmt: skip
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.rsa", "-out", f"{name}.csr",
                 "-subj", f"/CN=skillstats-test-{name}", cwd=directory)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.crt", "-extfile", "san.ext", *days, cwd=directory)  # fmt: skip
    _openssl("pkcs8", "-topk8", "-nocrypt", "-in", "server.rsa", "-out", "server.key", cwd=directory)
    (directory / "server.pem").write_text(
        (directory / "server.key").read_text() + (directory / "server.crt").read_text()
    )
    _openssl("pkcs8", "-topk8", "-in", "client.rsa", "-out", "client.key", "-passout", f"pass:{CLIENT_KEY_PASSWORD}",
             cwd=directory)  # fmt: skip


def _broker_config(certs: Path) -> str:
    scram = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
    plain = f'org.apache.kafka.common.security.plain.PlainLoginModule required user_{PLAIN_USER}="{PLAIN_PASSWORD}";'
    lines = [
        "sasl.enabled.mechanisms=SCRAM-SHA-512,PLAIN",
        "ssl.keystore.type=PEM",
        f"ssl.keystore.location={certs / 'server.pem'}",
        "ssl.truststore.type=PEM",
        f"ssl.truststore.location={certs / 'ca.pem'}",
        "listener.name.ssl.ssl.client.auth=required",
    ]
    for listener in ("sasl_plaintext", "sasl_ssl"):
        lines.append(f"listener.name.{listener}.scram-sha-512.sasl.jaas.config={scram}")
        lines.append(f"listener.name.{listener}.plain.sasl.jaas.config={plain}")
    return "\n".join(lines) + "\n"


def start(directory: Path) -> tuple[SecureKafka, dict[str, str]]:
    """Start the broker under `directory`; the Kafka and the kafka.sh environment to stop it with."""
    certs = directory / "certs"
    make_certificates(certs)
    port = free_port()
    extra = {name: free_port() for name in ("SASL_PLAINTEXT", "SSL", "SASL_SSL")}
    (directory / "extra.properties").write_text(_broker_config(certs))
    state = directory / "state"
    state.mkdir()
    os.symlink(ROOT / ".local" / "kafka-libs", state / "kafka-libs")
    env = {
        "KAFKA_PORT": str(port),
        "KAFKA_NODES": "1",
        "SKILLSTATS_STATE_DIR": str(state),
        "KAFKA_EXTRA_LISTENERS": ",".join(f"{name}://127.0.0.1:{p}" for name, p in extra.items()),
        "KAFKA_EXTRA_CONFIG": str(directory / "extra.properties"),
    }
    local_service("kafka.sh", "start", **env)
    kafka = SecureKafka(
        plaintext=f"127.0.0.1:{port}",
        sasl_plaintext=f"127.0.0.1:{extra['SASL_PLAINTEXT']}",
        ssl=f"127.0.0.1:{extra['SSL']}",
        sasl_ssl=f"127.0.0.1:{extra['SASL_SSL']}",
        ca=certs / "ca.pem",
        client_cert=certs / "client.crt",
        client_key=certs / "client.key",
    )
    admin = AdminClient({"bootstrap.servers": kafka.plaintext})
    upsert = UserScramCredentialUpsertion(
        SCRAM_USER, ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 8192), SCRAM_PASSWORD.encode()
    )
    for future in admin.alter_user_scram_credentials([upsert]).values():
        future.result(30)
    return kafka, env


def stop(env: dict[str, str]) -> None:
    local_service("kafka.sh", "reset", **env)
