"""Hostile input (issue 12, item 4): no record crashes the decoder, gets a reason outside the contract, or
splits its two paths.

Why this file exists: a consumer that raises on a record is restarted, reads the record again and raises
again, so one bad publisher would stop a whole partition; and `decode` has two paths that must give one
verdict, because the windows group, the docsync group and the publisher all rely on it. The fast path
(msgspec, typed) takes what it can prove valid; the reference path (orjson, a plain walk) names every
reason. Two JSON parsers disagree precisely on the bytes no serializer writes: integers past 64 bits or
past a double, `1.0` where an integer belongs, `-0`, a member named twice, invalid or overlong UTF-8,
NUL bytes and byte-order marks, nesting past a limit. That is what is fed to both paths here:

- `tests/hostile_corpus.py`: several hundred hand-written records, each with the verdict docs/contract.md
  gives it (both paths must return it, and return the same event or the same reason and message);
- properties with an oracle written from docs/contract.md rather than read from the code: number
  literals in every numeric field, one field replaced by any JSON value, a key against its skill_id in
  other Unicode normalisation forms;
- a property on hand-written near-valid text (members dropped, duplicated, renamed through escapes,
  values swapped for hostile tokens, then bytes inserted, deleted or overwritten), checked for totality,
  agreement and the spec's reason codes.

tests/test_contract.py has the per-reason cases and the properties on arbitrary bytes, on JSON values
written by json.dumps and on generated duplicates; this file reuses its `check_record` and does not
repeat them. A disagreement found is fixed in skillstats/contract.py and its record added to the corpus
(REGRESSIONS), so it is checked on every run and not only when Hypothesis happens to draw it.
No Kafka, no database: pure unit tests, a few seconds.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from skillstats.contract import (
    EPOCH_2000_MS,
    KINDS,
    MAX_ABS_DELTA,
    MAX_FUTURE_SKEW_MS,
    MAX_ID_CHARS,
    MAX_OCCURRED_AT_MS,
    Invalid,
    Reason,
    StatEvent,
)
from tests.hostile_corpus import AT, BOM, CORPUS, Hostile, quoted
from tests.test_contract import BASE, NOW, PROPERTY, TIMESTAMPS, check_record

# SPEC §2 and docs/contract.md "Validity": the only reasons a record can get. Written out rather than read
# from `Reason`, so a code added or renamed in the code alone fails here until the contract says so.
SPEC_REASONS = frozenset(
    {"malformed", "unsupported_version", "bad_field", "key_mismatch", "unknown_kind", "bad_timestamp", "bad_delta"}
)
# SPEC §3, the kinds' table.
SPEC_KINDS = (
    "download",
    "install_new",
    "install_reactivate",
    "install_deactivate",
    "install_clear",
    "star",
    "unstar",
    "comment",
    "uncomment",
)
DLQ_MESSAGE_CHARS = 1000  # the skillstats.message header keeps at most this much (docs/contract.md, Failures)
# The numbers of docs/contract.md "Validity" as written there: the oracle below reads these, not the code's.
DOC_ID_CHARS = 128
DOC_FIRST_MS = 946_684_800_000  # 2000-01-01T00:00:00Z
DOC_LAST_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z
DOC_SKEW_MS = 600_000
DOC_DELTA_BOUND = 1_000_000_000

Verdict = Reason | StatEvent


def verdict(key: bytes | None, value: bytes | None, timestamp: int | None) -> StatEvent | Invalid:
    """`check_record` (neither path raises, both return the same thing, an event round-trips through
    encode), and an invalid record has one of the spec's reasons and a message that fits a DLQ header."""
    result = check_record(key, value, timestamp)
    if isinstance(result, Invalid):
        assert result.reason.value in SPEC_REASONS, result
        assert 0 < len(result.message) <= DLQ_MESSAGE_CHARS, result.message[:200]
    return result


