"""Hostile records: what a broken or malicious publisher could put on the events topic, each with its verdict.

Every case is a whole Kafka record (key, value bytes, Kafka timestamp) and the one verdict docs/contract.md
gives it: a reason code, or the event it decodes to. tests/test_hostile_input.py runs each through both
decode paths. Values are written token by token (`doc`), not serialized, because the point is bytes no
serializer would write: numbers past 64 bits or past a double, `-0`, `1.0` for an integer, invalid or
overlong UTF-8, NUL and BOM bytes, a member named twice, a key that is the skill id in another Unicode
normalisation form. Records that once split the two paths are in REGRESSIONS, with what went wrong.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass

from skillstats.contract import EPOCH_2000_MS, MAX_FUTURE_SKEW_MS, MAX_OCCURRED_AT_MS, Reason, StatEvent
from tests.test_contract import NOW

AT = NOW - 1000  # occurred_at of every event below unless a case says otherwise
DELTA = b'{"all_time":-2,"current":-1}'


@dataclass(frozen=True)
class Hostile:
    """One record and its verdict: a reason code, or the event both decoders must return."""

    name: str
    value: bytes | None
    expect: Reason | StatEvent
    key: bytes | None = b"sk_1"
    timestamp: int | None = NOW


def quoted(text: str) -> bytes:
    """A JSON string token holding `text` as raw UTF-8 (nothing escaped: pass bytes to `doc` for escapes)."""
    return b'"' + text.encode() + b'"'


def doc(*extra: tuple[str | bytes, bytes], **fields: bytes | None) -> bytes:
    """An event's value written by hand: the base event's members, each replaced by a raw token or
    dropped (None), `delta` added if given, then `extra` members (a str name is quoted as is, a bytes
    name is written as given, escapes and all)."""
    tokens: dict[str, bytes | None] = {
        "v": b"1",
        "event_id": b'"e1"',
        "skill_id": b'"sk_1"',
        "kind": b'"download"',
        "occurred_at": str(AT).encode(),
    }
    tokens.update(fields)
    members = [quoted(name) + b":" + token for name, token in tokens.items() if token is not None]
    members += [(quoted(name) if isinstance(name, str) else name) + b":" + token for name, token in extra]
    return b"{" + b",".join(members) + b"}"


def clear(delta: bytes | None = DELTA, **fields: bytes | None) -> bytes:
    """An install_clear value with `delta` written by hand (None: no delta member)."""
    return doc(kind=b'"install_clear"', delta=delta, **fields)


def event(
    kind: str = "download",
    *,
    event_id: str = "e1",
    skill_id: str = "sk_1",
    occurred_at: int = AT,
    delta: tuple[int, int] = (0, 0),
) -> StatEvent:
    """The event a valid case decodes to: the base event with what is given changed."""
    return StatEvent(event_id, skill_id, kind, occurred_at, delta[0], delta[1])


def _same_key(name: str, skill_id: str) -> Hostile:
    """A valid record whose key is its skill_id's UTF-8."""
    return Hostile(name, doc(skill_id=quoted(skill_id)), event(skill_id=skill_id), key=skill_id.encode())


# --- Numbers ------------------------------------------------------------------------------------------------------
# Each literal goes into every place a number can be: an integer field (v, occurred_at, an install_clear's
# delta), a delta that a download ignores (the fast path still parses it), and a field nobody reads.

# Not JSON numbers, or numbers a double cannot hold: malformed wherever they are.
MALFORMED_NUMBERS = {
    "1e400": b"1e400",
    "-1e400": b"-1e400",
    "10**400 integer literal": b"1" + b"0" * 400,
    "-10**400 integer literal": b"-1" + b"0" * 400,
    "10**309 integer literal": b"1" + b"0" * 309,
    "5000 nines": b"9" * 5000,
    "NaN": b"NaN",
    "Infinity": b"Infinity",
    "-Infinity": b"-Infinity",
    "nan": b"nan",
    "inf": b"inf",
    "leading zero": b"01",
    "plus sign": b"+1",
    "no integer part": b".5",
    "no fraction digits": b"1.",
    "no exponent digits": b"1e",
    "hex": b"0x10",
    "two minus signs": b"--1",
    "digit separator": b"1_000",
    "Arabic-Indic digit": "\u0661".encode(),
    "fullwidth digit": "\uff11".encode(),
}
# Well-formed JSON numbers that are not contract integers (a fraction or exponent, or an integer read as a
# double because it is past 64 bits) or are integers out of every field's range: wrong in an integer field,
# ignored elsewhere.
NOT_CONTRACT_INTEGERS = {
    "1.0": b"1.0",
    "1e0": b"1e0",
    "1E3": b"1E3",
    "-0.0": b"-0.0",
    "1e-400 (underflows to 0.0)": b"1e-400",
    "occurred_at with .0": str(AT).encode() + b".0",
    "occurred_at with an exponent": b"1.764460799e12",
    "2**63 - 1": str(2**63 - 1).encode(),
    "2**63": str(2**63).encode(),
    "2**64 - 1": str(2**64 - 1).encode(),
    "2**64 (read as a double)": str(2**64).encode(),
    "-2**63": str(-(2**63)).encode(),
    "-2**63 - 1 (read as a double)": str(-(2**63) - 1).encode(),
    "10**308 integer literal (read as a double)": b"1" + b"0" * 308,
    "10**30": b"1" + b"0" * 30,
}


