"""Starting a rebuild, swapping it in, rolling back, dropping: every change of generation, each one transaction.

Start. A rebuild owns the UTC days whose every event the retained log still
holds. An event counts in the day of its `occurred_at`, however late it comes,
but the contract refuses one more than 10 minutes ahead of its record's Kafka
timestamp; so every record below the first offset stamped at or after
`D - 10 min` (Kafka's ListOffsets by time: the earliest such offset, every
record below it stamped earlier) holds events of days before D only. Reading
from there, the rebuild sees every event of day D and after. `--from DAY`
asks for D; it is refused when retention has already deleted records at or
past that point (the first retained record is stamped after it: what was
deleted before it may hold events of D). `--from-start` takes the earliest D
the log supports: the day after its oldest retained record's stamp plus the
skew (every day, when nothing was ever deleted). What that rests on: records
deleted by retention are no newer than the oldest one kept (retention deletes
whole segments from the oldest), and records carry timestamps (a record
without one, Kafka's -1, escapes the skew bound; producers since Kafka 0.10
always stamp).

Swap. The live worker goes on untouched: the rebuild is brought to the live
group's fences instead of the other way round. Under the fence rows' locks
(the live worker's next transaction waits for them), the records between the
two groups' positions are read from the log and their counts, for the days the
rebuild owns, added to the shadow tables (records the live group counted that
the rebuild has not reached) or taken away (records the rebuild counted that
the live group has not reached); the carried-over days are copied from the
live tables; then the renames. The shadow tables then hold exactly what the
live ones would hold at the live fences, so whatever the live worker has in
flight applies on top of them as it would have on the old ones: nothing is
re-read, nothing counted twice or lost, and the DLQ marks and Kafka commits of
the live group mean what they meant. The bound on the gap (`--max-gap`
records over all partitions) bounds how long that read holds the locks.
(The issue asked for the live fences to take the rebuild's positions; that
moves the live group over records its DLQ never saw, and makes the carried
days wrong by whatever the gap holds for them. Bringing the rebuild to the
live positions needs neither.)

Rollback. The previous generation becomes a rebuild again, at the fences it
was swapped out at, and is swapped back as any rebuild is: at once when the
records since fit the gap, else after `skillstats windows --rebuild` has
brought it forward.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import date, datetime

from sqlalchemy import Connection, Engine, delete, func, select, text
from sqlalchemy.dialects import postgresql, sqlite

from skillstats.config import Settings
from skillstats.contract import MS_PER_DAY, StatEvent
from skillstats.kafka import PATIENCE, TopicIds, TopicMissing, watermarks
from skillstats.rebuild.log import FUTURE_SKEW_MS, first_timestamps, offsets_at, parked_sources, read_between
from skillstats.rebuild.state import Rebuild, RebuildRefused, building, live_owner, swapped_in
from skillstats.sinks.db import connected
from skillstats.sinks.fences import PartitionFences
from skillstats.sinks.identity import REBUILD, Owner, record
from skillstats.sinks.rebuild import (
    BUILDING,
    DROPPED,
    LIVE,
    PREVIOUS,
    PREVIOUS_STATE,
    SHADOW,
    OwnedDays,
    add_events,
    carry_over,
    copy_grants,
    create_shadow,
    day_number,
    day_of,
    drop_generation,
    existing,
    generation,
    lock_live_tables,
    rename_generation,
    set_state,
    skipped,
    starts_json,
)
from skillstats.sinks.schema import (
    consumers,
    dlq_replays,
    imported_days,
    legacy_manifest,
    partition_fences,
    rebuild_skips,
    rebuilds,
    rejected_records,
)
from skillstats.sinks.upserts import now_utc_naive

log = logging.getLogger(__name__)
SWAP_TOKEN = "SWAP"
ROLLBACK_TOKEN = "ROLLBACK"
DROP_TOKEN = "DROP"
# Default --max-gap: the most records, over all partitions, between the rebuild's and the live group's fences at
# which a swap goes ahead; the swap reads them from the log while it holds the fence rows (about a second here).
MAX_GAP = 200_000
# How long the swap waits for a lock (a reader of a live table, a worker's transaction) before trying again.
LOCK_WAIT_S = 10
# How long the swap's read of the gap may make no progress (Kafka gone) before it gives up: it holds the fence
# rows meanwhile, so the live worker's next transaction waits that long too.
SWAP_READ_STALL_S = 10.0
_read_under_locks = functools.partial(read_between, timeout=SWAP_READ_STALL_S)


@dataclass(frozen=True, slots=True)
class StartPlan:
    owns_from: date | None  # None: every day
    starts: dict[int, int]
    ends: dict[int, int]
    topic_id: str | None
    why: str
    skips: frozenset[tuple[int, int]] = frozenset()  # records the live group parked: counted nowhere

    @property
    def records(self) -> int:
        return sum(max(self.ends[p] - s, 0) for p, s in self.starts.items())


def plan_start(settings: Settings, topic: str, from_day: date | None) -> StartPlan:
    """Where a rebuild reads each partition from, and the first day it owns (RebuildRefused: the log cannot)."""
    logs = watermarks(settings, topic)
    ends = {p: end for p, (_low, end) in logs.items()}
    lows = {p: low for p, (low, _end) in logs.items()}
    topic_id = TopicIds(settings).get(topic)
    trimmed = {p: low for p, low in lows.items() if low > 0}
    firsts = first_timestamps(settings, topic, trimmed, ends)
    earliest: date | None = None  # the first day the log supports (None: every day)
    if trimmed:
        newest = max((stamp for stamp in firsts.values()), default=-1)
        if any(stamp < 0 for stamp in firsts.values()):
            raise RebuildRefused(
                f"topic {topic!r}: a first retained record carries no timestamp, so which days the deleted records "
                f"held cannot be bounded; no rebuild can be started on this log"
            )
        emptied = [p for p in trimmed if p not in firsts]  # trimmed to its end: the deleted records' age is unknown
        if emptied:
            raise RebuildRefused(
                f"topic {topic!r}: records were deleted from partition(s) {emptied} and none is left there (but DLQ "
                f"replay copies) to date what was deleted, so which days they held is unknown; wait for new records "
                f"on those partitions, then start"
            )
        earliest = day_of((newest + FUTURE_SKEW_MS) // MS_PER_DAY + 1)
    if from_day is None:
        owns_from = earliest
        why = (
            "every day (retention has deleted nothing)"
            if earliest is None
            else f"the days from {earliest.isoformat()} on: the oldest retained record is stamped "
            f"{_iso(max(firsts.values()))}, and events of earlier days may have been in records retention deleted"
        )
        starts = dict(lows)
        if owns_from is not None:
            starts = offsets_at(settings, topic, _ms(owns_from) - FUTURE_SKEW_MS, ends)
        return StartPlan(owns_from, starts, ends, topic_id, why)
    if earliest is not None and from_day < earliest:
        raise RebuildRefused(
            f"topic {topic!r} no longer holds every event of {from_day.isoformat()}: retention has deleted records "
            f"up to offsets {', '.join(f'{p}:{low}' for p, low in sorted(trimmed.items()))}, and the oldest "
            f"retained one is stamped {_iso(max(firsts.values()))}; the earliest day a rebuild can own is "
            f"{earliest.isoformat()} (--from {earliest.isoformat()}, or --from-start)"
        )
    starts = offsets_at(settings, topic, _ms(from_day) - FUTURE_SKEW_MS, ends)
    why = (
        f"the days from {from_day.isoformat()} on: every record below these offsets is stamped before "
        f"{_iso(_ms(from_day) - FUTURE_SKEW_MS)}, so holds no event of those days"
    )
    return StartPlan(from_day, starts, ends, topic_id, why)


def _ms(day: date) -> int:
    return day_number(day) * MS_PER_DAY


def _iso(ms: int) -> str:
    return datetime.utcfromtimestamp(ms / 1000).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def with_skips(engine: Engine, settings: Settings, plan: StartPlan) -> StartPlan:
    """`plan` with the records the live group has parked in the DLQ (read from it now), which the rebuild counts
    nowhere: the live group counted none of them, whatever today's contract says of them (a contract widened since
    would count an original the live group parked and whose copy a replay published, or will)."""
    from dataclasses import replace

    from skillstats.dlq import database_mark_of

    live = live_owner(engine, settings.topic)
    parked = parked_sources(settings, settings.topic, live.group_id, database_mark_of(engine))
    return replace(plan, skips=frozenset(parked))


def start(engine: Engine, settings: Settings, plan: StartPlan, now: datetime | None = None) -> Rebuild:
    """Record the rebuild (its group, fences, claim, the records it skips) and make its empty shadow tables, in one
    transaction."""
    now = now or now_utc_naive()
    with engine.begin() as connection:
        _write_lock(connection)
        live = live_owner(connection, settings.topic)
        if live.topic_id is not None and plan.topic_id is not None and live.topic_id != plan.topic_id:
            raise RebuildRefused(
                f"topic {settings.topic!r} has Kafka id {plan.topic_id}, and the live tables count id "
                f"{live.topic_id}: the topic was replaced, so its log cannot recompute them (`skillstats status`)"
            )
        _refuse_if_building(connection)
        refuse_unrecorded_imports(connection)
        if existing(connection, SHADOW):
            raise RebuildRefused(
                "shadow tables (skill_*_stats_rebuild) exist without a rebuild building into them (left by a "
                "rollback): `skillstats rebuild drop --confirm DROP` first"
            )
        group = f"{settings.windows_group}-rebuild-{now:%Y%m%d%H%M%S}"
        rebuild_id = _new_rebuild(connection, group, settings.topic, plan.topic_id, plan.owns_from, plan.starts, now)
        if plan.skips:
            connection.execute(
                rebuild_skips.insert(),
                [{"rebuild_id": rebuild_id, "partition": p, "offset": o} for p, o in sorted(plan.skips)],
            )
        create_shadow(connection)
        found = building(connection)
        assert found is not None and found.id == rebuild_id
        return found


def _new_rebuild(
    connection: Connection,
    group: str,
    topic: str,
    topic_id: str | None,
    owns_from: date | None,
    starts: Mapping[int, int],
    now: datetime,
    note: str | None = None,
    restores: str | None = None,
) -> int:
    """A building rebuild's row, its group's fences at `starts` and the rebuild role recorded as its; its id.
    `restores`: a rollback's, the live group's refused records its swap gives their rows back (JSON pairs)."""
    result = connection.execute(
        rebuilds.insert().values(
            group_id=group,
            topic=topic,
            topic_id=topic_id,
            owns_from=owns_from,
            starts=starts_json(starts),
            state=BUILDING,
            started_at=now,
            note=note,
            unrejected=restores,
        )
    )
    _begin_group(connection, group, topic, topic_id, starts, now)
    return int(result.inserted_primary_key[0])


def _begin_group(
    connection: Connection, group: str, topic: str, topic_id: str | None, starts: Mapping[int, int], now: datetime
) -> None:
    """A rebuild group's fences at `starts`, and the rebuild role recorded as its."""
    fences = PartitionFences(connection.engine, group, topic)
    fences.lock(connection, starts, now, create_at=starts)
    record(connection, Owner(REBUILD, group, topic, topic_id), now)


