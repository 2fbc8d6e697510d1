"""A request body -> the records to publish, or every reason it cannot be published (docs/contract.md, HTTP).

The verdict on each event is the consumers' own: `decode_many`, with the key the
record will carry (the UTF-8 skill id) and the timestamp it will carry (the
server's clock now, set as the record's CreateTime when it is produced). So an
event this accepts is valid for both groups, and one it refuses would have been
parked, for the reason it names. An NDJSON line is published as the bytes the
client sent (so a forward-compatible extra field survives); an element of a
JSON array as orjson re-encodes it, after the whole body was checked for
members named twice, which a parse would otherwise resolve silently.

All or nothing: a body with any invalid event publishes none, and the answer
lists each one. Partial acceptance would leave the client to work out which
lines went in, and a retry of the whole body to count the valid ones twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

import msgspec
import orjson

from skillstats.contract import Reason, decode_many, duplicate_member

NDJSON: Final = "application/x-ndjson"
JSON: Final = "application/json"
CONTENT_TYPES: Final = (NDJSON, JSON)


class _SkillOnly(msgspec.Struct):
    """Just the member the record's key is taken from; every other member is skipped here and checked later."""

    skill_id: str


_skill_of = msgspec.json.Decoder(_SkillOnly).decode


@dataclass(frozen=True, slots=True)
class Rejected:
    """One event that cannot be published: where it is in the body (NDJSON line, or array index), and why."""

    where: str  # "line" (1-based, NDJSON) or "index" (0-based, a JSON array)
    at: int
    reason: str
    message: str

    def to_json(self) -> dict[str, object]:
        return {self.where: self.at, "reason": self.reason, "message": self.message}


@dataclass
class Parsed:
    """What a body holds: the records to publish, or why not (`rejected`, or `problem` for the body as a whole)."""

    records: list[tuple[bytes, bytes]] = field(default_factory=list)  # (key, value)
    rejected: list[Rejected] = field(default_factory=list)
    problem: str | None = None  # not an event list at all (malformed JSON, a number, ...): 400
    too_many: int | None = None  # more events than allowed: 413

    @property
    def ok(self) -> bool:
        return self.problem is None and self.too_many is None and not self.rejected


def media_type(content_type: str | None) -> str | None:
    """The media type a Content-Type names if it is one this API takes (UTF-8 only), else None."""
    if not content_type:
        return None
    kind, _, parameters = content_type.partition(";")
    kind = kind.strip().lower()
    for parameter in parameters.split(";"):
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            return None
    return kind if kind in CONTENT_TYPES else None


def parse(body: bytes, kind: str, now_ms: int, max_events: int) -> Parsed:
    """The records of `body` (of media type `kind`) or every reason they cannot be published; never raises."""
    if kind == NDJSON:
        where, numbered = "line", _ndjson_lines(body)
    else:
        where = "index"
        found = _json_values(body)
        if isinstance(found, str):
            return Parsed(problem=found)
        numbered = found
    if not numbered:
        return Parsed(problem="no events in the body")
    if len(numbered) > max_events:
        return Parsed(too_many=len(numbered))
    keys: list[bytes | None] = []
    for _at, value in numbered:
        try:
            keys.append(_skill_of(value).skill_id.encode())
        except Exception:  # no usable skill_id, or not JSON at all: decode_many says which
            keys.append(None)
    values = [value for _at, value in numbered]
    _events, invalid = decode_many(keys, values, [now_ms] * len(values))
    parsed = Parsed()
    for index, why in invalid:
        parsed.rejected.append(Rejected(where, numbered[index][0], why.reason.value, why.message))
    if not invalid:
        parsed.records = [(key, value) for key, value in zip(keys, values, strict=True)]  # type: ignore[misc]
    return parsed


def _ndjson_lines(body: bytes) -> list[tuple[int, bytes]]:
    """(1-based line number, the line without its surrounding whitespace) of every non-blank line."""
    lines = []
    for number, line in enumerate(body.split(b"\n"), start=1):
        line = line.strip()
        if line:
            lines.append((number, line))
    return lines


def _json_values(body: bytes) -> list[tuple[int, bytes]] | str:
    """(0-based index, the event re-encoded) of a JSON object or array of them, or what is wrong with the body."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return f"{Reason.MALFORMED.value}: not UTF-8 JSON: {exc}"
    # What the parse resolved silently (the last of two same-named members won), refused for the whole body
    # as the consumers would refuse the event. Depth needs no check here: each element is judged re-encoded.
    name = duplicate_member(body, parsed)
    if name is not None:
        return f"{Reason.MALFORMED.value}: a JSON object has the member {name!r} more than once (RFC 7493)"
    items = parsed if isinstance(parsed, list) else [parsed] if isinstance(parsed, dict) else None
    if items is None:
        return "the body must be one event object or an array of them"
    return [(index, orjson.dumps(item)) for index, item in enumerate(items)]