def number_cases() -> Iterator[Hostile]:
    for label, literal in MALFORMED_NUMBERS.items():
        yield Hostile(f"v {label}", doc(v=literal), Reason.MALFORMED)
        yield Hostile(f"occurred_at {label}", doc(occurred_at=literal), Reason.MALFORMED)
        yield Hostile(
            f"install_clear delta.all_time {label}",
            clear(b'{"all_time":' + literal + b',"current":-1}'),
            Reason.MALFORMED,
        )
        yield Hostile(
            f"install_clear delta.current {label}",
            clear(b'{"all_time":-2,"current":' + literal + b"}"),
            Reason.MALFORMED,
        )
        yield Hostile(
            f"download delta.all_time {label}",
            doc(delta=b'{"all_time":' + literal + b',"current":0}'),
            Reason.MALFORMED,
        )
        yield Hostile(f"unknown field {label}", doc(("pad", literal)), Reason.MALFORMED)
    for label, literal in NOT_CONTRACT_INTEGERS.items():
        yield Hostile(f"v {label}", doc(v=literal), Reason.UNSUPPORTED_VERSION)
        yield Hostile(f"occurred_at {label}", doc(occurred_at=literal), Reason.BAD_TIMESTAMP)
        yield Hostile(
            f"install_clear delta.all_time {label}",
            clear(b'{"all_time":' + literal + b',"current":-1}'),
            Reason.BAD_DELTA,
        )
        yield Hostile(
            f"install_clear delta.current {label}",
            clear(b'{"all_time":-2,"current":' + literal + b"}"),
            Reason.BAD_DELTA,
        )
        yield Hostile(
            f"download delta.all_time {label}", doc(delta=b'{"all_time":' + literal + b',"current":0}'), event()
        )
        yield Hostile(f"unknown field {label}", doc(("pad", literal)), event())
    # -0 is the integer 0.
    yield Hostile("v -0", doc(v=b"-0"), Reason.UNSUPPORTED_VERSION)
    yield Hostile("occurred_at -0", doc(occurred_at=b"-0"), Reason.BAD_TIMESTAMP)
    yield Hostile("install_clear delta -0 and -0", clear(b'{"all_time":-0,"current":-0}'), event("install_clear"))
    yield Hostile("v 1 then spaces", doc(v=b"1 \t\r\n "), event())


# --- Member names twice (docs/contract.md: malformed, whichever value would win) ---------------------------------

DUPLICATE_CASES = [
    Hostile("two skill_id, the key names the first", doc(("skill_id", b'"sk_2"')), Reason.MALFORMED),
    Hostile("two skill_id, the key names the second", doc(("skill_id", b'"sk_2"')), Reason.MALFORMED, key=b"sk_2"),
    Hostile("two skill_id, the first name escaped", doc((b'"\\u0073kill_id"', b'"sk_2"')), Reason.MALFORMED),
    Hostile("two kind, the first unknown", doc(("kind", b'"download"'), kind=b'"downvote"'), Reason.MALFORMED),
    Hostile("two kind, install_clear then download", clear(DELTA)[:-1] + b',"kind":"download"}', Reason.MALFORMED),
    Hostile(
        "two kind, download then install_clear", doc(delta=DELTA)[:-1] + b',"kind":"install_clear"}', Reason.MALFORMED
    ),
    Hostile(
        "two occurred_at, the second after the bound",
        doc(("occurred_at", str(NOW + 3_600_000).encode())),
        Reason.MALFORMED,
    ),
    # Without delta a valid value has 16 quote characters and with one 22: three more `"v":1` make 22 with no delta.
    Hostile(
        "v four times (as many quotes as an event with delta)",
        doc(("v", b"1"), ("v", b"1"), ("v", b"1")),
        Reason.MALFORMED,
    ),
    Hostile("an escaped quote and a duplicate", doc(("v", b"1"), event_id=b'"e\\"1"'), Reason.MALFORMED),
    Hostile("delta twice on a download", doc(("delta", b"null"), delta=DELTA), Reason.MALFORMED),
    # Not duplicates: names compare as code points after unescaping, never after normalisation or case folding.
    Hostile("names that are NFC and NFD of one name", doc(("\u00e9", b"1"), ("e\u0301", b"2")), event()),
    Hostile("kind and a fullwidth-k kind", doc(("\uff4bind", b'"star"')), event()),
]

