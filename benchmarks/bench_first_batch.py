"""First-batch latency and peak memory at the defaults, by ``runtime.tokenize_parallelism`` and corpus size.

Every measurement is a fresh process (peak RSS is per process), settings
interleaved over ``--repeats`` rounds so machine noise hits all alike; medians
are printed side by side. The time counts from ``build_text_loader`` (the
build: config, tokenizer, shard table) to the first batch, as a user waits for
it; ``transformers`` is imported before (a training script has it loaded).

The corpus is the Python standard library's ``.py`` files as JSONL (heavy
tailed: a few files of 100k+ tokens), S=2048, B=8, packed with ``wrap``, every
other setting the default (runner, read-ahead). ``--sizes`` compares corpus
sizes at the default setting (``quarter,whole``: a quarter of the stdlib files
and all of them; the first batch should not depend on the corpus' size).
``--resume 100,300`` compares a fresh start with resuming from a state saved
after 100 (and 300) batches (saved by an untimed process; the time counts
from the build, ``load_state_dict`` included, and the resumed first batch is
checked to be the uninterrupted run's next one). ``--endless`` makes the stream
endless (``passes: null``, training by steps) and, with ``--resume``, also
resumes under ``flush_every_records: 0`` (Zephon's unshortened flush cadence,
the default before the window was sized from the batch) to compare the waits.
``--cold 1,8`` builds on a node that has never seen the corpus: the whole
standard library repeated ``--copies`` times (and 8x that) in 32 JSONL shards
with Zephon's ``index.json`` built beforehand, a fresh ``ZEPHON_LOADER_CACHE``
per run; it prints the first batch, the bytes the process read until then
(``/proc/self/io`` ``rchar``: Zephon's reads included) and what a
``state_dict()`` right after the first batch waits (the shard digests the
fingerprint needs); also with a digest manifest (``zephon-loader index``) when
the code has that command.

    python benchmarks/bench_first_batch.py [--files 600] [--repeats 3] [--settings default,1,2] [--sizes]
                                           [--resume N,M] [--endless] [--cold 1,8 [--copies 32]]
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



def _stdlib_config(corpus: object) -> dict:
    """The loader every measurement here builds: the stdlib corpus at ``corpus``, the bundled tokenizer, 8 x 2048."""
    from zephon_loader.config import package_data_dir

    return {
        "sources": [{"name": "stdlib", "path": str(corpus)}],
        "tokenizer": {"path": str(package_data_dir() / "tokenizer")},
        "sequence_length": 2048,
        "micro_batch_size": 8,
        "packing": {"algorithm": "wrap"},
    }

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


def make_scaled_corpus(folder: Path, copies: int, shards: int = 32) -> int:
    """The non-test stdlib sources repeated ``copies`` times in ``shards`` JSONL shards, then Zephon's
    ``index.json``; returns the bytes of the shards."""
    folder.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in stdlib.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    lines = []
    for path in paths:
        text = path.read_text(errors="replace")
        if text.strip():
            lines.append(json.dumps({"text": text, "path": str(path.relative_to(stdlib))}) + "\n")
    handles = [open(folder / f"part-{i:03d}.jsonl", "w") for i in range(shards)]
    try:
        for copy in range(copies):
            for index, line in enumerate(lines):
                handles[(copy * len(lines) + index) % shards].write(line)
    finally:
        for handle in handles:
            handle.close()
    subprocess.run([sys.executable, "-m", "zephon.build_index", "jsonl", str(folder)], check=True,
                   capture_output=True)
    return sum(p.stat().st_size for p in folder.glob("*.jsonl"))


def _read_bytes() -> int:
    """Bytes this process has read so far (``rchar``: every read call, page cache included)."""
    with open("/proc/self/io") as handle:
        return int(next(line for line in handle if line.startswith("rchar:")).split()[1])


def cold_child(corpus: Path) -> None:
    """Build on ``corpus`` with the cache folder the parent made fresh; the first batch, the bytes read until
    then, and the wait of a ``state_dict()`` right after it; print JSON."""
    import transformers  # noqa: F401 - loaded before the timed part, as in a training script

    from zephon_loader import build_text_loader

    config = _stdlib_config(corpus)
    read_before = _read_bytes()
    start = time.perf_counter()
    with build_text_loader(config) as loader:
        built = time.perf_counter()
        next(iter(loader))
        first = time.perf_counter()
        read_first = _read_bytes()
        loader.state_dict()
        saved = time.perf_counter()
    print(json.dumps({"build_s": built - start, "first_batch_s": first - start,
                      "read_mib": (read_first - read_before) / 2**20, "state_dict_s": saved - first}))


def _cold(root: Path, scales: list[int], copies: int, repeats: int) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    corpora = {}
    for scale in scales:
        folder = root / f"x{scale}"
        size = make_scaled_corpus(folder, copies * scale)
        corpora[scale] = folder
        print(f"corpus {scale}x: {copies * scale} copies of the stdlib, 32 shards, {size / 2**30:.2f} GiB")
    try:  # the code measured has the digest manifest (zephon-loader index)
        from zephon_loader.pipeline.digests import MANIFEST_NAME

        manifest = True
    except ImportError:
        manifest, MANIFEST_NAME = False, ""
    cases = [(scale, False) for scale in scales] + ([(scale, True) for scale in scales] if manifest else [])
    runs: dict[tuple[int, bool], list[dict[str, float]]] = {case: [] for case in cases}
    index_s: dict[int, list[float]] = {}
    for _ in range(repeats):
        for scale, with_manifest in cases:
            folder = corpora[scale]
            if with_manifest:
                indexing = time.perf_counter()
                subprocess.run([sys.executable, "-m", "zephon_loader.cli", "index", str(folder)], env=env,
                               check=True, capture_output=True)
                index_s.setdefault(scale, []).append(time.perf_counter() - indexing)
            elif manifest:
                (folder / MANIFEST_NAME).unlink(missing_ok=True)
            with tempfile.TemporaryDirectory(prefix="cold-cache-") as cache:
                out = subprocess.run([sys.executable, __file__, "--cold-child", str(folder)],
                                     env={**env, "ZEPHON_LOADER_CACHE": cache}, capture_output=True, text=True,
                                     check=True).stdout
            runs[(scale, with_manifest)].append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'corpus':>22} {'build s':>8} {'first batch s':>14} {'read MiB':>9} {'state_dict after s':>19}")
    for (scale, with_manifest), got in runs.items():
        med = {key: statistics.median(run[key] for run in got) for key in got[0]}
        label = f"{scale}x cold" + (" + manifest" if with_manifest else "")
        print(f"{label:>22} {med['build_s']:>8.2f} {med['first_batch_s']:>14.2f} {med['read_mib']:>9.1f} "
              f"{med['state_dict_s']:>19.2f}")
    for scale, seconds in index_s.items():
        print(f"zephon-loader index at {scale}x (once per corpus version, a process of its own): "
              f"{statistics.median(seconds):.2f} s")


def _digest(batch: dict) -> str:
    import hashlib

    return hashlib.sha256(batch["input_ids"].numpy().tobytes() + batch["labels"].numpy().tobytes()).hexdigest()


def child(corpus: Path, setting: str) -> None:
    """One measurement in this process: build, time the first batch, then 20 more; print JSON.

    ``setting``: a ``tokenize_parallelism`` value or ``default``; ``save@N`` (untimed) iterates N batches, saves
    the state and the digest of batch N + 1 beside the corpus; ``resume@N`` builds, loads that state, times the
    first batch and checks that it is batch N + 1. Suffixes: ``+endless`` (``passes: null``), ``+zephon``
    (``flush_every_records: 0``; its states are saved apart).
    """
    import transformers  # noqa: F401 - loaded before the timed part, as in a training script

    import torch

    from zephon_loader import build_text_loader

    config = _stdlib_config(corpus)
    setting, *suffixes = setting.split("+")
    if "endless" in suffixes:
        config["passes"] = None
    if "zephon" in suffixes:
        config["flush_every_records"] = 0
    mode, _, count = setting.partition("@")
    state_file = corpus.parent / f"state-{count}{''.join('+' + s for s in suffixes)}.pt"
    if mode == "save":
        with build_text_loader(config) as loader:
            iterator = iter(loader)
            for _ in range(int(count)):
                next(iterator)
            torch.save({"loader": loader.state_dict(), "next": _digest(next(iterator))}, state_file)
        return
    if mode not in ("default", "resume"):
        config["runtime"] = {"tokenize_parallelism": int(setting)}
    start = time.perf_counter()
    with build_text_loader(config) as loader:
        if mode == "resume":
            saved = torch.load(state_file, weights_only=True)
            loader.load_state_dict(saved["loader"])
        built = time.perf_counter()
        iterator = iter(loader)
        batch = next(iterator)
        first = time.perf_counter()
        if mode == "resume" and _digest(batch) != saved["next"]:
            raise SystemExit(f"resume@{count}: the first batch is not batch {int(count) + 1} of the uninterrupted run")
        for _ in range(20):
            next(iterator)
        twenty = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB on Linux
    print(json.dumps({"build_s": built - start, "first_batch_s": first - start, "next_20_s": twenty - first,
                      "peak_rss_mib": peak}))


def _measure(cases: dict[str, tuple[Path, str]], repeats: int) -> dict[str, dict[str, float]]:
    """Run each case (corpus, setting) once per round, interleaved; medians per case."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, (corpus, setting) in cases.items():
            out = subprocess.run([sys.executable, __file__, "--child", str(corpus), setting], env=env,
                                 capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    return {name: {key: statistics.median(run[key] for run in got) for key in got[0]} for name, got in runs.items()}


def _print(label: str, medians: dict[str, dict[str, float]]) -> None:
    print(f"{label:>30} {'build s':>8} {'first batch s':>14} {'next 20 s':>10} {'peak RSS MiB':>13}")
    for name, med in medians.items():
        print(f"{name:>30} {med['build_s']:>8.2f} {med['first_batch_s']:>14.2f} {med['next_20_s']:>10.2f} "
              f"{med['peak_rss_mib']:>13.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=600, help="stdlib files in the corpus")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (each setting once per round)")
    parser.add_argument("--settings", default="default,1,2", help="comma-separated tokenize_parallelism values")
    parser.add_argument("--sizes", action="store_true",
                        help="instead: the default setting on a quarter of the stdlib files and on all of them")
    parser.add_argument("--resume", default=None, metavar="N,M",
                        help="instead: the first batch of a fresh start against a resume after N (and M...) batches")
    parser.add_argument("--endless", action="store_true",
                        help="passes: null; with --resume also resume under flush_every_records: 0 (Zephon's cadence)")
    parser.add_argument("--cold", default=None, metavar="1,8",
                        help="instead: a cold build (fresh cache folder) at these multiples of --copies")
    parser.add_argument("--copies", type=int, default=32, help="stdlib copies in the 1x corpus of --cold")
    parser.add_argument("--child", nargs=2, metavar=("CORPUS", "SETTING"), help=argparse.SUPPRESS)
    parser.add_argument("--cold-child", metavar="CORPUS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(Path(args.child[0]), args.child[1])
        return
    if args.cold_child:
        cold_child(Path(args.cold_child))
        return
    print(f"{os.cpu_count()} CPUs, affinity {len(os.sched_getaffinity(0))}; S=2048, B=8, wrap, default runner and "
          "read-ahead; time from build_text_loader to the first batch")
    with tempfile.TemporaryDirectory() as root:
        if args.cold:
            _cold(Path(root), [int(n) for n in args.cold.split(",")], args.copies, args.repeats)
            return
        if args.sizes:
            whole, whole_size = make_corpus(Path(root) / "whole", 10**6)
            quarter, quarter_size = make_corpus(Path(root) / "quarter", whole // 4)
            print(f"corpora: {quarter} files ({quarter_size / 2**20:.1f} MiB) and {whole} files "
                  f"({whole_size / 2**20:.1f} MiB)")
            medians = _measure({"quarter": (Path(root) / "quarter", "default"),
                                "whole": (Path(root) / "whole", "default")}, args.repeats)
            _print("corpus", medians)
            print(f"first batch whole / quarter: {medians['whole']['first_batch_s'] / medians['quarter']['first_batch_s']:.2f}")
            return
        corpus = Path(root) / "stdlib"
        documents, size = make_corpus(corpus, args.files)
        print(f"corpus: {documents} stdlib files, {size / 2**20:.1f} MiB of text")
        if args.resume:
            counts = [int(n) for n in args.resume.split(",")]
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
            variants = {"": ""}
            if args.endless:
                variants = {"": "+endless", ", cadence 0": "+endless+zephon"}
            for n in counts:  # the states to resume from, saved untimed
                for suffix in variants.values():
                    subprocess.run([sys.executable, __file__, "--child", str(corpus), f"save@{n}{suffix}"], env=env,
                                   check=True)
            cases = {"fresh": (corpus, "default" + variants[""]),
                     **{f"resume after {n}{label}": (corpus, f"resume@{n}{suffix}")
                        for n in counts for label, suffix in variants.items()}}
            medians = _measure(cases, args.repeats)
            _print("start", medians)
            return
        medians = _measure({setting: (corpus, setting) for setting in args.settings.split(",")}, args.repeats)
        _print("tokenize_parallelism", medians)


if __name__ == "__main__":
    main()