def outcome(result: StatEvent | Invalid) -> Verdict:
    return result.reason if isinstance(result, Invalid) else result


def test_the_reason_codes_and_kinds_are_the_specs() -> None:
    assert {reason.value for reason in Reason} == SPEC_REASONS
    assert set(KINDS) == set(SPEC_KINDS)


def test_the_corpus_covers_every_reason_and_names_each_case_once() -> None:
    names = [case.name for case in CORPUS]
    assert len(names) == len(set(names)), sorted(name for name in names if names.count(name) > 1)
    assert {case.expect for case in CORPUS if isinstance(case.expect, Reason)} == set(Reason)
    assert any(isinstance(case.expect, StatEvent) for case in CORPUS)


@pytest.mark.parametrize("case", CORPUS, ids=[case.name for case in CORPUS])
def test_hostile_record(case: Hostile) -> None:
    assert outcome(verdict(case.key, case.value, case.timestamp)) == case.expect


# --- The oracle: docs/contract.md "Validity", steps 2-7 ----------------------------------------------------------


def contract_verdict(document: dict[str, Any], key: bytes | None, timestamp: int | None) -> Verdict:
    """What the contract says of a well-formed JSON object (step 1 passed), written from docs/contract.md.

    `document` must be what a JSON parser reads: an integer here is one within the 64-bit range.
    """

    def integer(value: object) -> bool:
        return type(value) is int  # not bool, not float

    def an_id(value: object) -> bool:
        return type(value) is str and 1 <= len(value) <= DOC_ID_CHARS

    if not (integer(document.get("v")) and document["v"] == 1):
        return Reason.UNSUPPORTED_VERSION
    event_id, skill_id = document.get("event_id"), document.get("skill_id")
    if not (an_id(event_id) and an_id(skill_id)):
        return Reason.BAD_FIELD
    assert isinstance(event_id, str) and isinstance(skill_id, str)
    if key != skill_id.encode():
        return Reason.KEY_MISMATCH
    kind = document.get("kind")
    if not (type(kind) is str and kind in SPEC_KINDS):
        return Reason.UNKNOWN_KIND
    at = document.get("occurred_at")
    if not (integer(at) and DOC_FIRST_MS <= at <= DOC_LAST_MS):
        return Reason.BAD_TIMESTAMP
    if timestamp is not None and timestamp >= 0 and at > timestamp + DOC_SKEW_MS:
        return Reason.BAD_TIMESTAMP
    if kind != "install_clear":
        return StatEvent(event_id, skill_id, kind, at)
    delta = document.get("delta")
    if not isinstance(delta, dict):
        return Reason.BAD_DELTA
    all_time, current = delta.get("all_time"), delta.get("current")
    if not all(integer(x) and abs(x) <= DOC_DELTA_BOUND for x in (all_time, current)):
        return Reason.BAD_DELTA
    return StatEvent(event_id, skill_id, kind, at, all_time, current)  # type: ignore[arg-type]


RECORD_TIMESTAMPS = st.one_of(
    st.just(NOW),
    TIMESTAMPS,
    st.sampled_from([-1, 0, EPOCH_2000_MS - MAX_FUTURE_SKEW_MS, 2**63 - 1, -(2**63), 10**30, -(10**30)]),
)

# --- Numbers written as literals, in every numeric field ----------------------------------------------------------


@dataclass(frozen=True)
class Number:
    """A JSON number literal: an integer, perhaps with a suffix (`.0`, `e0`) that makes it a double."""

    value: int
    suffix: str = ""

    @property
    def text(self) -> bytes:
        return (str(self.value) + self.suffix).encode()

    @property
    def beyond_double(self) -> bool:
        """Too large for a double: the value is malformed (docs/contract.md, step 1)."""
        try:
            float(self.value)
        except OverflowError:
            return True
        return False

    @property
    def integer(self) -> int | None:
        """What the contract reads: the integer, or None for a double (a suffix, or past the 64-bit range)."""
        return None if self.suffix or not -(2**63) <= self.value < 2**64 else self.value


