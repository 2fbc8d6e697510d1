"""`skillstats publish`: one event, a JSONL file of events, or a synthetic demo stream; confirmed by the broker."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import orjson

from skillstats.cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    kafka_options,
    parse_time_ms,
    positive,
    verbosity,
)
from skillstats.config import Settings
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


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Publish stat events and wait until the broker confirms every one. Either give one event with "
        "--skill-id and --kind, or --file with one JSON object per line. " + INPUT_RULE + " Every line is "
        "validated before anything is sent; invalid lines are listed with their numbers and nothing is published "
        "unless --skip-invalid is given."
    )
    kafka_options(parser)
    verbosity(parser)
    parser.add_argument("--file", type=Path, metavar="PATH", help="JSONL file of events ('-' for stdin)")
    parser.add_argument("--skip-invalid", action="store_true", help="with --file: publish the valid lines anyway")
    parser.add_argument("--skill-id", help="skill id (also the record key)")
    parser.add_argument("--kind", choices=KINDS, help="event kind")
    parser.add_argument(
        "--occurred-at",
        type=parse_time_ms,
        metavar="WHEN",
        help="event time: epoch milliseconds or ISO-8601 with zone (default: now)",
    )
    parser.add_argument("--event-id", help="event id (default: a fresh UUID)")
    parser.add_argument("--delta-all-time", type=int, metavar="N", help="install_clear: change to installs_all_time")
    parser.add_argument("--delta-current", type=int, metavar="N", help="install_clear: change to installs_current")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for confirmation (default 30)")
    parser.add_argument(
        "--demo",
        type=positive,
        metavar="RATE",
        help="publish synthetic registry traffic (skewed popularity, the usual kind mix, some late events) at "
        "RATE events/s until SIGTERM, or until --demo-events",
    )
    parser.add_argument("--demo-events", type=positive, metavar="N", help="with --demo: stop after N events")


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    handle = sys.stdin.buffer if str(path) == "-" else path.open("rb")
    with handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield number, line


# The one rule for an event given to `publish`, as a line or with flags (--help says it): the wire
# format's fields (docs/contract.md), with `v` defaulting to 1, `event_id` to a fresh UUID and
# `occurred_at` to now, and `occurred_at` also taken as ISO-8601 with a zone. What is sent is
# always the strict wire format; this is only the command's input.
INPUT_RULE = (
    "An event, as a line of --file or with the flags, has the wire format's fields (docs/contract.md): "
    "skill_id, kind, occurred_at, and delta {all_time, current} for install_clear. v defaults to 1, event_id "
    "to a fresh UUID, occurred_at to now; occurred_at is epoch milliseconds or ISO-8601 with a zone "
    "(2026-12-01T07:30:00Z)."
)


def read_jsonl(path: Path, now_ms: int) -> tuple[list[StatEvent], list[str]]:
    """Validate every line of a JSONL file; returns the events and one message per bad line."""
    events: list[StatEvent] = []
    problems: list[str] = []
    for number, line in _lines(path):
        try:
            body = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            problems.append(f"line {number}: not JSON: {_json_error(line, exc)} (each line is one JSON object)")
            continue
        repeated = duplicate_member(line, body)
        if repeated is not None:
            problems.append(f"line {number}: malformed: the member {repeated!r} appears twice (RFC 7493)")
            continue
        if not isinstance(body, dict):
            problems.append(f"line {number}: not a JSON object (each line is one event object, {{...}})")
            continue
        body.setdefault("v", WIRE_VERSION)
        body.setdefault("event_id", uuid.uuid4().hex)
        when = body.get("occurred_at")
        if "occurred_at" not in body:  # absent: now, as the flag's default; an explicit null stays an error
            body["occurred_at"] = now_ms
        elif isinstance(when, str):
            try:
                body["occurred_at"] = parse_time_ms(when)
            except argparse.ArgumentTypeError as exc:
                problems.append(f"line {number}: occurred_at: {exc}")
                continue
        result = from_mapping(body, now_ms, check_key=False)
        if isinstance(result, Invalid):
            problems.append(f"line {number}: {result.reason}: {result.message}")
        else:
            events.append(result)
    return events, problems


def _published(count: int, settings: Settings) -> str:
    return f"published {count} event(s) to {settings.topic} on {settings.kafka_bootstrap} (confirmed by the broker)"


def _json_error(line: bytes, exc: orjson.JSONDecodeError) -> str:
    """What is wrong with a line that is not JSON, in words (the standard library's), with the column."""
    import json

    try:
        json.loads(line)
    except ValueError as reason:
        if isinstance(reason, json.JSONDecodeError):
            return f"{reason.msg} at column {reason.colno}"
        return str(reason)
    return str(exc)


def _progress(total: int, out: TextIO) -> object:
    from tqdm import tqdm

    return tqdm(total=total, unit="ev", file=out, disable=total < 10_000 or not out.isatty(), mininterval=0.5)


def run(args: argparse.Namespace, settings: Settings) -> int:
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
    print(_published(publisher.delivered, settings))
    return EXIT_OK


def _publish_demo(settings: Settings, rate: int, limit: int | None, timeout: float) -> int:
    """A steady stream of generated events, one second's worth at a time, until SIGTERM/SIGINT or `limit`."""
    from skillstats.kafka import partition_count
    from skillstats.publisher import Publisher
    from skillstats.workload import DEMO_SKILLS, generate

    partition_count(settings, settings.topic)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    sent, tick, began = 0, 0, time.monotonic()
    print(f"publishing about {rate} events/s to {settings.topic} until stopped", flush=True)
    with Publisher(settings, flush_timeout=timeout) as publisher:
        while not stop.is_set() and (limit is None or sent < limit):
            count = rate if limit is None else min(rate, limit - sent)
            for record in generate(count, now_ms=int(time.time() * 1000), skills=DEMO_SKILLS, seed=tick, days=2):
                publisher.send_raw(record.key, record.value)
            publisher.flush(timeout)
            sent, tick = sent + count, tick + 1
            if tick % 60 == 0:
                print(f"{sent:,} events published", flush=True)
            stop.wait(max(0.0, began + tick - time.monotonic()))
    print(_published(publisher.delivered, settings))
    return EXIT_OK
