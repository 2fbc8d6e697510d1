"""glibc's thresholds as the windows worker fixes them (skillstats/allocator.py), on this machine's glibc.

Why a worker's RSS could stay above its level after a long catch-up, and what
fixing the thresholds costs, is in docs/performance.md ("Memory after a long
drain"). Each case runs a fresh interpreter, as a worker starts, and does what a
catching-up worker does to glibc: frees a large block (which raises glibc's mmap
threshold to its size), then has blocks of 1 MiB written and freed while a later
one stays (so the freed ones are not at the heap's top, which free gives back once
it exceeds the trim threshold). The first case is the behaviour the worker guards
against; the others, that its fix (or an operator's own setting) undoes it, that
blocks under 1 MiB still come from the heap and the heap's top is kept up to
32 MiB, and that an operator's threshold or another allocator in front of glibc's
is left alone. If a glibc stops keeping such pages, the first fails and the
module's reason is out of date.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from skillstats.allocator import Outcome, fix_thresholds, operator_thresholds

_LIBC, _VERSION = platform.libc_ver()
pytestmark = pytest.mark.skipif(
    _LIBC != "glibc" or tuple(map(int, _VERSION.split(".")[:2])) < (2, 33), reason="glibc 2.33 or later (mallinfo2)"
)

_LEFT_BEHIND = """
import ctypes, os, sys

if "fix" in sys.argv:
    from skillstats.allocator import Outcome, fix_thresholds
    assert fix_thresholds().outcome is Outcome.FIXED

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


# A fresh interpreter's glibc with the worker's thresholds fixed, and its counters (mallinfo2) at hand.
_FIXED_GLIBC = """
import ctypes

from skillstats.allocator import Outcome, fix_thresholds

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
assert fix_thresholds().outcome is Outcome.FIXED
"""
# Whether a block of 256 KiB (lz4's scratch, one per record batch read) is cut from the heap or mapped on its own.
_FROM_THE_HEAP = (
    _FIXED_GLIBC
    + """mapped = libc.mallinfo2().hblks
small, large = libc.malloc(256 << 10), libc.malloc(2 << 20)
print(libc.mallinfo2().hblks - mapped)
libc.free(small)
libc.free(large)
"""
)


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
    ("setting", "said"),
    [
        ({"MALLOC_MMAP_THRESHOLD_": "131072"}, ("MALLOC_MMAP_THRESHOLD_=131072",)),
        ({"MALLOC_TRIM_THRESHOLD_": ""}, ("MALLOC_TRIM_THRESHOLD_=",)),  # glibc takes an empty one as 0
        (
            {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.trim_threshold=0"},
            ("GLIBC_TUNABLES glibc.malloc.trim_threshold=0",),
        ),
        (
            {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4194304", "MALLOC_TRIM_THRESHOLD_": "1"},
            ("MALLOC_TRIM_THRESHOLD_=1", "GLIBC_TUNABLES glibc.malloc.mmap_threshold=4194304"),
        ),
    ],
)
def test_an_operators_own_threshold_is_left_as_set_and_named(setting: dict[str, str], said: tuple[str, ...]) -> None:
    fixing = fix_thresholds(setting)
    assert fixing.outcome is Outcome.OPERATOR and fixing.settings == said
    assert all(part in fixing.line() for part in said)


@pytest.mark.parametrize(
    "tunables",
    [
        "glibc.malloc.arena_max=2",
        "xglibc.malloc.mmap_threshold=4194304",  # not a tunable's name: glibc skips it
        "glibc.malloc.trim_threshold",  # no value: glibc skips it
        "glibc.malloc.mmap_threshold_x=1",
    ],
)
def test_what_glibc_would_not_take_as_a_threshold_does_not_stop_the_fix(tunables: str) -> None:
    assert operator_thresholds({"GLIBC_TUNABLES": tunables}) == ()


def test_other_glibc_tunables_do_not_stop_the_fix() -> None:
    probe = (
        "from skillstats.allocator import fix_thresholds; "
        "print(fix_thresholds({'GLIBC_TUNABLES': 'glibc.malloc.arena_max=2'}).outcome.name)"
    )
    done = subprocess.run([sys.executable, "-c", probe], env=_clean_environment(), capture_output=True, text=True)
    assert done.stdout.strip() == "FIXED", done.stderr


# What the trim threshold keeps: blocks under the mmap threshold freed at the heap's top stay there, up to it.
_KEPT_AT_THE_TOP = (
    _FIXED_GLIBC
    + """blocks = [libc.malloc(512 << 10) for _ in range(32)]  # 16 MiB, from the heap's top
for block in reversed(blocks):
    libc.free(block)
print(libc.mallinfo2().keepcost >> 20)
"""
)


def test_under_the_workers_thresholds_the_heaps_top_is_kept_up_to_32_mib() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _KEPT_AT_THE_TOP], env=_clean_environment(), capture_output=True, text=True, check=True
    )
    assert int(done.stdout) >= 16


_MALLOC_IN_FRONT = """
#include <stddef.h>
extern void *__libc_malloc(size_t);
void *malloc(size_t size) { return __libc_malloc(size); }
int skillstats_test_front_loaded = 1;
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="a C compiler")
def test_with_another_malloc_preloaded_glibcs_thresholds_are_left_alone(tmp_path: Path) -> None:
    source, library = tmp_path / "front.c", tmp_path / "front.so"
    source.write_text(_MALLOC_IN_FRONT)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    probe = (
        "import ctypes; from skillstats.allocator import fix_thresholds; "
        "print(hasattr(ctypes.CDLL(None), 'skillstats_test_front_loaded'), fix_thresholds().outcome.name)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=_clean_environment(LD_PRELOAD=str(library)), capture_output=True, text=True
    )
    loaded, outcome = done.stdout.split()
    if loaded != "True":  # ld.so skips a preload it cannot take (a path with a space or a colon, a noexec mount)
        pytest.skip(f"the dynamic loader did not preload {library}")
    assert outcome == "ANOTHER_ALLOCATOR", done.stderr