EDGE_INTS = [
    *(0, 1, -1, 2, MAX_ABS_DELTA, MAX_ABS_DELTA + 1, -MAX_ABS_DELTA, -MAX_ABS_DELTA - 1),
    *(EPOCH_2000_MS - 1, EPOCH_2000_MS, NOW + MAX_FUTURE_SKEW_MS, NOW + MAX_FUTURE_SKEW_MS + 1),
    *(MAX_OCCURRED_AT_MS, MAX_OCCURRED_AT_MS + 1),
    *(2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**308, -(10**308)),
]
# Integers a double cannot hold (the largest double is about 1.8e308): the value is malformed.
BEYOND_DOUBLE = [2 * 10**308, 10**309, -(10**309), 10**400, -(10**400)]


NUMBERS = st.builds(
    Number,
    st.one_of(
        st.sampled_from(EDGE_INTS),
        st.sampled_from(BEYOND_DOUBLE),
        st.integers(),
        st.integers(min_value=-(2**70), max_value=2**70),
    ),
    st.sampled_from(["", "", "", "", "", "", ".0", "e0", "E+0", ".000"]),
)
NUMERIC_PLACES = ("v", "occurred_at", "all_time", "current")


@st.composite
def numeric_fields(draw: st.DrawFn) -> tuple[str, dict[str, Number], bool]:
    """A kind, the literals of the four numeric places (one or two of them any number, the rest valid), and
    whether the event has a delta (always when a delta member was drawn or the kind is install_clear)."""
    kind = draw(st.sampled_from(SPEC_KINDS))
    numbers = {"v": Number(1), "occurred_at": Number(AT), "all_time": Number(-2), "current": Number(-1)}
    places = draw(st.lists(st.sampled_from(NUMERIC_PLACES), min_size=1, max_size=2, unique=True))
    for place in places:
        numbers[place] = draw(NUMBERS)
    with_delta = kind == "install_clear" or bool({"all_time", "current"} & set(places)) or draw(st.booleans())
    return kind, numbers, with_delta


@PROPERTY
@given(fields=numeric_fields(), timestamp=RECORD_TIMESTAMPS)
def test_numbers_in_every_numeric_field(fields: tuple[str, dict[str, Number], bool], timestamp: int | None) -> None:
    """Shaped like an ordinary event (the fast path's own ground), with any literal in v, occurred_at or delta.

    Against the unfixed code it finds the record in the corpus's REGRESSIONS: a download whose delta held an
    integer literal past a double, which msgspec read as an int and the fast path, ignoring a download's
    delta, accepted.
    """
    kind, numbers, with_delta = fields
    value = b'{"v":%b,"event_id":"e1","skill_id":"sk_1","kind":"%b","occurred_at":%b' % (
        numbers["v"].text,
        kind.encode(),
        numbers["occurred_at"].text,
    )
    if with_delta:
        value += b',"delta":{"all_time":%b,"current":%b}' % (numbers["all_time"].text, numbers["current"].text)
    value += b"}"
    if any(number.beyond_double for number in numbers.values()):
        expected: Verdict = Reason.MALFORMED
    else:
        document: dict[str, Any] = {**BASE, "kind": kind, "v": numbers["v"].integer}
        document["occurred_at"] = numbers["occurred_at"].integer
        if with_delta:
            document["delta"] = {"all_time": numbers["all_time"].integer, "current": numbers["current"].integer}
        expected = contract_verdict(document, b"sk_1", timestamp)
    assert outcome(verdict(b"sk_1", value, timestamp)) == expected, value[:300]


# --- One field replaced by any JSON value --------------------------------------------------------------------------

