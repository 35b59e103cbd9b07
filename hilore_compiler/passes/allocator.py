"""Cost timings on the allocator a trainer runs with, whatever this process set.

CPU peaks are measured with ``MALLOC_MMAP_THRESHOLD_=65536``
(``bench/measure.py``): glibc then maps fresh pages for every allocation over
64 KiB, and each first touch faults. A region timed under that setting pays
for allocating its output more than for computing it: on ``small`` (B=2,
T=2048, 2 CPU cores) the norm's rsqrt recomputed in 1.25 ms against 0.10 ms
on glibc's default, the MLP's ``silu(g) * u`` in 18.0 ms against 3.5 ms. A
trace made in such a process (the bench's peak workers compile, so they
trace) priced every cheap recompute out of the plan that the rounds then
ran on the default allocator. ``default_allocator`` lifts the threshold to
where glibc's own dynamic threshold settles while costs are timed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
from collections.abc import Iterator

#: The environment variable that fixes glibc's mmap threshold at start-up.
MMAP_THRESHOLD_VAR = "MALLOC_MMAP_THRESHOLD_"
#: The environment variable that sets glibc's trim threshold at start-up.
TRIM_THRESHOLD_VAR = "MALLOC_TRIM_THRESHOLD_"
#: ``mallopt``'s parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: glibc's ``DEFAULT_TRIM_THRESHOLD``: free memory above it at the heap's top
#: goes back to the OS.
DEFAULT_TRIM_THRESHOLD = 128 << 10
#: glibc's ``DEFAULT_MMAP_THRESHOLD_MAX`` on 64-bit: its dynamic threshold
#: rises to this once a process frees large blocks, as a training step does.
DEFAULT_THRESHOLD_MAX = 32 << 20


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def _env_int(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def fixed_threshold() -> int | None:
    """The mmap threshold this process's environment fixed, or None (glibc's default)."""
    return _env_int(MMAP_THRESHOLD_VAR)


@contextlib.contextmanager
def default_allocator() -> Iterator[None]:
    """Within the block, allocations up to 32 MiB reuse the heap as on glibc's default.

    Does nothing where the threshold was not fixed (already the default) or
    where glibc's ``mallopt`` is missing. On exit the fixed threshold is back
    and the heap is trimmed, so what the block freed goes back to the OS and
    a later VmRSS/VmHWM peak reads as before.
    """
    fixed, libc = fixed_threshold(), _glibc()
    if fixed is None or libc is None or fixed >= DEFAULT_THRESHOLD_MAX:
        yield
        return
    # glibc's dynamic threshold raises the trim threshold to twice itself;
    # without that, each freed output is trimmed and the next one faults in.
    libc.mallopt(_M_TRIM_THRESHOLD, 2 * DEFAULT_THRESHOLD_MAX)
    libc.mallopt(_M_MMAP_THRESHOLD, DEFAULT_THRESHOLD_MAX)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, fixed)
        libc.mallopt(_M_TRIM_THRESHOLD, _env_int(TRIM_THRESHOLD_VAR) or DEFAULT_TRIM_THRESHOLD)
        libc.malloc_trim(0)
