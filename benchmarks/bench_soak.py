"""Soak: iterate >= 20,000 batches and watch resident memory and threads.

    python benchmarks/bench_soak.py [--batches 20000] [--mode stream|passes] [--read-ahead 2] [--tracemalloc]

The bundled demo configuration (its corpus and tokenizer) with a small
``sequence_length`` (64) and ``micro_batch_size`` (2), so 20,000 batches
take well under a minute of loader time on 2 cores:

* ``--mode stream`` (default): one pass of one long stream, as a long training
  run sees it. The source folders hold the demo shards linked ``--copies``
  times (symlinks, enough for ``--batches``), so Zephon reads one stream
  of many shards through the public YAML path, from one ``iter()``.
* ``--mode passes``: the demo corpus as is, a new ``iter()`` per pass (about
  900 batches each): every pass restarts Zephon's engine and the read-ahead.

Prints RSS (``VmRSS`` of /proc/self/status), threads, live Python objects
and glibc's heap in use (``mallinfo2``: ``uordblks`` in use, ``fordblks``
free but kept) at 0% (after the first batch), 25, 50, 75 and 100% of
``--batches``, then the growth from 25% to 100%. Goal: RSS growth < 5%.

``--tracemalloc`` also traces Python allocations (slower) and prints the
biggest growth between the 25% and 100% snapshots by source line, and the
Python object types whose count grew.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import math
import os
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from zephon_loader import build_text_loader
from zephon_loader.config import default_config_path

MARKS = (0, 25, 50, 75, 100)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"
    )]


def _libc_mallinfo2() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        function = libc.mallinfo2
    except (OSError, AttributeError):  # not glibc >= 2.33
        return None
    function.restype = _Mallinfo2
    return function


_MALLINFO2 = _libc_mallinfo2()


def memory_mb() -> dict[str, float]:
    """``VmRSS`` of this process and its parts ``RssAnon`` / ``RssFile`` (mapped files) / ``RssShmem``, in MiB."""
    keys = ("VmRSS", "RssAnon", "RssFile", "RssShmem")
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in keys:
            out[name] = int(value.split()[0]) / 1024
    if "VmRSS" not in out:
        raise RuntimeError("/proc/self/status has no VmRSS line (not Linux?)")
    return out


def heap_mb() -> tuple[float, float] | None:
    """glibc heap: (MiB in use by live allocations, MiB free but still held), or ``None`` off glibc."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return (info.uordblks + info.hblkhd) / 2**20, info.fordblks / 2**20


def malloc_trim() -> None:
    """Return glibc's free heap memory to the system (``malloc_trim(0)``).

    Raises:
        RuntimeError: Not glibc.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError) as error:
        raise RuntimeError(f"--malloc-trim: needs glibc's malloc_trim ({error})") from error


def demo_config(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The bundled demo's ``dataloader`` mapping with the soak's overrides (and linked shard copies in stream mode)."""
    demo = default_config_path()
    node = yaml.safe_load(demo.read_text())["dataloader"]
    node.pop("_target_", None)
    node.update(
        base_dir=str(demo.parent),
        sequence_length=args.sequence_length,
        micro_batch_size=args.micro_batch_size,
        read_ahead=args.read_ahead,
        chunk_size=args.chunk_size,
        runtime={"runner": args.runner},
    )
    if args.mode == "stream":
        sources = []
        for source in node["sources"]:
            shards = sorted((demo.parent / source["path"]).iterdir())
            linked = folder / source["name"]
            linked.mkdir(parents=True)
            for copy in range(args.copies):
                for shard in shards:
                    (linked / f"copy{copy:03d}-{shard.name}").symlink_to(shard)
            sources.append({**source, "path": str(linked)})
        node["sources"] = sources
    return node


