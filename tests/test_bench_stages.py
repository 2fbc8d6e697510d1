"""bench/stages.py runs the sink's own functions: what it writes is what the model counts (no broker needed)."""

from __future__ import annotations

import time
from pathlib import Path

from skillstats_bench.stages import measure

from skillstats.config import Settings
from skillstats.workload import generate
from tests.helpers import actual_windows, expected_windows


def test_the_stages_write_what_the_model_counts(tmp_path: Path) -> None:
    now_ms = int(time.time() * 1000)
    records = list(generate(3000, now_ms=now_ms, skills=50, seed=61, invalid_ratio=0.02, days=3))
    url = f"sqlite:///{tmp_path}/stages.db"
    # Stamped when published, as the broker would: the contract's future-skew check needs the timestamp.
    spent = measure([(r.key, r.value, now_ms) for r in records], url, 700)
    assert set(spent) == {"decode", "fold", "sql"} and all(seconds >= 0 for seconds in spent.values())
    assert actual_windows(Settings(database_url=url)) == expected_windows(records)
