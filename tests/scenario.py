"""The fault suite's harness: the three-node cluster, a steady publisher, and the one check every scenario ends with.

A scenario (docs/reliability.md) publishes continuously with the project's own
Publisher while it injects faults, then proves the outcome the same way each
time: the two window tables and the two doc-stat tables equal an expectation
computed from the events the publisher reported as sent (tests.helpers, which
restates the contract rather than importing it), the DLQ holds each invalid
record exactly once, and the topic holds each reported event exactly once. It
prints one line: events, faults injected, seconds to recover, differences.

"Seconds to recover" from a fault is the time until the group had applied every
event published before the fault: a kill until the restarted worker is past the
kill point, a broker stop until its partitions' new leaders serve the group.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from confluent_kafka.admin import AdminClient

from skillstats.config import Settings
from skillstats.dlq import H_OFFSET, H_PARTITION, H_REASON
from skillstats.kafka import end_offsets, while_moving
from skillstats.publisher import Publisher
from skillstats.workload import Record, generate
from tests.conftest import record_metric
from tests.helpers import (
    WorkerProcess,
    actual_docstats,
    actual_windows,
    expected_docstats,
    expected_windows,
    fences,
    local_service,
    read_records,
    run_docsync,
    wait_until,
)

SKILLS = 2000  # the skill ids the steady publisher draws from, and tests.helpers.registry knows


class Cluster:
    """The local KRaft cluster of deploy/local/kafka.sh: node N is broker id N on port KAFKA_PORT + N - 1."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.admin = AdminClient({"bootstrap.servers": bootstrap})
        self.nodes = sorted(self.admin.list_topics(timeout=10).brokers)
        self.stopped: set[int] = set()

    def leaders(self, topic: str) -> dict[int, int]:
        """partition -> the broker id leading it now."""
        metadata = self.admin.list_topics(topic, timeout=10).topics[topic]
        return {p: m.leader for p, m in metadata.partitions.items()}

    def coordinator(self, group: str) -> int:
        """The broker id coordinating `group` (Kafka names one even before the group has members)."""
        described = while_moving(lambda: self.admin.describe_consumer_groups([group])[group].result(15), 60)
        return int(described.coordinator.id)

    def stop(self, node: int, *, crash: bool = False) -> None:
        """Stop broker `node`: a controlled shutdown, or with `crash` a SIGKILL."""
        self.stopped.add(node)
        local_service("kafka.sh", "kill-node" if crash else "stop-node", str(node))

    def start(self, node: int) -> None:
        local_service("kafka.sh", "start-node", str(node))
        self.stopped.discard(node)

    def wait_in_sync(self, topics: list[str], timeout: float = 120) -> None:
        """Every replica of every partition of `topics` back in sync: a stopped node has caught up."""

        def in_sync() -> bool:
            metadata = self.admin.list_topics(timeout=10).topics
            return all(
                set(m.isrs) == set(m.replicas) and m.leader >= 0
                for topic in topics
                for m in metadata[topic].partitions.values()
            )

        wait_until(in_sync, timeout, f"every replica of {topics} back in sync", interval=0.5)


class SteadyPublisher:
    """The project's Publisher in a thread at `rate` events/s, remembering what the broker confirmed.

    Each slice of a tenth of a second is flushed (acks=all, idempotent) before it
    counts as sent, so `sent` never holds an event the broker did not acknowledge;
    a slice that cannot be confirmed in two minutes stops the publisher and fails
    the scenario, because a fault the suite injects must never cost a publish.
    """

    def __init__(self, settings: Settings, rate: int, *, seed: int, invalid_ratio: float = 0.004) -> None:
        self.settings = settings
        self.rate = rate
        self.sent: list[Record] = []
        self.error: BaseException | None = None
        self._source: Iterator[Record] = generate(
            10**9, now_ms=int(time.time() * 1000), skills=SKILLS, seed=seed, invalid_ratio=invalid_ratio
        )
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="steady-publisher", daemon=True)

    def __enter__(self) -> SteadyPublisher:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._halt.set()
        self._thread.join(180)

    def _run(self) -> None:
        started = time.monotonic()
        try:
            with Publisher(self.settings, flush_timeout=120) as publisher:
                while not self._halt.is_set():
                    due = int((time.monotonic() - started) * self.rate) - len(self.sent)
                    batch = [next(self._source) for _ in range(max(0, min(due, self.rate)))]
                    for record in batch:
                        publisher.send_raw(record.key, record.value)
                    publisher.flush()
                    self.sent.extend(batch)
                    self._halt.wait(0.1)
        except Exception as exc:  # PublishError above all; reported by stop()
            self.error = exc

    def confirmed_since(self, count: int) -> int:
        """Events confirmed since `count` were; fails the scenario if the publisher failed."""
        assert self.error is None, f"the publisher failed under the fault: {self.error!r}"
        return len(self.sent) - count

    def stop(self) -> list[Record]:
        """Stop publishing; every event the broker confirmed, in order. Fails if any publish failed."""
        self.__exit__()
        assert not self._thread.is_alive(), "the publisher did not stop"
        assert self.error is None, f"the publisher failed under the fault: {self.error!r}"
        return self.sent


