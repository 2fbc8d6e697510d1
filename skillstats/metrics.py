"""Prometheus metrics of the long-running processes, and the HTTP port that serves them with the health probes.

One module, fed by hooks: the windows pipeline hands each batch's outcome to
`PipelineMetrics.batch`, docsync hands each drain's summary to `drain`, and a
worker's `Health` (its database) and `KafkaReach` (whether Kafka answers it)
are read at scrape time by one collector (`watch_health`, `watch_kafka`), so
no metric is updated from the middle of the code that does the work. The
lag-exporter's metrics (offsets, lag in messages and seconds, group state) are
measured per scrape interval by `skillstats.lag`, which describes them there.

Names follow Prometheus' conventions: the `skillstats_` prefix, base units
(seconds, records), `_total` for counters. The README's metric table lists
every name exported here and in `skillstats.lag`; tests/test_metrics.py fails
when the two disagree.

The probes are designed for Kubernetes. `/healthz` (liveness) answers whether
the process is alive and its event loop turns: only a restart can cure a loop
that stopped. It never looks at Kafka or the database, so a broker blip or a
database failover does not get pods restarted (they would come back to the same
outage, and the restart costs a rebalance). `/readyz` (readiness) says whether
the worker joined its group and is not degraded; failing it takes the pod out
of rotation and holds a rolling update, without a restart.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Protocol

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from skillstats.sinks.batch import ApplyOutcome
    from skillstats.sinks.recovery import Health

log = logging.getLogger(__name__)
disable_created_metrics()  # no `<counter>_created` series: Prometheus does not need them

EVENTS = Counter(
    "skillstats_events",
    "Valid events handled, by kind and outcome: applied (counted now) or replayed (below the fence: counted before)",
    ["group", "kind", "outcome"],
)
INVALID_EVENTS = Counter(
    "skillstats_invalid_events",
    "Invalid records handled, by reason: parked by the windows group (a batch replayed after a crash counts "
    "them again), skipped by docsync in the partitions it applied",
    ["group", "reason"],
)
UNKNOWN_SKILL_EVENTS = Counter(
    "skillstats_unknown_skill_events",
    "Events docsync skipped because their skill has no row in `skills`",
    ["group"],
)
ROWS_UPSERTED = Counter(
    "skillstats_rows_upserted",
    "Rows written by the counter upserts, by table: the SQL work the events turned into (a row touched by two "
    "transactions counts twice)",
    ["group", "table"],
)
BATCH_RECORDS = Histogram(
    "skillstats_batch_records",
    "Records per SQL transaction of the windows group",
    ["group"],
    buckets=(1, 10, 100, 500, 1_000, 5_000, 10_000, 25_000, 50_000, 100_000),
)
APPLY_SECONDS = Histogram(
    "skillstats_sql_apply_seconds",
    "Time to process one batch of the windows group: decode, park invalid records, fold, SQL transaction, retries",
    ["group"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
DLQ_WRITES = Counter(
    "skillstats_dlq_writes",
    "Records this process handed to the dead-letter topic, by reason (one already parked is left out, but counted)",
    ["group", "reason"],
)
NEWEST_EVENT_TIME = Gauge(
    "skillstats_newest_applied_event_timestamp_seconds",
    "Newest `occurred_at` among the events applied, per partition (event time)",
    ["group", "partition"],
)
NEWEST_RECORD_TIME = Gauge(
    "skillstats_newest_applied_record_timestamp_seconds",
    "Newest Kafka record timestamp among the records applied, per partition",
    ["group", "partition"],
)
ASSIGNED_PARTITIONS = Gauge(
    "skillstats_assigned_partitions",
    "Partitions of the events topic assigned to this worker",
    ["group"],
)
RECORDS_LOST = Counter(
    "skillstats_records_lost_to_retention",
    "Offsets a group's fence was moved over because retention deleted them before they were applied (lost)",
    ["group", "topic", "partition"],
)
OFFSETS_UNDELIVERED = Counter(
    "skillstats_offsets_undelivered",
    "Offsets the fences moved over that held no record the consumer was handed: transaction markers and "
    "aborted records (read_committed), legitimately",
    ["group"],
)
READS_RESTARTED = Counter(
    "skillstats_reads_restarted",
    "Partitions positioned at their SQL fence, by why: assigned, fence_behind (the database went back in "
    "time: a restore, a failover), out_of_range, stale (records fetched before a seek or a rebalance, dropped)",
    ["group", "reason"],
)
DOCSYNC_RUNS = Counter(
    "skillstats_docsync_runs",
    "Docsync drains run by this process, by result (caught_up, budget, error)",
    ["group", "result"],
)
DOCSYNC_DURATION = Gauge(
    "skillstats_docsync_last_run_duration_seconds",
    "How long this process' last drain took",
    ["group"],
)
DOCSYNC_HELD = Gauge(
    "skillstats_docsync_held_back_offset",
    "Partitions this process' last drain held back because the database refused their deltas: the offset each "
    "is held at (its fence; nothing from it applied)",
    ["group", "partition"],
)

INGEST_REQUESTS = Counter(
    "skillstats_ingest_requests",
    "Requests `skillstats ingest` answered on /v1/events, by HTTP status",
    ["status"],
)
INGEST_EVENTS_ACCEPTED = Counter(
    "skillstats_ingest_events_accepted",
    "Events `skillstats ingest` published (their transaction committed) and answered 202 for",
)
INGEST_EVENTS_REJECTED = Counter(
    "skillstats_ingest_events_rejected",
    "Invalid events `skillstats ingest` refused (400; nothing of their request was published), by reason",
    ["reason"],
)
INGEST_ACCEPT_SECONDS = Histogram(
    "skillstats_ingest_accept_seconds",
    "From a request's arrival to its 202: reading, validating, the Kafka transaction, the idempotency key",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
INGEST_OUTCOMES = ("committed", "aborted", "unknown")
INGEST_TRANSACTIONS = Counter(
    "skillstats_ingest_transactions",
    "Kafka transactions of `skillstats ingest`, by outcome: committed, aborted (its requests got 503), unknown "
    "(500: the producer failed mid-commit)",
    ["outcome"],
)

INGEST_IN_FLIGHT = Gauge(
    "skillstats_ingest_requests_in_flight",
    "Requests on /v1/events being read, validated or published right now",
)
INGEST_QUEUED = Gauge(
    "skillstats_ingest_producer_queue_records",
    "Records waiting in the ingest producer's queue (librdkafka's), not yet acknowledged",
)


class IngestMetrics:
    """`skillstats ingest`'s hooks: one call per answered request, one per Kafka transaction (the publisher's
    `on_outcome`), and the producer's queue read at scrape time. Each transaction outcome is exported from the
    start, at 0: a rate of aborts is then a number, not a series that appears with the first one."""

    def __init__(self, queued_records: Callable[[], int]) -> None:
        self._status: dict[int, Counter] = {}
        self._outcomes = {outcome: INGEST_TRANSACTIONS.labels(outcome) for outcome in INGEST_OUTCOMES}
        INGEST_QUEUED.set_function(queued_records)

    def answered(self, status: int, accepted: int, rejected: Mapping[str, int], seconds: float | None) -> None:
        child = self._status.get(status)
        if child is None:
            child = self._status[status] = INGEST_REQUESTS.labels(str(status))
        child.inc()
        if accepted:
            INGEST_EVENTS_ACCEPTED.inc(accepted)
        for reason, count in rejected.items():
            INGEST_EVENTS_REJECTED.labels(reason).inc(count)
        if seconds is not None:
            INGEST_ACCEPT_SECONDS.observe(seconds)

    def transaction(self, outcome: str) -> None:
        child = self._outcomes.get(outcome)
        (child if child is not None else INGEST_TRANSACTIONS.labels(outcome)).inc()


_watched: dict[str, Health] = {}


class KafkaReachability(Protocol):
    """What a windows worker knows of Kafka (streams/windows.py, KafkaReach), read at scrape time."""

    @property
    def unreachable(self) -> bool: ...

    client_errors: int


_watched_kafka: dict[str, KafkaReachability] = {}


class _HealthCollector(Collector):
    """The degraded state and database retries, read from each watched worker's Health at scrape time; whether
    its Kafka answers, from its KafkaReach."""

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        degraded = GaugeMetricFamily(
            "skillstats_degraded",
            "1 while the worker's database (or its DLQ) is failing: batches retried with backoff, nothing lost",
            labels=["group"],
        )
        retries = CounterMetricFamily(
            "skillstats_sql_retries", "Database operations retried after an error", labels=["group"]
        )
        unreachable = GaugeMetricFamily(
            "skillstats_kafka_unreachable",
            "1 while the windows worker hears nothing from Kafka: no fetch of its partitions answered for 10s (or, "
            "with none to fetch, a positioning or the periodic check could not reach it); it is not consuming",
            labels=["group"],
        )
        client_errors = CounterMetricFamily(
            "skillstats_kafka_client_errors",
            "Failed attempts to reach a broker or the group coordinator that the windows worker's Kafka client "
            "(aiokafka) logged: folded into the worker's own lines, one when Kafka is found unreachable and one "
            "when it answers again",
            labels=["group"],
        )
        for group, health in list(_watched.items()):
            degraded.add_metric([group], 1.0 if health.degraded else 0.0)
            retries.add_metric([group], float(health.retries))
        for group, kafka in list(_watched_kafka.items()):
            unreachable.add_metric([group], 1.0 if kafka.unreachable else 0.0)
            client_errors.add_metric([group], float(kafka.client_errors))
        yield degraded
        yield retries
        yield unreachable
        yield client_errors

    def describe(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        return self.collect()


REGISTRY.register(_HealthCollector())


def watch_health(group: str, health: Health) -> None:
    """Export `health` (degraded, retries) under `group` from now on."""
    _watched[group] = health


def watch_kafka(group: str, kafka: KafkaReachability) -> None:
    """Export `kafka` (unreachable, the client's errors) under `group` from now on."""
    _watched_kafka[group] = kafka


class PipelineMetrics:
    """The windows group's hooks: one call per batch, with label children resolved once."""

    def __init__(self, group: str) -> None:
        self.group = group
        self._batch_records = BATCH_RECORDS.labels(group)
        self._apply_seconds = APPLY_SECONDS.labels(group)
        self._kinds: dict[tuple[str, str], Counter] = {}
        self._rows: dict[str, Counter] = {}
        self._newest: dict[tuple[Gauge, int], float] = {}

    def batch(self, outcome: ApplyOutcome, records: int, seconds: float) -> None:
        # Rows before records: a reader that sees a batch's records counted (the bench)
        # then also sees its rows.
        for table, rows in outcome.rows_upserted.items():
            rows_child = self._rows.get(table)
            if rows_child is None:
                rows_child = self._rows[table] = ROWS_UPSERTED.labels(self.group, table)
            rows_child.inc(rows)
        self._batch_records.observe(records)
        self._apply_seconds.observe(seconds)
        for outcome_name, kinds in (("applied", outcome.applied_kinds), ("replayed", outcome.replayed_kinds)):
            for kind, count in kinds.items():
                child = self._kinds.get((kind, outcome_name))
                if child is None:
                    child = self._kinds[(kind, outcome_name)] = EVENTS.labels(self.group, kind, outcome_name)
                child.inc(count)

    def invalid(self, reasons: Mapping[str, int], parked: bool) -> None:
        for reason, count in reasons.items():
            INVALID_EVENTS.labels(self.group, reason).inc(count)
            if parked:
                DLQ_WRITES.labels(self.group, reason).inc(count)

    def parked(self, reason: str, count: int) -> None:
        """Records parked for another reason than invalidity (one the database refused)."""
        if count:
            DLQ_WRITES.labels(self.group, reason).inc(count)

    def newest(self, event_ms: Mapping[int, int], record_ms: Mapping[int, int]) -> None:
        for family, newest in ((NEWEST_EVENT_TIME, event_ms), (NEWEST_RECORD_TIME, record_ms)):
            for partition, ms in newest.items():
                seconds = ms / 1000
                if seconds > self._newest.get((family, partition), float("-inf")):
                    self._newest[(family, partition)] = seconds
                    family.labels(self.group, str(partition)).set(seconds)

    def assigned(self, partitions: int) -> None:
        ASSIGNED_PARTITIONS.labels(self.group).set(partitions)

    def undelivered(self, offsets: int) -> None:
        if offsets:
            OFFSETS_UNDELIVERED.labels(self.group).inc(offsets)

    def restarted(self, reason: str, partitions: int) -> None:
        if partitions:
            READS_RESTARTED.labels(self.group, reason).inc(partitions)


def records_lost(group: str, topic: str, partition: int, offsets: int) -> None:
    """Either group's hook, when it moves a fence over offsets retention deleted before they were applied."""
    RECORDS_LOST.labels(group, topic, str(partition)).inc(offsets)


def drain_finished(
    group: str,
    result: str,
    seconds: float,
    applied_kinds: Mapping[str, int],
    invalid_reasons: Mapping[str, int],
    unknown_skill: int,
    rows_upserted: Mapping[str, int],
) -> None:
    """Docsync's hook, once per drain."""
    DOCSYNC_RUNS.labels(group, result).inc()
    DOCSYNC_DURATION.labels(group).set(seconds)
    for kind, count in applied_kinds.items():
        EVENTS.labels(group, kind, "applied").inc(count)
    for reason, count in invalid_reasons.items():
        INVALID_EVENTS.labels(group, reason).inc(count)
    UNKNOWN_SKILL_EVENTS.labels(group).inc(unknown_skill)
    for table, rows in rows_upserted.items():
        ROWS_UPSERTED.labels(group, table).inc(rows)


_held_partitions: dict[str, set[str]] = {}


def docsync_held(group: str, held: Mapping[int, int]) -> None:
    """Docsync's hook, after a drain that got to apply: the partitions it held back (partition -> offset).

    Replaces the last drain's set, so a partition applied since leaves no series behind."""
    now = {str(partition): offset for partition, offset in held.items()}
    for partition in _held_partitions.get(group, set()) - set(now):
        DOCSYNC_HELD.remove(group, partition)
    for partition, offset in now.items():
        DOCSYNC_HELD.labels(group, partition).set(offset)
    _held_partitions[group] = set(now)


# ---------------------------------------------------------------------- serving

# Where the metrics port listens unless told (--metrics-host, SKILLSTATS_METRICS_HOST): every interface. The
# kubelet probes a pod at its pod IP and Prometheus scrapes it from another pod or container, so a loopback default
# would fail every liveness probe (restarts for ever) wherever the setting was forgotten; what the port serves is
# read-only figures and probe answers, no secret (URLs masked). The cost: on a bare host anyone who can reach the
# port reads them; give --metrics-host 127.0.0.1 there. The Kubernetes ConfigMap states it (docs/deploy.md).
METRICS_HOST = "0.0.0.0"

Probe = Callable[[], str | None]  # None when fine, else why not


@dataclass
class Probes:
    live: Probe
    ready: Probe


def _always_fine() -> str | None:
    return None


class _ThreadingHTTPServerV6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class MetricsServer:
    """`/metrics`, `/healthz` and `/readyz` on one port, from a daemon thread."""

    def __init__(
        self, host: str, port: int, probes: Probes | None = None, registry: CollectorRegistry = REGISTRY
    ) -> None:
        probes = probes or Probes(_always_fine, _always_fine)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path in ("/healthz", "/readyz"):
                    problem = (probes.live if path == "/healthz" else probes.ready)()
                    body = ("ok\n" if problem is None else problem + "\n").encode()
                    self._send(200 if problem is None else 503, body, "text/plain; charset=utf-8")
                else:
                    self._send(404, b"not found: try /metrics, /healthz or /readyz\n", "text/plain; charset=utf-8")

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass  # a scrape every few seconds is not news

        server_class = _ThreadingHTTPServerV6 if ":" in host else ThreadingHTTPServer
        self._server = server_class((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class PortUnavailable(OSError):
    """The metrics port cannot be had (taken, or the address is not this host's): a setting to change."""


def serve(host: str, port: int, probes: Probes | None = None, registry: CollectorRegistry = REGISTRY) -> MetricsServer:
    """Start serving; PortUnavailable, naming the address and the setting, when the port cannot be had."""
    try:
        server = MetricsServer(host, port, probes, registry)
    except OSError as exc:
        raise PortUnavailable(
            f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}; choose another port with "
            f"--metrics-port (SKILLSTATS_METRICS_PORT; 0 serves none) or address with --metrics-host"
        ) from None
    log.info("metrics, /healthz and /readyz on http://%s:%d/", host, server.port)
    return server


def exported_series_names() -> dict[str, str]:
    """Every series name a skillstats process can export, as PromQL sees it -> its metric family's name.

    Counters are `<family>_total`, histograms `<family>_bucket`, `_sum` and `_count`.
    Includes the lag-exporter's metrics (skillstats.lag.EXPORTED).
    """
    from skillstats.lag import EXPORTED

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    names: dict[str, str] = {}
    families = [(family.name, family.type) for family in REGISTRY.collect()]
    families += [
        (name, "counter" if kind is CounterMetricFamily else "gauge") for name, (kind, _h, _l) in EXPORTED.items()
    ]
    for name, kind in families:
        if name.startswith("skillstats_"):
            for suffix in suffixes[kind]:
                names[name + suffix] = name
    return names
