"""skillstats._native (skillstats/_native.c) against the Python code it stands in for.

The C reader may only ACCEPT: every record it turns into an event must be one the
reference path (orjson and a dict walk) turns into the same event; anything else it
leaves to the Python paths. The properties here feed it what a strict hand-written
reader gets wrong (whitespace in every gap, members in any order, escapes, non-ASCII,
numbers of every shape, one byte inserted, deleted or overwritten) and compare it with
the reference record by record. tests/test_contract.py and tests/test_hostile_input.py
run their corpus and properties through `decode`, which is the C reader first; the
tests below also run the corpus without it, so the Python fast path stays checked
where the module is missing. The windows fold is compared with its Python twin.
"""

from __future__ import annotations

import random
import re
from typing import Any
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from skillstats import contract
from skillstats.contract import (
    EFFECTS,
    KINDS,
    MAX_FUTURE_SKEW_MS,
    MAX_OCCURRED_AT_MS,
    WINDOW_DELTAS,
    StatEvent,
    decode_many,
    decode_reference,
    make_event,
)
from skillstats.sinks import docstats, windows
from skillstats.sinks.docstats import PartitionDeltas
from skillstats.sinks.upserts import utc_naive
from tests.hostile_corpus import CORPUS
from tests.test_contract import NOW, PROPERTY, TIMESTAMPS

native = contract.native


def test_the_native_module_is_built() -> None:
    """The install (the README's commands, the image) builds it: a silent fall back to Python would only
    show as a slower worker."""
    assert native is not None and contract.NATIVE_MISSING is None
    assert windows.native is native and docstats.native is native


def accepted(key: bytes | None, value: bytes | None, timestamp: int | None) -> StatEvent | None:
    """What the C reader alone makes of one record: an event, or None when it leaves it to the Python paths."""
    assert native is not None
    events, pending = native.decode_valid([key], [value], [timestamp])
    assert (events[0] is None) == (pending == [0])
    return events[0]


def check_native(key: bytes | None, value: bytes | None, timestamp: int | None) -> StatEvent | None:
    event = accepted(key, value, timestamp)
    if event is not None:
        assert event == decode_reference(key, value, timestamp), value[:300] if value else value
        assert event.kind in EFFECTS and event.kind is next(k for k in KINDS if k == event.kind)
    return event


def test_publishers_records_take_the_native_path() -> None:
    """What make_event writes (every kind, delta or not) never needs the Python paths."""
    for kind in KINDS:
        delta = {"delta_all_time": -3, "delta_current": 2} if EFFECTS[kind].uses_delta else {}
        event = make_event("sk_1", kind, NOW - 5, event_id="e-1", now_ms=NOW, **delta)  # type: ignore[arg-type]
        assert check_native(b"sk_1", event.encode(), NOW) == event


def test_the_corpus_gets_the_reference_verdict_with_and_without_the_native_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    records = [(case.key, case.value, case.timestamp) for case in CORPUS]
    for key, value, stamp in records:
        check_native(key, value, stamp)
    keys, values, stamps = (list(column) for column in zip(*records, strict=True))
    with_native = decode_many(keys, values, stamps)
    monkeypatch.setattr(contract, "native", None)
    without = decode_many(keys, values, stamps)
    assert with_native == without
    for index, (key, value, stamp) in enumerate(records):
        reference = decode_reference(key, value, stamp)
        assert (without[0][index] or dict(without[1])[index]) == reference


WS = st.sampled_from(["", "", "", " ", "\n", "\t", "\r\n  "])
STRINGS = st.one_of(
    st.sampled_from(["sk_1", "e1", "download", "install_clear", "", "x" * 128, "x" * 129]),
    st.text(max_size=12),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=20),
)
NUMBERS = st.one_of(
    st.integers(min_value=NOW - 10**6, max_value=NOW + MAX_FUTURE_SKEW_MS + 10**6).map(str),
    st.sampled_from(
        ["1", "0", "-0", "01", "1.0", "1e3", "1E3", "-1", "+1", str(MAX_OCCURRED_AT_MS), str(MAX_OCCURRED_AT_MS + 1)]
    ),
    st.sampled_from(["946684800000", "946684799999", "1000000000", "-1000000000", "1000000001", "9" * 18, "9" * 19]),
    st.integers().map(str),
)


