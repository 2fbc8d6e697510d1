"""The event contract (docs/contract.md): one case or more per reason code, and every valid kind."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skillstats.contract import (
    EFFECTS,
    KINDS,
    MAX_FUTURE_SKEW_MS,
    MAX_NESTING_DEPTH,
    MAX_OCCURRED_AT_MS,
    Invalid,
    InvalidEvent,
    Reason,
    StatEvent,
    decode,
    decode_many,
    decode_reference,
    from_mapping,
    make_event,
)

NOW = 1_764_460_800_000  # 2025-11-30T00:00:00Z: the records' Kafka timestamp in most cases below
BASE = {"v": 1, "event_id": "e1", "skill_id": "sk_1", "kind": "download", "occurred_at": NOW - 1000}
EVENT_PREFIX = b'{"v":1,"event_id":"e1","skill_id":"sk_1","kind":"download","occurred_at":1764460799000'

Decoder = Callable[[bytes | None, bytes | None, int | None], StatEvent | Invalid]
BOTH_PATHS = pytest.mark.parametrize("decoder", [decode, decode_reference], ids=["decode", "decode_reference"])
PROPERTY = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def body(**changes: object) -> bytes:
    merged = {**BASE, **changes}
    return orjson.dumps({k: v for k, v in merged.items() if v is not ...})


def raw_event(occurred_at: bytes = b"1764460799000", extra: bytes = b"") -> bytes:
    """A record body written by hand, for what orjson.dumps refuses to write (huge ints, NaN, bad escapes)."""
    return b'{"v":1,"event_id":"e1","skill_id":"sk_1","kind":"download","occurred_at":' + occurred_at + extra + b"}"


def clear_event(delta: bytes) -> bytes:
    """An install_clear record whose delta (and whatever follows it) is written by hand."""
    return EVENT_PREFIX.replace(b'"download"', b'"install_clear"') + b',"delta":' + delta + b"}"


def assert_outcome(result: object) -> None:
    """The only two things a record may become: an event, or a reason with a message."""
    if isinstance(result, Invalid):
        assert isinstance(result.reason, Reason) and isinstance(result.message, str) and result.message
    else:
        assert isinstance(result, StatEvent), result


INVALID_CASES = [
    ("not json", b"sk_1", b"{oops", Reason.MALFORMED),
    ("not utf-8", b"sk_1", b'{"v": 1, "skill_id": "\xff"}', Reason.MALFORMED),
    ("json array", b"sk_1", b"[]", Reason.MALFORMED),
    ("json string", b"sk_1", b'"download"', Reason.MALFORMED),
    ("null value", b"sk_1", None, Reason.MALFORMED),
    ("over 64 KiB", b"sk_1", body(pad="x" * 65_536), Reason.MALFORMED),
    ("v missing", b"sk_1", body(v=...), Reason.UNSUPPORTED_VERSION),
    ("v 2", b"sk_1", body(v=2), Reason.UNSUPPORTED_VERSION),
    ("v string", b"sk_1", body(v="1"), Reason.UNSUPPORTED_VERSION),
    ("v true", b"sk_1", body(v=True), Reason.UNSUPPORTED_VERSION),
    ("v float", b"sk_1", body(v=1.0), Reason.UNSUPPORTED_VERSION),
    ("event_id missing", b"sk_1", body(event_id=...), Reason.BAD_FIELD),
    ("event_id empty", b"sk_1", body(event_id=""), Reason.BAD_FIELD),
    ("event_id 129 chars", b"sk_1", body(event_id="e" * 129), Reason.BAD_FIELD),
    ("event_id number", b"sk_1", body(event_id=7), Reason.BAD_FIELD),
    ("skill_id missing", b"sk_1", body(skill_id=...), Reason.BAD_FIELD),
    ("skill_id null", b"sk_1", body(skill_id=None), Reason.BAD_FIELD),
    ("key of another skill", b"sk_2", body(), Reason.KEY_MISMATCH),
    ("no key", None, body(), Reason.KEY_MISMATCH),
    ("key not utf-8 of skill", "sk_é".encode("latin-1"), body(skill_id="sk_é"), Reason.KEY_MISMATCH),
    ("kind unknown", b"sk_1", body(kind="downvote"), Reason.UNKNOWN_KIND),
    ("kind missing", b"sk_1", body(kind=...), Reason.UNKNOWN_KIND),
    ("kind wrong case", b"sk_1", body(kind="Download"), Reason.UNKNOWN_KIND),
    ("occurred_at float", b"sk_1", body(occurred_at=float(NOW)), Reason.BAD_TIMESTAMP),
    ("occurred_at bool", b"sk_1", body(occurred_at=True), Reason.BAD_TIMESTAMP),
    ("occurred_at string", b"sk_1", body(occurred_at=str(NOW)), Reason.BAD_TIMESTAMP),
    ("occurred_at missing", b"sk_1", body(occurred_at=...), Reason.BAD_TIMESTAMP),
    ("before 2000", b"sk_1", body(occurred_at=946_684_799_999), Reason.BAD_TIMESTAMP),
    ("11 minutes after the record timestamp", b"sk_1", body(occurred_at=NOW + 660_000), Reason.BAD_TIMESTAMP),
    ("after year 9999", b"sk_1", body(occurred_at=MAX_OCCURRED_AT_MS + 1), Reason.BAD_TIMESTAMP),
    ("occurred_at 10**30 literal", b"sk_1", raw_event(b"1" + b"0" * 30), Reason.BAD_TIMESTAMP),
    ("occurred_at -10**30 literal", b"sk_1", raw_event(b"-1" + b"0" * 30), Reason.BAD_TIMESTAMP),
    ("occurred_at 1e400", b"sk_1", raw_event(b"1e400"), Reason.MALFORMED),
    ("occurred_at NaN", b"sk_1", raw_event(b"NaN"), Reason.MALFORMED),
    ("occurred_at Infinity", b"sk_1", raw_event(b"Infinity"), Reason.MALFORMED),
    ("occurred_at -Infinity", b"sk_1", raw_event(b"-Infinity"), Reason.MALFORMED),
    ("v with 5000 digits", b"sk_1", b'{"v":' + b"9" * 5000 + b"}", Reason.MALFORMED),
    ("escaped lone surrogate in skill_id", b"sk_1", raw_event(extra=b',"skill_id":"\\ud800"'), Reason.MALFORMED),
    ("escaped lone low surrogate", b"sk_1", raw_event(extra=b',"pad":"\\udc00x"'), Reason.MALFORMED),
    ("raw surrogate bytes", b"sk_1", raw_event(extra=b',"pad":"\xed\xa0\x80"'), Reason.MALFORMED),
    ("overlong UTF-8", b"sk_1", raw_event(extra=b',"pad":"\xc0\xaf"'), Reason.MALFORMED),
    ("UTF-8 BOM", b"sk_1", b"\xef\xbb\xbf" + body(), Reason.MALFORMED),
    ("UTF-16 value", b"sk_1", body().decode().encode("utf-16"), Reason.MALFORMED),
    ("trailing garbage", b"sk_1", body() + b"x", Reason.MALFORMED),
    ("two documents", b"sk_1", body() + body(), Reason.MALFORMED),
    ("empty value", b"sk_1", b"", Reason.MALFORMED),
    ("whitespace value", b"sk_1", b" \n", Reason.MALFORMED),
    ("raw NUL in a string", b"sk_1", raw_event(extra=b',"pad":"a\x00b"'), Reason.MALFORMED),
    ("objects 1,000 deep", b"sk_1", b'{"a":' * 1000 + b"1" + b"}" * 1000, Reason.MALFORMED),
    ("arrays 1,000 deep", b"sk_1", b'{"x":' + b"[" * 999 + b"]" * 999 + b"}", Reason.MALFORMED),
    ("duplicate v, the last one 2", b"sk_1", raw_event(extra=b',"v":2'), Reason.MALFORMED),
    ("duplicate kind", b"sk_1", raw_event(extra=b',"kind":"install_new"'), Reason.MALFORMED),
    ("duplicate kind, same value", b"sk_1", raw_event(extra=b',"kind":"download"'), Reason.MALFORMED),
    ("duplicate kind, name escaped", b"sk_1", raw_event(extra=b',"\\u006bind":"star"'), Reason.MALFORMED),
    ("duplicate in an extra field", b"sk_1", raw_event(extra=b',"pad":[{"a":1,"b":2,"a":3}]'), Reason.MALFORMED),
    ("duplicate in delta", b"sk_1", clear_event(b'{"all_time":1,"current":2,"current":-5}'), Reason.MALFORMED),
    ("duplicate delta", b"sk_1", clear_event(b'{"all_time":1,"current":2},"delta":null'), Reason.MALFORMED),
    ("clear without delta", b"sk_1", body(kind="install_clear"), Reason.BAD_DELTA),
    ("clear delta not object", b"sk_1", body(kind="install_clear", delta=[1, 2]), Reason.BAD_DELTA),
    ("clear delta missing current", b"sk_1", body(kind="install_clear", delta={"all_time": 1}), Reason.BAD_DELTA),
    ("clear delta float", b"sk_1", body(kind="install_clear", delta={"all_time": 1.0, "current": 0}), Reason.BAD_DELTA),
    (
        "clear delta bool",
        b"sk_1",
        body(kind="install_clear", delta={"all_time": 0, "current": False}),
        Reason.BAD_DELTA,
    ),
    (
        "clear delta over 1e9",
        b"sk_1",
        body(kind="install_clear", delta={"all_time": 10**9 + 1, "current": 0}),
        Reason.BAD_DELTA,
    ),
]


@pytest.mark.parametrize(("case", "key", "value", "reason"), INVALID_CASES, ids=[c[0] for c in INVALID_CASES])
def test_invalid_records_get_their_reason(case: str, key: bytes | None, value: bytes | None, reason: Reason) -> None:
    result = decode(key, value, NOW)
    assert isinstance(result, Invalid), case
    assert result.reason is reason
    assert result.message
    assert len(result.message) < 400  # messages travel in DLQ headers
    assert decode_reference(key, value, NOW) == result


def test_every_reason_code_has_a_case() -> None:
    assert {case[3] for case in INVALID_CASES} == set(Reason)


@pytest.mark.parametrize("kind", sorted(EFFECTS))
def test_every_kind_is_valid(kind: str) -> None:
    extra = {"delta": {"all_time": -2, "current": -1}} if kind == "install_clear" else {}
    result = decode(b"sk_1", body(kind=kind, **extra), NOW)
    assert isinstance(result, StatEvent)
    assert result.kind == kind


VALID_EDGES = [
    ("exactly 2000-01-01", body(occurred_at=946_684_800_000)),
    ("exactly 10 minutes after the record timestamp", body(occurred_at=NOW + 600_000)),
    ("one member name in sibling objects", raw_event(extra=b',"pad":[{"a":1},{"a":2}],"x":{"a":{"a":3}}')),
    ("member names differing in case", raw_event(extra=b',"Kind":"star","KIND":1')),
    ("a quote escaped in a string", raw_event(extra=b',"pad":"say \\"hi\\", \\\\"')),
    ("a colon and braces in a string", raw_event(extra=b',"pad":"\\"kind\\":{}"')),
    ("delta null on download", body(delta=None)),
    ("clear delta written twice as wide", clear_event(b'{ "all_time" : -2 ,\n "current" : -1 }')),
    ("escaped surrogate pair", raw_event(extra=b',"pad":"\\ud83d\\ude00"')),
    ("nested exactly to the limit", raw_event(extra=b',"pad":' + b"[" * 511 + b"]" * 511)),
    ("ids of 128 chars", body(event_id="e" * 128, skill_id="s" * 128)),
    ("unknown fields ignored", body(source="cli", extra={"nested": True})),
    ("delta ignored on download", body(delta="anything")),
    ("clear delta at the bounds", body(kind="install_clear", delta={"all_time": -(10**9), "current": 10**9})),
]


@pytest.mark.parametrize(("case", "value"), VALID_EDGES, ids=[c[0] for c in VALID_EDGES])
def test_valid_edges(case: str, value: bytes) -> None:
    skill = orjson.loads(value)["skill_id"]
    result = decode(skill.encode(), value, NOW)
    assert isinstance(result, StatEvent), case
    assert decode_reference(skill.encode(), value, NOW) == result


def test_unicode_skill_id_key_is_utf8() -> None:
    result = decode("sk_é✓".encode(), body(skill_id="sk_é✓"), NOW)
    assert isinstance(result, StatEvent) and result.key == "sk_é✓".encode()


@pytest.mark.parametrize(
    ("kind", "delta", "expected"),
    [
        ("download", None, (1, 0, 0)),
        ("install_new", None, (0, 1, 1)),
        ("install_reactivate", None, (0, 0, 1)),
        ("install_deactivate", None, (0, 0, -1)),
        ("install_clear", (-3, -2), (0, -3, -2)),
        ("star", None, (0, 0, 0)),
        ("unstar", None, (0, 0, 0)),
        ("comment", None, (0, 0, 0)),
        ("uncomment", None, (0, 0, 0)),
    ],
)
def test_skill_deltas_follow_spec_table(kind: str, delta: tuple[int, int] | None, expected: tuple[int, ...]) -> None:
    all_time, current = delta or (None, None)
    event = make_event("sk_1", kind, NOW, delta_all_time=all_time, delta_current=current, now_ms=NOW)
    assert event.skill_deltas() == expected


def test_window_counts_only_downloads_and_new_installs() -> None:
    counted = {kind for kind, effect in EFFECTS.items() if effect.touches_windows}
    assert counted == {"download", "install_new"}


def test_encode_round_trips_through_decode() -> None:
    event = make_event("sk_9", "install_clear", NOW, delta_all_time=-5, delta_current=-4, now_ms=NOW)
    assert decode(event.key, event.encode(), NOW) == event


def test_make_event_refuses_what_the_contract_rejects() -> None:
    with pytest.raises(InvalidEvent) as raised:
        make_event("", "download", NOW, now_ms=NOW)
    assert raised.value.reason is Reason.BAD_FIELD
    with pytest.raises(InvalidEvent):
        make_event("sk_1", "install_clear", NOW, now_ms=NOW)


def test_fast_and_slow_decoders_agree_on_every_record() -> None:
    """The msgspec fast path may only take what the reference path calls valid, and must build the same event."""
    from skillstats.workload import generate

    now = int(time.time() * 1000)
    samples = [(key, value) for _, key, value, _ in INVALID_CASES]
    samples += [(r.key, r.value) for r in generate(20_000, now_ms=now, invalid_ratio=0.3, seed=3) if r.value]
    samples += [
        (b"sk_1", body(kind="install_clear", delta={"all_time": 1, "current": 2}, extra=[1])),
        (b"sk_1", body(kind="download", delta={"all_time": "x"})),
        (b"sk_1", body(v=1, skill_id="sk_1", event_id="e" * 128)),
    ]
    for key, value in samples:
        assert decode(key, value, now) == decode_reference(key, value, now), (value or b"")[:200]


def test_a_batch_decodes_each_record_as_if_alone() -> None:
    """decode_many over a shuffled mix of every hostile case and ordinary events: each index gets the
    reference verdict for its own record, whatever its neighbours, and the invalid list names exactly them."""
    import random

    from skillstats.workload import generate
    from tests.hostile_corpus import CORPUS

    now = int(time.time() * 1000)
    records = [(case.key, case.value, case.timestamp) for case in CORPUS]
    records += [(r.key, r.value, now) for r in generate(3_000, now_ms=now, invalid_ratio=0.2, seed=11)]
    records += [(b"sk_1", None, None), (None, b"{}", -1)]
    random.Random(5).shuffle(records)
    keys, values, stamps = (list(column) for column in zip(*records, strict=True))
    events, invalid = decode_many(keys, values, stamps)
    assert len(events) == len(records)
    reasons = dict(invalid)
    assert len(reasons) == len(invalid)
    for index, (key, value, stamp) in enumerate(records):
        reference = decode_reference(key, value, stamp)
        if isinstance(reference, Invalid):
            assert events[index] is None and reasons[index] == reference, (value or b"")[:200]
        else:
            assert events[index] == reference and index not in reasons, (value or b"")[:200]
    assert decode_many([], [], []) == ([], [])
    with pytest.raises(ValueError):
        decode_many([b"sk_1"], [], [NOW])


# --- Validity is a function of the record alone (issue "exactness", item 6) ---------------------------------------


@BOTH_PATHS
def test_future_bound_is_the_record_timestamp_plus_10_minutes(decoder: Decoder) -> None:
    timestamp = NOW - 3 * 3_600_000  # a record written three hours before "now"
    at_bound = decoder(b"sk_1", body(occurred_at=timestamp + MAX_FUTURE_SKEW_MS), timestamp)
    assert isinstance(at_bound, StatEvent)
    past_bound = decoder(b"sk_1", body(occurred_at=timestamp + MAX_FUTURE_SKEW_MS + 1), timestamp)
    assert isinstance(past_bound, Invalid) and past_bound.reason is Reason.BAD_TIMESTAMP
    assert "more than 10 minutes after the record's timestamp" in past_bound.message


@BOTH_PATHS
@pytest.mark.parametrize("timestamp", [None, -1, -(2**63)], ids=["None", "-1", "int64 min"])
def test_no_record_timestamp_skips_only_the_future_bound(decoder: Decoder, timestamp: int | None) -> None:
    year_2500 = 16_725_225_600_000
    assert isinstance(decoder(b"sk_1", body(occurred_at=year_2500), timestamp), StatEvent)
    assert isinstance(decoder(b"sk_1", body(occurred_at=MAX_OCCURRED_AT_MS), timestamp), StatEvent)
    for occurred_at in (MAX_OCCURRED_AT_MS + 1, 946_684_799_999):
        result = decoder(b"sk_1", body(occurred_at=occurred_at), timestamp)
        assert isinstance(result, Invalid) and result.reason is Reason.BAD_TIMESTAMP, occurred_at


@BOTH_PATHS
def test_a_producer_set_timestamp_cannot_admit_an_occurred_at_past_year_9999(decoder: Decoder) -> None:
    result = decoder(b"sk_1", body(occurred_at=MAX_OCCURRED_AT_MS + 1), 2**63 - 1)
    assert isinstance(result, Invalid) and result.reason is Reason.BAD_TIMESTAMP


@BOTH_PATHS
@pytest.mark.parametrize("wall_clock_s", [0.0, 1_764_460_800.0, 4_102_444_800.0], ids=["1970", "2025", "2100"])
def test_verdict_does_not_depend_on_the_wall_clock(
    decoder: Decoder, wall_clock_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two groups reading the same record years apart must agree on it."""
    monkeypatch.setattr(time, "time", lambda: wall_clock_s)
    monkeypatch.setattr(time, "time_ns", lambda: int(wall_clock_s * 1e9))
    in_2030 = 1_893_456_000_000  # 2030-01-01T00:00Z
    assert isinstance(decoder(b"sk_1", body(occurred_at=in_2030 + 5 * 60_000), in_2030), StatEvent)
    late = decoder(b"sk_1", body(occurred_at=in_2030 + 11 * 60_000), in_2030)
    assert isinstance(late, Invalid) and late.reason is Reason.BAD_TIMESTAMP