def python_types() -> Counter[str]:
    return Counter(type(obj).__qualname__ for obj in gc.get_objects())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--mode", choices=["stream", "passes"], default="stream")
    parser.add_argument("--copies", type=int, default=None,
                        help="stream mode: demo shard copies (default: enough for --batches)")
    parser.add_argument("--sequence-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--read-ahead", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="Zephon work-chunk size in records (default: the loader's choice, up to 16384)")
    parser.add_argument("--runner", choices=["threads", "inline", "process"], default="threads")
    parser.add_argument("--tracemalloc", action="store_true", help="trace Python allocations (slower)")
    parser.add_argument("--malloc-trim", action="store_true",
                        help="call glibc malloc_trim(0) before each measurement: RSS then counts live memory, "
                        "not freed memory glibc keeps in its arenas")
    parser.add_argument("--top", type=int, default=12, help="lines/types shown with --tracemalloc")
    args = parser.parse_args()
    if args.batches < 4:
        parser.error(f"--batches: got {args.batches}, expected an int >= 4")
    if args.copies is None:
        # The demo corpus packs into about 900 batches at S=64, B=2; scale with the batch size, keep a margin.
        per_copy = 900 * 64 * 2 / (args.sequence_length * args.micro_batch_size)
        args.copies = math.ceil(1.2 * args.batches / per_copy) + 1

    marks = {round(args.batches * p / 100) or 1: p for p in MARKS}
    rows: dict[int, dict[str, Any]] = {}
    snapshots: dict[int, Any] = {}
    types: dict[int, Counter[str]] = {}

    def record(percent: int, count: int, passes: int, start: float) -> None:
        gc.collect()
        if args.malloc_trim:
            malloc_trim()
        rows[percent] = {
            "batches": count, "passes": passes, **memory_mb(), "threads": threading.active_count(),
            "fds": len(os.listdir("/proc/self/fd")), "objects": len(gc.get_objects()),
            "blocks": sys.getallocatedblocks(), "heap": heap_mb(), "seconds": time.perf_counter() - start,
        }
        if percent in (25, 100):
            types[percent] = python_types()
            if args.tracemalloc:
                snapshots[percent] = tracemalloc.take_snapshot()

    with tempfile.TemporaryDirectory(prefix="bench_soak_") as scratch:
        config = demo_config(Path(scratch), args)
        if args.tracemalloc:
            tracemalloc.start(8)
        count = passes = 0
        with build_text_loader(config) as loader:
            start = time.perf_counter()
            while count < args.batches:
                passes += 1
                delivered = 0
                for _batch in loader:
                    count += 1
                    delivered += 1
                    if count in marks:
                        record(marks[count], count, passes, start)
                    if count >= args.batches:
                        break
                if delivered == 0:
                    raise RuntimeError(f"pass {passes} delivered no batch; the stream is empty")
                if args.mode == "stream" and count < args.batches:
                    raise RuntimeError(
                        f"the stream ended after {count} batches, before --batches {args.batches}; raise --copies "
                        f"(was {args.copies})"
                    )
        after_close = {**memory_mb(), "threads": threading.active_count()}

    print(
        f"soak: mode={args.mode} batches={args.batches} S={args.sequence_length} B={args.micro_batch_size} "
        f"read_ahead={args.read_ahead} chunk_size={args.chunk_size or 'auto'} runner={args.runner} passes={passes}"
        + (f" copies={args.copies}" if args.mode == "stream" else "")
        + (" tracemalloc=on" if args.tracemalloc else "")
        + (" malloc_trim=on" if args.malloc_trim else "")
        + (f" MALLOC_ARENA_MAX={os.environ['MALLOC_ARENA_MAX']}" if "MALLOC_ARENA_MAX" in os.environ else "")
    )
    print(f"{'at':>5} {'batches':>8} {'pass':>5} {'RSS MiB':>8} {'anon':>7} {'file':>7} {'threads':>8} {'fds':>5} "
          f"{'py objects':>11} {'py blocks':>10} {'heap used':>10} {'heap free':>10} {'seconds':>8}")
    for percent in MARKS:
        row = rows[percent]
        heap = row["heap"] or (float("nan"), float("nan"))
        print(f"{percent:>4}% {row['batches']:>8} {row['passes']:>5} {row['VmRSS']:>8.1f} "
              f"{row.get('RssAnon', float('nan')):>7.1f} {row.get('RssFile', float('nan')):>7.1f} {row['threads']:>8} {row['fds']:>5} "
              f"{row['objects']:>11} {row['blocks']:>10} {heap[0]:>10.1f} {heap[1]:>10.1f} {row['seconds']:>8.1f}")
    low, high = rows[25], rows[100]
    growth = high["VmRSS"] - low["VmRSS"]
    print(f"RSS growth 25% -> 100%: {growth:+.1f} MiB ({100 * growth / low['VmRSS']:+.2f}%; goal < 5%); "
          f"anonymous {high.get('RssAnon', 0) - low.get('RssAnon', 0):+.1f} MiB, "
          f"mapped files {high.get('RssFile', 0) - low.get('RssFile', 0):+.1f} MiB; "
          f"threads {low['threads']} -> {high['threads']}, fds {low['fds']} -> {high['fds']}, Python objects {low['objects']} -> {high['objects']}")
    if low["heap"] and high["heap"]:
        print(f"glibc heap 25% -> 100%: in use {high['heap'][0] - low['heap'][0]:+.1f} MiB, "
              f"free but held {high['heap'][1] - low['heap'][1]:+.1f} MiB")
    print(f"after close: RSS {after_close['VmRSS']:.1f} MiB, threads {after_close['threads']}")
    if args.tracemalloc:
        diff = snapshots[100].compare_to(snapshots[25], "lineno")
        print(f"tracemalloc, top {args.top} growth 25% -> 100% by line:")
        for stat in diff[: args.top]:
            print(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks  {stat.traceback[0]}")
        ours = [stat for stat in diff if "/zephon_loader/" in stat.traceback[0].filename and stat.size_diff]
        print(f"tracemalloc, zephon_loader's own lines ({len(ours)} changed), top {args.top}:")
        for stat in ours[: args.top]:
            print(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks  {stat.traceback[0]}")
    grown = ", ".join(f"{name} {n:+d}" for name, n in (types[100] - types[25]).most_common(args.top))
    print(f"Python object types grown 25% -> 100%: {grown or 'none'}")


if __name__ == "__main__":
    main()
