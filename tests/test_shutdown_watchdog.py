"""The shutdown watchdog and the batch's share of the budget (skillstats/shutdown.py), in a real process."""

from __future__ import annotations

import subprocess
import sys

from skillstats.shutdown import EXIT_SHUTDOWN_OVERRUN, LEAVE_RESERVE_S, batch_budget

HANGS = """
import threading
from skillstats.shutdown import ShutdownWatchdog
watchdog = ShutdownWatchdog("windows", 0.3)
watchdog.start()
watchdog.start()  # idempotent: one timer, counted from the first call
threading.Event().wait()  # a shutdown that never ends
"""

FINISHES = """
from skillstats.shutdown import ShutdownWatchdog
ShutdownWatchdog("docsync", 30).start()
print("clean")
"""


def test_a_hanging_shutdown_exits_3_with_a_message() -> None:
    result = subprocess.run([sys.executable, "-c", HANGS], capture_output=True, text=True, timeout=60)
    assert result.returncode == EXIT_SHUTDOWN_OVERRUN
    assert result.stderr.count("skillstats windows: shutdown took longer than its budget of 0.3s") == 1


def test_a_finished_shutdown_is_not_held_by_the_watchdog() -> None:
    result = subprocess.run([sys.executable, "-c", FINISHES], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout.strip(), result.stderr) == (0, "clean", "")


def test_the_batch_gets_the_budget_less_the_reserve_and_at_least_half() -> None:
    assert batch_budget(10) == 10 - LEAVE_RESERVE_S
    assert batch_budget(2) == 1
    assert 0 < batch_budget(0.5) < 0.5
