"""The `skillstats` command line (README, operations)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

import orjson

from skillstats import __version__
from skillstats.config import LIBRDKAFKA_LOG, MaskSecrets, Settings, SettingsError, mask, redact_url
from skillstats.contract import (
    EFFECTS,
    KINDS,
    WIRE_VERSION,
    Invalid,
    InvalidEvent,
    StatEvent,
    duplicate_member,
    from_mapping,
    make_event,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad input from the user: reported on stderr, exit status 2."""


def _common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("connection (flags override the SKILLSTATS_* environment)")
    group.add_argument("--bootstrap", metavar="HOST:PORT", help="Kafka bootstrap servers [SKILLSTATS_KAFKA_BOOTSTRAP]")
    group.add_argument(
        "--database-url",
        metavar="URL",
        help="postgresql://user:pass@host/db, or sqlite:////abs/path.db (four slashes; three make the path "
        "relative) [SKILLSTATS_DATABASE_URL]",
    )
    group.add_argument("--topic", help="stat events topic [SKILLSTATS_TOPIC]")
    group.add_argument("--dlq-topic", help="dead-letter topic [SKILLSTATS_DLQ_TOPIC]")
    group.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    return common


# Default metrics ports, one per long-running command, so they can share a host.
METRICS_PORTS = {"windows": 9310, "lag-exporter": 9311, "docsync": 9312}


def _metrics_options(command: str) -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(add_help=False)
    group = options.add_argument_group("metrics and health probes (GET /metrics, /healthz, /readyz)")
    group.add_argument(
        "--metrics-port",
        type=_port,
        # A string default goes through `type` too: a bad SKILLSTATS_METRICS_PORT is a usage error.
        default=os.environ.get("SKILLSTATS_METRICS_PORT", str(METRICS_PORTS[command])),
        metavar="PORT",
        help=f"HTTP port; 0 serves nothing [SKILLSTATS_METRICS_PORT] (default {METRICS_PORTS[command]})",
    )
    group.add_argument(
        "--metrics-host",
        default=os.environ.get("SKILLSTATS_METRICS_HOST", "0.0.0.0"),
        metavar="ADDRESS",
        help="address to listen on [SKILLSTATS_METRICS_HOST] (default 0.0.0.0, every interface)",
    )
    return options


def _shutdown_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shutdown-budget",
        type=float,
        default=os.environ.get("SKILLSTATS_SHUTDOWN_BUDGET", "10"),  # a string default goes through `type`
        metavar="SECONDS",
        help="on SIGTERM: finish or abandon the work in flight, commit and leave within this; past it, exit 3 "
        "with a message [SKILLSTATS_SHUTDOWN_BUDGET] (default 10)",
    )


def _settings(args: argparse.Namespace) -> Settings:
    return Settings.from_env().override(
        kafka_bootstrap=args.bootstrap,
        database_url=args.database_url,
        topic=args.topic,
        dlq_topic=args.dlq_topic,
        windows_group=getattr(args, "group", None) if args.command == "windows" else None,
        docsync_group=getattr(args, "group", None) if args.command == "docsync" else None,
    )


def _parse_time_ms(text: str) -> int:
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not epoch milliseconds or ISO-8601: {text!r}") from exc
    if parsed.tzinfo is None:
        raise argparse.ArgumentTypeError(f"give a timezone (e.g. a trailing Z for UTC): {text!r}")
    return int(parsed.timestamp() * 1000)