def applied(settings: Settings) -> int:
    """Records the windows group has applied, by its SQL fences."""
    return sum(fences(settings, settings.windows_group).values())


def started_applying(settings: Settings, worker: WorkerProcess) -> None:
    wait_until(lambda: worker.assert_alive() is None and applied(settings) > 0, 120, "the worker to start applying")


def applied_past(settings: Settings, group: str, ends: dict[int, int]) -> bool:
    """Whether `group`'s SQL fences are at or past `ends` (partition -> offset) everywhere."""
    applied = fences(settings, group)
    return all(applied.get(p, 0) >= n for p, n in ends.items() if n > 0)


def seconds_to_recover(
    settings: Settings,
    group: str,
    since: float,
    worker: WorkerProcess | None = None,
    publisher: SteadyPublisher | None = None,
    timeout: float = 240,
) -> float:
    """Seconds from `since` (monotonic) until `group` has applied events published after the fault.

    With `publisher`, first waits until it has had a second's worth of events
    confirmed since this call (publishing resumed: new leaders serve it), then
    takes the topic's ends: the group must apply those, so a restarted worker or a
    group whose leaders moved has to make real progress, not merely be where it was.
    """
    if publisher is not None:
        published = len(publisher.sent)
        wait_until(
            lambda: publisher.confirmed_since(published) >= publisher.rate, timeout, "events published after the fault"
        )
    ends = end_offsets(settings, settings.topic)

    def recovered() -> bool:
        if worker is not None:
            worker.assert_alive()
        return applied_past(settings, group, ends)

    wait_until(recovered, timeout, f"{group} to apply the events published after the fault")
    return time.monotonic() - since


def differences(settings: Settings, sent: list[Record], rows: dict[str, str | None]) -> dict[str, int]:
    """Rows (or records) that differ from the expectation, per table: all four, the DLQ and the topic.

    Runs one doc-stats drain first, so the docsync tables are compared too; the
    windows group must have caught up already.
    """
    found: dict[str, int] = {}
    want_daily, want_hourly = expected_windows(sent)
    got_daily, got_hourly = actual_windows(settings)
    found["skill_daily_stats"] = _mismatched(want_daily, got_daily)
    found["skill_hourly_stats"] = _mismatched(want_hourly, got_hourly)
    status, summaries = run_docsync(settings)
    assert status == 0 and summaries[-1]["stopped_reason"] == "caught_up", summaries
    want_skills, want_owners, _unknown = expected_docstats(sent, rows)
    got_skills, got_owners = actual_docstats(settings)
    found["skills"] = _mismatched(want_skills, got_skills)
    found["user_skill_stats"] = _mismatched(want_owners, got_owners)
    # The DLQ by position: each invalid record's partition and offset parked exactly once,
    # with a reason (identical bytes at two offsets are two records, each to be parked).
    events = read_records(settings, settings.topic)
    invalid = {(r.key, r.value) for r in sent if not r.valid}
    should_park = Counter((r.partition, r.offset) for r in events if (r.key, r.value) in invalid)
    parcels = read_records(settings, settings.dlq_topic)
    parked = Counter((int(p.headers[H_PARTITION]), int(p.headers[H_OFFSET])) for p in parcels if H_REASON in p.headers)
    found["dlq"] = sum(((parked - should_park) + (should_park - parked)).values()) + len(parcels) - parked.total()
    published = Counter((r.key, r.value) for r in events)
    reported = Counter((r.key, r.value) for r in sent)
    found["topic"] = sum(((published - reported) + (reported - published)).values())
    return found


def _mismatched(want: dict, got: dict) -> int:  # type: ignore[type-arg]
    return sum(1 for key in want.keys() | got.keys() if want.get(key) != got.get(key))


@dataclass
class ScenarioReport:
    """One scenario's line in the run's summary (and docs/reliability.md)."""

    name: str
    database: str
    events: int = 0
    faults: list[str] = field(default_factory=list)
    recoveries: list[float] = field(default_factory=list)
    found: dict[str, int] = field(default_factory=dict)

    def fault(self, what: str) -> None:
        self.faults.append(what)

    def line(self) -> str:
        recover = f"{max(self.recoveries):.1f}s worst, {min(self.recoveries):.1f}s best" if self.recoveries else "n/a"
        return (
            f"fault scenario '{self.name}' ({self.database}): {self.events} events, "
            f"{len(self.faults)} fault(s) [{'; '.join(self.faults)}], recovered in {recover}, "
            f"differences {sum(self.found.values())}"
        )

    def finish(self, settings: Settings, sent: list[Record], rows: dict[str, str | None]) -> None:
        """Check everything, print the line, fail on any difference."""
        self.events = len(sent)
        self.found = differences(settings, sent, rows)
        line = self.line()
        record_metric(line)
        print(line)
        assert sum(self.found.values()) == 0, f"{line}: {self.found}"