def test_publishers_check_against_their_own_clock() -> None:
    """make_event's now_ms is what the record's CreateTime will be; from_mapping keeps its positional form."""
    in_2030 = 1_893_456_000_000
    event = make_event("sk_1", "download", in_2030 + MAX_FUTURE_SKEW_MS, now_ms=in_2030)
    assert decode(event.key, event.encode(), in_2030) == event
    with pytest.raises(InvalidEvent) as raised:
        make_event("sk_1", "download", in_2030 + MAX_FUTURE_SKEW_MS + 1, now_ms=in_2030)
    assert raised.value.reason is Reason.BAD_TIMESTAMP
    assert isinstance(make_event("sk_1", "download", int(time.time() * 1000)), StatEvent)  # default: this clock
    assert from_mapping(orjson.loads(body()), NOW, check_key=False) == decode(b"sk_1", body(), NOW)


def test_builders_refuse_ids_without_a_utf8_form() -> None:
    with pytest.raises(InvalidEvent) as raised:
        make_event("sk_\ud800", "download", NOW, now_ms=NOW)
    assert raised.value.reason is Reason.BAD_FIELD
    result = from_mapping({**BASE, "event_id": "\udfff"}, NOW, b"sk_1")
    assert isinstance(result, Invalid) and result.reason is Reason.BAD_FIELD


