"""The event contract and the one kind→effect table (docs/contract.md).

Everything that reads or writes a stat event goes through this module: the
publisher validates with the same function the consumers decode with, so a
record that leaves a Python publisher can never be parked by a Python consumer.

Validity is a function of the record alone (key, value bytes, Kafka timestamp),
never of when or by whom it is read. That is why the future bound on
`occurred_at` is measured from the record's own Kafka timestamp and not from the
consumer's wall clock: the windows group reading a record seconds after it was
written and the docsync group reading it six hours later must reach the same
verdict, or one would count an event the other parks. A publisher checks against
its own clock (`make_event(now_ms=...)`), which is what the record's CreateTime
will be, so what a publisher accepts a consumer accepts too.

`decode` is total: whatever bytes arrive, it returns a `StatEvent` or an
`Invalid` with a reason, and never raises (MemoryError aside, which is about the
process and not the record). A consumer that raised on a record would crash, be
restarted, re-read the same record and crash again: one bad publisher would stop
the whole partition. Two parser limits make hostile input deterministic rather
than dependent on the Python stack depth at the call site: values nested deeper
than MAX_NESTING_DEPTH are `malformed`, and so is anything the JSON parser
refuses (invalid UTF-8, lone surrogates, NaN/Infinity, numbers beyond a double).

A JSON object that names a member twice is `malformed` too, at any depth. RFC
8259 leaves such a document's meaning to the parser (ours keep the last value,
others keep the first or refuse it), and I-JSON (RFC 7493) forbids it; accepting
it would let a publisher-side validator and the consumers count different kinds
or deltas from the same bytes.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Final

import msgspec
import orjson

# The C module (skillstats/_native.c): decode's first path, the folds and the windows rows. Without it (an install that
# could not build it, or SKILLSTATS_PURE_PYTHON=1 to measure what it gains or to rule it out) the Python paths
# alone run, with the same verdicts and the same counts.
native: Any
NATIVE_MISSING: str | None = None  # why it is not in use, for the workers' start-up WARNING
try:
    from skillstats import _native as native
except ImportError as exc:
    native = None
    NATIVE_MISSING = (
        f"skillstats._native is not built ({exc}): the Python paths run, the same counts at more CPU per "
        "event; install with gcc and the Python headers present (README)"
    )
# A module built from another source than the one beside it would judge by that other code: it is left unused. In
# a checkout that is one pulled without reinstalling; an installed package ships its source as package data
# (pyproject.toml), so a module left behind by another install, or copied in by hand, is caught there too.
_native_source = Path(native.__file__).with_name("_native.c") if native is not None else None
if _native_source is not None and _native_source.is_file():
    try:
        _source_sha256 = hashlib.sha256(_native_source.read_bytes()).hexdigest()
    except OSError as exc:  # there but unreadable (or gone mid-upgrade): it cannot vouch for the module
        NATIVE_MISSING = (
            f"cannot read {_native_source} ({exc}) to check skillstats._native against it: the Python paths run"
        )
    else:
        if _source_sha256 != getattr(native, "SOURCE_SHA256", None):
            NATIVE_MISSING = (
                f"skillstats._native at {native.__file__} was built from another source than {_native_source}: "
                "the Python paths run; reinstall skillstats (pip install -e . in a checkout) to rebuild it"
            )
    if NATIVE_MISSING is not None:
        native = None
# Where no source lies beside the module (a package built before it shipped its source, or one whose source was
# removed), one built from an older source may lack a function this code calls, and would fail where it is first
# called (docsync's import). It is left unused too.
_NATIVE_FUNCTIONS: Final = (
    "configure",
    "decode_valid",
    "window_rows",
    "WindowFold",
    "fold_skills",
    "fold_records",
    "take_run",
    "batch_columns",
)
_native_lacks = [name for name in _NATIVE_FUNCTIONS if not hasattr(native, name)] if native is not None else []
if _native_lacks:
    NATIVE_MISSING = (
        f"skillstats._native at {native.__file__} lacks {', '.join(_native_lacks)} (built from an older source): "
        "the Python paths run; reinstall to rebuild it"
    )
    native = None
if native is not None and os.environ.get("SKILLSTATS_PURE_PYTHON", "") not in ("", "0"):
    native = None
    NATIVE_MISSING = "SKILLSTATS_PURE_PYTHON is set: skillstats._native is left unused, the Python paths run"

WIRE_VERSION: Final = 1
MAX_VALUE_BYTES: Final = 64 * 1024
MAX_ID_CHARS: Final = 128
MAX_ABS_DELTA: Final = 10**9
EPOCH_2000_MS: Final = 946_684_800_000
MAX_FUTURE_SKEW_MS: Final = 10 * 60 * 1000
# 9999-12-31T23:59:59.999Z: the last millisecond a Python datetime (and so the
# sinks' DATE/TIMESTAMP columns) can hold. Without it a record with no Kafka
# timestamp, or a producer-set CreateTime far in the future, could carry an
# occurred_at the sink cannot turn into an hour bucket.
MAX_OCCURRED_AT_MS: Final = 253_402_300_799_999
# Deeper JSON is malformed. A real event is 2 levels deep; the limit is far above
# any forward-compatible extension and below orjson's own (1024), so this
# constant, not a library version or the caller's stack depth, draws the line.
MAX_NESTING_DEPTH: Final = 512
_SHOW_CHARS: Final = 60
MS_PER_HOUR: Final = 3_600_000
MS_PER_DAY: Final = 86_400_000


class Reason(StrEnum):
    """Why a record is invalid; the codes are part of the contract (DLQ headers, metrics)."""

    MALFORMED = "malformed"
    UNSUPPORTED_VERSION = "unsupported_version"
    BAD_FIELD = "bad_field"
    KEY_MISMATCH = "key_mismatch"
    UNKNOWN_KIND = "unknown_kind"
    BAD_TIMESTAMP = "bad_timestamp"
    BAD_DELTA = "bad_delta"


@dataclass(frozen=True, slots=True)
class Effect:
    """What one event of a kind adds to each counter.

    `uses_delta` kinds take the skill counters from the event's own `delta`
    instead of the constants here (only `install_clear`).
    """

    downloads: int = 0
    installs_all_time: int = 0
    installs_current: int = 0
    window_downloads: int = 0
    window_installs: int = 0
    uses_delta: bool = False

    @property
    def touches_skill(self) -> bool:
        return self.uses_delta or any((self.downloads, self.installs_all_time, self.installs_current))

    @property
    def touches_windows(self) -> bool:
        return bool(self.window_downloads or self.window_installs)


NO_EFFECT: Final = Effect()

# docs/contract.md, "What each kind does". The only place a kind's meaning is written down.
EFFECTS: Final[Mapping[str, Effect]] = {
    "download": Effect(downloads=1, window_downloads=1),
    "install_new": Effect(installs_all_time=1, installs_current=1, window_installs=1),
    "install_reactivate": Effect(installs_current=1),
    "install_deactivate": Effect(installs_current=-1),
    "install_clear": Effect(uses_delta=True),
    # Stars are counted synchronously by the registry and comments are retired;
    # the kinds stay valid so old publishers are not parked for sending them.
    "star": NO_EFFECT,
    "unstar": NO_EFFECT,
    "comment": NO_EFFECT,
    "uncomment": NO_EFFECT,
}
KINDS: Final = tuple(EFFECTS)
# The same table cut the two ways the sinks read it per event, so a hot loop does one
# dict lookup per event and no attribute reads; derived here, never written down twice.
# kind -> (downloads, installs) it adds to its hour and day; only the kinds that count there.
WINDOW_DELTAS: Final[Mapping[str, tuple[int, int]]] = {
    kind: (effect.window_downloads, effect.window_installs)
    for kind, effect in EFFECTS.items()
    if effect.touches_windows
}
# kind -> (downloads, installs_all_time, installs_current) it adds to its skill, for the
# kinds whose effect does not depend on the event (all but the `uses_delta` ones).
FIXED_SKILL_DELTAS: Final[Mapping[str, tuple[int, int, int]]] = {
    kind: (effect.downloads, effect.installs_all_time, effect.installs_current)
    for kind, effect in EFFECTS.items()
    if not effect.uses_delta
}


class StatEvent(msgspec.Struct, frozen=True, gc=False):
    """A valid stat event. `occurred_at` is integer milliseconds since the epoch (UTC).

    A msgspec Struct rather than a frozen dataclass: one is built per record, and a
    frozen dataclass's __init__ (object.__setattr__ per field) cost more than the
    JSON decode itself.
    """

    event_id: str
    skill_id: str
    kind: str
    occurred_at: int
    delta_all_time: int = 0
    delta_current: int = 0

    @property
    def effect(self) -> Effect:
        return EFFECTS[self.kind]

    def skill_deltas(self) -> tuple[int, int, int]:
        """(downloads, installs_all_time, installs_current) this event adds to its skill."""
        fixed = FIXED_SKILL_DELTAS.get(self.kind)
        return fixed if fixed is not None else (0, self.delta_all_time, self.delta_current)

    @property
    def key(self) -> bytes:
        return self.skill_id.encode()

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "v": WIRE_VERSION,
            "event_id": self.event_id,
            "skill_id": self.skill_id,
            "kind": self.kind,
            "occurred_at": self.occurred_at,
        }
        if EFFECTS[self.kind].uses_delta:
            body["delta"] = {"all_time": self.delta_all_time, "current": self.delta_current}
        return body

    def encode(self) -> bytes:
        return orjson.dumps(self.to_wire())


if native is not None:
    # The C reader builds StatEvents, names kinds with the table's own strings and judges by these limits.
    native.configure(
        StatEvent,
        {kind: effect.uses_delta for kind, effect in EFFECTS.items()},
        (
            WIRE_VERSION,
            MAX_VALUE_BYTES,
            MAX_ID_CHARS,
            MAX_ABS_DELTA,
            EPOCH_2000_MS,
            MAX_OCCURRED_AT_MS,
            MAX_FUTURE_SKEW_MS,
        ),
    )


@dataclass(frozen=True, slots=True)
class Invalid:
    reason: Reason
    message: str


class InvalidEvent(ValueError):
    """Raised by the builders below when asked to make an event the contract rejects."""

    def __init__(self, invalid: Invalid) -> None:
        super().__init__(f"{invalid.reason}: {invalid.message}")
        self.reason = invalid.reason
        self.message = invalid.message


def _is_int(value: object) -> bool:
    # bool is an int subclass in Python; JSON true must not pass as 1.
    return type(value) is int


def _show(value: object) -> str:
    """A short description of a decoded JSON value for an Invalid message; never raises.

    Messages end up in DLQ headers and logs, so they must stay small, and `repr`
    is not safe on hostile input: it recurses on nested arrays (RecursionError)
    and refuses ints of more than 4300 digits (ValueError).
    """
    try:
        if value is None or isinstance(value, bool):
            return "null" if value is None else str(value).lower()
        if isinstance(value, dict):
            return "an object"
        if isinstance(value, list):
            return "an array"
        if type(value) is int:
            return str(value) if -(10**18) < value < 10**18 else f"an integer of {value.bit_length()} bits"
        if isinstance(value, str):
            return repr(value) if len(value) <= _SHOW_CHARS else repr(value[:_SHOW_CHARS]) + "..."
        if isinstance(value, float):
            return repr(value)
        return f"a {type(value).__name__}"
    except Exception:
        return "an unprintable value"


def _check_id(name: str, value: object) -> Invalid | None:
    if type(value) is not str or not 1 <= len(value) <= MAX_ID_CHARS:
        return Invalid(Reason.BAD_FIELD, f"{name} must be a string of 1-{MAX_ID_CHARS} characters")
    if not value.isascii():
        # Only reachable from Python callers (JSON parsers refuse lone surrogates): an id
        # that has no UTF-8 form can be neither a record key nor encoded on the wire.
        try:
            value.encode()
        except UnicodeEncodeError:
            return Invalid(Reason.BAD_FIELD, f"{name} is not valid Unicode (it holds a lone surrogate)")
    return None


def _check_occurred_at(occurred_at: object, timestamp_ms: int | None) -> Invalid | None:
    if not _is_int(occurred_at):
        return Invalid(
            Reason.BAD_TIMESTAMP, f"occurred_at must be integer milliseconds since the epoch, got {_show(occurred_at)}"
        )
    assert isinstance(occurred_at, int)
    if occurred_at < EPOCH_2000_MS:
        return Invalid(Reason.BAD_TIMESTAMP, f"occurred_at {_show(occurred_at)} is before 2000-01-01T00:00Z")
    if occurred_at > MAX_OCCURRED_AT_MS:
        return Invalid(Reason.BAD_TIMESTAMP, f"occurred_at {_show(occurred_at)} is after 9999-12-31T23:59:59.999Z")
    if timestamp_ms is not None and timestamp_ms >= 0 and occurred_at > timestamp_ms + MAX_FUTURE_SKEW_MS:
        return Invalid(
            Reason.BAD_TIMESTAMP,
            f"occurred_at {occurred_at} is more than 10 minutes after the record's timestamp {timestamp_ms}",
        )
    return None


def from_mapping(
    body: object, timestamp_ms: int | None, key: bytes | None = None, check_key: bool = True
) -> StatEvent | Invalid:
    """Validate a decoded JSON value against the contract, checks in docs/contract.md's order.

    `timestamp_ms` is what `occurred_at` may not be more than 10 minutes after: the
    record's Kafka timestamp for a consumer, the publisher's clock for a publisher
    (it becomes the record's CreateTime). None or negative (Kafka's "no timestamp")
    skips that bound; the verdict is still a function of the arguments alone.
    Never raises, whatever `body` holds.
    """
    if not isinstance(body, dict):
        return Invalid(Reason.MALFORMED, "value is not a JSON object")
    version = body.get("v")
    if not (_is_int(version) and version == WIRE_VERSION):
        return Invalid(Reason.UNSUPPORTED_VERSION, f"v must be the integer {WIRE_VERSION}, got {_show(version)}")
    event_id = body.get("event_id")
    skill_id = body.get("skill_id")
    bad = _check_id("event_id", event_id) or _check_id("skill_id", skill_id)
    if bad:
        return bad
    assert isinstance(event_id, str) and isinstance(skill_id, str)
    if check_key and key != skill_id.encode():
        return Invalid(Reason.KEY_MISMATCH, "record key is not the UTF-8 skill_id")
    kind = body.get("kind")
    if type(kind) is not str or kind not in EFFECTS:
        return Invalid(Reason.UNKNOWN_KIND, f"kind {_show(kind)} is not one of {', '.join(KINDS)}")
    occurred_at = body.get("occurred_at")
    bad = _check_occurred_at(occurred_at, timestamp_ms)
    if bad:
        return bad
    assert isinstance(occurred_at, int)
    if not EFFECTS[kind].uses_delta:
        return StatEvent(event_id, skill_id, kind, occurred_at)
    delta = body.get("delta")
    if not isinstance(delta, dict):
        return Invalid(Reason.BAD_DELTA, "install_clear needs delta {all_time, current}")
    all_time, current = delta.get("all_time"), delta.get("current")
    for value in (all_time, current):
        if not _is_int(value) or abs(value) > MAX_ABS_DELTA:  # type: ignore[arg-type]
            return Invalid(Reason.BAD_DELTA, f"delta values must be integers with |x| <= {MAX_ABS_DELTA}")
    return StatEvent(event_id, skill_id, kind, occurred_at, all_time, current)  # type: ignore[arg-type]


# forbid_unknown_fields: msgspec skips an unknown field's value without checking it
# (invalid UTF-8, or a number like 1e400 that the reference parser refuses, pass
# unseen), so the fast path would call valid a record the reference calls
# malformed. Refusing unknown fields means the fast path only ever accepts a
# document every byte of which it has validated; a record that carries extra
# fields (forward-compatible, and rare) is judged by the reference path instead.
# It also caps what the fast path accepts at two levels of nesting.
#
# msgspec, like orjson, lets the last of duplicate members win, so the fast path
# counts quote characters to prove there are none. With unknown fields refused
# and every field typed, the text holds one string per member name plus the three
# string values: 8 strings (16 quotes) without `delta`, 11 (22 quotes) with a
# `delta` object. A repeated member adds at least one string, and an escaped quote
# inside a string adds a quote, so a count of exactly that many proves every
# member appears once; any other count (`"delta": null` included, 18) goes to the
# reference path, which decides.
_QUOTES_WITHOUT_DELTA: Final = 2 * (5 + 3)
_QUOTES_WITH_DELTA: Final = 2 * (5 + 3 + 3)


class _WireDelta(msgspec.Struct, forbid_unknown_fields=True):
    all_time: int
    current: int


class _Wire(msgspec.Struct, forbid_unknown_fields=True):
    v: int
    event_id: str
    skill_id: str
    kind: str
    occurred_at: int
    delta: _WireDelta | None = None


_wire_decoder = msgspec.json.Decoder(_Wire)


def decode(key: bytes | None, value: bytes | None, timestamp_ms: int | None) -> StatEvent | Invalid:
    """Decode one Kafka record into a valid event or the reason it is not; never raises.

    `timestamp_ms` is the record's Kafka timestamp (CreateTime or LogAppendTime) in
    milliseconds: `occurred_at` may be at most 10 minutes after it. None, or a
    negative value (Kafka's "not available"), skips that bound. Either way the
    verdict depends on the record alone, so every consumer group agrees on it.
    """
    events, invalid = decode_many((key,), (value,), (timestamp_ms,))
    return invalid[0][1] if invalid else events[0]  # type: ignore[return-value]


def decode_many(
    keys: Sequence[bytes | None], values: Sequence[bytes | None], timestamps: Sequence[int | None]
) -> tuple[list[StatEvent | None], list[tuple[int, Invalid]]]:
    """`decode` over columns of records: the events (None for an invalid record) and the invalid ones by index.

    One call per batch rather than per record, because at a hundred thousand
    records a second the call, its argument tuple and the global lookups are a
    sizeable share of a record's budget; the verdicts are `decode`'s (which is this
    on one record), so every caller gets the same contract.

    Three paths, one contract, each taking only what it can prove valid and
    handing the rest on: the C reader (skillstats/_native.c: a strict subset of
    JSON, the checks in C; almost every record a publisher sends), then a typed
    msgspec decode with the checks inlined (about 3x faster than a dict walk; it
    takes what the C reader leaves for being merely unusual, such as an escaped
    character or a non-ASCII id), then `decode_reference`, which alone says why a
    record is invalid and turns any failure of its own into `malformed`.
    tests/test_contract.py and tests/test_native.py check they agree, on
    hand-picked and generated records.
    """
    if not len(keys) == len(values) == len(timestamps):
        raise ValueError("keys, values and timestamps must be of one length")
    if native is None:
        return _decode_python(keys, values, timestamps)
    events, pending = native.decode_valid(keys, values, timestamps)
    if not pending:
        return events, []
    rest, invalid = decode_pending(keys, values, timestamps, pending)
    for index, event in zip(pending, rest, strict=True):
        events[index] = event
    return events, invalid


def decode_pending(
    keys: Sequence[bytes | None], values: Sequence[bytes | None], timestamps: Sequence[int | None], pending: list[int]
) -> tuple[list[StatEvent | None], list[tuple[int, Invalid]]]:
    """The records at `pending` (indexes into the columns) decoded by the Python paths: what the C reader left
    (`decode_valid`, or a fold that reads the records themselves), an event or None for each, in `pending`'s
    order, and the invalid ones by their index in the columns."""
    if not pending:
        return [], []
    rest, invalid = _decode_python(
        [keys[i] for i in pending], [values[i] for i in pending], [timestamps[i] for i in pending]
    )
    return rest, [(pending[at], why) for at, why in invalid]


def _decode_python(
    keys: Sequence[bytes | None], values: Sequence[bytes | None], timestamps: Sequence[int | None]
) -> tuple[list[StatEvent | None], list[tuple[int, Invalid]]]:
    """`decode_many` without the C reader: the msgspec fast path, then the reference."""
    events: list[StatEvent | None] = []
    invalid: list[tuple[int, Invalid]] = []
    append = events.append
    wire_decode = _wire_decoder.decode
    effects = EFFECTS
    for index, (key, value, timestamp_ms) in enumerate(zip(keys, values, timestamps, strict=True)):
        if value is not None and len(value) <= MAX_VALUE_BYTES:
            try:
                wire = wire_decode(value)
                skill_id, event_id, kind, at = wire.skill_id, wire.event_id, wire.kind, wire.occurred_at
                delta = wire.delta
                effect = effects.get(kind)
                if (
                    wire.v == WIRE_VERSION
                    and 0 < len(event_id) <= MAX_ID_CHARS
                    and 0 < len(skill_id) <= MAX_ID_CHARS
                    and effect is not None
                    and EPOCH_2000_MS <= at <= MAX_OCCURRED_AT_MS
                    and (timestamp_ms is None or timestamp_ms < 0 or at <= timestamp_ms + MAX_FUTURE_SKEW_MS)
                    and key == skill_id.encode()
                    and value.count(b'"') == (_QUOTES_WITHOUT_DELTA if delta is None else _QUOTES_WITH_DELTA)
                    # Bounds on delta whatever the kind: msgspec reads an integer literal of any length
                    # as an int, where the reference parser (orjson) reads one past 64 bits as a double
                    # and refuses one past a double. A download carrying `"all_time": 1` and 400 zeros
                    # was valid here and malformed there (tests/hostile_corpus.py); every number the
                    # fast path accepts must be one it has range-checked.
                    and (
                        delta is None or (abs(delta.all_time) <= MAX_ABS_DELTA and abs(delta.current) <= MAX_ABS_DELTA)
                    )
                ):
                    if not effect.uses_delta:
                        append(StatEvent(event_id, skill_id, kind, at))
                        continue
                    if delta is not None:
                        append(StatEvent(event_id, skill_id, kind, at, delta.all_time, delta.current))
                        continue
            except MemoryError:
                raise
            except Exception:
                pass  # DecodeError, ValidationError, RecursionError, anything: the reference path says why
        decoded = decode_reference(key, value, timestamp_ms)
        if isinstance(decoded, Invalid):
            invalid.append((index, decoded))
            append(None)
        else:
            append(decoded)
    return events, invalid


def decode_reference(key: bytes | None, value: bytes | None, timestamp_ms: int | None) -> StatEvent | Invalid:
    """The contract as a plain walk over the parsed JSON: slower, and the one that names reasons.

    Total like `decode`: an exception from anywhere below (a parser or library bug
    included) makes the record `malformed` with what happened as the message,
    because the alternative is a consumer crash-looping on it. MemoryError alone
    propagates: it says nothing about the record, and parking a good record for it
    would lose the record.
    """
    try:
        return _decode_reference(key, value, timestamp_ms)
    except MemoryError:
        raise
    except Exception as exc:
        return Invalid(Reason.MALFORMED, f"record could not be decoded: {_describe_exception(exc)}")


def _decode_reference(key: bytes | None, value: bytes | None, timestamp_ms: int | None) -> StatEvent | Invalid:
    if value is None or len(value) > MAX_VALUE_BYTES:
        return Invalid(Reason.MALFORMED, "value is empty" if value is None else "value is over 64 KiB")
    try:
        body = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        return Invalid(Reason.MALFORMED, f"not UTF-8 JSON: {exc}")
    if _nested_deeper_than(value, body, MAX_NESTING_DEPTH):
        return Invalid(Reason.MALFORMED, f"JSON is nested deeper than {MAX_NESTING_DEPTH} levels")
    name = duplicate_member(value, body)
    if name is not None:
        return Invalid(Reason.MALFORMED, f"a JSON object has the member {_show(name)} more than once (RFC 7493)")
    return from_mapping(body, timestamp_ms, key)


# For `duplicate_member`: skip text that is neither a brace nor a member name (string
# values included, so braces and quotes inside strings are skipped with them), then
# match a brace, a member name, or the end. Possessive, so no input backtracks; the
# end alternative stops a tail without braces from being rescanned at every offset.
_STRING = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
_BRACE_OR_NAME = re.compile(rb'(?:[^"{}]++|' + _STRING + rb"(?!\s*+:))*+(?:([{}])|(" + _STRING + rb")\s*+:|\Z)")


def duplicate_member(raw: bytes, parsed: object) -> str | None:
    """A member name that some object of the JSON text `raw` holds twice (the first found), or None.

    `raw` must be JSON the parser accepted, and `parsed` what it made of it. The
    parser kept one of any two same-named members and lost the other's strings
    (its name at least), so when `parsed` holds as many strings as `raw` has quote
    pairs, no member was lost and the text is not scanned. Otherwise (a
    duplicate, or a quote escaped inside a string) the text is scanned for member
    names per object: iteratively, so no depth can exhaust the stack. Arrays need
    no tracking: an object inside one opens and closes within it.
    """
    if b"{" not in raw or raw.count(b'"') == 2 * _strings_in(parsed):
        return None
    scopes: list[set[str]] = []
    for brace, quoted in _BRACE_OR_NAME.findall(raw):  # b"" for the group that did not match
        if brace == b"{":
            scopes.append(set())
        elif brace == b"}":
            scopes.pop()
        elif quoted:
            name = orjson.loads(quoted) if b"\\" in quoted else quoted[1:-1].decode()
            names = scopes[-1]
            if name in names:
                return name
            names.add(name)
    return None


def _strings_in(parsed: object) -> int:
    """How many strings a parsed JSON value holds, member names included; iterative."""
    count = 0
    stack = [parsed]
    while stack:
        node = stack.pop()
        if type(node) is dict:
            count += len(node)
            node = node.values()
        elif type(node) is not list:
            count += type(node) is str
            continue
        for child in node:
            if type(child) is str:
                count += 1
            elif type(child) is dict or type(child) is list:
                stack.append(child)
    return count


def _nested_deeper_than(raw: bytes, body: object, limit: int) -> bool:
    """Whether the parsed value nests arrays/objects more than `limit` deep (the top level is 1).

    The byte count is an upper bound on the depth (brackets inside strings count
    too) and costs two C-level scans, so ordinary records never walk the tree; the
    walk itself is iterative, so no depth can exhaust the Python stack.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    stack: list[tuple[object, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def _describe_exception(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:
        text = ""
    text = text if len(text) <= 200 else text[:200] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def make_event(
    skill_id: str,
    kind: str,
    occurred_at: int,
    *,
    event_id: str | None = None,
    delta_all_time: int | None = None,
    delta_current: int | None = None,
    now_ms: int | None = None,
) -> StatEvent:
    """Build a valid event for publishing, or raise InvalidEvent saying why it is not.

    `now_ms` (default: this process's clock) stands in for the record's Kafka
    timestamp, which the producer sets to its clock when it sends: an event this
    accepts stays valid when a consumer checks it against the record's CreateTime.
    """
    body: dict[str, Any] = {
        "v": WIRE_VERSION,
        "event_id": event_id or uuid.uuid4().hex,
        "skill_id": skill_id,
        "kind": kind,
        "occurred_at": occurred_at,
    }
    if delta_all_time is not None or delta_current is not None:
        body["delta"] = {"all_time": delta_all_time or 0, "current": delta_current or 0}
    result = from_mapping(body, now_ms if now_ms is not None else int(time.time() * 1000), check_key=False)
    if isinstance(result, Invalid):
        raise InvalidEvent(result)
    return result


def hour_start_ms(occurred_at: int) -> int:
    return occurred_at - occurred_at % MS_PER_HOUR


def day_start_ms(occurred_at: int) -> int:
    return occurred_at - occurred_at % MS_PER_DAY
