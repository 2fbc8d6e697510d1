"""Synthetic registry traffic, for the demo, the tests and the benchmark.

Popularity is Zipf-skewed (a few skills get most downloads), the kind mix is
that of a real registry (mostly downloads), event times spread over days with
late and out-of-order arrivals, and a share of the records can be made invalid
in every way docs/contract.md, validity names, so consumers meet what production sends them.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass

import orjson

from skillstats.contract import EPOCH_2000_MS, MS_PER_DAY, MS_PER_HOUR, WIRE_VERSION

# (kind, weight): the mix the registry sees.
KIND_MIX: tuple[tuple[str, int], ...] = (
    ("download", 80),
    ("install_new", 8),
    ("install_reactivate", 3),
    ("install_deactivate", 4),
    ("install_clear", 1),
    ("star", 2),
    ("unstar", 1),
    ("comment", 1),
    ("uncomment", 1),
)


@dataclass(frozen=True, slots=True)
class Record:
    key: bytes | None
    value: bytes | None
    valid: bool


def skill_ids(count: int) -> list[str]:
    return [f"sk_{i:06d}" for i in range(count)]


# `publish --demo` publishes for these skills; `init --demo-registry` gives them rows in
# the registry's `skills` table (docsync updates only skills that exist there).
DEMO_SKILLS = 500
DEMO_OWNERS = 50


def demo_registry() -> dict[str, str]:
    """skill id -> owner id of the demo's skills: what `init --demo-registry` registers."""
    return {skill: f"user_{i % DEMO_OWNERS:03d}" for i, skill in enumerate(skill_ids(DEMO_SKILLS))}


def _zipf_cumulative(count: int, exponent: float) -> list[float]:
    return list(itertools.accumulate(1.0 / (rank**exponent) for rank in range(1, count + 1)))


def _boundary_times(now_ms: int) -> list[int]:
    """Instants a bucketing bug would get wrong: the last and first millisecond of days and hours."""
    today = now_ms - now_ms % MS_PER_DAY
    hour = now_ms - now_ms % MS_PER_HOUR
    times = []
    for start in (today, today - MS_PER_DAY, today - 3 * MS_PER_DAY, hour, hour - MS_PER_HOUR):
        times += [start - 1, start, start + 1]
    return [t for t in times if t <= now_ms]


def _invalid(rng: random.Random, skill: str, now_ms: int, serial: int) -> tuple[bytes | None, bytes | None]:
    """One invalid record, cycling through every reason code of docs/contract.md, validity."""
    key = skill.encode()
    good = {
        "v": WIRE_VERSION,
        "event_id": f"bad-{serial}",
        "skill_id": skill,
        "kind": "download",
        "occurred_at": now_ms - rng.randrange(MS_PER_DAY),
    }
    variant = serial % 15
    if variant == 0:
        return key, b"{not json"
    if variant == 1:
        return key, b"[1, 2, 3]"
    if variant == 2:
        return key, orjson.dumps({**good, "v": 2})
    if variant == 3:
        return key, orjson.dumps({**good, "skill_id": ""})
    if variant == 4:
        return key, orjson.dumps({**good, "event_id": "x" * 129})
    if variant == 5:
        return b"someone-else", orjson.dumps(good)
    if variant == 6:
        return key, orjson.dumps({**good, "kind": "downvote"})
    if variant == 7:
        return key, orjson.dumps({**good, "occurred_at": float(good["occurred_at"])})
    if variant == 8:
        return key, orjson.dumps({**good, "occurred_at": EPOCH_2000_MS - 1})
    if variant == 9:
        return key, orjson.dumps({**good, "occurred_at": now_ms + 3_600_000})
    if variant == 10:
        return key, orjson.dumps({**good, "kind": "install_clear", "delta": {"all_time": 1.5, "current": 0}})
    if variant == 11:
        return key, None
    if variant == 12:
        # Poison for a recursive decoder: 1,000 nested objects, then 2,000 nested arrays.
        return key, b'{"a":' * 1000 + b"1" + b"}" * 1000
    if variant == 13:
        return key, b'{"x":' + b"[" * 2000 + b"]" * 2000 + b"}"
    return key, b'{"v": 1, "event_id": "' + b"z" * 70_000 + b'"}'


def generate(
    count: int,
    *,
    now_ms: int,
    skills: int = 2000,
    seed: int = 7,
    invalid_ratio: float = 0.0,
    days: int = 10,
    late_ratio: float = 0.05,
    exponent: float = 1.1,
) -> Iterator[Record]:
    """`count` records: valid events over the last `days` days (a share of them late), and invalid ones."""
    rng = random.Random(seed)
    ids = skill_ids(skills)
    cumulative = _zipf_cumulative(skills, exponent)
    total_weight = cumulative[-1]
    kinds = [kind for kind, _ in KIND_MIX]
    kind_cumulative = list(itertools.accumulate(weight for _, weight in KIND_MIX))
    boundaries = _boundary_times(now_ms)
    horizon = days * MS_PER_DAY
    for serial in range(count):
        skill = ids[bisect.bisect_left(cumulative, rng.random() * total_weight)]
        if invalid_ratio and rng.random() < invalid_ratio:
            key, value = _invalid(rng, skill, now_ms, serial)
            yield Record(key, value, False)
            continue
        kind = kinds[bisect.bisect_left(kind_cumulative, rng.random() * kind_cumulative[-1])]
        roll = rng.random()
        if roll < 0.02:
            occurred_at = rng.choice(boundaries)
        elif roll < 0.02 + late_ratio:
            occurred_at = now_ms - rng.randrange(horizon)  # hours or days late
        else:
            occurred_at = now_ms - rng.randrange(15 * 60_000)  # the last quarter hour
        body: dict[str, object] = {
            "v": WIRE_VERSION,
            "event_id": f"ev-{seed}-{serial}",
            "skill_id": skill,
            "kind": kind,
            "occurred_at": occurred_at,
        }
        if kind == "install_clear":
            body["delta"] = {"all_time": -rng.randrange(0, 5), "current": -rng.randrange(0, 3)}
        yield Record(skill.encode(), orjson.dumps(body), True)