# --- No record can crash a consumer (issue "exactness", item 8) ---------------------------------------------------

NESTINGS = {
    "objects": lambda depth: b'{"a":' * depth + b"1" + b"}" * depth,
    "arrays in an object": lambda depth: b'{"x":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}",
    "bare arrays": lambda depth: b"[" * depth + b"]" * depth,
    "arrays in a valid event": lambda depth: EVENT_PREFIX + b',"pad":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}",
    "objects in a valid event": lambda depth: EVENT_PREFIX + b',"pad":' + b'{"a":' * (depth - 1) + b"0" + b"}" * depth,
}


@BOTH_PATHS
@pytest.mark.parametrize("shape", sorted(NESTINGS))
@pytest.mark.parametrize("depth", [MAX_NESTING_DEPTH + 1, 1_000, 1_025, 10_000, 30_000, 100_000])
def test_deep_nesting_is_malformed(decoder: Decoder, shape: str, depth: int) -> None:
    """1,000 levels used to raise RecursionError from the decoder and crash-loop the consumer."""
    result = decoder(b"sk_1", NESTINGS[shape](depth), NOW)
    assert isinstance(result, Invalid) and result.reason is Reason.MALFORMED, result


@BOTH_PATHS
@pytest.mark.parametrize("shape", ["arrays in a valid event", "objects in a valid event"])
def test_nesting_up_to_the_limit_is_ignored_like_any_unknown_field(decoder: Decoder, shape: str) -> None:
    assert isinstance(decoder(b"sk_1", NESTINGS[shape](MAX_NESTING_DEPTH), NOW), StatEvent)


