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
from collections import Counter
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
    assert out.startswith("True True True\n") and "lacks WindowFold, fold_records, take_run" in out


def test_the_functions_checked_at_import_are_the_modules_and_the_callers() -> None:
    """contract._NATIVE_FUNCTIONS (what a module must have to be used) names every function and type _native.c
    defines and every `native.<name>(` the code calls: a function added to one and not the other would let a
    stale build through to fail at its first call."""
    from pathlib import Path

    root = Path(contract.__file__).resolve().parents[1]
    source = (root / "skillstats" / "_native.c").read_text()
    table = set(re.findall(r'\{"(\w+)", \w+, METH_', source))
    table |= set(re.findall(r'PyModule_AddObjectRef\(created, "(\w+)"', source))  # the types
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


# ---- the windows fold at the decode (WindowFold) --------------------------------------------------------------

FOLD_SKILLS = ["a", "b", "ab", "a" * 9, "sk_é", "sk_✓", "c" * 128]  # shared by records and events: summed together


@st.composite
def publisher_records(draw: st.DrawFn) -> tuple[bytes | None, bytes | None, int | None]:
    """A record as a publisher writes it (the C reader takes it, or, for a non-ASCII id, leaves it to Python), now
    and then with a space the reader passes over, an escape it leaves to Python, or a future it must refuse."""
    kind = draw(st.sampled_from(KINDS))
    delta = {"delta_all_time": 3, "delta_current": -1} if EFFECTS[kind].uses_delta else {}
    at = draw(st.integers(NOW - 3 * 86_400_000, NOW))
    event = make_event(draw(st.sampled_from(FOLD_SKILLS)), kind, at, now_ms=NOW, **delta)  # type: ignore[arg-type]
    value = event.encode()
    how = draw(st.integers(0, 5))
    if how == 0:
        value = value.replace(b",", b" ,", 1)
    elif how == 1:
        value = value.replace(b'"kind"', b'"\\u006bind"')
    stamp = NOW if how != 2 else at - MAX_FUTURE_SKEW_MS - 1  # 2: occurred too far after its Kafka timestamp
    return event.key, value, stamp


FOLD_PIECES = st.lists(
    st.one_of(
        st.tuples(
            st.just("records"),
            st.lists(publisher_records() | written_events().map(lambda r: (r[1], r[0], r[2])), max_size=15),
        ),
        st.tuples(
            st.just("events"),
            st.lists(
                st.builds(
                    StatEvent,
                    event_id=st.just("e"),
                    skill_id=st.sampled_from(FOLD_SKILLS).map(lambda s: "".join(s)),
                    kind=st.sampled_from(KINDS),
                    occurred_at=st.integers(NOW - 3 * 86_400_000, NOW),
                ),
                max_size=15,
            ),
        ),
    ),
    max_size=6,
)


@PROPERTY
@given(pieces=FOLD_PIECES)
def test_a_fold_of_records_and_events_is_the_fold_of_their_events(pieces: list[tuple[str, list[Any]]]) -> None:
    """WindowFold fed reads of records (add_records: no event built, the rest decoded and their events added, as
    sinks/pipeline.py does) and events (add_events) in any order: the Python fold's rows of all the valid events,
    their kinds counted, each read's pending exactly decode_valid's and its newest the latest it took."""
    assert native is not None
    fold = native.WindowFold(WINDOW_DELTAS)
    valid: list[StatEvent] = []
    for what, piece in pieces:
        if what == "events":
            fold.add_events(piece)
            valid += piece
            continue
        keys, values, stamps = ([record[i] for record in piece] for i in range(3))
        pending, newest = fold.add_records(keys, values, stamps)
        assert pending == native.decode_valid(keys, values, stamps)[1]
        events, _invalid = decode_many(keys, values, stamps)
        taken = [event for i, event in enumerate(events) if event is not None and i not in pending]
        assert newest == max((event.occurred_at for event in taken), default=None)
        rest, _invalid = contract.decode_pending(keys, values, stamps, pending)
        fold.add_events([event for event in rest if event is not None])
        valid += filter(None, events)
    assert fold.kinds() == dict(Counter(event.kind for event in valid))
    hourly, daily = windows.fold(valid)
    assert fold.rows(_hour, _day) == (windows.bucket_rows(hourly, _hour), windows.bucket_rows(daily, _day))


