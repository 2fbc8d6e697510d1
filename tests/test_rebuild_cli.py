"""`skillstats rebuild` on the command line, with the generations' steps faked (unit): what it says when one of
several steps fails half-way."""

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