def _at_stack_depth(frames: int, call: Callable[[], Any]) -> Any:
    return call() if frames <= 0 else _at_stack_depth(frames - 1, call)


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        (body(), True),
        (NESTINGS["arrays in a valid event"](MAX_NESTING_DEPTH), True),
        (raw_event(extra=b',"pad":' + b"[" * 400 + b"]" * 400), True),
        (NESTINGS["arrays in a valid event"](MAX_NESTING_DEPTH + 1), False),
        (NESTINGS["objects"](1_000), False),
    ],
)
def test_verdict_does_not_depend_on_the_callers_stack_depth(value: bytes, valid: bool) -> None:
    """msgspec's depth limit is the Python stack's, orjson's is its own; a consumer deep in frames agrees."""
    shallow = decode(b"sk_1", value, NOW)
    assert isinstance(shallow, StatEvent) is valid
    headroom = 60
    deep = _at_stack_depth(sys.getrecursionlimit() - headroom, lambda: decode(b"sk_1", value, NOW))
    assert deep == shallow


def test_an_unexpected_error_in_the_fast_path_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import skillstats.contract as contract

    class Exploding:
        def decode(self, value: bytes) -> object:
            raise RecursionError("maximum recursion depth exceeded while deserializing an object")

    monkeypatch.setattr(contract, "_wire_decoder", Exploding())
    assert decode(b"sk_1", body(), NOW) == decode_reference(b"sk_1", body(), NOW)
    assert isinstance(decode(b"sk_1", body(), NOW), StatEvent)