# --- UTF-8 ------------------------------------------------------------------------------------------------------

BAD_UTF8 = {
    "overlong NUL (C0 80)": b"\xc0\x80",
    "overlong 3-byte (E0 80 80)": b"\xe0\x80\x80",
    "overlong 4-byte (F0 80 80 80)": b"\xf0\x80\x80\x80",
    "high surrogate (ED A0 80)": b"\xed\xa0\x80",
    "low surrogate (ED BF BF)": b"\xed\xbf\xbf",
    "CESU-8 surrogate pair": b"\xed\xa0\xbd\xed\xb8\x80",
    "past U+10FFFF (F4 90 80 80)": b"\xf4\x90\x80\x80",
    "F5 lead byte": b"\xf5\x80\x80\x80",
    "5-byte form (F8)": b"\xf8\x88\x80\x80\x80",
    "FE": b"\xfe",
    "FF": b"\xff",
    "lone continuation byte": b"\x80",
    "truncated 3-byte sequence": b"\xe2\x82",
    "truncated 4-byte sequence": b"\xf0\x9f\x98",
    "Latin-1 e-acute": b"\xe9",
}


def utf8_cases() -> Iterator[Hostile]:
    for label, raw in BAD_UTF8.items():
        text = b'"sk_' + raw + b'"'
        yield Hostile(f"event_id {label}", doc(event_id=text), Reason.MALFORMED)
        # The key holds the same bytes: malformed comes first, it is never a key question.
        yield Hostile(f"skill_id {label}", doc(skill_id=text), Reason.MALFORMED, key=b"sk_" + raw)
        yield Hostile(f"kind {label}", doc(kind=b'"download' + raw + b'"'), Reason.MALFORMED)
        yield Hostile(f"member name {label}", doc((b'"pad' + raw + b'"', b"1")), Reason.MALFORMED)
        yield Hostile(f"unknown field value {label}", doc(("pad", text)), Reason.MALFORMED)
        yield Hostile(f"between members {label}", doc(v=b"1" + raw), Reason.MALFORMED)
        # The key is only compared: bytes that are not UTF-8 there are just another skill's key.
        yield Hostile(f"key {label}", doc(), Reason.KEY_MISMATCH, key=b"sk_1" + raw)
    # Legal UTF-8 that looks odd: noncharacters, the last code point, line separators, astral characters.
    for label, char in {
        "noncharacter U+FFFF": "\uffff",
        "noncharacter U+FDD0": "\ufdd0",
        "last code point U+10FFFF": "\U0010ffff",
        "line separator U+2028": "\u2028",
        "DEL": "\x7f",
        "emoji": "\U0001f600",
        "zero width joiner": "\u200d",
    }.items():
        yield _same_key(f"skill_id with {label}", "sk_" + char)


# --- NUL bytes and byte-order marks -------------------------------------------------------------------------------

