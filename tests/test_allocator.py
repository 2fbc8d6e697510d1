"""The allocator setting the README offers operators (`MALLOC_MMAP_THRESHOLD_`), on this machine's glibc.

Why a worker's RSS can stay above its level after a long catch-up, and what the
setting costs, is in docs/performance.md ("Memory after a long drain"). Each case
runs a fresh interpreter, as a worker starts, and does what a catching-up worker
does to glibc: frees a large block (which raises glibc's mmap threshold to its
size), then has blocks of 1 MiB written and freed while a later one stays (so the
freed ones are not at the heap's top, which free gives back once it exceeds the
trim threshold). The first case is the behaviour the README describes; the
second, that the setting undoes it. If a glibc stops keeping such pages, the
first fails and the README's paragraph is out of date.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")

_LEFT_BEHIND = """
import ctypes, os

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.memset.argtypes = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
MIB = 1 << 20

def rss_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB

big = libc.malloc(16 * MIB)
libc.memset(big, 1, 16 * MIB)
libc.free(big)
before = rss_mib()
blocks = []
for _ in range(64):
    block = libc.malloc(MIB)
    libc.memset(block, 1, MIB)
    blocks.append(block)
for block in blocks[:-1]:
    libc.free(block)
print(rss_mib() - before)
"""


def _mib_left_behind(**setting: str) -> float:
    """MiB of RSS that 63 freed blocks of 1 MiB leave in a fresh interpreter with `setting` in its environment."""
    theirs = ("GLIBC_TUNABLES", "LD_PRELOAD")  # another allocator's or the caller's tuning
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in theirs}
    done = subprocess.run(
        [sys.executable, "-c", _LEFT_BEHIND], env={**env, **setting}, capture_output=True, text=True, check=True
    )
    return float(done.stdout)


def test_by_default_glibc_keeps_the_pages_of_freed_blocks_under_its_raised_threshold() -> None:
    assert _mib_left_behind() > 48


def test_with_the_readmes_setting_freed_blocks_leave_the_process() -> None:
    assert _mib_left_behind(MALLOC_MMAP_THRESHOLD_="131072") < 8