def test_an_unexpected_error_in_the_reference_path_is_malformed(monkeypatch: pytest.MonkeyPatch) -> None:
    import skillstats.contract as contract

    def explode(value: bytes) -> object:
        raise ValueError("x" * 10_000)

    monkeypatch.setattr(contract.orjson, "loads", explode)
    result = decode(b"sk_1", body(pad="y" * 2000), NOW)  # over the fast path's size: straight to the reference
    assert isinstance(result, Invalid) and result.reason is Reason.MALFORMED
    assert "ValueError" in result.message and len(result.message) < 400


def test_memory_error_is_not_blamed_on_the_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parking a good record because this process ran short of memory would lose it; let the consumer retry."""
    import skillstats.contract as contract

    def exhausted(value: bytes) -> object:
        raise MemoryError

    monkeypatch.setattr(contract.orjson, "loads", exhausted)
    with pytest.raises(MemoryError):
        decode(b"sk_1", body(pad="y" * 2000), NOW)


@pytest.mark.parametrize(
    "value",
    [
        {**BASE, "v": [[[[]]]]},
        {**BASE, "kind": [[["download"]]]},
        {**BASE, "kind": "k" * 100_000},
        {**BASE, "occurred_at": 10**5000},
        {**BASE, "occurred_at": -(10**5000)},
        {**BASE, "occurred_at": float("nan")},
        {**BASE, "v": 10**5000},
        {**BASE, "kind": "install_clear", "delta": {"all_time": 10**5000, "current": 0}},
    ],
    ids=["deep v", "deep kind", "long kind", "huge int", "huge negative int", "nan", "huge v", "huge delta"],
)
def test_from_mapping_never_raises_on_python_values(value: dict[str, object]) -> None:
    """The builders see Python values (cli's JSONL, callers of make_event): messages must not repr them blindly."""
    deep = value
    for _ in range(5_000):
        deep = {"a": deep}
    for candidate in (value, {**value, "v": deep} if value.get("v") == 1 else value):
        result = from_mapping(candidate, NOW, b"sk_1")
        assert isinstance(result, Invalid) and len(result.message) < 400


def test_fast_path_takes_ordinary_events(monkeypatch: pytest.MonkeyPatch) -> None:
    """Totality must not cost the fast path its records: valid events never reach the reference walk."""
    import skillstats.contract as contract
    from skillstats.workload import generate

    records = [(r.key, r.value) for r in generate(2_000, now_ms=NOW, invalid_ratio=0.0, seed=5) if r.value]
    records.append(("sk_é✓".encode(), body(skill_id="sk_é✓")))
    records.append((b"sk_1", body(kind="install_clear", delta={"all_time": -3, "current": 2})))

    def no_reference(key: bytes | None, value: bytes | None, timestamp_ms: int | None) -> StatEvent | Invalid:
        raise AssertionError(f"reference path used for {value!r}")

    monkeypatch.setattr(contract, "decode_reference", no_reference)
    for key, value in records:
        assert isinstance(decode(key, value, NOW), StatEvent)
        assert isinstance(decode(key, value, None), StatEvent)


# --- A member name twice in one object is malformed, on both paths (issue 8, item 9) -----------------------------

DUPLICATES = {
    "top level, last value would be valid": (raw_event(extra=b',"kind":"install_new"'), "kind"),
    "top level, first value invalid": (b'{"v":2,' + EVENT_PREFIX[1:] + b',"v":1}', "v"),
    "top level, both equal": (raw_event(extra=b',"skill_id":"sk_1"'), "skill_id"),
    "top level, with whitespace": (raw_event(extra=b' , "occurred_at" :\t1764460799001 '), "occurred_at"),
    "top level, name escaped": (raw_event(extra=b',"event_\\u0069d":"e2"'), "event_id"),
    "in delta": (clear_event(b'{"all_time":-2,"current":-1,"all_time":5}'), "all_time"),
    "in delta, name escaped": (clear_event(b'{"all_time":-2,"\\u0063urrent":0,"current":-1}'), "current"),
    "delta twice": (clear_event(b'{"all_time":-2,"current":-1},"delta":{"all_time":0,"current":0}'), "delta"),
    "deep in an unknown field": (raw_event(extra=b',"pad":{"a":[1,{"b":{"c":1,"c":1}}]}'), "c"),
}


@BOTH_PATHS
@pytest.mark.parametrize("case", sorted(DUPLICATES))
def test_a_member_named_twice_is_malformed(decoder: Decoder, case: str) -> None:
    """I-JSON (RFC 7493): a validator that keeps the first value must never disagree with us on a record."""
    value, name = DUPLICATES[case]
    orjson.loads(value)  # well-formed JSON otherwise: only the duplicate makes it malformed
    result = decoder(b"sk_1", value, NOW)
    assert isinstance(result, Invalid) and result.reason is Reason.MALFORMED, result
    assert f"member {name!r} more than once" in result.message


@pytest.mark.parametrize("case", sorted(DUPLICATES))
def test_the_fast_path_never_accepts_a_member_named_twice(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """msgspec lets the last member win, so the fast path must hand every duplicate to the reference path."""
    import skillstats.contract as contract

    handed_over = Invalid(Reason.MALFORMED, "handed to the reference path")
    monkeypatch.setattr(contract, "decode_reference", lambda key, value, timestamp_ms: handed_over)
    assert decode(b"sk_1", DUPLICATES[case][0], NOW) is handed_over


def test_a_duplicate_is_found_without_recursion_and_in_linear_time() -> None:
    deep = raw_event(extra=b',"pad":' + b'{"a":' * 500 + b'{"b":"\\"","b":1}' + b"}" * 500)
    result = _at_stack_depth(sys.getrecursionlimit() - 60, lambda: decode(b"sk_1", deep, NOW))
    assert isinstance(result, Invalid) and "member 'b' more than once" in result.message
    # A tail without braces must be scanned once: a scanner retrying at each offset of it would take minutes.
    tail = b'[{"a":"\\""}' + b" " * 65_000 + b"]"
    started = time.perf_counter()
    assert decode(b"sk_1", tail, NOW) == Invalid(Reason.MALFORMED, "value is not a JSON object")
    assert time.perf_counter() - started < 5.0


# --- Properties: decode is total, and its two paths agree -------------------------------------------------------

TIMESTAMPS = st.none() | st.integers() | st.integers(min_value=NOW - 10**9, max_value=NOW + 10**9)
JSON_TOKENS = [
    b"{", b"}", b"[", b"]", b":", b",", b" ", b'"', b"\\", b"\\u", b"d800", b"dc00", b"null", b"true", b"1", b"-",
    b"0", b".5", b"e400", b"NaN", b"Infinity", b'"v"', b'"event_id"', b'"skill_id"', b'"sk_1"', b'"kind"',
    b'"download"', b'"install_clear"', b'"occurred_at"', b"1764460799000", b'"delta"', b'"all_time"', b'"current"',
    b"\xff", b"\xed\xa0\x80", b"\xef\xbb\xbf", b"\x00",
]  # fmt: skip
VALUES = st.binary(max_size=300) | st.lists(st.sampled_from(JSON_TOKENS), max_size=60).map(b"".join)
KEYS = st.none() | st.just(b"sk_1") | st.binary(max_size=20)


def check_record(key: bytes | None, value: bytes | None, timestamp: int | None) -> StatEvent | Invalid:
    """Both paths never raise, return an event or a reason, and agree; an event survives its own round trip."""
    fast = decode(key, value, timestamp)
    assert_outcome(fast)
    reference = decode_reference(key, value, timestamp)
    assert fast == reference, (value or b"")[:300]
    if isinstance(fast, StatEvent):
        assert fast.key == key
        assert decode(fast.key, fast.encode(), timestamp) == fast
    return fast


@PROPERTY
@given(key=KEYS, value=st.none() | VALUES, timestamp=TIMESTAMPS)
def test_decode_is_total_on_arbitrary_bytes(key: bytes | None, value: bytes | None, timestamp: int | None) -> None:
    check_record(key, value, timestamp)


JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(["download", "install_clear", "sk_1", "\ud800", "e" * 129])
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
FIELDS = ("v", "event_id", "skill_id", "kind", "occurred_at", "delta")
ID_TEXT = st.text(min_size=1, max_size=128)
IDS = st.one_of(ID_TEXT, ID_TEXT, ID_TEXT, st.sampled_from(["sk_é✓", "e" * 128, "sk_\x00", "e" * 129, ""]))


@st.composite
def event_like(draw: st.DrawFn) -> dict[str, Any]:
    """A valid event dict, then perhaps fields removed, replaced by other JSON values, or extra ones added."""
    kind = draw(st.sampled_from(KINDS))
    event: dict[str, Any] = {
        "v": 1,
        "event_id": draw(IDS),
        "skill_id": draw(IDS),
        "kind": kind,
        "occurred_at": draw(
            st.sampled_from([946_684_800_000, NOW, NOW + MAX_FUTURE_SKEW_MS, MAX_OCCURRED_AT_MS])
            | st.integers(min_value=946_684_800_000 - 10, max_value=NOW + MAX_FUTURE_SKEW_MS + 10)
            | st.integers()
        ),
    }
    if kind == "install_clear" or draw(st.booleans()):
        bound = 10**9 + 2
        event["delta"] = {
            "all_time": draw(st.integers(min_value=-bound, max_value=bound)),
            "current": draw(st.integers(min_value=-bound, max_value=bound)),
        }
    mutated = draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)) if draw(st.booleans()) else []
    for field in mutated:
        if draw(st.booleans()):
            event.pop(field, None)
        else:
            event[field] = draw(JSON_VALUES)
    event.update(draw(st.dictionaries(st.text(max_size=10), JSON_VALUES, max_size=2)))  # may override fields too
    return event


