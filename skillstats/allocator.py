"""The C allocator's settings for a long-running worker: glibc's thresholds fixed, so RSS follows what it holds.

Why. glibc's malloc gives a block of at least its mmap threshold (128 KiB at start) a mapping of its own and
unmaps it when freed, but raises the threshold to the size of each such block freed, up to 32 MiB. A catching-up
windows worker frees blocks of many MiB every fetch (aiokafka's answer, up to `--partition-fetch-mib` per
partition, read through asyncio's growing buffer and then copied out), so within seconds the threshold sits near
its top and every block under it is cut from the heap, where `free` keeps the pages of all but the topmost. When
the drain's shape changes (its partitions run out one by one) the blocks land in new places, and the RSS of some
drains stepped 10-35 MiB above their level and stayed there (+14% and +15% on the bench's soak; docs/performance.md,
"Memory after a long drain").

What. Both thresholds fixed at start, which also stops glibc moving them:
- the mmap threshold at 1 MiB: a fetch's buffers mostly get mappings of their own and are given back when freed
  (a block that fits in free heap space is still cut from it); smaller blocks (lz4's 256 KiB scratch, one per
  record batch read) come from the heap and are reused there;
- the trim threshold at 32 MiB: setting either threshold stops glibc moving both, so fixing the first alone leaves
  this one wherever it stood (128 KiB at start), and a catching-up worker then gave the heap's top back and took it
  again batch after batch: the bench read 0-0.2 CPU s per million events more than with it at 32 MiB. glibc's
  own rule keeps it at twice the mmap threshold; 32 MiB lets a batch's worth of the heap's top stay, per arena.

What it costs (docs/performance.md, "glibc's thresholds fixed in the worker"): about 0.06 CPU s per million events
on a catch-up (4% on PostgreSQL), none the bench can see on a live stream; a fetch's pages are faulted in fresh each
time rather than reused. What it buys: over the soak's 10,000,000 events the RSS stayed within 0-5% of its level at
10% of the stream, and fell as the partitions ran out, where the defaults read +1% to +15%.

An operator's own setting wins: glibc reads `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_` and `GLIBC_TUNABLES`
at start, and when any of them sets either threshold both are left as glibc took them, and the log line names the
setting. On a C library that is not glibc (musl, macOS), or with another allocator preloaded in front of glibc's
(jemalloc, mimalloc, tcmalloc through `LD_PRELOAD`), nothing is done.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from enum import Enum
from typing import NamedTuple

MMAP_THRESHOLD_BYTES = 1 << 20
TRIM_THRESHOLD_BYTES = 32 << 20
# mallopt's parameter numbers (<malloc.h>).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# What sets either threshold: glibc's environment variables, and its tunables' names inside GLIBC_TUNABLES.
_OPERATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_OPERATOR_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")


class Outcome(Enum):
    """What `fix_thresholds` did."""

    FIXED = "glibc's mmap threshold fixed at 1 MiB and its trim threshold at 32 MiB"
    OPERATOR = "glibc's thresholds left as the environment sets them"
    NOT_GLIBC = "the C library is not glibc: its allocator left as it is"
    ANOTHER_ALLOCATOR = "malloc is not glibc's (another allocator is preloaded): left as it is"
    REFUSED = "glibc refused a threshold: its allocator left as it is"


class Thresholds(NamedTuple):
    """What `fix_thresholds` did, and the operator's settings it left in place (as given), for the worker's log."""

    outcome: Outcome
    settings: tuple[str, ...] = ()

    def line(self) -> str:
        return self.outcome.value + (f" ({', '.join(self.settings)})" if self.settings else "")


def fix_thresholds(environ: Mapping[str, str] = os.environ) -> Thresholds:
    """Fix glibc's mmap and trim thresholds for this process (see the module's docstring), unless `environ` sets
    either; call it once at start, before the worker's large buffers come and go."""
    settings = operator_thresholds(environ)
    if settings:
        return Thresholds(Outcome.OPERATOR, settings)
    libc = _glibc()
    if libc is None:
        return Thresholds(Outcome.NOT_GLIBC)
    if not _glibc_allocates(libc):
        return Thresholds(Outcome.ANOTHER_ALLOCATOR)
    # glibc 2.36 takes any value for either (it answers 1); an answer of 0 would come from another glibc, said rather
    # than raised, since the worker counts the same either way. The mmap threshold goes first, so that its refusal
    # leaves glibc as it was.
    if not libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES):
        return Thresholds(Outcome.REFUSED)
    if not libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES):
        return Thresholds(Outcome.REFUSED)
    return Thresholds(Outcome.FIXED)


def operator_thresholds(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The settings in `environ` by which glibc takes either threshold from the operator, as given: its variables,
    and the tunables of those names in GLIBC_TUNABLES (`name=value` items, `:` between them; glibc skips any other)."""
    found = [f"{name}={environ[name]}" for name in _OPERATOR_VARIABLES if name in environ]
    for item in environ.get("GLIBC_TUNABLES", "").split(":"):
        name, is_set, _ = item.partition("=")
        if is_set and name in _OPERATOR_TUNABLES:
            found.append(f"GLIBC_TUNABLES {item}")
    return tuple(found)


def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc (it has `gnu_get_libc_version` and `mallopt`), else None."""
    try:
        libc = ctypes.CDLL(None)  # the symbols the process has loaded, its C library's among them
    except (OSError, TypeError):  # a Python that loads no libraries, or not a POSIX system
        return None
    if not (hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt")):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc


def _glibc_allocates(process: ctypes.CDLL) -> bool:
    """Whether the process's `malloc` and `mallopt` are glibc's own: a library preloaded in front of glibc (jemalloc,
    mimalloc, tcmalloc) answers for them first, and glibc's thresholds would then govern nothing."""
    try:
        own = ctypes.CDLL("libc.so.6")  # glibc's own library: its symbols, not the first the process finds
    except OSError:
        return False
    return all(
        ctypes.cast(getattr(process, name), ctypes.c_void_p).value
        == ctypes.cast(getattr(own, name), ctypes.c_void_p).value
        for name in ("malloc", "mallopt")
    )