def refuse_unrecorded_imports(connection: Connection | Engine) -> None:
    """RebuildRefused when `legacy import` added windows counts whose days were never recorded (an import run before
    skillstats_imported_days existed): a rebuild would recompute those days without them."""
    with connected(connection) as c:
        imported = c.execute(
            select(legacy_manifest.c.legacy_id).where(legacy_manifest.c.target.in_(("windows", "history"))).limit(1)
        ).first()
        recorded = c.execute(select(imported_days.c.day).limit(1)).first()
    if imported is not None and recorded is None:
        raise RebuildRefused(
            "`skillstats legacy import` added counts to the windows tables here before the days it adds to were "
            "recorded (skillstats_imported_days is empty): a rebuild would recompute those days without them. "
            "Run the same `skillstats legacy import EXPORT --confirm IMPORT_LEGACY` again first: it applies "
            "nothing twice, and records the days"
        )


def _refuse_if_building(connection: Connection) -> None:
    current = building(connection)
    if current is not None:
        raise RebuildRefused(
            f"rebuild {current.id} (group {current.group_id}) is still building: swap it in or drop it first "
            f"(`skillstats rebuild status`)"
        )


def _write_lock(connection: Connection) -> None:
    """SQLite: take the write lock first (the fences' rule, sinks/db.py); PostgreSQL: bound the lock waits."""
    if connection.dialect.name == "sqlite":
        connection.execute(delete(rebuilds).where(rebuilds.c.id == -1))
    else:
        connection.execute(text(f"SET LOCAL lock_timeout = '{LOCK_WAIT_S}s'"))