def string_token(text: str, escape: bool) -> str:
    if escape and text:
        return f'"\\u{ord(text[0]):04x}' + text[1:].replace("\\", "\\\\").replace('"', '\\"') + '"'
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


ASCII_IDS = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=128)
IN_RANGE = st.integers(min_value=946_684_800_000, max_value=NOW + MAX_FUTURE_SKEW_MS).map(str)
SMALL = st.integers(min_value=-(10**9), max_value=10**9).map(str)


@st.composite
def written_events(draw: st.DrawFn) -> tuple[bytes, bytes | None, int | None]:
    """A record text written member by member: the contract's members in any order, whitespace anywhere JSON
    allows it; half of them valid as written, the other half with some of: members dropped, repeated, added
    or given values of every shape, escapes, one byte inserted, deleted or overwritten."""
    hostile = draw(st.booleans())

    def pick(valid: st.SearchStrategy[Any], other: st.SearchStrategy[Any]) -> Any:
        return draw(other) if hostile and draw(st.integers(0, 3)) == 0 else draw(valid)

    kind = pick(st.sampled_from(KINDS), st.sampled_from(["nope", "Download", "download "]))
    skill = pick(ASCII_IDS, STRINGS)
    members: list[tuple[str, str]] = [
        ("v", pick(st.just("1"), st.sampled_from(["2", "1.0", '"1"', "true", "01", "-0", "1e0"]))),
        ("event_id", string_token(pick(ASCII_IDS, STRINGS), hostile and draw(st.booleans()))),
        ("skill_id", string_token(skill, hostile and draw(st.integers(0, 5)) == 0)),
        ("kind", string_token(kind, hostile and draw(st.integers(0, 5)) == 0)),
        ("occurred_at", pick(IN_RANGE, NUMBERS)),
    ]
    if kind == "install_clear" or draw(st.booleans()):
        inner = [("all_time", pick(SMALL, NUMBERS)), ("current", pick(SMALL, NUMBERS))]
        if hostile and draw(st.integers(0, 4)) == 0:
            inner.append(draw(st.sampled_from(inner)))
        if hostile and draw(st.integers(0, 4)) == 0:
            inner.pop(0)
        w = draw(WS)
        delta = "{" + ",".join(f'{w}"{k}"{w}:{w}{v}{w}' for k, v in draw(st.permutations(inner))) + "}"
        members.append(("delta", pick(st.just(delta), st.sampled_from(["null", "[]", "{}", "1"]))))
    members = draw(st.permutations(members))
    if hostile and draw(st.integers(0, 4)) == 0:
        members.append(draw(st.sampled_from(members)))  # a member named twice
    if hostile and draw(st.integers(0, 4)) == 0:
        extra = ("extra", draw(st.sampled_from(["1", '"x"', "{}"])))
        members.insert(draw(st.integers(0, len(members))), extra)
    if hostile and draw(st.integers(0, 6)) == 0:
        members.pop(draw(st.integers(0, len(members) - 1)))
    text = ",".join(f"{draw(WS)}{string_token(k, False)}{draw(WS)}:{draw(WS)}{v}{draw(WS)}" for k, v in members)
    value = (draw(WS) + "{" + text + "}" + draw(WS)).encode("utf-8", "surrogatepass")
    if hostile and draw(st.integers(0, 3)) == 0:
        at = draw(st.integers(0, len(value) - 1))
        byte = bytes([draw(st.integers(0, 255))])
        value = draw(
            st.sampled_from(
                [value[:at] + value[at + 1 :], value[:at] + byte + value[at:], value[:at] + byte + value[at + 1 :]]
            )
        )
    key: bytes | None = skill.encode("utf-8", "surrogatepass")
    if hostile and draw(st.integers(0, 4)) == 0:
        key = draw(st.sampled_from([None, b"sk_1", key + b" "]))
    return value, key, draw(st.none() | st.just(NOW) | TIMESTAMPS)


