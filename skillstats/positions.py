"""Where a consumer group reads from, and whether it may write at all: the SQL fence and the recorded identity,
checked against the topic as Kafka describes it now (docs/contract.md, exactly once).

Both groups do the same before they read: claim their role (sinks/identity.py:
the group name, the topic name and the topic's Kafka id must be the database's),
then take each assigned partition's start from its fence (sinks/fences.py,
`begin_reading`), never from Kafka's committed offset. Kafka is asked for the
topic's id and its partitions' log start and end every time, because both
change under a running consumer: a topic recreated, retention moving the log
start past a fence.

The claim also reads the group's last Kafka commits: each carries the mark of
the database that counts the group (sinks/identity.py), and another database's
mark refuses the consumer, so two deployments with databases of their own
cannot split one group's partitions without a word.

What it costs: three admin requests and one short SQL transaction per
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
import time
from collections.abc import Iterable, Mapping

from confluent_kafka import KafkaException

from skillstats.config import FIRST_ANSWER_S, Settings
from skillstats.kafka import TOPIC_SETTLE_S, TopicIds, commit_metadata, partition_count, watermarks
from skillstats.metrics import records_lost
from skillstats.sinks.fences import PartitionFences, ReadStart, check_within_log
from skillstats.sinks.identity import (
    IdentityMismatch,
    Owner,
    another_database_message,
    claim,
    database_mark,
    other_databases,
    owner_of,
    topic_replaced_message,
)
from skillstats.sinks.upserts import now_utc_naive

log = logging.getLogger(__name__)

# How long partitions the metadata does not list, but the group has fences on or was assigned, are
# asked about again before they are taken to be gone (a fence there is then ahead of its log): a
# broker's metadata can trail a partition increase by a moment.
STALE_METADATA_S = 2 * TOPIC_SETTLE_S


class Positions:
    """One group's claim on its role, and the start of each partition it is assigned."""

    def __init__(self, settings: Settings, role: str, fences: PartitionFences, timeout: float = FIRST_ANSWER_S) -> None:
        self.settings = settings
        self.role = role
        self.fences = fences
        self.timeout = timeout
        self.topic_ids = TopicIds(settings, timeout)
        self.owner: Owner | None = None  # once claimed
        self.mark = ""  # once claimed: the metadata of this group's Kafka commits, this database's mark
        self._mark_check_skipped = False  # the last claim could not read the group's commits (said once)

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
        partitions = partition_count(self.settings, topic, self.timeout)
        topic_id = self.topic_ids.get(topic)
        wanted = Owner(self.role, self.fences.group_id, topic, topic_id)
        recorded = owner_of(self.fences.engine, self.role)
        recount = None
        if recorded is not None and recorded.group_id != wanted.group_id:
            recount = self._recount(recorded)
        owner = claim(self.fences.engine, wanted, now_utc_naive(), recount)
        mark = database_mark(self.fences.engine, self.role)
        self._check_group_database(partitions, mark)
        self.mark = mark
        self._set_owner(owner)
        return owner, topic_id

    def _check_group_database(self, partitions: int, mark: str) -> None:
        """IdentityMismatch when the group's Kafka commits say another database counts it.

        The SQL claim cannot see a second deployment with a database of its own and
        the same group name: Kafka would split the partitions between the two, and
        each database miss what the other reads. Every commit of ours carries this
        database's mark (`commit_metadata`); a worker that finds another mark on any
        partition refuses before it reads. A newcomer is refused at its first
        assignment; two that start at once both refuse at their next check, once
        each has committed. Commits without a mark (older versions, an admin tool)
        say nothing.

        The commits are read from the group's coordinator, which may be moving (its
        broker just died): then the check is said undone, once, and made again at the
        next claim (every 10 s in the windows worker, every drain in docsync), rather
        than stopping a consumer that needs no coordinator to count exactly (the
        fences are its position) on a guard against a misconfiguration. A newcomer
        cannot join a group whose coordinator is away either.
        """
        try:
            committed = commit_metadata(
                self.settings, self.fences.group_id, self.fences.topic, partitions, self.timeout
            )
        except (KafkaException, TimeoutError) as exc:
            if not self._mark_check_skipped:
                log.warning(
                    "could not read group %s's Kafka commits to check which database counts it (%s); checking "
                    "again at the next claim",
                    self.fences.group_id,
                    exc,
                )
            self._mark_check_skipped = True
            return
        if self._mark_check_skipped:
            log.info("group %s's Kafka commits read again: the database check is made", self.fences.group_id)
            self._mark_check_skipped = False
        theirs = other_databases(mark, committed)
        if theirs:
            raise IdentityMismatch(
                another_database_message(
                    self.fences.group_id, self.fences.topic, mark, theirs, self.settings.kafka_bootstrap
                )
            )

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
        logs = self.log_bounds(wanted)
        if owner.topic_id is None and topic_id is not None:
            # The id is about to be recorded as the one the counts belong to: every fence of the
            # group must fit this log first, not only those of the partitions assigned here.
            fences = self.fences.fences()
            logs = self.log_bounds((p for p, fence in fences.items() if fence > 0), logs)
            check_within_log(self.fences.group_id, self.fences.topic, fences, {p: end for p, (_s, end) in logs.items()})
        found = Owner(owner.role, owner.group_id, owner.topic, topic_id)
        starts = self.fences.begin_reading(
            {p: logs[p] for p in sorted(wanted & set(logs))}, now_utc_naive(), found if owner.topic_id is None else None
        )
        if owner.topic_id is None:
            self._set_owner(found)  # recorded with the fences that fit it
        self._report(starts)
        return starts

    def log_bounds(
        self, needed: Iterable[int], logs: Mapping[int, tuple[int, int]] | None = None
    ) -> dict[int, tuple[int, int]]:
        """(log start, log end) of every partition of the topic (`logs`, when already asked), asked again with
        fresh metadata, for up to STALE_METADATA_S, while a partition in `needed` is not among them.

        A partition missing from the metadata has no log end, so a fence on it looks
        ahead of its log (FenceAheadOfLog: exit 2, an operator's decision) and an
        assignment of it is dropped. Metadata that trails a partition increase must
        not do either: only partitions still missing after the wait are taken to be
        gone. What it costs: nothing while the metadata lists them; otherwise a
        metadata and watermark request every half second, for a few seconds at most.
        """
        wanted = set(needed)
        bounds = dict(logs) if logs is not None else watermarks(self.settings, self.fences.topic, self.timeout)
        deadline = time.monotonic() + min(self.timeout, STALE_METADATA_S)
        said = False
        while wanted - set(bounds) and time.monotonic() < deadline:
            if not said:
                log.warning(
                    "%s: the metadata lists no partition(s) %s, which group %s has fences on or was assigned; asking "
                    "again",
                    self.fences.topic,
                    sorted(wanted - set(bounds)),
                    self.fences.group_id,
                )
                said = True
            time.sleep(0.5)
            bounds = watermarks(self.settings, self.fences.topic, self.timeout)
        return bounds

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
