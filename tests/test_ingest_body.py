"""skillstats/ingest/body.py: the HTTP body's verdict is the consumers' verdict, for any body (hypothesis)."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from skillstats.contract import decode, make_event
from skillstats.ingest.body import JSON, NDJSON, media_type, parse

NOW = 1_764_460_800_000


def valid_line(index: int) -> bytes:
    return make_event(f"sk_{index % 7}", "download", NOW - index, event_id=f"e{index}", now_ms=NOW).encode()


# Lines a client may send: valid events, events with one thing wrong, and things that are not events at all.
BAD_LINES = [
    b'{"v": 2, "event_id": "e", "skill_id": "s", "kind": "download", "occurred_at": 1764460800000}',
    b'{"v": 1, "event_id": "e", "skill_id": "s", "kind": "upvote", "occurred_at": 1764460800000}',
    b'{"v": 1, "event_id": "e", "skill_id": "s", "kind": "download", "occurred_at": 99999999999999}',
    b'{"v": 1, "event_id": "e", "skill_id": 5, "kind": "download", "occurred_at": 1764460800000}',
    b'{"v": 1, "event_id": "e", "skill_id": "s", "kind": "install_clear", "occurred_at": 1764460800000}',
    b'{"v": 1, "v": 1, "event_id": "e", "skill_id": "s", "kind": "download", "occurred_at": 1764460800000}',
    b"not json at all",
    b"[1, 2]",
    b'"a string"',
    b"\xff\xfe",
    b"{" * 600 + b"}" * 600,
]
line = st.one_of(st.integers(0, 50).map(valid_line), st.sampled_from(BAD_LINES), st.binary(max_size=40))


@settings(max_examples=300, deadline=None)
@given(st.lists(line, min_size=1, max_size=30), st.sampled_from([b"\n", b"\r\n"]))
def test_a_body_is_accepted_exactly_when_every_event_would_be_counted(lines: list[bytes], newline: bytes) -> None:
    body = newline.join(lines)
    parsed = parse(body, NDJSON, NOW, 10_000)
    kept = [(number, raw.strip()) for number, raw in enumerate(body.split(b"\n"), start=1) if raw.strip()]
    verdicts = {}
    for number, value in kept:
        try:
            key = orjson.loads(value)["skill_id"].encode()
        except Exception:
            key = None
        verdicts[number] = (key, value, decode(key, value, NOW))
    if not kept:
        assert parsed.problem == "no events in the body"
        return
    invalid = [number for number, (_k, _v, event) in verdicts.items() if not hasattr(event, "skill_id")]
    assert [r.at for r in parsed.rejected] == invalid
    assert [r.reason for r in parsed.rejected] == [verdicts[n][2].reason.value for n in invalid]  # type: ignore[union-attr]
    if invalid:
        assert parsed.records == []
    else:
        # What is published is what the client sent, keyed by its skill id: the consumers' decode agrees.
        assert parsed.records == [(k, v) for k, v, _e in verdicts.values()]
        assert all(k is not None and k.decode() == decode(k, v, NOW).skill_id for k, v in parsed.records)  # type: ignore[union-attr]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=20))
def test_a_json_array_and_ndjson_of_the_same_events_publish_the_same_events(indexes: list[int]) -> None:
    events = [orjson.loads(valid_line(i)) for i in indexes]
    from_array = parse(orjson.dumps(events), JSON, NOW, 10_000)
    from_lines = parse(b"\n".join(orjson.dumps(e) for e in events), NDJSON, NOW, 10_000)
    assert from_array.ok and from_lines.ok
    assert [(k, orjson.loads(v)) for k, v in from_array.records] == [
        (k, orjson.loads(v)) for k, v in from_lines.records
    ]
    single = parse(orjson.dumps(events[0]), JSON, NOW, 10_000)
    assert single.records == from_array.records[:1]


def test_what_a_body_as_a_whole_can_get_wrong() -> None:
    assert parse(b"[]", JSON, NOW, 10).problem == "no events in the body"
    assert parse(b"5", JSON, NOW, 10).problem == "the body must be one event object or an array of them"
    assert "more than once" in (parse(b'[{"a": 1, "a": 2}]', JSON, NOW, 10).problem or "")
    assert "line 1 column" in (parse(b"[{", JSON, NOW, 10).problem or "")
    assert parse(b"\n".join([valid_line(1)] * 11), NDJSON, NOW, 10).too_many == 11
    assert parse(b"\n".join([valid_line(1)] * 10), NDJSON, NOW, 10).ok
    # The future bound is measured from the server's clock, which becomes the record's CreateTime.
    late = make_event("sk", "download", NOW + 9 * 60_000, now_ms=NOW + 9 * 60_000).encode()
    assert parse(late, NDJSON, NOW, 10).ok
    assert [r.reason for r in parse(late, NDJSON, NOW - 2 * 60_000, 10).rejected] == ["bad_timestamp"]


def test_media_types() -> None:
    assert media_type("application/x-ndjson") == NDJSON
    assert media_type("Application/JSON; charset=UTF-8") == JSON
    assert media_type('application/json; charset="utf-8"') == JSON
    assert media_type("application/json; charset=latin-1") is None
    assert media_type("text/plain") is None
    assert media_type(None) is None