@PROPERTY
@given(record=written_events())
def test_what_the_native_reader_accepts_the_reference_accepts_the_same(
    record: tuple[bytes, bytes | None, int | None],
) -> None:
    value, key, stamp = record
    check_native(key, value, stamp)


def test_a_plain_valid_record_is_taken_whatever_its_layout() -> None:
    """Whitespace and member order do not send a valid record to the Python paths."""
    text = b' {\n "occurred_at" : 1764460799000 ,\t"kind":"download", "skill_id":"sk_1","event_id":"e1","v":1 } \r\n'
    assert check_native(b"sk_1", text, NOW) == StatEvent("e1", "sk_1", "download", NOW - 1000)
    clear = (
        b'{"delta":{"current":-1,"all_time":-2},"v":1,"event_id":"e1","skill_id":"sk_1",'
        b'"kind":"install_clear","occurred_at":1764460799000}'
    )
    assert check_native(b"sk_1", clear, NOW) == StatEvent("e1", "sk_1", "install_clear", NOW - 1000, -2, -1)


def test_batches_of_any_mix_decode_alike_with_and_without_the_native_module(monkeypatch: pytest.MonkeyPatch) -> None:
    from skillstats.workload import generate

    records = [(r.key, r.value, NOW) for r in generate(5_000, now_ms=NOW, invalid_ratio=0.2, seed=17)]
    records += [(case.key, case.value, case.timestamp) for case in CORPUS]
    random.Random(3).shuffle(records)
    keys, values, stamps = (tuple(column) for column in zip(*records, strict=True))  # any sequence, not only lists
    with_native = decode_many(keys, values, stamps)
    monkeypatch.setattr(contract, "native", None)
    assert decode_many(keys, values, stamps) == with_native
    with pytest.raises(ValueError):
        decode_many([b"sk_1"], [], [NOW])


EVENTS = st.builds(
    StatEvent,
    event_id=st.just("e"),
    skill_id=st.sampled_from(["a", "b", "sk_é", "c" * 128]),
    kind=st.sampled_from(KINDS),
    occurred_at=st.integers(min_value=946_684_800_000, max_value=MAX_OCCURRED_AT_MS)
    | st.integers(min_value=NOW - 3 * 86_400_000, max_value=NOW),
    delta_all_time=st.integers(-(10**9), 10**9),
    delta_current=st.integers(-(10**9), 10**9),
)


def _hour(start: int) -> str:
    return f"<h{start}>"


def _day(start: int) -> str:
    return f"<d{start}>"


@PROPERTY
@given(events=st.lists(EVENTS, max_size=60))
def test_the_native_rows_are_the_python_rows(events: list[StatEvent]) -> None:
    """The same rows in the same order as the dicts of the Python fold made into rows, hours and days."""
    assert native is not None
    hourly, daily = windows.fold(events)
    assert native.window_rows(events, WINDOW_DELTAS, _hour, _day) == (
        windows.bucket_rows(hourly, _hour),
        windows.bucket_rows(daily, _day),
    )
    with mock.patch.object(windows, "native", None):
        assert windows.fold_rows(events) == windows.rows_of((hourly, daily))
    assert windows.fold_rows(events) == windows.rows_of((hourly, daily))


ROW_SKILLS = st.sampled_from(["a", "b", "ab", "a\x00", "sk_é", "sk_✓", "sk_\U0001f600", "Z", "", "c" * 128]) | st.text(
    max_size=6
)


