"""Bounded shutdown: SIGTERM gets the process out within a budget, or out loudly.

Kubernetes sends SIGKILL after the pod's grace period; a consumer that hangs in
its shutdown (a batch waiting on a database lock, a LeaveGroup to a broker that
is gone) would be killed without a word, and an operator could not tell a
clean stop from a lost one. So each long-running command, on its first
SIGTERM, starts a watchdog: the command finishes or abandons its in-flight
work within the budget (`--shutdown-budget`, SKILLSTATS_SHUTDOWN_BUDGET, 10 s
by default), commits what was applied, leaves its group and exits 0; if it is
still running when the budget is spent, the watchdog says so on stderr and
exits with status 3. Either way the counts are exact: the SQL fences say what
was applied, and whoever reads the partitions next starts from there.
"""

from __future__ import annotations

import os
import sys
import threading

EXIT_SHUTDOWN_OVERRUN = 3
DEFAULT_BUDGET_S = 10.0
# Of the budget, what is kept for committing and leaving the group after the
# in-flight batch has been given its time.
LEAVE_RESERVE_S = 3.0


class ShutdownWatchdog:
    """Exits the process (status 3, a message on stderr) if it is still running `budget` s after start()."""

    def __init__(self, command: str, budget: float, consequence: str = "") -> None:
        self.command = command
        self.budget = budget
        # What an unclean stop leaves, in the words of this command; the consumers' by default.
        self.consequence = consequence or (
            "Nothing is lost: the SQL fences hold what was applied, and the next owner of the partitions starts "
            "from them."
        )
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Idempotent: the budget counts from the first call (the first SIGTERM)."""
        with self._lock:
            if self._timer is None:
                self._timer = threading.Timer(self.budget, self._overrun)
                self._timer.daemon = True
                self._timer.start()

    def _overrun(self) -> None:
        print(
            f"skillstats {self.command}: shutdown took longer than its budget of {self.budget:g}s (a database or "
            f"broker not answering); exiting {EXIT_SHUTDOWN_OVERRUN} without a clean stop. {self.consequence}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_SHUTDOWN_OVERRUN)


def batch_budget(budget: float) -> float:
    """How long the in-flight batch may take at shutdown, leaving room to commit and leave (half, for small budgets)."""
    return max(budget / 2, budget - LEAVE_RESERVE_S)
