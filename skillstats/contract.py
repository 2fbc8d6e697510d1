"""The event contract (SPEC §2) and the one kind→effect table (SPEC §3).

Everything that reads or writes a stat event goes through this module: the
publisher validates with the same function the consumers decode with, so a
record that leaves a Python publisher can never be parked by a Python consumer.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final

import msgspec
import orjson

WIRE_VERSION: Final = 1
MAX_VALUE_BYTES: Final = 64 * 1024
MAX_ID_CHARS: Final = 128
MAX_ABS_DELTA: Final = 10**9
EPOCH_2000_MS: Final = 946_684_800_000
MAX_FUTURE_SKEW_MS: Final = 10 * 60 * 1000
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

# SPEC §3. The only place a kind's meaning is written down.
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
        effect = EFFECTS[self.kind]
        if effect.uses_delta:
            return (0, self.delta_all_time, self.delta_current)
        return (effect.downloads, effect.installs_all_time, effect.installs_current)

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


def _check_id(name: str, value: object) -> Invalid | None:
    if type(value) is not str or not 1 <= len(value) <= MAX_ID_CHARS:
        return Invalid(Reason.BAD_FIELD, f"{name} must be a string of 1-{MAX_ID_CHARS} characters")
    return None


def from_mapping(body: object, now_ms: int, key: bytes | None = None, check_key: bool = True) -> StatEvent | Invalid:
    """Validate a decoded JSON value against SPEC §2, checks in the SPEC's order."""
    if not isinstance(body, dict):
        return Invalid(Reason.MALFORMED, "value is not a JSON object")
    version = body.get("v")
    if not (_is_int(version) and version == WIRE_VERSION):
        return Invalid(Reason.UNSUPPORTED_VERSION, f"v must be the integer {WIRE_VERSION}, got {version!r}")
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
        return Invalid(Reason.UNKNOWN_KIND, f"kind {kind!r} is not one of {', '.join(KINDS)}")
    occurred_at = body.get("occurred_at")
    if not _is_int(occurred_at):
        return Invalid(Reason.BAD_TIMESTAMP, "occurred_at must be integer milliseconds since the epoch")
    assert isinstance(occurred_at, int)
    if occurred_at < EPOCH_2000_MS or occurred_at > now_ms + MAX_FUTURE_SKEW_MS:
        return Invalid(Reason.BAD_TIMESTAMP, f"occurred_at {occurred_at} is before 2000 or over 10 minutes ahead")
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


class _WireDelta(msgspec.Struct):
    all_time: int
    current: int


class _Wire(msgspec.Struct):
    v: int
    event_id: str
    skill_id: str
    kind: str
    occurred_at: int
    delta: _WireDelta | None = None


_wire_decoder = msgspec.json.Decoder(_Wire)


def decode(key: bytes | None, value: bytes | None, now_ms: int) -> StatEvent | Invalid:
    """Decode one Kafka record (key and value bytes) into a valid event or the reason it is not.

    Two paths, one contract: a typed msgspec decode with the checks inlined takes
    every record it can prove valid (almost all of them, about 3x faster than a
    dict walk); anything it cannot, it hands to `decode_reference`, which alone says
    why a record is invalid. tests/test_contract.py checks both agree.
    """
    if value is None or len(value) > MAX_VALUE_BYTES:
        return decode_reference(key, value, now_ms)
    try:
        wire = _wire_decoder.decode(value)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    else:
        skill_id, event_id, kind, at = wire.skill_id, wire.event_id, wire.kind, wire.occurred_at
        effect = EFFECTS.get(kind)
        if (
            wire.v == WIRE_VERSION
            and 0 < len(event_id) <= MAX_ID_CHARS
            and 0 < len(skill_id) <= MAX_ID_CHARS
            and effect is not None
            and EPOCH_2000_MS <= at <= now_ms + MAX_FUTURE_SKEW_MS
            and key == skill_id.encode()
        ):
            if not effect.uses_delta:
                return StatEvent(event_id, skill_id, kind, at)
            delta = wire.delta
            if delta is not None and abs(delta.all_time) <= MAX_ABS_DELTA and abs(delta.current) <= MAX_ABS_DELTA:
                return StatEvent(event_id, skill_id, kind, at, delta.all_time, delta.current)
    return decode_reference(key, value, now_ms)


def decode_reference(key: bytes | None, value: bytes | None, now_ms: int) -> StatEvent | Invalid:
    """The contract as a plain walk over the parsed JSON: slower, and the one that names reasons."""
    if value is None or len(value) > MAX_VALUE_BYTES:
        return Invalid(Reason.MALFORMED, "value is empty" if value is None else "value is over 64 KiB")
    try:
        body = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        return Invalid(Reason.MALFORMED, f"not UTF-8 JSON: {exc}")
    return from_mapping(body, now_ms, key)


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
    """Build a valid event for publishing, or raise InvalidEvent saying why it is not."""
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