@dataclass(slots=True)
class SwapOutcome:
    rebuild: Rebuild
    live_fences: dict[int, int]
    rebuild_fences: dict[int, int]
    added: int = 0  # events the live group had counted past the rebuild, added to the rebuilt tables
    taken: int = 0  # events the rebuild had counted past the live group, taken away
    carried: dict[str, int] = field(default_factory=dict)  # rows copied from the live tables, per table
    unrejected: int = 0  # records the live group's database had refused, counted by the rebuild
    owned: str = ""  # which days came from the rebuild (the rest carried over from the live tables)


@dataclass(frozen=True, slots=True)
class Gap:
    """Where the two groups stand, per partition: the live fence, the rebuild's."""

    live: dict[int, int]
    rebuild: dict[int, int]

    @property
    def records(self) -> int:
        return sum(abs(self.rebuild.get(p, 0) - f) for p, f in self.live.items())

    def spans(self) -> dict[int, tuple[int, int]]:
        return {p: tuple(sorted((f, self.rebuild[p]))) for p, f in self.live.items() if self.rebuild[p] != f}  # type: ignore[misc]


def fences_of(connection: Connection, group: str, topic: str) -> dict[int, int]:
    rows = connection.execute(
        select(partition_fences.c.partition, partition_fences.c.next_offset).where(
            partition_fences.c.group_id == group, partition_fences.c.topic == topic
        )
    )
    return {p: n for p, n in rows}


