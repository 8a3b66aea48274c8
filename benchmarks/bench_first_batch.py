"""First-batch latency and peak memory on a corpus of long documents, by ``runtime.tokenize_parallelism``.

Zephon tokenizes 64 documents per call and keeps several calls in flight, so
on a corpus of long files the first batch waits for many of them to be
tokenized and their text and tokens are held at once. ``tokenize_parallelism``
bounds the calls in flight. Each setting runs in a fresh process (peak RSS is
per process), interleaved over ``--repeats`` rounds so machine noise hits all
settings alike; medians are printed side by side.

The corpus is the Python standard library's ``.py`` files as JSONL (heavy
tailed: a few files of 100k+ tokens), packed with ``wrap``.

    python benchmarks/bench_first_batch.py [--files 600] [--repeats 3] [--settings default,1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path


def make_corpus(folder: Path, files: int) -> tuple[int, int]:
    """Write up to ``files`` stdlib sources as JSONL shards; returns (documents, bytes)."""
    folder.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    candidates = sorted(p for p in stdlib.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    # Empty files (many __init__.py) are bad records for the loader: leave them out of the corpus.
    paths = [p for p in candidates if p.read_text(errors="replace").strip()][:files]
    total = 0
    shards = [open(folder / f"part-{i:02d}.jsonl", "w") for i in range(4)]
    try:
        for index, path in enumerate(paths):
            text = path.read_text(errors="replace")
            total += len(text.encode())
            shards[index % 4].write(json.dumps({"text": text, "path": str(path.relative_to(stdlib))}) + "\n")
    finally:
        for shard in shards:
            shard.close()
    return len(paths), total


def child(corpus: Path, setting: str) -> None:
    """One measurement in this process: build, time the first batch, then one more batch; print JSON."""
    from zephon_loader import build_text_loader
    from zephon_loader.config import package_data_dir

    runtime = {"runner": "threads"}
    if setting != "default":
        runtime["tokenize_parallelism"] = int(setting)
    config = {
        "sources": [{"name": "stdlib", "path": str(corpus)}],
        "tokenizer": {"path": str(package_data_dir() / "tokenizer")},
        "sequence_length": 2048,
        "micro_batch_size": 4,
        "packing": {"algorithm": "wrap"},
        "read_ahead": 0,
        "runtime": runtime,
    }
    start = time.perf_counter()
    with build_text_loader(config) as loader:
        built = time.perf_counter()
        iterator = iter(loader)
        next(iterator)
        first = time.perf_counter()
        for _ in range(20):
            next(iterator)
        twenty = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    print(json.dumps({"build_s": built - start, "first_batch_s": first - built, "next_20_s": twenty - first,
                      "peak_rss_mib": peak}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=600, help="stdlib files in the corpus")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (each setting once per round)")
    parser.add_argument("--settings", default="default,1,2", help="comma-separated tokenize_parallelism values")
    parser.add_argument("--child", nargs=2, metavar=("CORPUS", "SETTING"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(Path(args.child[0]), args.child[1])
        return
    settings = args.settings.split(",")
    with tempfile.TemporaryDirectory() as root:
        corpus = Path(root) / "stdlib"
        documents, size = make_corpus(corpus, args.files)
        print(f"corpus: {documents} stdlib files, {size / 2**20:.1f} MiB of text; S=2048, B=4, wrap, threads runner")
        results: dict[str, list[dict[str, float]]] = {s: [] for s in settings}
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        for _ in range(args.repeats):
            for setting in settings:
                out = subprocess.run([sys.executable, __file__, "--child", str(corpus), setting], env=env,
                                     capture_output=True, text=True, check=True).stdout
                results[setting].append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'tokenize_parallelism':>22} {'first batch s':>14} {'next 20 s':>10} {'peak RSS MiB':>13}")
    for setting, runs in results.items():
        med = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(f"{setting:>22} {med['first_batch_s']:>14.2f} {med['next_20_s']:>10.2f} {med['peak_rss_mib']:>13.0f}")


if __name__ == "__main__":
    main()
