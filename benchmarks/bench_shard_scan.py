"""What the shard fingerprint costs: 1,000 JSONL shards hashed (first build), then stat'ed (later builds).

Prints, side by side in one run: the loader's scan of a source cold (every byte hashed: SHA-256 of each
shard, the resume fingerprint) and warm (digests from the cache: one stat per shard), and Zephon's own
discovery of the same folder (``zephon.Dataset.from_path``: without an index it reads every shard to count
its records), which every build pays anyway.

    python benchmarks/bench_shard_scan.py [--shards 1000] [--shard-kib 256]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path


def make_shards(folder: Path, shards: int, shard_kib: int) -> int:
    folder.mkdir(parents=True)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "loader", "token", "packed", "resume", "shard", "epoch"]
    total = 0
    for i in range(shards):
        lines, size = [], 0
        while size < shard_kib * 1024:
            line = json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(5, 200)))}) + "\n"
            lines.append(line)
            size += len(line)
        (folder / f"part-{i:05d}.jsonl").write_text("".join(lines), encoding="utf-8")
        total += size
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=1000)
    parser.add_argument("--shard-kib", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["ZEPHON_LOADER_CACHE"] = os.path.join(tmp, "cache")
        folder = Path(tmp) / "data"
        total = make_shards(folder, args.shards, args.shard_kib)
        from zephon_loader.pipeline.shards import open_source

        import zephon

        timings = {}
        started = time.perf_counter()
        open_source("web", "bench", str(folder), folder)
        timings["loader scan, cold (hash every byte)"] = time.perf_counter() - started
        started = time.perf_counter()
        open_source("web", "bench", str(folder), folder)
        timings["loader scan, warm (stat + cached digests)"] = time.perf_counter() - started
        started = time.perf_counter()
        zephon.Dataset.from_path("web", str(folder)).total()
        timings["zephon discovery (count records, no index)"] = time.perf_counter() - started
        print(f"{args.shards} shards, {total / 2**20:.0f} MiB")
        base = timings["zephon discovery (count records, no index)"]
        for what, seconds in timings.items():
            print(f"  {what:<45} {seconds * 1000:9.1f} ms   {seconds / base:5.2f}x zephon's discovery")


if __name__ == "__main__":
    main()