def lost_of(connection: Connection, group: str, topic: str) -> int:
    return int(
        connection.execute(
            select(func.coalesce(func.sum(partition_fences.c.offsets_lost), 0)).where(
                partition_fences.c.group_id == group, partition_fences.c.topic == topic
            )
        ).scalar_one()
    )


def rejected_of(connection: Connection, group: str, topic: str) -> set[tuple[int, int]]:
    rows = connection.execute(
        select(rejected_records.c.partition, rejected_records.c.offset).where(
            rejected_records.c.group_id == group, rejected_records.c.topic == topic
        )
    )
    return {(p, o) for p, o in rows}


def replayed_sources(connection: Connection, topic: str) -> set[tuple[int, int]]:
    rows = connection.execute(
        select(dlq_replays.c.source_partition, dlq_replays.c.source_offset).where(dlq_replays.c.source_topic == topic)
    )
    return {(p, o) for p, o in rows if p is not None}


class Problem(str):
    """Why a rebuild cannot be swapped in now, as the text said to the operator; `failing`: no waiting cures it
    (the rebuild must be dropped, and `rebuild status` exits 1). Decided where the problem is found, never read
    back out of its wording."""

    failing: bool

    def __new__(cls, text: str, *, failing: bool = False) -> Problem:
        problem = super().__new__(cls, text)
        problem.failing = failing
        return problem


def swap_problems(connection: Connection, rebuild: Rebuild, live: Owner, max_gap: int) -> tuple[list[Problem], Gap]:
    """Why the rebuild cannot be swapped in now (none: it can), and where the two groups stand."""
    problems: list[Problem] = []
    gap = Gap(fences_of(connection, live.group_id, live.topic), fences_of(connection, rebuild.group_id, rebuild.topic))
    unread = sorted(set(gap.rebuild) - set(gap.live))
    if unread:
        problems.append(Problem(f"the live group has no fence on partition(s) {unread} yet (it has not read them)"))
    missing = sorted(set(gap.live) - set(gap.rebuild))
    if missing:
        problems.append(Problem(f"the rebuild has no fence on partition(s) {missing}: start its worker"))
    lost = lost_of(connection, rebuild.group_id, rebuild.topic)
    if lost:
        problems.append(
            Problem(
                f"retention deleted {lost:,} record(s) before the rebuild read them: it cannot be exact; drop it "
                f"and start again from a later day",
                failing=True,
            )
        )
    refused = rejected_of(connection, rebuild.group_id, rebuild.topic)
    if refused:
        problems.append(
            Problem(
                f"the database refused {len(refused)} record(s) the rebuild read (skillstats_rejected_records, "
                f"group {rebuild.group_id}): it is not what the log says; drop it, fix the cause, start again",
                failing=True,
            )
        )
    if live.topic_id is not None and rebuild.topic_id is not None and live.topic_id != rebuild.topic_id:
        problems.append(
            Problem(f"the topic was replaced (id {rebuild.topic_id} then, {live.topic_id} now)", failing=True)
        )
    if not missing and not unread and gap.records > max_gap:
        problems.append(
            Problem(
                f"the rebuild is {gap.records:,} record(s) from the live group's fences, more than --max-gap "
                f"{max_gap:,}: let its worker catch up"
            )
        )
    return problems, gap