# Within what a parser reads faithfully (integers in 64 bits, finite floats, no lone surrogates), so that the
# oracle needs no step 1; the corpus and the number property cover what lies beyond.
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from([*SPEC_KINDS, "sk_1", "e1", "", "e" * MAX_ID_CHARS, "e" * (MAX_ID_CHARS + 1), "Download"]),
    st.sampled_from([0, 1, -1, AT, EPOCH_2000_MS - 1, MAX_ABS_DELTA, MAX_ABS_DELTA + 1, 1.0, -0.0, float(AT)]),
)
ANY_VALUE = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
DELTA_LIKE = st.fixed_dictionaries({"all_time": SCALARS, "current": SCALARS})
PLACES = ("v", "event_id", "skill_id", "kind", "occurred_at", "delta", "delta.all_time", "delta.current")


@st.composite
def one_field_replaced(draw: st.DrawFn) -> dict[str, Any]:
    """A valid event (with a valid delta, whatever its kind), then one field or delta member replaced or removed."""
    document: dict[str, Any] = {**BASE, "kind": draw(st.sampled_from(SPEC_KINDS))}
    document["delta"] = {"all_time": -2, "current": -1}
    place = draw(st.sampled_from(PLACES))
    target, name = (document["delta"], place[len("delta.") :]) if place.startswith("delta.") else (document, place)
    if draw(st.sampled_from([False] * 7 + [True])):
        del target[name]
    else:
        target[name] = draw(ANY_VALUE | DELTA_LIKE if place == "delta" else ANY_VALUE)
    return document


@PROPERTY
@given(
    document=one_field_replaced(),
    ascii_only=st.booleans(),
    key_is_the_skill_id=st.booleans(),
    timestamp=st.just(NOW) | RECORD_TIMESTAMPS,
)
def test_one_field_replaced_by_any_json_value(
    document: dict[str, Any], ascii_only: bool, key_is_the_skill_id: bool, timestamp: int | None
) -> None:
    """Wrong types in every field (null, bool, number, float, string, array, object, missing) get that
    field's reason, in the contract's order; a value that happens to be right gives the event it describes."""
    skill_id = document.get("skill_id")
    key = skill_id.encode() if key_is_the_skill_id and isinstance(skill_id, str) else b"sk_1"
    value = json.dumps(document, ensure_ascii=ascii_only).encode()
    expected = contract_verdict(document, key, timestamp)
    assert outcome(verdict(key, value, timestamp)) == expected, value[:300]


# --- The key against the skill_id in other Unicode normalisation forms -----------------------------------------------

NORMALISATION_PRONE = st.sampled_from(
    [
        *("e", "\u0301", "\u00e9", "A", "\u030a", "\u00c5", "\u212b", "\u2126", "\u03a9", "_", "1"),
        *("\ud55c", "\u1112", "\u1161", "\u11ab", "\ufb01", "\uff53", "\u1e9b", "\u0323", "\u0958", "\ufdfa"),
        *("\U0001d400", "\u00df", "\u0130", "\u0344", "\u212a", "\u2160", "\u00bd", "\u3000"),
    ]
)
NORMAL_FORMS = st.sampled_from([None, "NFC", "NFD", "NFKC", "NFKD"])


@PROPERTY
@given(
    text=st.text(st.one_of(NORMALISATION_PRONE, NORMALISATION_PRONE, st.characters(codec="utf-8")), max_size=24),
    body_form=NORMAL_FORMS,
    key_form=NORMAL_FORMS,
    ascii_only=st.booleans(),
)
def test_the_key_is_compared_byte_for_byte_never_normalised(
    text: str, body_form: str | None, key_form: str | None, ascii_only: bool
) -> None:
    """Two spellings of one text are two skills: the key must be the skill_id's own UTF-8, code point for code
    point, and the event keeps the skill_id exactly as written (no decoder normalises it)."""
    skill_id = text if body_form is None else unicodedata.normalize(body_form, text)
    key = (text if key_form is None else unicodedata.normalize(key_form, text)).encode()
    value = json.dumps({**BASE, "skill_id": skill_id}, ensure_ascii=ascii_only).encode()
    result = outcome(verdict(key, value, NOW))
    if not 1 <= len(skill_id) <= DOC_ID_CHARS:
        assert result is Reason.BAD_FIELD
    elif key != skill_id.encode():
        assert result is Reason.KEY_MISMATCH
    else:
        assert result == StatEvent("e1", skill_id, "download", AT)


