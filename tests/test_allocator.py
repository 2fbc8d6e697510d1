"""glibc's thresholds as the windows worker fixes them (skillstats/allocator.py), on this machine's glibc.

Why a worker's RSS could stay above its level after a long catch-up, and what
fixing the thresholds costs, is in docs/performance.md ("Memory after a long
drain"). Each case runs a fresh interpreter, as a worker starts, and does what a
catching-up worker does to glibc: frees a large block (which raises glibc's mmap
threshold to its size), then has blocks of 1 MiB written and freed while a later
one stays (so the freed ones are not at the heap's top, which free gives back once
it exceeds the trim threshold). The first case is the behaviour the worker guards
against; the others, that its fix (or an operator's own setting) undoes it, and
that blocks under 1 MiB still come from the heap. If a glibc stops keeping such
pages, the first fails and the module's reason is out of date.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from skillstats.allocator import Thresholds, fix_thresholds

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")

_LEFT_BEHIND = """
import ctypes, os, sys

if "fix" in sys.argv:
    from skillstats.allocator import Thresholds, fix_thresholds
    assert fix_thresholds() is Thresholds.FIXED

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


# Whether a block of 256 KiB (lz4's scratch, one per record batch read) is cut from the heap or mapped on its own.
_FROM_THE_HEAP = """
import ctypes

from skillstats.allocator import Thresholds, fix_thresholds

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
assert fix_thresholds() is Thresholds.FIXED
mapped = libc.mallinfo2().hblks
small, large = libc.malloc(256 << 10), libc.malloc(2 << 20)
print(libc.mallinfo2().hblks - mapped)
libc.free(small)
libc.free(large)
"""


def _clean_environment(**setting: str) -> dict[str, str]:
    """This process's environment without any allocator tuning of the caller's, with `setting`."""
    theirs = ("GLIBC_TUNABLES", "LD_PRELOAD")  # another allocator's or the caller's tuning
    return {**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in theirs}, **setting}


def _mib_left_behind(*, fix: bool = False, **setting: str) -> float:
    """MiB of RSS that 63 freed blocks of 1 MiB leave in a fresh interpreter with `setting` in its environment,
    the worker's `fix_thresholds` called first when `fix`."""
    done = subprocess.run(
        [sys.executable, "-c", _LEFT_BEHIND, *(["fix"] if fix else [])],
        env=_clean_environment(**setting),
        capture_output=True,
        text=True,
        check=True,
    )
    return float(done.stdout)


def test_by_default_glibc_keeps_the_pages_of_freed_blocks_under_its_raised_threshold() -> None:
    assert _mib_left_behind() > 48


def test_an_operators_threshold_fixed_at_its_start_value_gives_freed_blocks_back() -> None:
    assert _mib_left_behind(MALLOC_MMAP_THRESHOLD_="131072") < 8


def test_the_workers_fixed_thresholds_give_freed_blocks_back() -> None:
    assert _mib_left_behind(fix=True) < 8


def test_under_the_workers_thresholds_a_block_under_a_mib_comes_from_the_heap_and_one_over_it_is_mapped() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _FROM_THE_HEAP], env=_clean_environment(), capture_output=True, text=True, check=True
    )
    assert int(done.stdout) == 1


@pytest.mark.parametrize(
    "setting",
    [
        {"MALLOC_MMAP_THRESHOLD_": "131072"},
        {"MALLOC_TRIM_THRESHOLD_": "0"},
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.trim_threshold=0"},
        {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4194304"},
    ],
)
def test_an_operators_own_threshold_is_left_as_set(setting: dict[str, str]) -> None:
    assert fix_thresholds(setting) is Thresholds.OPERATOR


def test_other_glibc_tunables_do_not_stop_the_fix() -> None:
    probe = (
        "from skillstats.allocator import fix_thresholds; "
        "print(fix_thresholds({'GLIBC_TUNABLES': 'glibc.malloc.arena_max=2'}).name)"
    )
    done = subprocess.run([sys.executable, "-c", probe], env=_clean_environment(), capture_output=True, text=True)
    assert done.stdout.strip() == "FIXED", done.stderr