@PROPERTY
@given(
    events=st.lists(
        st.builds(
            StatEvent,
            event_id=st.just("e"),
            skill_id=ROW_SKILLS.map(lambda s: "".join(s)),  # a new str object per event, equal texts apart
            kind=st.sampled_from(KINDS),
            occurred_at=st.integers(-(2**62), 2**62) | st.sampled_from([0, NOW, NOW + 3_600_000, -1, 86_399_999]),
        ),
        max_size=80,
    )
)
def test_the_native_rows_order_and_sum_as_python_does(events: list[StatEvent]) -> None:
    """Python's str order code point by code point whatever the strings' widths, starts of either sign, equal
    skill ids in distinct objects summed together, and each converter called once per distinct start."""
    assert native is not None
    calls: list[str] = []

    def hour_of(start: int) -> str:
        calls.append(_hour(start))
        return _hour(start)

    def day_of(start: int) -> str:
        calls.append(_day(start))
        return _day(start)

    rows = native.window_rows(events, WINDOW_DELTAS, hour_of, day_of)
    hourly, daily = windows.fold(events)
    assert rows == (windows.bucket_rows(hourly, _hour), windows.bucket_rows(daily, _day))
    assert sorted(calls) == sorted({_hour(start) for _k, start in hourly} | {_day(start) for _k, start in daily})


def test_the_rows_refuse_what_is_not_an_event() -> None:
    assert native is not None
    with pytest.raises(AttributeError):
        native.window_rows([object()], WINDOW_DELTAS, _hour, _day)
    with pytest.raises(TypeError):
        native.window_rows([StatEvent("e", 7, "download", NOW)], WINDOW_DELTAS, _hour, _day)  # type: ignore[arg-type]
    with pytest.raises(ZeroDivisionError):
        native.window_rows([StatEvent("e", "a", "download", NOW)], WINDOW_DELTAS, lambda start: 1 / 0, _day)


@PROPERTY
@given(batches=st.lists(st.lists(st.none() | EVENTS, max_size=30), max_size=4))
def test_the_native_docsync_fold_is_the_python_fold(batches: list[list[StatEvent | None]]) -> None:
    """PartitionDeltas.add_decoded, batch after batch into the same partition, with and without the C loop."""
    with_native = PartitionDeltas(0, 0, 0)
    without = PartitionDeltas(0, 0, 0)
    for events in batches:
        with_native.add_decoded(events, [])
    with mock.patch.object(docstats, "native", None):
        for events in batches:
            without.add_decoded(events, [])
    assert (with_native.deltas, with_native.kinds) == (without.deltas, without.kinds)


@PROPERTY
@given(batches=st.lists(st.lists(written_events(), max_size=12), max_size=4))
def test_the_records_folded_in_c_count_as_their_decoded_events(
    batches: list[list[tuple[bytes, bytes | None, int | None]]],
) -> None:
    """PartitionDeltas.add_records (fold_records: no event built, the rest to decode_many) against decode_many and
    add_decoded without the C module, batch after batch into the same partition: the same deltas, kinds and
    invalid reasons; and fold_records leaves to Python exactly the records decode_valid leaves."""
    assert native is not None
    folded = PartitionDeltas(0, 0, 0)
    decoded = PartitionDeltas(0, 0, 0)
    for batch in batches:
        values = [value for value, _key, _stamp in batch]
        keys = [key for _value, key, _stamp in batch]
        stamps = [stamp for _value, _key, stamp in batch]
        folded.add_records(keys, values, stamps)
        with mock.patch.object(contract, "native", None), mock.patch.object(docstats, "native", None):
            decoded.add_records(keys, values, stamps)
        pending = native.fold_records(keys, values, stamps, contract.FIXED_SKILL_DELTAS, {}, {})
        assert pending == native.decode_valid(keys, values, stamps)[1]
    assert (folded.deltas, folded.kinds) == (decoded.deltas, decoded.kinds)
    assert (folded.invalid, folded.invalid_reasons) == (decoded.invalid, decoded.invalid_reasons)


def test_the_records_fold_counts_the_publishers_records_and_refuses_what_it_cannot_read() -> None:
    """Every kind make_event writes is folded in C (nothing left pending), as its event would be; a fixed table
    that is not the contract's shape, or columns of different lengths, are refused rather than misread."""
    assert native is not None
    events = [
        make_event(f"sk_{i % 3}", kind, NOW - i, now_ms=NOW, **delta)  # type: ignore[arg-type]
        for i, kind in enumerate(KINDS * 3)
        for delta in [{"delta_all_time": i - 4, "delta_current": 2 - i} if EFFECTS[kind].uses_delta else {}]
    ]
    keys = [event.key for event in events]
    values = [event.encode() for event in events]
    kinds: dict[str, int] = {}
    deltas: dict[str, list[int]] = {}
    assert native.fold_records(keys, values, [NOW] * len(events), contract.FIXED_SKILL_DELTAS, kinds, deltas) == []
    expected = PartitionDeltas(0, 0, 0)
    expected.add_decoded(events, [])
    assert (deltas, kinds) == (expected.deltas, expected.kinds)
    with pytest.raises(TypeError):
        native.fold_records(keys, values, [NOW] * len(events), {KINDS[0]: (1, 2)}, {}, {})
    with pytest.raises(ValueError):
        native.fold_records(keys, values, [NOW], contract.FIXED_SKILL_DELTAS, {}, {})


def test_the_folds_survive_events_that_change_the_list_they_are_in() -> None:
    """An attribute that runs code (not a StatEvent's) and empties the list being folded: the folds read a
    snapshot, so they count what they were handed (found by a review: the borrowed items were freed)."""
    assert native is not None
    events: list[Any] = []

    class Meddling:
        skill_id = "s"
        occurred_at = NOW
        delta_all_time = delta_current = 0

        @property
        def kind(self) -> str:
            events.clear()
            events.extend(object() for _ in range(1000))
            return "download"

    def fresh() -> list[Any]:
        events[:] = [Meddling(), *(StatEvent("e", "s", "download", NOW) for _ in range(5))]
        return events

    hourly, daily = native.window_rows(fresh(), WINDOW_DELTAS, _hour, _day)
    assert hourly == [("s", _hour(NOW - NOW % 3_600_000), 6, 0)] and [row[2] for row in daily] == [6]
    kinds: dict[str, int] = {}
    deltas: dict[str, list[int]] = {}
    native.fold_skills(fresh(), contract.FIXED_SKILL_DELTAS, kinds, deltas)
    assert kinds == {"download": 6} and deltas == {"s": [6, 0, 0, 6]}


def test_the_docsync_fold_adds_past_64_bits_as_python_does() -> None:
    """Unreachable by real drains (9e9 clears of 1e9 each), but an int is an int: no wraparound."""
    for module in (native, None):
        part = PartitionDeltas(0, 0, 0, deltas={"s": [2**63 - 1, 0, 0, 0]}, kinds={"download": 2**63 - 1})
        with mock.patch.object(docstats, "native", module):
            part.add_decoded([StatEvent("e", "s", "download", NOW)], [])
        assert part.deltas == {"s": [2**63, 0, 0, 1]} and part.kinds == {"download": 2**63}


def test_the_native_rows_are_what_was_handed_over_whatever_the_converters_do() -> None:
    """A converter that empties the list of events and drops its own earlier results changes nothing in the
    rows: the counts and skills are the fold's own, held until the rows are made."""
    assert native is not None
    events = [StatEvent("e", f"sk_{n % 3}", "download", NOW - n * 3_600_000) for n in range(9)]
    expected = windows.rows_of(windows.fold(events))

    def meddling(start: int) -> Any:
        events.clear()
        return utc_naive(start)

    assert native.window_rows(events, WINDOW_DELTAS, meddling, lambda start: utc_naive(start).date()) == expected


