"""Soak: iterate >= 20,000 batches and watch resident memory, threads and file descriptors.

    python benchmarks/bench_soak.py [--batches 20000] [--mode stream|passes] [--read-ahead 2] [--chunk-size N]
                                    [--runner threads] [--malloc-trim] [--tracemalloc]

The bundled demo configuration (its corpus, tokenizer, ``wrap`` packing and
FA4 contract) with a small ``sequence_length`` (64) and ``micro_batch_size``
(2): 20,000 batches take well under a minute of loader time on 2 cores.

* ``--mode stream`` (default): one long stream from one ``iter()``, as a long
  training run sees it. The source folders hold the demo shards linked
  ``--copies`` times (symlinks, enough for ``--batches``; Zephon's
  ``index.json`` built for them), so Zephon reads one pass over many shards
  through the public YAML path.
* ``--mode passes``: the demo corpus as is, a new ``iter()`` per pass (about
  900 batches each): every pass restarts Zephon's engine and the read-ahead.

At 0% (after the first batch), 25, 50, 75 and 100% of ``--batches``, after a
``gc.collect()``, it prints: ``VmRSS`` and its ``RssAnon`` / ``RssFile`` parts
(/proc/self/status), threads, open file descriptors, live gc-tracked Python
objects, pymalloc blocks (``sys.getallocatedblocks``), and glibc's heap
(``mallinfo2``, all arenas: bytes in live allocations, and bytes free but
kept). Then the growth from 25% to 100% (goal: RSS < 5%) and the Python
object types whose count grew.

Diagnostics: ``--malloc-trim`` calls glibc's ``malloc_trim(0)`` before each
measurement (RSS then leaves out most freed memory glibc keeps);
``MALLOC_ARENA_MAX=2`` in the environment limits glibc's per-thread arenas;
``--tracemalloc`` traces Python allocations (about 8x slower, and its own
traces inflate RSS) and prints the largest growth by source line, overall and
in zephon_loader's own files.
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
#: Batches one copy of the demo corpus packs into at S=64, B=2 (scaled for other sizes; --copies adds a margin).
DEMO_BATCHES_AT_64x2 = 900


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]


def _libc_function(name: str, restype: Any) -> Any:
    try:
        function = getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):  # not glibc (or glibc < 2.33 for mallinfo2)
        return None
    function.restype = restype
    return function


_MALLINFO2 = _libc_function("mallinfo2", _Mallinfo2)
_MALLOC_TRIM = _libc_function("malloc_trim", ctypes.c_int)


def memory_mb() -> dict[str, float]:
    """``VmRSS`` of this process and its parts ``RssAnon`` / ``RssFile`` (mapped files) / ``RssShmem``, in MiB."""
    keys = ("VmRSS", "RssAnon", "RssFile", "RssShmem")
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in keys:
            out[name] = int(value.split()[0]) / 1024
    if "VmRSS" not in out:
        raise RuntimeError("/proc/self/status has no VmRSS line; this benchmark needs Linux")
    return out


def heap_mb() -> tuple[float, float]:
    """glibc's heap over all arenas: (MiB in live allocations, MiB free but kept); NaN off glibc."""
    if _MALLINFO2 is None:
        return math.nan, math.nan
    info = _MALLINFO2()
    return (info.uordblks + info.hblkhd) / 2**20, info.fordblks / 2**20