BOM = b"\xef\xbb\xbf"
NUL_AND_BOM_CASES = [
    Hostile("raw NUL in skill_id", doc(skill_id=b'"sk_\x00"'), Reason.MALFORMED, key=b"sk_\x00"),
    Hostile("raw NUL in kind", doc(kind=b'"download\x00"'), Reason.MALFORMED),
    Hostile("raw NUL between members", doc(v=b"1\x00"), Reason.MALFORMED),
    Hostile("NUL before the document", b"\x00" + doc(), Reason.MALFORMED),
    Hostile("NUL after the document", doc() + b"\x00", Reason.MALFORMED),
    Hostile("only NUL bytes", b"\x00" * 1000, Reason.MALFORMED),
    Hostile(
        "escaped NUL in skill_id, key with a NUL",
        doc(skill_id=b'"sk_\\u0000"'),
        event(skill_id="sk_\x00"),
        key=b"sk_\x00",
    ),
    Hostile("escaped NUL in skill_id, key without it", doc(skill_id=b'"sk_\\u0000"'), Reason.KEY_MISMATCH, key=b"sk_"),
    Hostile("escaped NUL as the whole event_id", doc(event_id=b'"\\u0000"'), event(event_id="\x00")),
    Hostile("escaped NUL after the kind", doc(kind=b'"download\\u0000"'), Reason.UNKNOWN_KIND),
    Hostile("key with a trailing NUL", doc(), Reason.KEY_MISMATCH, key=b"sk_1\x00"),
    Hostile("BOM between members", doc(v=b"1" + BOM), Reason.MALFORMED),
    Hostile("BOM after the document", doc() + BOM, Reason.MALFORMED),
    Hostile("two BOMs before the document", BOM + BOM + doc(), Reason.MALFORMED),
    Hostile("UTF-16-BE with BOM", b"\xfe\xff" + doc().decode().encode("utf-16-be"), Reason.MALFORMED),
    Hostile("UTF-16-LE without BOM", doc().decode().encode("utf-16-le"), Reason.MALFORMED),
    Hostile("UTF-32 with BOM", doc().decode().encode("utf-32"), Reason.MALFORMED),
    Hostile("key with a BOM", doc(), Reason.KEY_MISMATCH, key=BOM + b"sk_1"),
    Hostile(
        "raw BOM starting skill_id, key likewise",
        doc(skill_id=b'"' + BOM + b'sk_1"'),
        event(skill_id="\ufeffsk_1"),
        key=BOM + b"sk_1",
    ),
    Hostile("escaped BOM starting skill_id, key without it", doc(skill_id=b'"\\ufeffsk_1"'), Reason.KEY_MISMATCH),
    Hostile("BOM before the kind", doc(kind=b'"' + BOM + b'download"'), Reason.UNKNOWN_KIND),
]

# --- Size -----------------------------------------------------------------------------------------------------------

MB = 1 << 20


def _padded_to(size: int) -> bytes:
    """A valid event whose value is exactly `size` bytes, padded by an unknown string field."""
    shortest = doc(("pad", b'""'))
    return doc(("pad", b'"' + b"x" * (size - len(shortest)) + b'"'))


SIZE_CASES = [
    Hostile("a 1 MB string", doc(("pad", quoted("x" * MB))), Reason.MALFORMED),
    Hostile("a 1 MB skill_id, key likewise", doc(skill_id=quoted("s" * MB)), Reason.MALFORMED, key=b"s" * MB),
    Hostile("a 1 MB key", doc(), Reason.KEY_MISMATCH, key=b"k" * MB),
    Hostile("1 MB of open brackets", b"[" * MB, Reason.MALFORMED),
    Hostile("value exactly 65,536 bytes", _padded_to(65_536), event()),
    Hostile("value 65,537 bytes", _padded_to(65_537), Reason.MALFORMED),
    Hostile("valid event in 65,000 bytes of whitespace", b" " * 32_000 + doc() + b"\n" * 33_000, event()),
    Hostile("event_id of 60,000 characters", doc(event_id=quoted("e" * 60_000)), Reason.BAD_FIELD),
    Hostile("kind of 60,000 characters", doc(kind=quoted("k" * 60_000)), Reason.UNKNOWN_KIND),
    Hostile("30,000 escaped backslashes", doc(("pad", b'"' + b"\\\\" * 30_000 + b'"')), event()),
    Hostile("20,000 escaped quotes", doc(("pad", b'"' + b'\\"' * 20_000 + b'"')), event()),
    Hostile("60,000 brackets inside a string", doc(("pad", b'"' + b"[{" * 30_000 + b'"')), event()),
    Hostile("5,000 members", doc(*((f"m{i}", b"0") for i in range(5_000))), event()),
    Hostile("20,000 empty arrays side by side", doc(("pad", b"[" + b",".join([b"[]"] * 20_000) + b"]")), event()),
]

# --- Nesting (test_contract.py covers deep objects and arrays in general; these are the places it does not) -------