def topic_replaced(settings: Settings, rebuild: Rebuild, live: Owner, ids: TopicIds) -> Problem | None:
    """Why the topic in Kafka now is not the log both groups' fences were taken on (None: by its id, it is).

    The workers refuse a recreated topic themselves, but a swap or a diff made while both are stopped reads the
    records between the two groups' fences from the log: a topic deleted and created again under the same name
    would hand it another log's records at those offsets. KafkaUnreachable when Kafka does not answer."""
    try:
        current = ids.get(rebuild.topic)
    except TopicMissing:
        return Problem(
            f"topic {rebuild.topic!r} does not exist any more: nothing can be read between the fences", failing=True
        )
    recorded = {i for i in (rebuild.topic_id, live.topic_id) if i is not None}
    if current is None or recorded <= {current}:
        return None
    return Problem(
        f"topic {rebuild.topic!r} was deleted and created again (its Kafka id is {current} now, the fences were "
        f"taken on {', '.join(sorted(recorded))}): the records between the fences are gone; `skillstats rebuild "
        f"drop` the rebuild, and see `skillstats fences --help` for the live group",
        failing=True,
    )


def counted_apart(connection: Connection, rebuild: Rebuild, live: Owner) -> tuple[set[tuple[int, int]], ...]:
    """The records each group counts nowhere though their verdict may say valid: (the live group's, the rebuild's).

    The live group: the records its database refused and no replay added since, and those it parked (the rebuild
    start's DLQ read). The rebuild: those it skips (the same parked records) and any its own database refused."""
    skips = {(p, o) for p, offsets in skipped(connection, rebuild.id).items() for o in offsets}
    refused_live = rejected_of(connection, live.group_id, live.topic) - replayed_sources(connection, live.topic)
    return refused_live | skips, rejected_of(connection, rebuild.group_id, rebuild.topic) | skips


def gap_events(
    settings: Settings,
    rebuild: Rebuild,
    owned: OwnedDays,
    gap: Gap,
    apart: tuple[set[tuple[int, int]], ...],
    read: Callable[..., list],  # type: ignore[type-arg]
) -> tuple[list[StatEvent], list[StatEvent]]:
    """The events of the owned days between the two groups' fences, read from the log: (counted by the live group
    and not yet by the rebuild, counted by the rebuild and not yet by the live group)."""
    live_apart, rebuild_apart = apart
    ahead_live: list[StatEvent] = []
    ahead_rebuild: list[StatEvent] = []
    for found in read(settings, rebuild.topic, gap.spans()):
        if not owned.owns_ms(found.event.occurred_at):
            continue
        where = (found.partition, found.offset)
        if gap.rebuild[found.partition] <= found.offset < gap.live[found.partition]:
            if where not in live_apart:
                ahead_live.append(found.event)
        elif where not in rebuild_apart:
            ahead_rebuild.append(found.event)
    return ahead_live, ahead_rebuild


