"""Where a consumer group reads from, and whether it may write at all: the SQL fence and the recorded identity,
checked against the topic as Kafka describes it now (docs/contract.md, exactly once).

Both groups do the same before they read: claim their role (sinks/identity.py:
the group name, the topic name and the topic's Kafka id must be the database's),
then take each assigned partition's start from its fence (sinks/fences.py,
`begin_reading`), never from Kafka's committed offset. Kafka is asked for the
topic's id and its partitions' log start and end every time, because both
change under a running consumer: a topic recreated, retention moving the log
start past a fence.

What it costs: two admin requests and one short SQL transaction per
assignment (the windows worker) or per drain (docsync), and the windows
worker asks for the topic id once more before each batch's transaction (see
streams/windows.py). What a fence below the log start loses is lost: retention
deleted those records before they were applied. It is said once at ERROR,
added to the fence row's `offsets_lost` and to
`skillstats_records_lost_to_retention_total`, and reading goes on from the log
start.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from skillstats.config import FIRST_ANSWER_S, Settings
from skillstats.kafka import TopicIds, partition_count, watermarks
from skillstats.metrics import records_lost
from skillstats.sinks.fences import PartitionFences, ReadStart, check_within_log
from skillstats.sinks.identity import IdentityMismatch, Owner, claim, owner_of, topic_replaced_message
from skillstats.sinks.upserts import now_utc_naive

log = logging.getLogger(__name__)


class Positions:
    """One group's claim on its role, and the start of each partition it is assigned."""

    def __init__(self, settings: Settings, role: str, fences: PartitionFences, timeout: float = FIRST_ANSWER_S) -> None:
        self.settings = settings
        self.role = role
        self.fences = fences
        self.timeout = timeout
        self.topic_ids = TopicIds(settings, timeout)
        self.owner: Owner | None = None  # once claimed

    def claim(self) -> Owner:
        """Claim the role for this group and topic (IdentityMismatch: another's; TopicMissing: no such topic).

        The owner returned carries the topic's id only once the database has it:
        recorded by `starts` the first time the fences are found to fit the log.
        """
        return self._claim()[0]

    def _claim(self) -> tuple[Owner, str | None]:
        """The claim, and the topic's id as Kafka said it for it (the claim may run in two threads at once)."""
        topic = self.fences.topic
        # The metadata first: a missing topic, an unreachable or refusing broker, each said as such.
        partition_count(self.settings, topic, self.timeout)
        topic_id = self.topic_ids.get(topic)
        wanted = Owner(self.role, self.fences.group_id, topic, topic_id)
        recorded = owner_of(self.fences.engine, self.role)
        recount = None
        if recorded is not None and recorded.group_id != wanted.group_id:
            recount = self._recount(recorded)
        owner = claim(self.fences.engine, wanted, now_utc_naive(), recount)
        self._set_owner(owner)
        return owner, topic_id

    def _set_owner(self, owner: Owner) -> None:
        self.owner = owner
        self.fences.owner = owner  # checked again inside every transaction that writes counts

    def verify_topic(self) -> None:
        """IdentityMismatch when the topic's id, asked now, is not the claimed one."""
        assert self.owner is not None, "claim() first"
        self.check_topic_id(self.topic_ids.get(self.owner.topic))

    def check_topic_id(self, now_id: str | None) -> None:
        """IdentityMismatch when `now_id` (None: the cluster keeps no ids) is not the claimed topic's id."""
        assert self.owner is not None, "claim() first"
        if self.owner.topic_id is not None and now_id is not None and now_id != self.owner.topic_id:
            raise IdentityMismatch(topic_replaced_message(self.owner, now_id))

    def starts(self, partitions: Iterable[int]) -> dict[int, ReadStart]:
        """Where to read each partition from (its fence; FenceAheadOfLog past the log end), the role claimed first
        (the database may have gone back to before the claim, or the topic been replaced).

        Partitions the topic does not have (a stale assignment) are left out.
        """
        wanted = set(partitions)
        owner, topic_id = self._claim()
        logs = {p: bounds for p, bounds in watermarks(self.settings, self.fences.topic, self.timeout).items()}
        if owner.topic_id is None and topic_id is not None:
            # The id is about to be recorded as the one the counts belong to: every fence of the
            # group must fit this log first, not only those of the partitions assigned here.
            check_within_log(
                self.fences.group_id, self.fences.topic, self.fences.fences(), {p: end for p, (_s, end) in logs.items()}
            )
        found = Owner(owner.role, owner.group_id, owner.topic, topic_id)
        starts = self.fences.begin_reading(
            {p: logs[p] for p in sorted(wanted & set(logs))}, now_utc_naive(), found if owner.topic_id is None else None
        )
        if owner.topic_id is None:
            self._set_owner(found)  # recorded with the fences that fit it
        self._report(starts)
        return starts

    def _report(self, starts: Mapping[int, ReadStart]) -> None:
        group, topic = self.fences.group_id, self.fences.topic
        for start in starts.values():
            if start.lost is not None:
                first, end = start.lost
                log.error(
                    "%s partition %d: offsets %d..%d (%d) were deleted by retention before group %s applied them; "
                    "they are lost for good (counted in skillstats_records_lost_to_retention_total and the fence "
                    "row's offsets_lost). Reading on from the log start, %d. Give the topic a longer retention "
                    "(README, 'Retention and skillstats prune').",
                    topic,
                    start.partition,
                    first,
                    end - 1,
                    end - first,
                    group,
                    end,
                )
                records_lost(group, topic, start.partition, end - first)
            elif start.created and start.offset > 0:
                log.warning(
                    "%s partition %d: group %s has no fence here yet; it starts at the log start, %d (the %d "
                    "offsets before it are gone and were never counted by this group)",
                    topic,
                    start.partition,
                    group,
                    start.offset,
                    start.offset,
                )

    def _recount(self, recorded: Owner) -> dict[int, int] | None:
        """Per partition, the records a new group would count again: the recorded group's, below its fences."""
        try:
            logs = watermarks(self.settings, recorded.topic, self.timeout)
        except Exception:  # only for the message; the refusal does not depend on it
            return None
        theirs = PartitionFences(self.fences.engine, recorded.group_id, recorded.topic).fences()
        return {p: max(0, min(fence, logs[p][1]) - logs[p][0]) for p, fence in theirs.items() if p in logs}
