"""Shared timing helper for the benchmark scripts (run them from the repository root)."""

from __future__ import annotations

import ctypes
import ctypes.util
import statistics
import time
from typing import Callable

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def rotated(names: list[str], round_index: int) -> list[str]:
    """``names`` starting at position ``round_index`` (wrapping): the order of one round, so that across rounds
    each side goes first equally often and machine noise and warm caches favour none."""
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn()`` over ``repeats`` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_median_seconds(fn: Callable[[], object], base: Callable[[], object],
                          repeats: int) -> tuple[float, float, float]:
    """``fn`` and ``base`` timed in alternation: their median wall times and the median of the pairs' ratios.

    One warm-up call each, then ``repeats`` pairs, the order flipped every pair; each ratio compares two
    calls made a moment apart, so a machine that slows down or speeds up during the run moves both
    sides of it alike (two medians taken seconds apart do not: on a shared machine they drift).

    Returns:
        ``(fn_median_s, base_median_s, median of fn_s / base_s)``.
    """
    fn()
    base()
    ours: list[float] = []
    theirs: list[float] = []
    sides = ((fn, ours), (base, theirs))
    for index in range(repeats):
        for call, times in sides if index % 2 == 0 else sides[::-1]:
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    ratios = [a / b for a, b in zip(ours, theirs)]
    return statistics.median(ours), statistics.median(theirs), statistics.median(ratios)


def pin_allocator(mmap_threshold: int = 64 << 20, trim_threshold: int = 128 << 20) -> str:
    """Fix glibc's allocation thresholds for this process, so that timings compare computation.

    By default glibc serves a large allocation with a fresh ``mmap`` (every page faulted in on first
    use) until an earlier free raised its dynamic threshold, and trims the heap's top when it grows past
    twice that: whether a ``[B, S]`` tensor allocated per call costs page faults depends on what the
    process freed before. Timings of the same code then differ 2-5x from one process to the next. With
    fixed thresholds, allocations below ``mmap_threshold`` reuse heap memory and nothing is trimmed.

    Returns:
        What was done, for the benchmark's header line.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        mallopt = None
    if mallopt is None or not (mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and mallopt(_M_TRIM_THRESHOLD, trim_threshold)):
        return "allocator: default (no glibc mallopt here)"
    return f"allocator: glibc mmap threshold {mmap_threshold >> 20} MiB, trim threshold {trim_threshold >> 20} MiB (pinned)"