def swap(
    engine: Engine,
    settings: Settings,
    max_gap: int = MAX_GAP,
    read: Callable[..., list] = _read_under_locks,  # type: ignore[type-arg]
) -> SwapOutcome:
    """Swap the building rebuild in (RebuildRefused: it cannot be now; nothing changed).

    The topic's id is asked before any lock is taken (a Kafka that does not answer, or a topic created again, is
    refused without holding up the live worker) and again after the gap is read, inside the transaction: a topic
    replaced while it read rolls the swap back."""
    now = now_utc_naive()
    ids = TopicIds(settings)
    before = building(engine)
    if before is not None:
        replaced = topic_replaced(settings, before, live_owner(engine, before.topic), ids)
        if replaced:
            raise RebuildRefused(f"rebuild {before.id} cannot be swapped in: {replaced}")
    with engine.begin() as connection:
        _write_lock(connection)
        rebuild = building(connection)
        if rebuild is None:
            raise RebuildRefused("no rebuild is building: `skillstats rebuild start` first")
        if before is None or rebuild.id != before.id:
            raise RebuildRefused(f"rebuild {rebuild.id} was started while the swap began: run the swap again")
        if existing(connection, PREVIOUS):
            raise RebuildRefused(
                "a previous generation (skill_*_stats_previous) is still kept: `skillstats rebuild drop --previous "
                "--confirm DROP` it first (after which there is no rolling back to it)"
            )
        live = live_owner(connection, rebuild.topic)
        # The locks: every fence row of both groups (partition order, live first: the workers take only their own),
        # then the live tables against every other writer (PostgreSQL; SQLite's write lock is held already).
        for fences in (
            PartitionFences(engine, live.group_id, live.topic),
            PartitionFences(engine, rebuild.group_id, rebuild.topic),
        ):
            held = list(fences.fences())
            fences.lock(connection, held, now, create_none_of=held)
        lock_live_tables(connection)
        _restore_rejected(connection, rebuild, live, now)
        problems, gap = swap_problems(connection, rebuild, live, max_gap)
        if problems:
            raise RebuildRefused(f"rebuild {rebuild.id} cannot be swapped in now: " + "; ".join(problems))
        owned = rebuild.owned(connection)
        outcome = SwapOutcome(rebuild, dict(gap.live), dict(gap.rebuild), owned=owned.describe())
        apart = counted_apart(connection, rebuild, live)
        ahead_live, ahead_rebuild = gap_events(settings, rebuild, owned, gap, apart, read)
        add_events(connection, generation(SHADOW), ahead_live, 1, now)
        add_events(connection, generation(SHADOW), ahead_rebuild, -1, now)
        outcome.added, outcome.taken = len(ahead_live), len(ahead_rebuild)
        outcome.carried = carry_over(connection, owned)
        unrejected = _settle_rejected(connection, settings, rebuild, live, owned, gap, apart, read)
        outcome.unrejected = len(unrejected)
        # Everything the swap reads from the log is read: was it the log the fences were taken on? Asked with a
        # patience that fits SWAP_READ_STALL_S, since the fence rows are held meanwhile.
        replaced = topic_replaced(settings, rebuild, live, TopicIds(settings, SWAP_READ_STALL_S / PATIENCE))
        if replaced:
            raise RebuildRefused(f"rebuild {rebuild.id} cannot be swapped in: {replaced}")
        copy_grants(connection, None, SHADOW)
        rename_generation(connection, None, PREVIOUS)
        rename_generation(connection, SHADOW, None)
        connection.execute(rebuilds.update().where(rebuilds.c.state == LIVE).values(state=PREVIOUS_STATE))
        set_state(
            connection,
            rebuild.id,
            LIVE,
            swapped_at=now,
            swap_fences=starts_json(gap.live),
            unrejected=json.dumps(sorted(unrejected)),
        )
        _end_group(connection, rebuild)
        log.info("rebuild %d swapped in at the live fences %s", rebuild.id, gap.live)
        return outcome


def _restore_rejected(connection: Connection, rebuild: Rebuild, live: Owner, now: datetime) -> None:
    """A rollback's swap: the live group's refused records the generation it replaced had made counted get their
    skillstats_rejected_records rows back (the tables it puts back never counted them)."""
    restored = [tuple(pair) for pair in json.loads(rebuild.unrejected or "[]")]
    if not restored:
        return
    dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
    connection.execute(
        dialect.insert(rejected_records).on_conflict_do_nothing(),
        [
            {"group_id": live.group_id, "topic": live.topic, "partition": p, "offset": o, "rejected_at": now}
            for p, o in restored
        ],
    )


def _settle_rejected(
    connection: Connection,
    settings: Settings,
    rebuild: Rebuild,
    live: Owner,
    owned: OwnedDays,
    gap: Gap,
    apart: tuple[set[tuple[int, int]], ...],
    read: Callable[..., list],  # type: ignore[type-arg]
) -> list[tuple[int, int]]:
    """The live group's refused records the rebuilt tables now count (below both fences, of an owned day, neither
    skipped nor refused by the rebuild): their rows go (a `dlq replay` of one would count it twice; without the row
    it is refused as not proven skipped) and are returned, for a rollback to put back. Those of carried days stay."""
    refused = rejected_of(connection, live.group_id, live.topic) - replayed_sources(connection, live.topic)
    within = sorted(
        (p, o)
        for p, o in refused - apart[1]
        if rebuild.starts.get(p, 0) <= o < min(gap.live.get(p, 0), gap.rebuild.get(p, 0))
    )
    counted = [
        (found.partition, found.offset)
        for p, o in within  # rare: one read per record
        for found in read(settings, rebuild.topic, {p: (o, o + 1)})
        if owned.owns_ms(found.event.occurred_at)
    ]
    for p, o in counted:
        connection.execute(
            delete(rejected_records).where(
                rejected_records.c.group_id == live.group_id,
                rejected_records.c.topic == live.topic,
                rejected_records.c.partition == p,
                rejected_records.c.offset == o,
            )
        )
    return counted