def _port(text: str) -> int:
    if not text.strip().isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port (0-65535; 0 serves nothing): {text!r}")
    return int(text)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _retention_days(text: str) -> int:
    from skillstats.prune import MAX_RETENTION_DAYS, MIN_RETENTION_DAYS

    if not text.strip().isdigit() or not MIN_RETENTION_DAYS <= int(text) <= MAX_RETENTION_DAYS:
        raise argparse.ArgumentTypeError(f"days from {MIN_RETENTION_DAYS} to {MAX_RETENTION_DAYS}, not {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    common = _common_options()
    parser = argparse.ArgumentParser(
        prog="skillstats",
        description="Exact per-skill, per-day and per-hour stat counters in SQL, from a Kafka topic of stat events.",
        epilog="Each command has its own --help. Configuration: SKILLSTATS_* environment variables, see README.",
    )
    parser.add_argument("--version", action="version", version=f"skillstats {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    init = commands.add_parser(
        "init",
        parents=[common],
        help="create the topics and the SQL schema (idempotent)",
        description="Create the events and DLQ topics through the Kafka admin API and bring the SQL "
        "schema to the newest migration. Safe to run again: existing topics and tables are left as they are.",
    )
    init.add_argument("--partitions", type=_positive, default=12, help="partitions of the events topic (default 12)")
    init.add_argument("--dlq-partitions", type=_positive, default=3, help="partitions of the DLQ topic (default 3)")
    init.add_argument(
        "--replication-factor",
        type=_positive,
        default=-1,
        help="replication factor (default: the broker's default.replication.factor)",
    )
    init.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for Kafka (default 30)")
    init.add_argument("--skip-topics", action="store_true", help="only migrate the SQL schema")
    init.add_argument("--skip-schema", action="store_true", help="only create the topics")

    publish = commands.add_parser(
        "publish",
        parents=[common],
        help="publish one event, or a JSONL file of events",
        description="Publish stat events and wait until the broker confirms every one. Either give one event "
        "with --skill-id and --kind, or --file with one JSON object per line in the wire format (v and "
        "event_id may be left out: v defaults to 1 and event_id to a fresh UUID). Every line is validated "
        "before anything is sent; invalid lines are listed with their numbers and nothing is published "
        "unless --skip-invalid is given.",
    )
    publish.add_argument("--file", type=Path, metavar="PATH", help="JSONL file of events ('-' for stdin)")
    publish.add_argument("--skip-invalid", action="store_true", help="with --file: publish the valid lines anyway")
    publish.add_argument("--skill-id", help="skill id (also the record key)")
    publish.add_argument("--kind", choices=KINDS, help="event kind")
    publish.add_argument(
        "--occurred-at",
        type=_parse_time_ms,
        metavar="WHEN",
        help="event time: epoch milliseconds or ISO-8601 with zone (default: now)",
    )
    publish.add_argument("--event-id", help="event id (default: a fresh UUID)")
    publish.add_argument("--delta-all-time", type=int, metavar="N", help="install_clear: change to installs_all_time")
    publish.add_argument("--delta-current", type=int, metavar="N", help="install_clear: change to installs_current")
    publish.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for confirmation (default 30)")
    publish.add_argument(
        "--demo",
        type=_positive,
        metavar="RATE",
        help="publish synthetic registry traffic (skewed popularity, the usual kind mix, some late events) at "
        "RATE events/s until SIGTERM, or until --demo-events",
    )
    publish.add_argument("--demo-events", type=_positive, metavar="N", help="with --demo: stop after N events")

    windows = commands.add_parser(
        "windows",
        parents=[common, _metrics_options("windows")],
        help="run the per-day/per-hour worker (faust app)",
        description="Run the consumer group that keeps skill_daily_stats and skill_hourly_stats exact, "
        "seconds behind the stream. Runs until SIGTERM or SIGINT.",
    )
    windows.add_argument("--group", help="consumer group id [SKILLSTATS_WINDOWS_GROUP] (default skillstats-windows)")
    windows.add_argument(
        "--instance-id",
        default=os.environ.get("SKILLSTATS_INSTANCE_ID"),
        help="static group membership id, stable across restarts, e.g. the pod name [SKILLSTATS_INSTANCE_ID]",
    )
    windows.add_argument(
        "--batch-size",
        type=_positive,
        default=50_000,
        help="most records per SQL transaction (default 50000); records fetched while one "
        "transaction runs form the next, so batches are small when the stream is quiet",
    )
    windows.add_argument(
        "--fetch-size", type=_positive, default=10_000, help="most records per fetch from Kafka (default 10000)"
    )
    windows.add_argument(
        "--partition-fetch-mib",
        type=_positive,
        default=4,
        help="most MiB one fetch brings per partition (default 4); the worker may hold this much compressed data "
        "per partition it owns, and below 4 it waits on the broker more (docs/performance.md)",
    )
    _shutdown_option(windows)
    windows.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="info (default): the start, assignments, rebalances; debug: every batch too",
    )
    docsync = commands.add_parser(
        "docsync",
        parents=[common, _metrics_options("docsync")],
        help="apply skill and owner stat deltas (one bounded drain, or --every)",
        description="Run the consumer group that keeps the skills stat columns and user_skill_stats exact. "
        "By default one bounded drain, then exit (fit for a Kubernetes CronJob): snapshot the end offsets, read "
        "up to them (or to --max-events / --max-seconds), apply each skill's deltas once, print a summary. Exit "
        "status 0 unless the drain failed. With --every, drain on that cadence until SIGTERM, serving metrics "
        "(a single drain serves none: the lag-exporter reports the last successful run).",
    )
    docsync.add_argument("--group", help="consumer group id [SKILLSTATS_DOCSYNC_GROUP] (default skillstats-docsync)")
    docsync.add_argument(
        "--every", metavar="INTERVAL", help="drain repeatedly; a number with a unit: 30s, 15m, 6h, 1d (default: once)"
    )
    docsync.add_argument("--max-events", type=_positive, help="stop reading after this many records")
    docsync.add_argument("--max-seconds", type=float, help="stop reading after this many seconds")
    docsync.add_argument(
        "--chunk-partitions",
        type=_positive,
        default=4,
        help="partitions per SQL transaction (default 4; halved on database errors)",
    )
    docsync.add_argument("--json", action="store_true", help="print the summary as one JSON object per drain")
    _shutdown_option(docsync)

    status = commands.add_parser(
        "status",
        parents=[common],
        help="how far each consumer group is; the last docsync runs",
        description="For the windows and docsync groups: records in the topic, records applied to SQL (below "
        "the fences), Kafka's committed offsets and the lag; then the most recent docsync runs.",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output, per partition")

    bench = commands.add_parser(
        "bench",
        parents=[common],
        help="measure throughput, memory and latency of each consumer",
        description="For each workload (steady, backfill), preload a fresh topic and measure, in one run, each "
        "consumer from a cold start to caught up: (a) a bare confluent-kafka loop, the ceiling; (b) the loop plus "
        "decoding; (c) skillstats windows and (d) a docsync drain, on SQLite and PostgreSQL; (e) a naive faust agent "
        "updating a windowed Table per event; (f) Kafka's own kafka-consumer-perf-test; (g) the windows sink behind a "
        "confluent-kafka loop; (h) two windows workers in one group. Each row gives events/s, "
        "the ratio to (a), CPU seconds per million events and SQL rows upserted/s. Then publish-to-SQL latency at a "
        "steady offered load. See docs/performance.md.",
    )
    fences = commands.add_parser(
        "fences",
        parents=[common],
        help="show or reset a group's SQL fences (the way out of a fence ahead of the log)",
        description="Each consumer group's SQL fence per partition is the next offset it has not applied; "
        "its counts in SQL are exactly the records below. A fence past its partition's log end means the topic "
        "was recreated or truncated, or the database restored from elsewhere, and the consumers refuse to run. "
        "`reset` sets the group's fences (and its Kafka committed offsets) for the chosen partitions: "
        "--to start counts again everything the topic holds now (right after a topic was recreated and its "
        "records were never counted), --to end counts only what arrives from now on. Without --confirm it "
        "only prints what it would do. Stop the group's consumers first.",
    )
    exporter = commands.add_parser(
        "lag-exporter",
        parents=[common, _metrics_options("lag-exporter")],
        help="serve both groups' lag (records and seconds) to Prometheus; always on",
        description="Measure, every --interval seconds, for the windows and docsync groups and every partition: "
        "committed offset, log end offset, lag in records, and lag in seconds as the age of the oldest record not "
        "yet consumed (that record is read, its timestamp taken); the groups' state and members; the DLQ's size; "
        "the last successful docsync run (from SQL). Serves the last measurement on /metrics until SIGTERM, and "
        "keeps serving while Kafka is unreachable, with skillstats_lag_exporter_up 0. The groups are "
        "SKILLSTATS_WINDOWS_GROUP and SKILLSTATS_DOCSYNC_GROUP (defaults skillstats-windows, skillstats-docsync).",
    )
    exporter.add_argument("--interval", type=float, default=15.0, help="seconds between measurements (default 15)")
    exporter.add_argument(
        "--timeout", type=float, default=10.0, help="bound on each Kafka request, in seconds (default 10)"
    )

    dlq = commands.add_parser(
        "dlq",
        parents=[common],
        help="inspect and replay the dead-letter topic",
        description="`list` shows the parked records (reason, message, source partition and offset, when) and "
        "counts by reason. `replay` publishes copies of the selected parked records to the events topic, with "
        "the header skillstats.replayed_from naming their DLQ partition and offset: for when the cause is gone "
        "(a contract fixed, a database restored). A copy still invalid is parked again, and is not replayed "
        "again without --again; a record replayed before is refused without --again (it would count twice). "
        "Filters combine: every one given must match.",
    )
    dlq.add_argument("action", choices=["list", "replay"])
    dlq.add_argument("--reason", action="append", default=[], help="only this reason (repeatable)")
    dlq.add_argument("--since", type=_parse_time_ms, metavar="WHEN", help="parked at or after (ms or ISO-8601)")
    dlq.add_argument(
        "--source-offsets",
        metavar="P:O[,P:O...]",
        help="only these source records: partition:offset of the events topic, comma-separated",
    )
    dlq.add_argument("--limit", type=_positive, default=50, help="list: most records shown (default 50)")
    dlq.add_argument("--json", action="store_true", help="list: machine-readable output")
    dlq.add_argument("--all", action="store_true", help="replay: every parked record (no filter given)")
    dlq.add_argument("--dry-run", action="store_true", help="replay: show what would be replayed, publish nothing")
    dlq.add_argument("--again", action="store_true", help="replay: also records replayed before")

    top = commands.add_parser(
        "top",
        parents=[common],
        help="the most downloaded or installed skills of the last days",
        description="The leaderboard the daily table exists for: per skill, downloads and installs summed over the "
        "last --days UTC days (today included), from skill_daily_stats.",
    )
    top.add_argument("--days", type=_positive, default=7, help="UTC days, today included (default 7)")
    top.add_argument(
        "--by", choices=["downloads", "installs"], default="downloads", help="order by (default downloads)"
    )
    top.add_argument("--limit", type=_positive, default=20, help="rows (default 20)")
    top.add_argument("--json", action="store_true", help="machine-readable output")

    prune = commands.add_parser(
        "prune",
        parents=[common],
        help="delete old events every required group has read (dry run unless --apply)",
        description="Per partition of the events topic, delete the records older than --retention-days AND below "
        "the committed offset of every required group (never above that group's SQL fence): Kafka's time "
        "retention alone can delete records a lagging group has not read; prune cannot. A partition where a "
        "required group has no committed offset is left alone (not ready). Prints, per partition, the log start "
        "(low watermark), the cutoff, the records below it and what set it. A dry run unless --apply --confirm "
        "PRUNE_SKILL_STAT_EVENTS. With --hourly-days, also deletes the skill_hourly_stats rows of hours that "
        "ended more than N days ago, a few thousand rows per transaction.",
    )
    prune.add_argument(
        "--retention-days",
        type=_retention_days,
        default=7,
        metavar="N",
        help="keep records newer than N days (1-90, default 7)",
    )
    prune.add_argument(
        "--require-groups",
        metavar="GROUP[,GROUP...]",
        help="consumer groups that must have committed past a record before it goes, comma-separated "
        "(default: the windows and docsync groups, SKILLSTATS_WINDOWS_GROUP and SKILLSTATS_DOCSYNC_GROUP)",
    )
    prune.add_argument(
        "--hourly-days",
        type=_positive,
        metavar="N",
        help="also delete skill_hourly_stats rows older than N days (default: keep them all)",
    )
    prune.add_argument("--apply", action="store_true", help="really delete (needs --confirm)")
    prune.add_argument("--confirm", metavar="TOKEN", help="PRUNE_SKILL_STAT_EVENTS, with --apply")
    prune.add_argument("--json", action="store_true", help="machine-readable output, per partition")
    prune.add_argument(
        "--timeout", type=float, default=30.0, help="bound on each Kafka request, in seconds (default 30)"
    )

    fences.add_argument("action", choices=["show", "reset"])
    fences.add_argument("--group", help="consumer group (default: both groups for show; required for reset)")
    fences.add_argument("--to", choices=["start", "end"], help="reset target: the log start or the log end")
    fences.add_argument("--partition", type=int, action="append", help="only this partition (repeatable)")
    fences.add_argument("--confirm", metavar="TOKEN", help="RESET_FENCES, to really reset")

    from skillstats.bench import add_arguments

    add_arguments(bench)
    return parser


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    handle = sys.stdin.buffer if str(path) == "-" else path.open("rb")
    with handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield number, line


def read_jsonl(path: Path, now_ms: int) -> tuple[list[StatEvent], list[str]]:
    """Validate every line of a JSONL file; returns the events and one message per bad line."""
    events: list[StatEvent] = []
    problems: list[str] = []
    for number, line in _lines(path):
        try:
            body = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            problems.append(f"line {number}: malformed: {exc}")
            continue
        repeated = duplicate_member(line, body)
        if repeated is not None:
            problems.append(f"line {number}: malformed: the member {repeated!r} appears twice (RFC 7493)")
            continue
        if isinstance(body, dict):
            body.setdefault("v", WIRE_VERSION)
            body.setdefault("event_id", uuid.uuid4().hex)
        result = from_mapping(body, now_ms, check_key=False)
        if isinstance(result, Invalid):
            problems.append(f"line {number}: {result.reason}: {result.message}")
        else:
            events.append(result)
    return events, problems


def _progress(total: int, out: TextIO) -> object:
    from tqdm import tqdm

    return tqdm(total=total, unit="ev", file=out, disable=total < 10_000 or not out.isatty(), mininterval=0.5)


def cmd_publish(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.publisher import Publisher

    now_ms = int(time.time() * 1000)
    if args.demo is not None:
        if args.file is not None or args.skill_id or args.kind:
            raise UsageError("--demo publishes generated events: give no --file, --skill-id or --kind with it")
        return _publish_demo(settings, args.demo, args.demo_events, args.timeout)
    if args.demo_events is not None:
        raise UsageError("--demo-events goes with --demo")
    if args.file is not None:
        if args.skill_id or args.kind:
            raise UsageError("give either --file or --skill-id/--kind, not both")
        if str(args.file) != "-" and not args.file.is_file():
            raise UsageError(f"no such file: {args.file}")
        events, problems = read_jsonl(args.file, now_ms)
        for problem in problems[:50]:
            print(problem, file=sys.stderr)
        if len(problems) > 50:
            print(f"... and {len(problems) - 50} more invalid lines", file=sys.stderr)
        if problems and not args.skip_invalid:
            print(
                f"{len(problems)} invalid line(s); nothing was published (use --skip-invalid to send the "
                f"{len(events)} valid ones)",
                file=sys.stderr,
            )
            return EXIT_USAGE
    else:
        if not (args.skill_id and args.kind):
            raise UsageError("give --skill-id and --kind for one event, or --file for many")
        has_delta = args.delta_all_time is not None or args.delta_current is not None
        if has_delta and args.kind in EFFECTS and not EFFECTS[args.kind].uses_delta:
            raise UsageError(
                f"--delta-all-time/--delta-current apply to install_clear only; a {args.kind} event carries no "
                f"delta (it would be dropped)"
            )
        try:
            events = [
                make_event(
                    args.skill_id,
                    args.kind,
                    args.occurred_at if args.occurred_at is not None else now_ms,
                    event_id=args.event_id,
                    delta_all_time=args.delta_all_time,
                    delta_current=args.delta_current,
                    now_ms=now_ms,
                )
            ]
        except InvalidEvent as exc:
            raise UsageError(str(exc)) from exc
    from skillstats.kafka import partition_count

    partition_count(settings, settings.topic)  # a missing topic or an unreachable broker, said at once
    progress = _progress(len(events), sys.stderr)
    with Publisher(settings, flush_timeout=args.timeout) as publisher:
        for index, event in enumerate(events, start=1):
            publisher.send(event)
            if index % 1000 == 0:
                progress.update(1000)  # type: ignore[attr-defined]
        progress.update(len(events) % 1000)  # type: ignore[attr-defined]
    progress.close()  # type: ignore[attr-defined]
    print(f"published {publisher.delivered} event(s) to {settings.topic} (confirmed by the broker)")
    return EXIT_OK


def _publish_demo(settings: Settings, rate: int, limit: int | None, timeout: float) -> int:
    """A steady stream of generated events, one second's worth at a time, until SIGTERM/SIGINT or `limit`."""
    from skillstats.kafka import partition_count
    from skillstats.publisher import Publisher
    from skillstats.workload import generate

    partition_count(settings, settings.topic)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    sent, tick, began = 0, 0, time.monotonic()
    print(f"publishing about {rate} events/s to {settings.topic} until stopped", flush=True)
    with Publisher(settings, flush_timeout=timeout) as publisher:
        while not stop.is_set() and (limit is None or sent < limit):
            count = rate if limit is None else min(rate, limit - sent)
            for record in generate(count, now_ms=int(time.time() * 1000), skills=500, seed=tick, days=2):
                publisher.send_raw(record.key, record.value)
            publisher.flush(timeout)
            sent, tick = sent + count, tick + 1
            if tick % 60 == 0:
                print(f"{sent:,} events published", flush=True)
            stop.wait(max(0.0, began + tick - time.monotonic()))
    print(f"published {publisher.delivered} event(s) to {settings.topic} (confirmed by the broker)")
    return EXIT_OK


def cmd_init(args: argparse.Namespace, settings: Settings) -> int:
    # The database first: a wrong URL must not leave topics created behind a failed init.
    if not args.skip_schema:
        from skillstats.sinks.db import open_engine
        from skillstats.sinks.migrate import upgrade

        before, after = upgrade(open_engine(settings.database_url))
        state = "up to date" if before == after else f"migrated {before or 'empty'} -> {after}"
        print(f"schema {redact_url(settings.database_url)}: {state}")
    if not args.skip_topics:
        from skillstats.dlq import DLQ_TOPIC_CONFIG
        from skillstats.kafka import ensure_topics

        reports = ensure_topics(
            settings,
            {settings.topic: args.partitions, settings.dlq_topic: args.dlq_partitions},
            configs={settings.dlq_topic: DLQ_TOPIC_CONFIG},
            replication_factor=args.replication_factor,
            timeout=args.timeout,
        )
        for report in reports:
            state = "created" if report.created else "exists"
            print(f"topic {report.name}: {state}, {report.partitions} partitions")
    return EXIT_OK


def _refuse_early(settings: Settings, command: str) -> None:
    """Stop a long-running command at once when Kafka refuses its credentials or TLS.

    A broker that is merely away is not an error here: the worker or exporter keeps
    trying (Kubernetes may start it before Kafka). A refusal is different: no retry
    cures it, and faust's client would otherwise retry it silently for ever.
    """
    from skillstats.kafka import KafkaRefused, KafkaUnreachable, list_topic_names

    try:
        list_topic_names(settings, timeout=15)
    except KafkaRefused:
        raise
    except KafkaUnreachable as exc:
        logging.getLogger("skillstats").warning("%s: %s; starting anyway, it keeps trying", command, exc)


def cmd_windows(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.streams.windows import run

    _refuse_early(settings, "windows")
    run(
        settings,
        log_level=args.log_level,
        batch_size=args.batch_size,
        fetch_size=args.fetch_size,
        partition_fetch_mib=args.partition_fetch_mib,
        instance_id=args.instance_id,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        shutdown_budget=_budget(args.shutdown_budget),
    )
    return EXIT_OK


def _budget(seconds: float) -> float:
    if not 0 < seconds < 3600:
        raise UsageError(f"--shutdown-budget must be between 0 and 3600 seconds, not {seconds:g}")
    return seconds


def cmd_docsync(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.streams.docsync import DrainBudget, DrainSummary, parse_interval, run

    try:
        every = parse_interval(args.every) if args.every else None
    except ValueError as exc:
        raise UsageError(str(exc)) from exc

    def emit(summary: DrainSummary) -> None:
        print(summary.to_json() if args.json else summary.describe(), flush=True)

    budget = DrainBudget(
        max_events=args.max_events, max_seconds=args.max_seconds, chunk_partitions=args.chunk_partitions
    )
    return run(
        settings,
        budget,
        every=every,
        emit=emit,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        shutdown_budget=_budget(args.shutdown_budget),
    )


def cmd_lag_exporter(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.lag import LagExporter
    from skillstats.metrics import REGISTRY, MetricsServer, Probes
    from skillstats.sinks.db import open_engine, sqlite_path

    if args.interval <= 0 or args.timeout <= 0:
        raise UsageError("--interval and --timeout must be positive")
    if not args.metrics_port:
        raise UsageError("the lag-exporter only serves metrics: give it a --metrics-port")
    path = sqlite_path(settings.database_url)
    _refuse_early(settings, "lag-exporter")

    def open_database() -> Any:
        # The exporter never creates a database: until there is one it serves Kafka's view only.
        if path is not None and not path.exists():
            raise FileNotFoundError(f"no SQLite database at {path} yet")
        return open_engine(settings.database_url)

    exporter = LagExporter(settings, interval=args.interval, timeout=args.timeout, open_database=open_database)
    REGISTRY.register(exporter)
    try:
        server = MetricsServer(args.metrics_host, args.metrics_port, Probes(exporter.live, exporter.live), REGISTRY)
    except OSError as exc:
        raise UsageError(f"cannot serve on {args.metrics_host}:{args.metrics_port}: {exc.strerror or exc}") from None
    exporter.start()
    print(
        f"skillstats lag-exporter: measuring {settings.windows_group} and {settings.docsync_group} on "
        f"{settings.topic} every {args.interval:g}s; serving http://{args.metrics_host}:{server.port}/metrics",
        flush=True,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    exporter.close()
    server.close()
    return EXIT_OK


def _source_offsets(text: str | None) -> list[tuple[int, int]]:
    pairs = []
    for item in (text or "").split(","):
        if not item.strip():
            continue
        partition, _, offset = item.strip().partition(":")
        if not (partition.isdigit() and offset.isdigit()):
            raise UsageError(f"--source-offsets wants partition:offset pairs, e.g. 3:1200,3:1201; not {item!r}")
        pairs.append((int(partition), int(offset)))
    return pairs


def cmd_dlq(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.dlq_admin import (
        ReplayRefused,
        Selection,
        counts_by_reason,
        plan_replay,
        read_parked,
        replay,
        replay_counts,
    )
    from skillstats.lag import LagProbe
    from skillstats.sinks.db import open_engine
    from skillstats.sinks.migrate import require_current

    selection = Selection(tuple(args.reason), args.since, tuple(_source_offsets(args.source_offsets)))
    filtered = bool(args.reason or args.since is not None or selection.sources)
    if args.action == "replay" and not (filtered or args.all):
        raise UsageError("say what to replay: --reason, --since, --source-offsets, or --all for everything")
    probe = LagProbe(settings)
    try:
        ranges = probe.topic_offsets(settings.dlq_topic, retention=False).partitions
    finally:
        probe.close()
    listing = args.action == "list"
    parked = read_parked(settings, ranges, keep_payload=None if not listing and args.all else selection)
    chosen = [r for r in parked if selection(r)]
    if listing:
        newest = sorted(chosen, key=lambda r: (r.parked_at_ms or 0, r.dlq_partition, r.dlq_offset))
        shown = newest[-args.limit :]
        if args.json:
            report = {
                "records": [r.summary() for r in shown],
                "matched": len(chosen),
                "counts_by_reason": counts_by_reason(chosen),
            }
            print(json.dumps(report, sort_keys=True))
            return EXIT_OK
        more = f" (the newest {len(shown)} shown; --limit for more)" if len(shown) < len(chosen) else ""
        print(f"{settings.dlq_topic}: {len(parked):,} parked, {len(chosen):,} match{more}")
        for r in shown:
            when = "?"
            if r.parked_at_ms is not None:
                when = datetime.fromtimestamp(r.parked_at_ms / 1000, UTC).isoformat(timespec="seconds")
            copy = f"  (a replayed copy of {r.replayed_from}, invalid again)" if r.replayed_from else ""
            print(
                f"  {when:<25} {r.reason:<20} source p{r.source_partition}@{r.source_offset}  "
                f"dlq {r.dlq_partition}:{r.dlq_offset}  {r.message[:80]}{copy}"
            )
        print("by reason: " + (", ".join(f"{k} {v:,}" for k, v in counts_by_reason(chosen).items()) or "none"))
        return EXIT_OK
    engine = open_engine(settings.database_url)
    try:
        require_current(engine)
        plan = plan_replay(settings, parked, chosen, replay_counts(engine, settings.dlq_topic), again=args.again)
        for root, why in plan.skipped:
            print(f"left out {root}: {why}", file=sys.stderr)
        if not plan.publish:
            if not chosen:
                print("nothing parked matches; nothing replayed")
                return EXIT_OK
            raise UsageError(f"none of the {len(chosen)} matching parked record(s) can be replayed (see above)")
        if args.dry_run:
            for r in plan.publish:
                print(
                    f"would replay dlq {r.dlq_partition}:{r.dlq_offset} ({r.reason}, source p{r.source_partition}@"
                    f"{r.source_offset})"
                )
            print(f"{len(plan.publish)} record(s) would be replayed to {settings.topic} (dry run: nothing published)")
            return EXIT_OK
        delivered = replay(settings, engine, plan)
    except ReplayRefused as exc:
        raise UsageError(str(exc)) from None
    finally:
        engine.dispose()
    print(f"replayed {delivered} record(s) to {settings.topic} (confirmed by the broker)")
    return EXIT_OK


def cmd_top(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.sinks.db import open_engine
    from skillstats.sinks.migrate import require_current
    from skillstats.top import leaderboard, render

    engine = open_engine(settings.database_url)
    try:
        require_current(engine)
        report = leaderboard(engine, days=args.days, by=args.by, limit=args.limit)
    finally:
        engine.dispose()
    print(render(report, args.json))
    return EXIT_OK


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.status import render, status

    print(render(status(settings), args.json))
    return EXIT_OK


def cmd_fences(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.kafka import commit_offsets, watermarks
    from skillstats.sinks.db import open_engine
    from skillstats.sinks.fences import RESET_TOKEN, PartitionFences
    from skillstats.sinks.migrate import require_current
    from skillstats.sinks.upserts import now_utc_naive

    if args.action == "reset" and (not args.group or not args.to):
        raise UsageError("reset needs --group and --to start|end")
    engine = open_engine(settings.database_url)
    require_current(engine)
    marks = watermarks(settings, settings.topic)
    groups = [args.group] if args.group else [settings.windows_group, settings.docsync_group]
    for group in groups:
        current = PartitionFences(engine, group, settings.topic).fences()
        print(f"group {group}, topic {settings.topic}")
        for partition, (low, high) in sorted(marks.items()):
            if args.partition and partition not in args.partition:
                continue
            fence = current.get(partition)
            state = "AHEAD OF LOG" if fence is not None and fence > high else ""
            line = f"  partition {partition:>3}  fence {fence if fence is not None else '-':>12}  log {low}..{high}"
            if args.action == "reset":
                line += f"  -> {low if args.to == 'start' else high}"
            print(f"{line}  {state}".rstrip())
    if args.action == "show":
        return EXIT_OK
    targets = {
        p: (low if args.to == "start" else high)
        for p, (low, high) in marks.items()
        if not args.partition or p in args.partition
    }
    if args.confirm != RESET_TOKEN:
        if args.confirm is not None:
            raise UsageError(f"the confirmation token is {RESET_TOKEN}")
        print(f"dry run: nothing changed; add --confirm {RESET_TOKEN} to reset")
        return EXIT_OK
    from skillstats.dlq import DeadLetters

    commit_offsets(settings, args.group, settings.topic, targets)
    dead_letters = DeadLetters(settings, args.group)
    try:
        marks = dead_letters.end_marks(sorted(targets))
    finally:
        dead_letters.close()
    PartitionFences(engine, args.group, settings.topic).reset(targets, marks, now_utc_naive())
    print(f"reset {len(targets)} fence(s) of group {args.group} and its committed offsets")
    return EXIT_OK


def cmd_prune(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.prune import CONFIRM_TOKEN, apply, count_hourly, delete_hourly, plan, render
    from skillstats.sinks.db import open_engine
    from skillstats.sinks.migrate import require_current

    if args.confirm is not None and not args.apply:
        raise UsageError(f"--confirm goes with --apply: --apply --confirm {CONFIRM_TOKEN}")
    if args.apply and args.confirm != CONFIRM_TOKEN:
        if args.confirm is None:
            raise UsageError(f"--apply deletes records for good: add --confirm {CONFIRM_TOKEN}; nothing was deleted")
        raise UsageError(f"the confirmation token is {CONFIRM_TOKEN}, not {args.confirm!r}; nothing was deleted")
    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    default_groups = [settings.windows_group, settings.docsync_group]
    groups = default_groups
    if args.require_groups is not None:
        groups = list(dict.fromkeys(g.strip() for g in args.require_groups.split(",") if g.strip()))
        if not groups:
            raise UsageError("--require-groups needs at least one group name (comma-separated)")
    for group in default_groups:
        if group not in groups:
            print(f"note: group {group} is not required: records it has not read may be deleted", file=sys.stderr)
    out = sys.stderr if args.json else sys.stdout
    engine = open_engine(settings.database_url)
    try:
        require_current(engine)
        prune = plan(settings, engine, retention_days=args.retention_days, groups=groups, timeout=args.timeout)
        if args.hourly_days is not None:
            prune.hourly = count_hourly(engine, args.hourly_days)
        if args.apply:
            apply(settings, prune, timeout=args.timeout)
            if prune.hourly is not None and prune.hourly.rows:
                print(f"skill_hourly_stats: deleting {prune.hourly.rows:,} row(s) ...", file=out, flush=True)
                delete_hourly(
                    engine, prune.hourly, progress=lambda n: print(f"  {n:,} row(s) deleted", file=out, flush=True)
                )
    finally:
        engine.dispose()
    print(render(prune.to_dict(), args.json))
    return EXIT_FAILED if prune.failed else EXIT_OK


def cmd_bench(args: argparse.Namespace, settings: Settings) -> int:
    from skillstats.bench import main_from_cli, workload_names

    try:
        workload_names(args.workload)
    except ValueError as exc:
        raise UsageError(f"--workload: {exc}") from None
    return main_from_cli(args, settings)


COMMANDS = {
    "init": cmd_init,
    "publish": cmd_publish,
    "windows": cmd_windows,
    "docsync": cmd_docsync,
    "status": cmd_status,
    "bench": cmd_bench,
    "fences": cmd_fences,
    "lag-exporter": cmd_lag_exporter,
    "top": cmd_top,
    "dlq": cmd_dlq,
    "prune": cmd_prune,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=(logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)],
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    LIBRDKAFKA_LOG.setLevel(logging.CRITICAL if args.verbose == 0 else logging.DEBUG)
    try:
        settings = _settings(args)
    except SettingsError as exc:
        parser.exit(EXIT_USAGE, f"skillstats {args.command}: {exc}\n")
    secrets = settings.secrets()
    masking = MaskSecrets(secrets)
    for handler in logging.getLogger().handlers:
        handler.addFilter(masking)
    try:
        return COMMANDS[args.command](args, settings)
    except UsageError as exc:
        parser.exit(EXIT_USAGE, mask(f"skillstats {args.command}: {exc}\n", secrets))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`skillstats status | head`): nothing is wrong, nothing more to say.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:
        logging.getLogger("skillstats").debug("failed", exc_info=True)
        print(mask(f"skillstats {args.command}: {type(exc).__name__}: {exc}", secrets), file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