def _imported_with(stand_in: str, report: str) -> str:
    """What `report` prints in a fresh interpreter where `stand_in` (lines making a module `old`) took the place of
    skillstats._native before skillstats.contract was imported."""
    import subprocess
    import sys

    probe = (
        "import sys, tempfile, types\n"
        "from pathlib import Path\n"
        "import skillstats\n"
        "old = types.ModuleType('skillstats._native')\n"
        f"{stand_in}"
        "sys.modules['skillstats._native'] = skillstats._native = old\n"
        "from skillstats import contract\n"
        "from skillstats.streams import docsync\n"
        "from skillstats.sinks import windows\n"
        f"{report}"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_module_built_from_another_source_is_left_unused() -> None:
    """An editable checkout pulled without reinstalling holds a module built from yesterday's _native.c: it
    runs the Python paths (and says why) rather than judge by yesterday's code; the current one is used."""
    assert native is not None and native.SOURCE_SHA256 != "unknown"
    out = _imported_with(
        "old.__file__ = str(Path(skillstats.__file__).with_name('_native.so'))\nold.SOURCE_SHA256 = '0' * 64\n",
        "print(contract.native is None, windows.native is None, contract.NATIVE_MISSING)\n",
    )
    assert out.startswith("True True ") and "built from another source" in out


def test_a_source_that_cannot_be_read_leaves_the_module_unused_and_imports() -> None:
    """A _native.c beside the module that cannot be read (its permissions, or gone mid-upgrade) cannot vouch for
    the module: the Python paths run and say why, and importing the consumers does not fail."""
    out = _imported_with(
        "from skillstats import _native as current\n"
        "old.__file__ = current.__file__\n"
        "old.SOURCE_SHA256 = current.SOURCE_SHA256\n"
        "real = Path.read_bytes\n"
        "def refused(self):\n"
        "    if self.name == '_native.c':\n"
        "        raise PermissionError(13, 'Permission denied', str(self))\n"
        "    return real(self)\n"
        "Path.read_bytes = refused\n",
        "print(contract.native is None, windows.native is None, contract.NATIVE_MISSING)\n",
    )
    assert out.startswith("True True cannot read ") and "Permission denied" in out


def test_an_installed_module_lacking_a_function_is_left_unused() -> None:
    """A module with no _native.c beside it to compare (a package built before it shipped its source): one built
    from an older source, which lacks a function this code calls (docsync's take_run), runs the Python paths and
    says so, rather than fail docsync's import or a call."""
    out = _imported_with(
        "from skillstats import _native as current\n"
        # A directory that does not exist: no source beside the module, so no hash check.
        "old.__file__ = str(Path(tempfile.gettempdir()) / 'skillstats-no-source' / 'x' / '_native.so')\n"
        "for name in ('configure', 'decode_valid', 'window_rows', 'fold_skills'):\n"
        "    setattr(old, name, getattr(current, name))\n",
        "print(contract.native is None, docsync.native_take_run is None, windows.native is None)\n"
        "print(contract.NATIVE_MISSING)\n",
    )
    assert out.startswith("True True True\n") and "lacks fold_records, take_run" in out


def test_the_functions_checked_at_import_are_the_modules_and_the_callers() -> None:
    """contract._NATIVE_FUNCTIONS (what a module must have to be used) names every function _native.c defines and
    every `native.<name>(` the code calls: a function added to one and not the other would let a stale build
    through to fail at its first call."""
    from pathlib import Path

    root = Path(contract.__file__).resolve().parents[1]
    table = set(re.findall(r'\{"(\w+)", \w+, METH_', (root / "skillstats" / "_native.c").read_text()))
    called: set[str] = set()
    for folder in ("skillstats", "streams", "sinks"):
        for path in (root / folder).rglob("*.py"):
            called.update(re.findall(r"\bnative\.(\w+)\b(?!\.)", path.read_text()))
    called -= {"c", "py", "__file__", "SOURCE_SHA256"}  # file names in comments, the module's own attributes
    assert table == set(contract._NATIVE_FUNCTIONS)
    assert called <= table, called - table


def test_an_installed_package_ships_the_source_its_module_is_checked_against() -> None:
    """The hash check needs _native.c beside the module: pyproject.toml ships it as package data, so an installed
    package (a wheel, the image) is checked as a checkout is (tests/test_image.py looks inside the image)."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]  # the checkout the tests are in, whatever is installed
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert "_native.c" in project["tool"]["setuptools"]["package-data"]["skillstats"]
    assert project["tool"]["setuptools"]["package-dir"]["skillstats"] == "skillstats"


def _varint(value: int) -> bytes:
    """Kafka's zig-zag varint."""
    value = (value << 1) ^ (value >> 63)
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out) + bytes([value])