NESTING_CASES = [
    Hostile(
        "arrays 600 deep in an install_clear's delta",
        clear(b'{"all_time":' + b"[" * 600 + b"]" * 600 + b',"current":0}'),
        Reason.MALFORMED,
    ),
    Hostile("objects 600 deep in a download's delta", doc(delta=b'{"a":' * 600 + b"0" + b"}" * 600), Reason.MALFORMED),
    Hostile(
        "arrays and objects alternating, 513 levels",
        doc(("pad", b'[{"a":' * 256 + b"0" + b"}]" * 256)),
        Reason.MALFORMED,
    ),
    Hostile("arrays and objects alternating, 512 levels", doc(("pad", b'[{"a":' * 255 + b"[]" + b"}]" * 255)), event()),
    Hostile("60,000 open arrays, never closed", doc(("pad", b"[" * 60_000)), Reason.MALFORMED),
    Hostile("12,000 open objects, never closed", b'{"a":' * 12_000, Reason.MALFORMED),
    Hostile("deep nesting in skill_id", doc(skill_id=b"[" * 1_000 + b"]" * 1_000), Reason.MALFORMED),
]

# --- Not an object ---------------------------------------------------------------------------------------------------

NOT_OBJECT_CASES = [
    Hostile(f"value {label}", raw, Reason.MALFORMED)
    for label, raw in {
        "null": b"null",
        "true": b"true",
        "a number": b"1764460799000",
        "an empty string": b'""',
        "an array holding the event": b"[" + doc() + b"]",
        "the event as a JSON string": b'"' + doc().replace(b'"', b'\\"') + b'"',
    }.items()
] + [
    Hostile("empty object", b"{}", Reason.UNSUPPORTED_VERSION),
    Hostile("only v", b'{"v":1}', Reason.BAD_FIELD),
    Hostile("empty key, empty skill_id", doc(skill_id=b'""'), Reason.BAD_FIELD, key=b""),
    Hostile("no key, no skill_id", doc(skill_id=None), Reason.BAD_FIELD, key=None),
    Hostile("empty key, valid skill_id", doc(), Reason.KEY_MISMATCH, key=b""),
]

# --- Every field, every wrong JSON type ------------------------------------------------------------------------------

WRONG_TYPES: dict[str, bytes | None] = {
    "missing": None,
    "null": b"null",
    "true": b"true",
    "false": b"false",
    "an array": b'["sk_1"]',
    "an empty array": b"[]",
    "an object": b'{"v":1}',
    "an empty object": b"{}",
    "integer 0": b"0",
    "integer 1": b"1",
    "float 1.5": b"1.5",
    "string '1'": b'"1"',
    "empty string": b'""',
    "string 'download'": b'"download"',
}
# What a value of the wrong type in each place makes of the record, and the types that are right there.
FIELD_REASONS: dict[str, tuple[Reason, set[str]]] = {
    "v": (Reason.UNSUPPORTED_VERSION, {"integer 1"}),
    "event_id": (Reason.BAD_FIELD, {"string '1'", "string 'download'"}),
    "skill_id": (Reason.BAD_FIELD, {"string '1'", "string 'download'"}),  # strings, but not the key: see below
    "kind": (Reason.UNKNOWN_KIND, {"string 'download'"}),
    "occurred_at": (Reason.BAD_TIMESTAMP, set()),
    "delta": (Reason.BAD_DELTA, set()),
    "delta.all_time": (Reason.BAD_DELTA, {"integer 0", "integer 1"}),
    "delta.current": (Reason.BAD_DELTA, {"integer 0", "integer 1"}),
}


def wrong_type_cases() -> Iterator[Hostile]:
    for field, (reason, right) in FIELD_REASONS.items():
        for label, token in WRONG_TYPES.items():
            if label in right:
                continue
            if field == "delta":
                value = clear(token)
            elif field.startswith("delta."):
                member = field.removeprefix("delta.").encode()
                other = b"current" if member == b"all_time" else b"all_time"
                inner = b'"' + other + b'":0' + (b"" if token is None else b',"' + member + b'":' + token)
                value = clear(b"{" + inner + b"}")
            else:
                value = doc(**{field: token})
            yield Hostile(f"{field} {label}", value, reason)
    # A download ignores its delta, whatever it holds.
    yield Hostile("download with delta an array", doc(delta=b'["sk_1"]'), event())
    yield Hostile(
        "download with delta members of the wrong types", doc(delta=b'{"all_time":"1","current":null}'), event()
    )
    yield Hostile("skill_id string '1' (keyed sk_1)", doc(skill_id=b'"1"'), Reason.KEY_MISMATCH)
    yield Hostile("skill_id 'download' (keyed sk_1)", doc(skill_id=b'"download"'), Reason.KEY_MISMATCH)


# --- The key and Unicode normalisation: keys compare byte for byte, never normalised ---------------------------------

E_NFC, E_NFD = "\u00e9", "e\u0301"


def _keyed(
    skill_id: str, key: str, expect: Reason | None = None, body: bytes | None = None
) -> tuple[bytes, Reason | StatEvent, bytes]:
    """A record keyed `key` whose skill_id is `skill_id` (raw UTF-8 unless `body` writes it); valid unless `expect`."""
    value = body if body is not None else doc(skill_id=quoted(skill_id))
    return value, expect or event(skill_id=skill_id), key.encode()


NORMALISATION = {
    "key NFC, skill_id NFD": _keyed(E_NFD, E_NFC, Reason.KEY_MISMATCH),
    "key NFD, skill_id NFC": _keyed(E_NFC, E_NFD, Reason.KEY_MISMATCH),
    "key and skill_id NFC": _keyed(E_NFC, E_NFC),
    "key and skill_id NFD (kept decomposed)": _keyed(E_NFD, E_NFD),
    "skill_id escaped \\u00e9, key NFC": _keyed(E_NFC, E_NFC, body=doc(skill_id=b'"\\u00e9"')),
    "skill_id escaped e\\u0301, key NFC": _keyed(E_NFD, E_NFC, Reason.KEY_MISMATCH, body=doc(skill_id=b'"e\\u0301"')),
    "skill_id ohm sign, key omega (NFC of it)": _keyed(
        "\u2126", unicodedata.normalize("NFC", "\u2126"), Reason.KEY_MISMATCH
    ),
    "skill_id angstrom sign, key A-ring": _keyed("\u212b", "\u00c5", Reason.KEY_MISMATCH),
    "skill_id Hangul syllable, key its jamo": _keyed(
        "\ud55c", unicodedata.normalize("NFD", "\ud55c"), Reason.KEY_MISMATCH
    ),
    "skill_id sk_1, key fullwidth (NFKC of it is sk_1)": _keyed(
        "sk_1", "\uff53\uff4b\uff3f\uff11", Reason.KEY_MISMATCH
    ),
    "skill_id fi ligature, key fi": _keyed("\ufb01", "fi", Reason.KEY_MISMATCH),
    "skill_id sk_1, key SK_1": _keyed("sk_1", "SK_1", Reason.KEY_MISMATCH),
    "skill_id with ZWJ, key without": _keyed("sk\u200d_1", "sk_1", Reason.KEY_MISMATCH),
}


def key_cases() -> Iterator[Hostile]:
    for label, (value, expect, key) in NORMALISATION.items():
        yield Hostile(label, value, expect, key=key)
    yield Hostile("key UTF-16 of skill_id", doc(), Reason.KEY_MISMATCH, key="sk_1".encode("utf-16-le"))
    emoji = "\U0001f600"
    yield Hostile(
        "key CESU-8 of an astral skill_id",
        doc(skill_id=quoted(emoji)),
        Reason.KEY_MISMATCH,
        key=b"\xed\xa0\xbd\xed\xb8\x80",
    )
    yield Hostile("kind fullwidth d", doc(kind=quoted("\uff44ownload")), Reason.UNKNOWN_KIND)
    yield Hostile("kind with a combining acute", doc(kind=quoted("download\u0301")), Reason.UNKNOWN_KIND)
    yield Hostile("kind with a dotless i", doc(kind=quoted("\u0131nstall_new")), Reason.UNKNOWN_KIND)
    # 128 characters are code points: a decomposed e-acute is two of them, an emoji one (however escaped).
    yield _same_key("skill_id 64 NFD e-acutes (128 characters)", E_NFD * 64)
    yield Hostile(
        "skill_id 65 NFD e-acutes (130 characters)",
        doc(skill_id=quoted(E_NFD * 65)),
        Reason.BAD_FIELD,
        key=(E_NFD * 65).encode(),
    )
    yield _same_key("skill_id 128 NFC e-acutes (256 bytes)", E_NFC * 128)
    pair = b"\\ud83d\\ude00"
    yield Hostile(
        "skill_id 128 escaped surrogate pairs",
        doc(skill_id=b'"' + pair * 128 + b'"'),
        event(skill_id=emoji * 128),
        key=(emoji * 128).encode(),
    )
    yield Hostile(
        "skill_id 129 escaped surrogate pairs",
        doc(skill_id=b'"' + pair * 129 + b'"'),
        Reason.BAD_FIELD,
        key=(emoji * 129).encode(),
    )