def demo_config(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The bundled demo's ``dataloader`` mapping with the soak's overrides (stream mode: linked shard copies)."""
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
        from zephon.build_index import build_index

        sources = []
        for source in node["sources"]:
            shards = sorted((demo.parent / source["path"]).glob("*.jsonl"))
            linked = folder / source["name"]
            linked.mkdir(parents=True)
            for copy in range(args.copies):
                for shard in shards:
                    (linked / f"copy{copy:03d}-{shard.name}").symlink_to(shard)
            build_index("jsonl", linked, progress=False, max_workers=2)
            sources.append({**source, "path": str(linked)})
        node["sources"] = sources
    return node


def measure(count: int, passes: int, seconds: float, malloc_trim: bool) -> dict[str, Any]:
    """One row of the table (after a full garbage collection, and ``malloc_trim(0)`` if asked)."""
    gc.collect()
    if malloc_trim:
        if _MALLOC_TRIM is None:
            raise RuntimeError("--malloc-trim: this C library has no malloc_trim (not glibc)")
        _MALLOC_TRIM(0)
    return {
        "batches": count, "passes": passes, **memory_mb(), "threads": threading.active_count(),
        "fds": len(os.listdir("/proc/self/fd")), "objects": len(gc.get_objects()),
        "blocks": sys.getallocatedblocks(), "heap": heap_mb(), "seconds": seconds,
    }


def python_types() -> Counter[str]:
    """Live gc-tracked objects by type name."""
    return Counter(type(obj).__qualname__ for obj in gc.get_objects())


def soak(config: dict[str, Any], args: argparse.Namespace) -> tuple[dict[int, dict], dict[int, Counter], dict, dict]:
    """Iterate ``args.batches`` batches; returns the rows by percent, type counts and snapshots at 25/100%, and
    the memory after ``close()``."""
    marks = {round(args.batches * p / 100) or 1: p for p in MARKS}
    rows: dict[int, dict[str, Any]] = {}
    types: dict[int, Counter[str]] = {}
    snapshots: dict[int, Any] = {}
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
                    percent = marks[count]
                    rows[percent] = measure(count, passes, time.perf_counter() - start, args.malloc_trim)
                    if percent in (25, 100):
                        types[percent] = python_types()
                        if args.tracemalloc:
                            snapshots[percent] = tracemalloc.take_snapshot()
                if count >= args.batches:
                    break
            if delivered == 0:
                raise RuntimeError(f"pass {passes} delivered no batch: the stream is empty")
            if args.mode == "stream" and count < args.batches:
                raise RuntimeError(
                    f"the stream ended after {count} batches, before --batches {args.batches}; "
                    f"raise --copies (was {args.copies})"
                )
    gc.collect()
    return rows, types, snapshots, {**memory_mb(), "threads": threading.active_count()}


def report(args: argparse.Namespace, rows: dict[int, dict], types: dict[int, Counter], snapshots: dict,
           closed: dict) -> None:
    passes = rows[100]["passes"]
    print(
        f"soak: mode={args.mode} batches={args.batches} S={args.sequence_length} B={args.micro_batch_size} "
        f"read_ahead={args.read_ahead} chunk_size={args.chunk_size or 'auto'} runner={args.runner} passes={passes}"
        + (f" copies={args.copies}" if args.mode == "stream" else "")
        + (" malloc_trim=on" if args.malloc_trim else "")
        + (" tracemalloc=on" if args.tracemalloc else "")
        + (f" MALLOC_ARENA_MAX={os.environ['MALLOC_ARENA_MAX']}" if "MALLOC_ARENA_MAX" in os.environ else "")
    )
    print(f"{'at':>5} {'batches':>8} {'pass':>5} {'RSS MiB':>8} {'anon':>7} {'file':>7} {'threads':>8} {'fds':>4} "
          f"{'py objects':>11} {'py blocks':>10} {'heap used':>10} {'heap free':>10} {'seconds':>8}")
    for percent in MARKS:
        row = rows[percent]
        print(f"{percent:>4}% {row['batches']:>8} {row['passes']:>5} {row['VmRSS']:>8.1f} "
              f"{row.get('RssAnon', math.nan):>7.1f} {row.get('RssFile', math.nan):>7.1f} {row['threads']:>8} "
              f"{row['fds']:>4} {row['objects']:>11} {row['blocks']:>10} {row['heap'][0]:>10.1f} "
              f"{row['heap'][1]:>10.1f} {row['seconds']:>8.1f}")
    low, high = rows[25], rows[100]

    def grew(key: str) -> float:
        return high.get(key, math.nan) - low.get(key, math.nan)

    print(f"RSS growth 25% -> 100%: {grew('VmRSS'):+.1f} MiB ({100 * grew('VmRSS') / low['VmRSS']:+.2f}%, goal < 5%): "
          f"anonymous {grew('RssAnon'):+.1f} MiB, mapped files {grew('RssFile'):+.1f} MiB")
    print(f"25% -> 100%: threads {low['threads']} -> {high['threads']}, fds {low['fds']} -> {high['fds']}, "
          f"Python objects {grew('objects'):+.0f}, pymalloc blocks {grew('blocks'):+.0f}, "
          f"glibc heap in use {high['heap'][0] - low['heap'][0]:+.1f} MiB, "
          f"free but kept {high['heap'][1] - low['heap'][1]:+.1f} MiB")
    grown = ", ".join(f"{name} {n:+d}" for name, n in (types[100] - types[25]).most_common(args.top))
    print(f"Python object types grown 25% -> 100%: {grown or 'none'}")
    print(f"after close(): RSS {closed['VmRSS']:.1f} MiB, threads {closed['threads']}")
    if args.tracemalloc:
        diff = snapshots[100].compare_to(snapshots[25], "lineno")
        ours = [stat for stat in diff if "/zephon_loader/" in stat.traceback[0].filename and stat.size_diff]
        for title, stats in (("all code", diff), (f"zephon_loader's own files ({len(ours)} lines changed)", ours)):
            print(f"tracemalloc growth 25% -> 100%, {title}, top {args.top}:")
            for stat in stats[: args.top]:
                print(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks  {stat.traceback[0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20_000)
    parser.add_argument("--mode", choices=["stream", "passes"], default="stream")
    parser.add_argument("--copies", type=int, default=None,
                        help="stream mode: links of the demo shards (default: enough for --batches)")
    parser.add_argument("--sequence-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--read-ahead", type=int, default=2)
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="Zephon work-chunk size in records (default: the loader's choice, up to 16384)")
    parser.add_argument("--runner", choices=["threads", "inline", "process"], default="threads")
    parser.add_argument("--malloc-trim", action="store_true", help="glibc malloc_trim(0) before each measurement")
    parser.add_argument("--tracemalloc", action="store_true", help="trace Python allocations (slow)")
    parser.add_argument("--top", type=int, default=12, help="object types / tracemalloc lines shown")
    args = parser.parse_args()
    if args.batches < 4:
        parser.error(f"--batches: got {args.batches}, expected an int >= 4")
    if args.copies is None:
        per_copy = DEMO_BATCHES_AT_64x2 * 64 * 2 / (args.sequence_length * args.micro_batch_size)
        args.copies = math.ceil(1.2 * args.batches / per_copy) + 1
    with tempfile.TemporaryDirectory(prefix="bench_soak_") as scratch:
        rows, types, snapshots, closed = soak(demo_config(Path(scratch), args), args)
    report(args, rows, types, snapshots, closed)


if __name__ == "__main__":
    main()