def _field(data: bytes | None) -> bytes:
    return _varint(-1) if data is None else _varint(len(data)) + data


def _record(offset_delta: int, stamp_delta: int, key: bytes | None, value: bytes | None, headers: Any) -> bytes:
    body = b"\x00" + _varint(stamp_delta) + _varint(offset_delta) + _field(key) + _field(value)
    body += _varint(len(headers)) + b"".join(_field(name.encode()) + _field(content) for name, content in headers)
    return _varint(len(body)) + body


_records = st.lists(
    st.tuples(
        st.integers(-5, 40),  # offset deltas in any order: the C loop must not rely on Kafka's rising ones
        st.integers(-(2**40), 2**40),
        st.one_of(st.none(), st.binary(max_size=20)),
        st.one_of(st.none(), st.binary(max_size=300)),
        st.lists(st.tuples(st.text(max_size=5), st.one_of(st.none(), st.binary(max_size=5))), max_size=2),
    ),
    max_size=12,
)


@given(records=_records, position=st.integers(-5, 1045), append_time=st.one_of(st.none(), st.integers(0, 2**45)))
def test_batch_columns_keeps_what_aiokafkas_loop_keeps(records: list[Any], position: int, append_time: Any) -> None:
    """`batch_columns` reads the records of a v2 batch's bytes into columns: each record at or past the position
    as it stands at it, with its timestamp (the batch's first plus its delta, or the append time), key, value
    and headers, as streams/aiokafka_records.py's Python loop keeps aiokafka's records."""
    assert native is not None
    data = b"".join(_record(*record) for record in records)
    kept: list[tuple[Any, ...]] = []
    at = position
    for delta, stamp_delta, key, value, headers in records:
        if 1000 + delta >= at:
            stamp = append_time if append_time is not None else 1_700_000_000_000 + stamp_delta
            kept.append((1000 + delta, stamp, key, value, tuple(headers) if headers else ()))
            at = 1000 + delta + 1
    columns: tuple[list[Any], ...] = ([], [], [], [], [])
    after = native.batch_columns(data, len(records), 1000, 1_700_000_000_000, append_time, position, columns)
    assert [(*row[:4], tuple(row[4])) for row in zip(*columns, strict=True)] == kept
    assert after == at and all(type(row) is tuple for row in columns[4] if not row)


def test_batch_columns_refuses_what_does_not_read() -> None:
    """A field past the end, a length that does not match, a record too few or bytes left over, a header key
    that is no UTF-8, a negative header count or key: ValueError (aiokafka_records raises CorruptRecordException
    for it), whatever was appended before left to the caller to drop; an offset past 64 bits: ValueError too."""
    assert native is not None
    good = _record(0, 0, b"k", b"v", [("h", b"x")])

    def read(data: bytes, count: int = 1, base: int = 0) -> Any:
        return native.batch_columns(data, count, base, 0, None, 0, ([], [], [], [], []))

    assert read(good) == 1
    for data, count in [
        (good[:-1], 1),  # cut short
        (good, 2),  # a record missing
        (good + b"\x00", 1),  # a byte left over
        (_varint(len(good[1:]) + 1) + good[1:], 1),  # the length one past the fields
        (good.replace(b"\x02h", b"\x02\xff"), 1),  # a header key that is no UTF-8
        (_record(0, 0, None, None, [])[:-1] + _varint(-1), 1),  # a negative header count
        (_varint(8) + b"\x00\x00\x00\x01\x01\x02" + _varint(-1) + b"\x00", 1),  # a negative header key
        (_varint(11) + b"\x00\x00" + b"\xff" * 9, 1),  # a varint of more than ten bytes
    ]:
        with pytest.raises(ValueError):
            read(data, count)
    with pytest.raises(ValueError):
        read(good, base=2**63 - 1)  # one past it is no offset
    with pytest.raises(ValueError):
        read(_record(5, 0, None, None, []), base=2**63 - 3)  # past 64 bits
    with pytest.raises(TypeError):
        native.batch_columns(good, 1, 0, 0, None, 0, ([], [], [], []))  # four columns