# --- Hand-written near-valid text, mutated ----------------------------------------------------------------------------

STRING_PIECES = [
    *(b"sk_1", b"e1", b"download", b"install_clear", b"\\u0000", b"\\ud800", b"\\udc00", b"\\ud83d\\ude00"),
    *(b'\\"', b"\\\\", b"\\/", b"\\u00e9", b"\\x", b"\\u12", b"e\xcc\x81", b"\xc3\xa9", b"\xc0\x80", b"\xed\xa0\x80"),
    *(b"\xf5\x80\x80\x80", b"\xf4\x90\x80\x80", BOM, b"\xef\xbf\xbf", b"\xe2\x80\xa8", b"\x00", b"\x7f", b"\t"),
    *(b"{", b"}", b"[", b":", b","),
]
NUMBER_TOKENS = st.builds(
    lambda sign, digits, fraction, exponent: sign + digits + fraction + exponent,
    st.sampled_from([b"", b"", b"", b"-", b"+"]),
    st.sampled_from([b"0", b"1", b"01", str(AT).encode(), str(2**63).encode(), str(2**64).encode()])
    | st.sampled_from([b"1" + b"0" * 309, b"1" + b"0" * 400, b"1000000001"])
    | st.text("0123456789", min_size=1, max_size=25).map(str.encode),
    st.sampled_from([b"", b"", b"", b"", b".0", b".", b".5"]),
    st.sampled_from([b"", b"", b"", b"", b"e0", b"E3", b"e+1", b"e-1", b"e400", b"e-400", b"e"]),
)
STRING_TOKENS = st.lists(
    st.sampled_from(STRING_PIECES) | st.binary(max_size=3) | st.text(max_size=3).map(str.encode), max_size=5
).map(lambda pieces: b'"' + b"".join(pieces) + b'"')
LITERAL_TOKENS = st.sampled_from(
    [
        *(b"null", b"true", b"false", b"NaN", b"Infinity", b"-Infinity", b"[]", b"{}", b'["sk_1"]', b"nul", b""),
        *(b"[", b"{", b'{"all_time":1,"current":2}', b'{"all_time":1}', b'{"all_time":1,"current":2,"current":3}'),
    ]
)
HOSTILE_TOKENS = st.one_of(NUMBER_TOKENS, STRING_TOKENS, LITERAL_TOKENS)
# Mostly kept: a document with every member mangled would only ever exercise the parsers' error paths.
MEMBER_OPS = st.sampled_from(["keep"] * 20 + ["drop", "replace", "duplicate", "respell"])
SEPARATORS = st.sampled_from(
    [b""] * 20
    + [b" ", b"\n\t", b"\r\n  "] * 2
    + [b"\x0b", b"\x0c", b"\xc2\xa0", BOM]  # the last four are not JSON whitespace
)


@st.composite
def spelled(draw: st.DrawFn, name: str) -> bytes:
    """A member name as written: plainly, with one character \\u-escaped (the same name), or in another case."""
    how = draw(st.sampled_from(["plain", "escaped", "escaped", "upper"]))
    if how == "escaped":
        at = draw(st.integers(0, len(name) - 1))
        return b'"%b\\u%04x%b"' % (name[:at].encode(), ord(name[at]), name[at + 1 :].encode())
    return quoted(name.upper() if how == "upper" else name)