# --- The record timestamp: any int or none ----------------------------------------------------------------------------

TIMESTAMP_CASES = [
    Hostile(
        "no timestamp, occurred_at the last millisecond",
        doc(occurred_at=str(MAX_OCCURRED_AT_MS).encode()),
        event(occurred_at=MAX_OCCURRED_AT_MS),
        timestamp=None,
    ),
    Hostile(
        "timestamp -10**30 counts as none",
        doc(occurred_at=str(MAX_OCCURRED_AT_MS).encode()),
        event(occurred_at=MAX_OCCURRED_AT_MS),
        timestamp=-(10**30),
    ),
    Hostile(
        "timestamp 10**30",
        doc(occurred_at=str(MAX_OCCURRED_AT_MS).encode()),
        event(occurred_at=MAX_OCCURRED_AT_MS),
        timestamp=10**30,
    ),
    Hostile(
        "timestamp 10**30, occurred_at past year 9999",
        doc(occurred_at=str(MAX_OCCURRED_AT_MS + 1).encode()),
        Reason.BAD_TIMESTAMP,
        timestamp=10**30,
    ),
    Hostile(
        "timestamp 0 is a timestamp", doc(occurred_at=str(EPOCH_2000_MS).encode()), Reason.BAD_TIMESTAMP, timestamp=0
    ),
    Hostile(
        "occurred_at 2000-01-01, timestamp 10 minutes before",
        doc(occurred_at=str(EPOCH_2000_MS).encode()),
        event(occurred_at=EPOCH_2000_MS),
        timestamp=EPOCH_2000_MS - MAX_FUTURE_SKEW_MS,
    ),
    Hostile(
        "occurred_at 2000-01-01, timestamp 10 minutes and 1 ms before",
        doc(occurred_at=str(EPOCH_2000_MS).encode()),
        Reason.BAD_TIMESTAMP,
        timestamp=EPOCH_2000_MS - MAX_FUTURE_SKEW_MS - 1,
    ),
    Hostile("occurred_at -1", doc(occurred_at=b"-1"), Reason.BAD_TIMESTAMP, timestamp=None),
    Hostile(
        "occurred_at -2**63, no timestamp",
        doc(occurred_at=str(-(2**63)).encode()),
        Reason.BAD_TIMESTAMP,
        timestamp=None,
    ),
]

# --- Records that once split the two decode paths -----------------------------------------------------------------

REGRESSIONS = [
    # Found while writing these tests, probing msgspec against orjson on number literals (and found again by
    # test_numbers_in_every_numeric_field against the unfixed code). The fast path (msgspec) read `1` and 400
    # zeros in a download's delta as a Python int and, a download ignoring its delta, called the record valid;
    # the reference parser (orjson) refuses a number past a double, so it called it malformed. Fixed in
    # skillstats/contract.py: the fast path bounds delta whatever the kind. (number_cases has the same records
    # under other names; these keep the exact ones by name.)
    Hostile(
        "regression: download whose delta.all_time is 10**400 written as an integer",
        doc(delta=b'{"all_time":1' + b"0" * 400 + b',"current":0}'),
        Reason.MALFORMED,
    ),
    Hostile(
        "regression: download whose delta.current is -10**309 written as an integer",
        doc(delta=b'{"all_time":0,"current":-1' + b"0" * 309 + b"}"),
        Reason.MALFORMED,
    ),
    # Its harmless neighbour: an integer out of the delta bounds but within a double is ignored on a download.
    Hostile(
        "regression: download whose delta.all_time is 10**10",
        doc(delta=b'{"all_time":10000000000,"current":0}'),
        event(),
    ),
]

CORPUS: list[Hostile] = [
    *number_cases(),
    *DUPLICATE_CASES,
    *utf8_cases(),
    *NUL_AND_BOM_CASES,
    *SIZE_CASES,
    *NESTING_CASES,
    *NOT_OBJECT_CASES,
    *wrong_type_cases(),
    *key_cases(),
    *TIMESTAMP_CASES,
    *REGRESSIONS,
]
