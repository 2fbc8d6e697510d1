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
- the mmap threshold at 1 MiB: a fetch's buffers get mappings of their own and are given back when freed;
  smaller blocks (lz4's 256 KiB scratch, one per record batch read) come from the heap and are reused there;
- the trim threshold at 32 MiB: fixing the first stops this one where it stands too (128 KiB at start), and a
  catching-up worker then gave the heap's top back and took it again every batch, for 0.2-0.3 CPU s per million
  events. At 32 MiB (glibc's own moving keeps it at twice the mmap threshold) that churn is gone, for up to 32 MiB
  kept at the heap's top.

What it costs (docs/performance.md, "glibc's thresholds fixed in the worker"): about 0.06 CPU s per million events
on a catch-up (4% on PostgreSQL), none the bench can see on a live stream; a fetch's pages are faulted in fresh each
time rather than reused. What it buys: over the soak's 10,000,000 events the RSS stayed within 0-5% of its level at
10% of the stream, and fell as the partitions ran out, where the defaults read +1% to +15%.

An operator's own setting wins: glibc reads `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_` and `GLIBC_TUNABLES`
at start, and when any of them names either threshold both are left as the operator set them. On a C library that
is not glibc (musl, macOS) nothing is done.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping
from enum import Enum

MMAP_THRESHOLD_BYTES = 1 << 20
TRIM_THRESHOLD_BYTES = 32 << 20
# mallopt's parameter numbers (<malloc.h>).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# What names either threshold: glibc's environment variables, and its tunables' names inside GLIBC_TUNABLES.
_OPERATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
_OPERATOR_TUNABLES = ("glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold")


class Thresholds(Enum):
    """What `fix_thresholds` did, for the worker's start-up line."""

    FIXED = "glibc's mmap threshold fixed at 1 MiB and its trim threshold at 32 MiB"
    OPERATOR = "glibc's thresholds left as the environment sets them"
    NOT_GLIBC = "the C library is not glibc: its allocator left as it is"
    REFUSED = "glibc refused a threshold: its allocator left as it is"


def fix_thresholds(environ: Mapping[str, str] = os.environ) -> Thresholds:
    """Fix glibc's mmap and trim thresholds for this process (see the module's docstring), unless `environ` sets
    either; call it once at start, before the worker's large buffers come and go."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if any(name in environ for name in _OPERATOR_VARIABLES) or any(name in tunables for name in _OPERATOR_TUNABLES):
        return Thresholds.OPERATOR
    libc = _glibc()
    if libc is None:
        return Thresholds.NOT_GLIBC
    # mallopt answers 0 for a value it does not take (an mmap threshold over 32 MiB); said, not raised, since the
    # worker counts the same either way. The mmap threshold goes first, so its refusal leaves glibc as it was.
    if not (
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    ):
        return Thresholds.REFUSED
    return Thresholds.FIXED


def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc (it has `gnu_get_libc_version` and `mallopt`), else None."""
    libc = ctypes.CDLL(None)  # the symbols the process has loaded, its C library's among them
    if not (hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt")):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc
