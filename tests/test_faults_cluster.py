"""Faults on the three-node cluster, under a steady stream of events (docs/reliability.md).

Each scenario runs the windows worker while tests.scenario.SteadyPublisher
publishes, injects its faults one at a time, and ends with the same proof: the
four tables, the DLQ and the topic against what the publisher reported as sent
(tests.scenario.ScenarioReport.finish). The cluster is deploy/local/kafka.sh's
with KAFKA_NODES=3 (started by deploy/local/test-faults.sh): topics replicated
three times, min.insync.replicas 2, so one broker can go at any time.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from sqlalchemy import select

from skillstats.config import Settings
from skillstats.kafka import end_offsets, ensure_topics
from skillstats.publisher import Publisher, PublishError
from skillstats.sinks.db import open_engine
from skillstats.sinks.schema import docsync_runs
from skillstats.workload import generate
from tests.conftest import settings_env
from tests.helpers import (
    WorkerProcess,
    caught_up,
    read_topic,
    run_docsync,
    wait_until,
)
from tests.scenario import Cluster, ScenarioReport, SteadyPublisher, applied, seconds_to_recover, started_applying
from tests.test_publish import cli

pytestmark = pytest.mark.faults

RATE = 2000  # events/s while the faults happen: a busy registry, well below what one worker applies
KILLS = 5
BROKER_DOWN_EVENTS = 10_000  # published while a broker is down, before it comes back


@pytest.fixture
def cluster(kafka_bootstrap: str) -> Iterator[Cluster]:
    cluster = Cluster(kafka_bootstrap)
    if len(cluster.nodes) < 3:
        pytest.fail(f"{kafka_bootstrap} has {len(cluster.nodes)} node(s); deploy/local/test-faults.sh starts three")
    yield cluster
    for node in sorted(cluster.stopped):  # a failed scenario leaves no broker down for the next one
        cluster.start(node)


def database(settings: Settings) -> str:
    return settings.database_url.split(":")[0]


def test_windows_killed_five_times_under_load(
    settings: Settings, registry_rows: dict[str, str | None], cluster: Cluster, tmp_path: Path
) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    report = ScenarioReport(f"windows SIGKILLed {KILLS} times (seed {seed})", database(settings))
    log = tmp_path / "worker.log"
    same_member = ("--instance-id", "worker-a")  # as the StatefulSet's pod name: the restart takes its place
    with SteadyPublisher(settings, RATE, seed=seed) as publisher:
        worker = WorkerProcess(settings, log, *same_member)
        started_applying(settings, worker)
        for _ in range(KILLS):
            # A random point of the worker's cycle: fetching, folding, upserting, committing, parking.
            time.sleep(rng.uniform(0.1, 3.0))
            worker.kill9()
            killed = time.monotonic()
            report.fault(f"SIGKILL at {applied(settings)} applied")
            worker = WorkerProcess(settings, log, *same_member)
            report.recoveries.append(seconds_to_recover(settings, settings.windows_group, killed, worker, publisher))
        sent = publisher.stop()
    wait_until(caught_up(settings, settings.windows_group, worker), 180, "the worker to apply everything")
    assert worker.terminate() == 0, worker.log_tail()
    report.finish(settings, sent, registry_rows)


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("crash", [False, True], ids=["stopped", "killed"])
@pytest.mark.parametrize("target", ["partition leader", "group coordinator"])
def test_a_broker_stopped_and_restarted_under_load(
    settings: Settings, registry_rows: dict[str, str | None], cluster: Cluster, target: str, crash: bool, tmp_path: Path
) -> None:
    group = settings.windows_group
    how = "killed (SIGKILL)" if crash else "stopped"
    report = ScenarioReport(f"the {target}'s broker {how} and restarted", database(settings))
    with SteadyPublisher(settings, RATE, seed=31) as publisher:
        worker = WorkerProcess(settings, tmp_path / "worker.log", "--instance-id", "worker-a")
        started_applying(settings, worker)
        coordinator = cluster.coordinator(group)
        leaders = cluster.leaders(settings.topic)
        if target == "group coordinator":
            node = coordinator
        else:  # the broker leading the most partitions, other than the coordinator's
            node = next(n for n, _ in Counter(leaders.values()).most_common() if n != coordinator)
        led = sorted(p for p, n in leaders.items() if n == node)
        assert led or (target == "group coordinator" and not crash)  # a crash takes leaders down with it

        cluster.stop(node, crash=crash)
        stopped = time.monotonic()
        report.fault(
            f"broker {node} {how} (leader of partitions {led}{', coordinator of the group' * (node == coordinator)})"
        )
        report.recoveries.append(seconds_to_recover(settings, group, stopped, worker, publisher))
        assert cluster.leaders(settings.topic).keys() == leaders.keys()
        assert node not in cluster.leaders(settings.topic).values()
        down_since = len(publisher.sent)
        wait_until(
            lambda: worker.assert_alive() or len(publisher.sent) >= down_since + BROKER_DOWN_EVENTS,
            120,
            f"{BROKER_DOWN_EVENTS} events published with broker {node} down",
        )

        cluster.start(node)
        restarted = time.monotonic()
        report.fault(f"broker {node} restarted")
        cluster.wait_in_sync([settings.topic, settings.dlq_topic, "__consumer_offsets"])
        report.recoveries.append(seconds_to_recover(settings, group, restarted, worker, publisher))
        sent = publisher.stop()
    wait_until(caught_up(settings, group, worker), 180, "the worker to apply everything")
    assert worker.terminate() == 0, worker.log_tail()
    report.finish(settings, sent, registry_rows)


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("crash", [False, True], ids=["stopped", "killed"])
def test_a_docsync_drain_while_a_broker_is_down(
    settings: Settings, registry_rows: dict[str, str | None], cluster: Cluster, crash: bool, tmp_path: Path
) -> None:
    how = "killed (SIGKILL)" if crash else "stopped"
    report = ScenarioReport(f"a docsync drain with a broker {how} just before", database(settings))
    with SteadyPublisher(settings, RATE, seed=41) as publisher:
        worker = WorkerProcess(settings, tmp_path / "worker.log")
        wait_until(lambda: worker.assert_alive() or len(publisher.sent) >= 10_000, 120, "a backlog for docsync")
        # The docsync group's coordinator: its commits and its fences' group must move with it.
        node = cluster.coordinator(settings.docsync_group)
        cluster.stop(node, crash=crash)
        stopped = time.monotonic()
        report.fault(f"broker {node} {how} (coordinator of the docsync group)")
        status, summaries = run_docsync(settings)
        assert status == 0 and summaries[-1]["stopped_reason"] == "caught_up", summaries
        assert summaries[-1]["events_read"] > 0, summaries
        report.recoveries.append(time.monotonic() - stopped)
        cluster.start(node)
        report.fault(f"broker {node} restarted")
        cluster.wait_in_sync([settings.topic, "__consumer_offsets"])
        sent = publisher.stop()
    wait_until(caught_up(settings, settings.windows_group, worker), 180, "the worker to apply everything")
    assert worker.terminate() == 0, worker.log_tail()
    report.finish(settings, sent, registry_rows)  # a second drain: the rest, nothing twice


def test_a_docsync_drain_killed_mid_run_then_run_again(
    settings: Settings, registry_rows: dict[str, str | None], tmp_path: Path
) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    report = ScenarioReport(f"a docsync drain SIGKILLed mid-run, then run again (seed {seed})", database(settings))
    engine = open_engine(settings.database_url)

    def run_started() -> bool:
        with engine.connect() as connection:
            return connection.execute(select(docsync_runs.c.id)).first() is not None

    with SteadyPublisher(settings, RATE, seed=seed) as publisher:
        worker = WorkerProcess(settings, tmp_path / "worker.log")
        wait_until(lambda: worker.assert_alive() or len(publisher.sent) >= 20_000, 120, "a backlog for docsync")
        drain = subprocess.Popen(
            [sys.executable, "-m", "skillstats.cli", "docsync", "--chunk-partitions", "1"],
            env=settings_env(settings),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(run_started, 60, "the drain to start")
        time.sleep(rng.uniform(0.0, 1.5))  # a random point: reading, applying a chunk, or done
        drain.send_signal(signal.SIGKILL)
        drain.wait(30)
        killed = time.monotonic()
        report.fault("docsync SIGKILLed")
        status, summaries = run_docsync(settings)  # the next run, events still arriving
        assert status == 0 and summaries[-1]["stopped_reason"] == "caught_up", summaries
        report.recoveries.append(time.monotonic() - killed)
        sent = publisher.stop()
    engine.dispose()
    wait_until(caught_up(settings, settings.windows_group, worker), 180, "the worker to apply everything")
    assert worker.terminate() == 0, worker.log_tail()
    report.finish(settings, sent, registry_rows)  # one more drain: the rest, nothing twice


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_publisher_never_reports_an_event_the_in_sync_replicas_did_not_take(
    settings: Settings, cluster: Cluster
) -> None:
    # Three replicas required, one broker stopped: acks=all cannot be satisfied.
    strict = replace(settings, topic=f"{settings.topic}-isr3")
    ensure_topics(strict, {strict.topic: 3}, configs={strict.topic: {"min.insync.replicas": "3"}})
    records = list(generate(300, now_ms=int(time.time() * 1000), seed=51))
    node = cluster.nodes[-1]
    cluster.stop(node)

    publisher = Publisher(strict, flush_timeout=5)
    for record in records:
        publisher.send_raw(record.key, record.value)
    with pytest.raises(PublishError, match="not confirmed by the broker within 5s") as raised:
        publisher.flush()
    assert raised.value.unconfirmed == len(records) and publisher.delivered == 0
    assert sum(end_offsets(strict, strict.topic).values()) == 0
    # The command line says so too: non-zero, a clear message, within its --timeout.
    refused = cli(strict, "publish", "--skill-id", "sk_000001", "--kind", "download", "--timeout", "5")
    assert refused.returncode != 0 and "not confirmed by the broker within 5s" in refused.stderr, refused.stderr

    # Back to three in-sync replicas: the same publisher delivers each record, once.
    cluster.start(node)
    cluster.wait_in_sync([strict.topic])
    assert publisher.flush(120) == len(records)
    published = Counter((key, value) for key, value, _ in read_topic(strict, strict.topic))
    assert published == Counter((r.key, r.value) for r in records)
