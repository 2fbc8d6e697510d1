"""Starting a long-running consumer: wait for what it needs, refuse what cannot work.

Kubernetes may start a worker before Kafka or the database answer (a cluster
coming up, a failover in progress). A process that exits then is restarted
with growing delays (CrashLoopBackOff) and says the same 40 lines each time;
one that waits says one line per attempt and starts the moment both answer. So
a consumer waits, with capped backoff, for Kafka, the database, and its claim
on its role (which needs both), while /healthz answers 200 (it is alive) and
/readyz 503 with what it waits for.

What waiting cannot cure stops it at once, with one line that names the fix:
credentials Kafka refuses (exit 1), a topic that does not exist, a database
whose counts belong to another group or topic (exit 2), a schema that is not
current (exit 1: run `skillstats init`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sqlalchemy import Engine

from skillstats.config import FIRST_ANSWER_S, Settings, redact_url
from skillstats.kafka import KafkaRefused, TopicMissing, partition_count
from skillstats.positions import Positions
from skillstats.retry import Backoff, Outage
from skillstats.sinks.db import open_engine
from skillstats.sinks.fences import PartitionFences
from skillstats.sinks.identity import IdentityMismatch, Owner
from skillstats.sinks.migrate import SchemaOutdated, require_current
from skillstats.sinks.recovery import describe

log = logging.getLogger(__name__)
Probe = Callable[[], str | None]


class Starting:
    """Probes for a process still starting (/healthz fine, /readyz what it waits for), then the process's own."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.waiting_for = "starting"
        self._live: Probe | None = None
        self._ready: Probe | None = None

    def live(self) -> str | None:
        return self._live() if self._live is not None else None

    def ready(self) -> str | None:
        return self._ready() if self._ready is not None else f"starting: {self.waiting_for}"

    def delegate(self, live: Probe, ready: Probe) -> None:
        self._live, self._ready = live, ready


def wait_for_dependencies(
    settings: Settings,
    role: str,
    group: str,
    starting: Starting,
    stop: threading.Event,
    backoff: Backoff | None = None,
) -> tuple[Engine, Owner] | None:
    """Wait until Kafka has the topic, the database is current and the role is this group's; None if stopped.

    Raises what waiting cannot cure: KafkaRefused, TopicMissing, IdentityMismatch,
    SchemaOutdated, a database URL that cannot be (ValueError).
    """
    backoff = backoff or Backoff(base=1.0, cap=30.0)
    engine: Engine | None = None
    outage = Outage(log)
    attempt = 0
    while True:
        # The database first: what cannot be cured by waiting there (no database yet, an old
        # schema) is said at once, whether or not Kafka answers.
        what = f"the database {redact_url(settings.database_url)}"
        try:
            if engine is None:
                engine = open_engine(settings.database_url)
            require_current(engine)
            what = f"Kafka at {settings.kafka_bootstrap}"
            partition_count(settings, settings.topic, timeout=FIRST_ANSWER_S)
            what = f"the claim of the {role} role (Kafka and the database)"
            owner = Positions(settings, role, PartitionFences(engine, group, settings.topic)).claim()
        except (KafkaRefused, TopicMissing, IdentityMismatch, SchemaOutdated, ValueError):
            raise
        except Exception as exc:
            delay = backoff.delay(attempt)
            problem = describe(exc)
            starting.waiting_for = f"waiting for {what}: {problem}"
            outage.failed(f"waiting for {what}", problem, delay)
            if stop.wait(delay):
                return None
            attempt += 1
            continue
        outage.recovered("Kafka and the database answer; starting")
        starting.waiting_for = "joining the consumer group"
        return engine, owner