def to_wire(document: object, ascii_only: bool) -> bytes:
    """Serialize with the stdlib: unlike orjson it writes big ints, NaN/Infinity and lone surrogates (escaped)."""
    text = json.dumps(document, ensure_ascii=ascii_only)
    return text.encode("utf-8", "surrogatepass")


@PROPERTY
@given(
    document=st.one_of(event_like(), event_like(), event_like(), JSON_VALUES),  # mostly near-valid events
    ascii_only=st.booleans(),
    key_choice=st.sampled_from(["skill_id", "skill_id", "skill_id", "other", "none"]),
    timestamp=st.none() | st.just(NOW) | TIMESTAMPS,
)
def test_decode_paths_agree_on_json_values(
    document: object, ascii_only: bool, key_choice: str, timestamp: int | None
) -> None:
    skill_id = document.get("skill_id") if isinstance(document, dict) else None
    key: bytes | None = None
    if key_choice == "skill_id" and isinstance(skill_id, str):
        key = skill_id.encode("utf-8", "surrogatepass")
    elif key_choice == "other":
        key = b"sk_other"
    result = check_record(key, to_wire(document, ascii_only), timestamp)
    if isinstance(result, StatEvent):
        assert isinstance(document, dict)
        assert (result.event_id, result.skill_id, result.kind) == (document["event_id"], skill_id, document["kind"])
        assert result.occurred_at == document["occurred_at"]
        if result.effect.uses_delta:
            assert (result.delta_all_time, result.delta_current) == (
                document["delta"]["all_time"],
                document["delta"]["current"],
            )


