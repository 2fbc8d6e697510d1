"""A rebuild as the database records it (skillstats_rebuilds), and the checks every command makes on it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import date, datetime

from sqlalchemy import Connection, Engine, select

from skillstats.sinks.db import connected
from skillstats.sinks.identity import WINDOWS, Owner, owner_of
from skillstats.sinks.rebuild import BUILDING, LIVE, OwnedDays, owned_days, starts_from_json
from skillstats.sinks.schema import rebuilds


class RebuildRefused(Exception):
    """A rebuild command cannot do what was asked: one message saying why and what to do; nothing changed."""


@dataclass(frozen=True, slots=True)
class Rebuild:
    id: int
    group_id: str
    topic: str
    topic_id: str | None
    owns_from: date | None
    starts: dict[int, int]
    state: str
    started_at: datetime
    swapped_at: datetime | None
    swap_fences: dict[int, int] | None
    note: str | None
    # JSON pairs (partition, offset) of the live group's refused records: those its swap made counted (a live or
    # previous rebuild: a rollback restores their rows), or, a rollback's while building, those its swap restores.
    unrejected: str | None

    def owned(self, connection: Connection | Engine) -> OwnedDays:
        return owned_days(connection, self.owns_from)


def _rebuild(row: object) -> Rebuild:
    m = row._mapping  # type: ignore[attr-defined]
    return Rebuild(
        m["id"],
        m["group_id"],
        m["topic"],
        m["topic_id"],
        m["owns_from"],
        starts_from_json(m["starts"]),
        m["state"],
        m["started_at"],
        m["swapped_at"],
        {int(p): int(o) for p, o in json.loads(m["swap_fences"]).items()} if m["swap_fences"] else None,
        m["note"],
        m["unrejected"],
    )


def latest(connection: Connection | Engine, state: str) -> Rebuild | None:
    """The newest rebuild in `state` (building: there is at most one)."""

    with connected(connection) as c:
        row = c.execute(select(rebuilds).where(rebuilds.c.state == state).order_by(rebuilds.c.id.desc())).first()
    return None if row is None else _rebuild(row)


def building(connection: Connection | Engine) -> Rebuild | None:
    return latest(connection, BUILDING)


def swapped_in(connection: Connection | Engine) -> Rebuild | None:
    return latest(connection, LIVE)


def all_rebuilds(engine: Engine) -> list[Rebuild]:
    with engine.connect() as connection:
        return [_rebuild(row) for row in connection.execute(select(rebuilds).order_by(rebuilds.c.id))]


def live_owner(connection: Connection | Engine, topic: str | None = None) -> Owner:
    """The windows group whose tables a rebuild recomputes (RebuildRefused when no group counts them yet)."""
    owner = owner_of(connection, WINDOWS)
    if owner is None:
        raise RebuildRefused(
            "no windows group counts into this database yet (`skillstats windows` has never run against it): there "
            "are no live tables to rebuild beside"
        )
    if topic is not None and owner.topic != topic:
        raise RebuildRefused(
            f"the live windows tables count topic {owner.topic!r}, and this rebuild read {topic!r}: it cannot "
            f"replace them; `skillstats rebuild drop` it"
        )
    return owner