def test_a_fold_grows_past_its_first_table() -> None:
    """Many more (skill, hour)s than its first table holds, from the bytes and from events, the same skills in
    both: every one kept and summed."""
    assert native is not None
    events = [
        make_event(f"sk_{n % 3000}", "download", NOW - (n // 3000 % 2) * 3_600_000, now_ms=NOW) for n in range(12_000)
    ]
    fold = native.WindowFold(WINDOW_DELTAS)
    half = len(events) // 2
    assert fold.add_records([e.key for e in events[:half]], [e.encode() for e in events[:half]], [NOW] * half) == (
        [],
        max(e.occurred_at for e in events[:half]),
    )
    fold.add_events(events[half:])
    hourly, daily = windows.fold(events)
    rows = fold.rows(_hour, _day)
    assert rows == (windows.bucket_rows(hourly, _hour), windows.bucket_rows(daily, _day))
    assert len(rows[0]) == 6000 and {row[2] for row in rows[0]} == {2}  # one from each half


def test_a_fold_takes_nothing_after_its_rows_nor_from_inside_its_own_calls() -> None:
    """Its rows once (sorting them ends the table); an attribute read or a converter that calls back into the
    fold is refused rather than let it change the table it is walking; columns of different lengths refused."""
    assert native is not None
    fold = native.WindowFold(WINDOW_DELTAS)

    class CallingBack:
        skill_id = "s"
        occurred_at = NOW

        @property
        def kind(self) -> str:
            fold.add_events([StatEvent("e", "t", "download", NOW)])
            return "download"

    with pytest.raises(RuntimeError, match="in use"):
        fold.add_events([CallingBack()])
    with pytest.raises(RuntimeError, match="part-way"):  # the add that was called back into failed
        fold.add_events([])
    fold = native.WindowFold(WINDOW_DELTAS)
    with pytest.raises(ValueError):
        fold.add_records([b"s"], [], [NOW])  # refused before anything was added: the fold goes on
    fold.add_events([StatEvent("e", "s", "download", NOW)])

    def calling_back(start: int) -> str:
        fold.add_records([], [], [])
        return _hour(start)

    with pytest.raises(RuntimeError, match="in use"):
        fold.rows(calling_back, _day)
    with pytest.raises(RuntimeError, match="taken"):
        fold.rows(_hour, _day)
    with pytest.raises(RuntimeError, match="taken"):
        fold.add_events([])
    with pytest.raises(TypeError):
        native.WindowFold({"download": (1,)})
    # An add that fails part-way leaves part of itself in: the fold refuses to go on (fed again, it would count
    # the first part twice).
    huge = native.WindowFold({"download": (2**62, 0)})
    with pytest.raises(OverflowError):
        huge.add_events([StatEvent("e", "s", "download", NOW)] * 2)
    with pytest.raises(RuntimeError, match="part-way"):
        huge.add_events([])
    with pytest.raises(RuntimeError, match="part-way"):
        huge.rows(_hour, _day)
    with pytest.raises(RuntimeError, match="part-way"):
        huge.kinds()


def test_a_sink_with_a_fold_of_its_own_folds_its_events() -> None:
    """The fold at the decode is the windows sink's fold: a subclass that folds otherwise (a rebuild's keeps only
    the days it owns) gets none, so its own fold runs."""
    from sqlalchemy import create_engine

    class Halving(windows.WindowsSink):
        def fold(self, events: list[StatEvent]) -> windows.WindowRows:
            return super().fold(events[::2])

    engine = create_engine("sqlite://")
    assert windows.WindowsSink(engine, "g", "t").fold_at_decode() is not None
    assert Halving(engine, "g", "t").fold_at_decode() is None


def test_a_batch_decoded_into_the_fold_is_the_batch_decoded_into_events() -> None:
    """sinks/pipeline.py's decode_batch with the windows sink's fold and without: the same events (decoded on
    use), parcels and newest times, and the sink prepares the same rows and kinds from either."""
    from sqlalchemy import create_engine

    from skillstats.sinks.pipeline import ColumnRecord, decode_batch
    from skillstats.workload import generate

    records = [(r.key, r.value, NOW) for r in generate(3_000, now_ms=NOW, invalid_ratio=0.2, seed=5)]
    records += [(case.key, case.value, case.timestamp) for case in CORPUS]
    random.Random(4).shuffle(records)
    fetched = {
        p: [ColumnRecord(o, stamp, key, value, ()) for o, (key, value, stamp) in enumerate(records[p::3])]
        for p in range(3)
    }
    since = dict.fromkeys(fetched, 0)
    sink = windows.WindowsSink(create_engine("sqlite://"), "g", "t")  # folding only: never connected
    as_events = decode_batch(fetched, since)
    as_fold = decode_batch(fetched, since, fold=sink.fold_at_decode())
    assert as_events.folded is None and as_fold.folded is not None
    assert [list(part.events) for part in as_fold.parts] == [part.events for part in as_events.parts]
    assert as_fold.parcels == as_events.parcels
    assert (as_fold.newest_event_ms, as_fold.newest_record_ms) == (
        as_events.newest_event_ms,
        as_events.newest_record_ms,
    )
    with pytest.raises(ValueError, match="at the decode of"):  # the fold of all three for one entry: refused
        sink.prepare(as_fold.parts[:1], folded_at_decode=as_fold.folded)
    with_fold = sink.prepare(as_fold.parts, folded_at_decode=as_fold.folded)
    without = sink.prepare(as_events.parts)
    assert (with_fold.folded, with_fold.kinds) == (without.folded, without.kinds)
    assert as_fold.folded.handed() == len(records)
