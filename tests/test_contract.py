"""The event contract, SPEC §2-3: one case or more per reason code, and every valid kind."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from skillstats.contract import (
    EFFECTS,
    Invalid,
    InvalidEvent,
    Reason,
    StatEvent,
    decode,
    make_event,
)

NOW = 1_764_460_800_000  # 2025-11-30T00:00:00Z
BASE = {"v": 1, "event_id": "e1", "skill_id": "sk_1", "kind": "download", "occurred_at": NOW - 1000}


def body(**changes: object) -> bytes:
    merged = {**BASE, **changes}
    return orjson.dumps({k: v for k, v in merged.items() if v is not ...})


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
    ("11 minutes ahead", b"sk_1", body(occurred_at=NOW + 660_000), Reason.BAD_TIMESTAMP),
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
    ("exactly 10 minutes ahead", body(occurred_at=NOW + 600_000)),
    ("ids of 128 chars", body(event_id="e" * 128, skill_id="s" * 128)),
    ("unknown fields ignored", body(source="cli", extra={"nested": True})),
    ("delta ignored on download", body(delta="anything")),
    ("clear delta at the bounds", body(kind="install_clear", delta={"all_time": -(10**9), "current": 10**9})),
]


@pytest.mark.parametrize(("case", "value"), VALID_EDGES, ids=[c[0] for c in VALID_EDGES])
def test_valid_edges(case: str, value: bytes) -> None:
    skill = orjson.loads(value)["skill_id"]
    assert isinstance(decode(skill.encode(), value, NOW), StatEvent), case


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


def test_json_schema_lists_the_same_kinds_and_bounds() -> None:
    import skillstats

    schema = json.loads((Path(skillstats.__file__).parent / "schema" / "stat-event-v1.schema.json").read_text())
    assert set(schema["properties"]["kind"]["enum"]) == set(EFFECTS)
    assert schema["properties"]["skill_id"]["maxLength"] == 128
    assert schema["properties"]["occurred_at"]["minimum"] == 946_684_800_000


def test_fast_and_slow_decoders_agree_on_every_record() -> None:
    """The msgspec fast path may only take what the reference path calls valid, and must build the same event."""
    import time

    from skillstats.contract import decode_reference
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