@st.composite
def with_a_duplicate(draw: st.DrawFn) -> tuple[bytes, str, bytes]:
    """A near-valid event written member by member, one member (top level or in delta) written twice.

    Returns the value, the name written twice and the record key (the skill_id when it is a string).
    """
    event = draw(event_like())
    delta = event.get("delta")
    in_delta = isinstance(delta, dict) and bool(delta) and draw(st.booleans())
    members = list((delta if in_delta else event).items())
    name, value = draw(st.sampled_from(members))
    members.insert(draw(st.integers(0, len(members))), (name, draw(st.just(value) | JSON_VALUES)))

    def write(pairs: list[tuple[str, Any]]) -> str:
        return "{" + ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in pairs) + "}"

    if in_delta:
        text = write([*((k, v) for k, v in event.items() if k != "delta"), ("delta", "@DELTA@")])
        text = text.replace('"@DELTA@"', write(members))
    else:
        text = write(members)
    skill_id = event.get("skill_id")
    key = skill_id.encode("utf-8", "surrogatepass") if isinstance(skill_id, str) else b"sk_1"
    return text.encode("utf-8", "surrogatepass"), name, key


@PROPERTY
@given(case=with_a_duplicate(), timestamp=st.none() | st.just(NOW) | TIMESTAMPS)
def test_a_member_named_twice_is_malformed_whatever_else(case: tuple[bytes, str, bytes], timestamp: int | None) -> None:
    value, name, key = case
    result = check_record(key, value, timestamp)
    assert isinstance(result, Invalid) and result.reason is Reason.MALFORMED, value[:300]
    try:
        orjson.loads(value)
    except orjson.JSONDecodeError:
        return  # malformed before duplicates are looked for (NaN, a lone surrogate, a number past a double)
    assert f"member {name!r} more than once" in result.message, (value[:300], result.message)