@st.composite
def near_valid_object(draw: st.DrawFn, members: list[tuple[str, st.SearchStrategy[bytes]]]) -> bytes:
    """An object written member by member, each kept, dropped, given a hostile value, written twice or respelled;
    perhaps extra members, another order and odd separators."""
    written: list[tuple[bytes, bytes]] = []
    for name, valid in members:
        op = draw(MEMBER_OPS)
        if op == "drop":
            continue
        written.append(
            (
                draw(spelled(name)) if op == "respell" else quoted(name),
                draw(HOSTILE_TOKENS if op == "replace" else valid),
            )
        )
        if op == "duplicate":
            written.insert(draw(st.integers(0, len(written))), (draw(spelled(name)), draw(valid | HOSTILE_TOKENS)))
    if draw(st.sampled_from([False, False, False, True])):
        extra = st.sampled_from(["pad", "delta", "kind", "v", "\u00e9"]).map(quoted)
        written += draw(st.lists(st.tuples(extra, HOSTILE_TOKENS), min_size=1, max_size=2))
    if draw(st.sampled_from([False, False, False, True])):
        written = draw(st.permutations(written))
    space = draw(SEPARATORS)
    return b"{" + space + b",".join(name + space + b":" + token + space for name, token in written) + b"}"


@st.composite
def hand_written_event(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(SPEC_KINDS))
    bounds = st.sampled_from([b"-2", b"0", b"1000000000", b"-1000000000"])
    members: list[tuple[str, st.SearchStrategy[bytes]]] = [
        ("v", st.just(b"1")),
        ("event_id", st.just(b'"e1"')),
        ("skill_id", st.just(b'"sk_1"')),
        ("kind", st.just(quoted(kind))),
        ("occurred_at", st.sampled_from([str(AT).encode(), str(EPOCH_2000_MS).encode()])),
    ]
    if kind == "install_clear" or draw(st.sampled_from([False, False, True])):
        members.append(("delta", near_valid_object([("all_time", bounds), ("current", bounds)])))
    return draw(near_valid_object(members))


@st.composite
def byte_mutated(draw: st.DrawFn, text: bytes) -> bytes:
    """`text` with a few bytes inserted, deleted or overwritten, or cut short (most often: left alone)."""
    for _ in range(draw(st.sampled_from([0, 0, 0, 0, 0, 1, 1, 2, 3]))):
        at = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "delete", "overwrite", "cut"]))
        if op == "insert":
            inserted = st.binary(min_size=1, max_size=4) | st.sampled_from([b'"', b"\\", b"{", b"}", b",", b":"])
            text = text[:at] + draw(inserted | st.sampled_from([BOM, b"\x00", b"\xc0\x80"])) + text[at:]
        elif op == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 4)) :]
        elif op == "overwrite":
            text = text[:at] + draw(st.binary(min_size=1, max_size=1)) + text[at + 1 :]
        else:
            text = text[:at]
    return text


def skill_id_in(value: bytes) -> bytes:
    """The UTF-8 of the skill_id the reference parser reads in `value`, or b"sk_1" when it reads none."""
    try:
        document = orjson.loads(value)
    except orjson.JSONDecodeError:
        return b"sk_1"
    skill_id = document.get("skill_id") if isinstance(document, dict) else None
    return skill_id.encode() if isinstance(skill_id, str) else b"sk_1"


@PROPERTY
@given(
    value=hand_written_event().flatmap(byte_mutated),
    key_choice=st.sampled_from(["sk_1", "sk_1", "read", "read", "none", "bytes"]),
    random_key=st.binary(max_size=8),
    timestamp=RECORD_TIMESTAMPS | st.none(),
)
def test_hand_written_near_valid_text(value: bytes, key_choice: str, random_key: bytes, timestamp: int | None) -> None:
    """Texts no serializer writes but a hand-rolled publisher might: the paths stay total and agree on each."""
    key = {"sk_1": b"sk_1", "read": skill_id_in(value), "none": None, "bytes": random_key}[key_choice]
    verdict(key, value, timestamp)
