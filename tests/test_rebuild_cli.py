"""`skillstats rebuild` on the command line, with the generations' steps faked (unit): what it says when one of
several steps fails half-way; and which of a swap's problems make `rebuild status` say FAILING (SQLite only)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from skillstats.rebuild import generations
from skillstats.rebuild.state import Rebuild, RebuildRefused
from skillstats.sinks.db import open_engine
from skillstats.sinks.migrate import upgrade


def test_a_rollback_whose_swap_back_fails_says_the_previous_generation_is_building_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from skillstats.cli import main

    url = f"sqlite:///{tmp_path}/skillstats.db"
    upgrade(open_engine(url))
    made = Rebuild(
        7, "windows-rebuild-7", "events", None, None, {0: 5}, "building", datetime(2026, 1, 1), None, None, None, None
    )

    def swap(*_args: object) -> object:
        raise RebuildRefused("Kafka said no")

    monkeypatch.setattr(generations, "rollback", lambda *_a: generations.RollbackOutcome(made, 0))
    monkeypatch.setattr(generations, "swap", swap)
    monkeypatch.setenv("SKILLSTATS_DATABASE_URL", url)
    assert main(["rebuild", "rollback", "--confirm", "ROLLBACK"]) == 2
    said = capsys.readouterr()
    assert said.out == ""
    assert "the previous generation is rebuild 7 again, building (group windows-rebuild-7)" in said.err
    assert "`skillstats rebuild swap --confirm SWAP` finishes the rollback" in said.err
    assert said.err.rstrip().endswith("Kafka said no")


def test_whether_a_rebuild_is_failing_is_decided_where_each_problem_is_found_not_read_from_its_wording(
    tmp_path: Path,
) -> None:
    import json

    from sqlalchemy import insert

    from skillstats.cli.rebuild import _status_json
    from skillstats.config import Settings
    from skillstats.kafka import TopicMissing
    from skillstats.rebuild.generations import Problem, swap_problems, topic_replaced
    from skillstats.rebuild.report import Status
    from skillstats.sinks.identity import Owner
    from skillstats.sinks.schema import partition_fences, rejected_records

    engine = open_engine(f"sqlite:///{tmp_path}/skillstats.db")
    upgrade(engine)
    made = Rebuild(7, "rebuild-7", "events", "id-a", None, {0: 0}, "building", datetime(2026, 1, 1), *[None] * 4)
    live = Owner("windows", "live", "events", "id-a")
    now = datetime(2026, 1, 2)

    def fence(group: str, partition: int, offset: int) -> None:
        with engine.begin() as connection:
            connection.execute(
                insert(partition_fences).values(
                    group_id=group,
                    topic="events",
                    partition=partition,
                    next_offset=offset,
                    updated_at=now,
                )
            )

    fence("live", 0, 500)
    fence("live", 1, 10)
    fence("rebuild-7", 0, 100)
    # Waiting cures these: the rebuild's worker has not read partition 1 yet; then it has, 400 records behind.
    with engine.connect() as connection:
        unread, _gap = swap_problems(connection, made, live, max_gap=50)
    assert [(p.failing, "start its worker" in p) for p in unread] == [(False, True)], unread
    fence("rebuild-7", 1, 10)
    with engine.connect() as connection:
        behind, _gap = swap_problems(connection, made, live, max_gap=50)
    assert [(p.failing, "--max-gap" in p) for p in behind] == [(False, True)], behind
    assert not Status(made, None, False, problems=[*unread, *behind]).failing

    with engine.begin() as connection:
        lost = partition_fences.c.group_id == "rebuild-7"
        connection.execute(partition_fences.update().values(offsets_lost=3).where(lost))
        connection.execute(
            insert(rejected_records).values(
                group_id="rebuild-7", topic="events", partition=0, offset=7, rejected_at=now
            )
        )
    with engine.connect() as connection:
        cut, _gap = swap_problems(connection, made, Owner("windows", "live", "events", "id-b"), max_gap=1000)
    # Retention cut it, the database refused a record it read, the topic is another one: none cures itself.
    assert [p.failing for p in cut] == [True, True, True], cut
    assert ["retention deleted" in cut[0], "refused" in cut[1], "replaced" in cut[2]] == [True] * 3, cut

    class Ids:
        """What Kafka says of the topic now (TopicIds.get): an id, or TopicMissing."""

        def __init__(self, now: str | None) -> None:
            self.now = now

        def get(self, topic: str) -> str | None:
            if self.now is None:
                raise TopicMissing(settings, topic)
            return self.now

    settings = Settings()
    assert topic_replaced(settings, made, live, Ids("id-a")) is None  # type: ignore[arg-type]
    gone = topic_replaced(settings, made, live, Ids(None))  # type: ignore[arg-type]
    again = topic_replaced(settings, made, live, Ids("id-c"))  # type: ignore[arg-type]
    assert gone is not None and gone.failing and "does not exist any more" in gone, gone
    assert again is not None and again.failing and "created again" in again, again

    # What `rebuild status --json` says: the problems as plain text, and whether they are failing.
    for problems, failing in (([*unread, *behind], False), ([*behind, gone], True), (cut, True)):
        status = Status(made, None, False, problems=problems)
        said = json.loads(json.dumps(_status_json(status)))
        assert said["problems"] == [str(p) for p in problems] and said["failing"] is failing, said
        assert ("swap: FAILING" in status.render()) is failing

    # Wording no longer decides: a waiting problem that says "refused" is not failing, a failing one that says
    # none of the old words is.
    assert not Status(made, None, False, problems=[Problem("the broker refused a connection")]).failing
    assert Status(made, None, False, problems=[Problem("gone", failing=True)]).failing