def _end_group(connection: Connection, rebuild: Rebuild) -> None:
    """The rebuild's group is done: its fences and its claim go (its worker stops at its next transaction)."""
    connection.execute(
        delete(partition_fences).where(
            partition_fences.c.group_id == rebuild.group_id, partition_fences.c.topic == rebuild.topic
        )
    )
    connection.execute(delete(consumers).where(consumers.c.role == REBUILD, consumers.c.group_id == rebuild.group_id))


@dataclass(slots=True)
class RollbackOutcome:
    rebuild: Rebuild  # the rebuild the previous generation became
    behind: int  # records between the fences it was swapped out at and the live fences now


def rollback(engine: Engine, settings: Settings) -> RollbackOutcome:
    """Make the previous generation a rebuild again, at the fences it was swapped out at (then `swap` it back).

    The live group's refused records the swap had made counted get their rows back when it is swapped back in
    (the previous generation never counted them; until then the live tables do). Refused when the log no longer
    holds a record since those fences (nothing changed)."""
    now = now_utc_naive()
    current = swapped_in(engine)
    if current is None or current.swap_fences is None:
        raise RebuildRefused("there is no previous generation to roll back to (none was swapped out)")
    logs = watermarks(settings, current.topic)
    cut = {p: (o, logs[p][0]) for p, o in current.swap_fences.items() if p in logs and logs[p][0] > o}
    if cut:
        raise RebuildRefused(
            "the log no longer holds every record since the previous generation was swapped out (partition: its "
            "fence then, the log start now: "
            + ", ".join(f"{p}: {o} < {start}" for p, (o, start) in sorted(cut.items()))
            + "): it cannot be brought to the live fences; nothing changed"
        )
    with engine.begin() as connection:
        _write_lock(connection)
        current = swapped_in(connection)
        if current is None or current.swap_fences is None or not existing(connection, PREVIOUS):
            raise RebuildRefused(
                "there is no previous generation to roll back to (none was swapped out, or it was dropped)"
            )
        _refuse_if_building(connection)
        if existing(connection, SHADOW):
            raise RebuildRefused("shadow tables exist: `skillstats rebuild drop --confirm DROP` them first")
        live = live_owner(connection, current.topic)
        rename_generation(connection, PREVIOUS, SHADOW)
        group = f"{settings.windows_group}-rollback-{now:%Y%m%d%H%M%S}"
        note = f"the generation rebuild {current.id} replaced, rolled back"
        # The refused records' rows come back with the swap that puts the old tables back, not before: until then
        # the live tables count those records, and a row would let a DLQ replay count them again.
        rebuild_id = _new_rebuild(
            connection,
            group,
            current.topic,
            live.topic_id,
            current.owns_from,
            current.swap_fences,
            now,
            note,
            restores=current.unrejected,
        )
        set_state(connection, current.id, PREVIOUS_STATE)
        live_now = fences_of(connection, live.group_id, live.topic)
        behind = sum(max(live_now.get(p, 0) - o, 0) for p, o in current.swap_fences.items())
        found = building(connection)
        assert found is not None and found.id == rebuild_id
    return RollbackOutcome(found, behind)


def drop(engine: Engine, previous: bool) -> str:
    """Discard the building rebuild (its tables, fences and claim), or the previous generation; what was done."""
    with engine.begin() as connection:
        _write_lock(connection)
        if previous:
            if not existing(connection, PREVIOUS):
                raise RebuildRefused("there is no previous generation to drop")
            drop_generation(connection, PREVIOUS)
            return "dropped the previous generation (skill_*_stats_previous): there is no rolling back to it now"
        current = building(connection)
        if current is None and not existing(connection, SHADOW):
            raise RebuildRefused("no rebuild is building and no shadow tables exist: nothing to drop")
        drop_generation(connection, SHADOW)
        if current is None:
            return "dropped shadow tables no rebuild was building into"
        _end_group(connection, current)
        set_state(connection, current.id, DROPPED)
        return f"dropped rebuild {current.id} (group {current.group_id}): its tables, fences and claim"
