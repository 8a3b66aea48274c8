"""Object storage against local disk: throughput, and time to first batch for few and many shards.

A real S3 server on loopback (moto's server mode, started here; nothing leaves the machine) holds the same
shards as a local folder. Each measurement runs in a fresh subprocess, local and S3 alternating, so the
machine's noise hits both alike; the ratio is what to read (moto is a Python server: a real bucket's latency
is higher per request, its bandwidth much higher).

* **throughput**: a whole pass of the Python standard library's sources as JSONL (``--files``, 8 shards),
  S=2048, B=8, wrap; tokens per second, build included and excluded.
* **first batch**: build + first batch over 10 and over 1,000 small JSONL shards (``--many``), with and
  without Zephon's ``index.json`` (built locally with ``python -m zephon.build_index`` and uploaded).

    python benchmarks/bench_object_storage.py [--files 600] [--many 1000] [--rounds 2]

Needs ``pip install 'zephon-loader[s3]' 'moto[server]' boto3``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def stdlib_corpus(folder: Path, files: int, shards: int = 8) -> int:
    folder.mkdir(parents=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in stdlib.rglob("*.py") if "test" not in p.parts and "site-packages" not in p.parts)
    handles = [(folder / f"part-{i:05d}.jsonl").open("w", encoding="utf-8") for i in range(shards)]
    count = 0
    for path in paths:
        if count >= files:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            handles[count % shards].write(json.dumps({"text": text}) + "\n")
            count += 1
    for handle in handles:
        handle.close()
    return count


def small_shards(folder: Path, shards: int) -> None:
    folder.mkdir(parents=True)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "loader", "token", "packed", "resume", "shard", "epoch"]
    for i in range(shards):
        lines = [json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 300)))})
                 for _ in range(20)]
        (folder / f"part-{i:05d}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def child(path: str, mode: str) -> None:
    from zephon_loader import build_text_loader
    from zephon_loader.config.schema import package_data_dir

    cfg = {"sources": [{"name": "corpus", "path": path}], "tokenizer": {"path": str(package_data_dir() / "tokenizer")},
           "sequence_length": 2048, "micro_batch_size": 8, "packing": {"algorithm": "wrap"}}
    started = time.perf_counter()
    with build_text_loader(cfg) as loader:
        built = time.perf_counter()
        tokens = 0
        for batch in loader:
            if mode == "first":
                break
            tokens += int((~batch["padding_mask"]).sum()) if "padding_mask" in batch else batch["input_ids"].numel()
        ended = time.perf_counter()
    print(json.dumps({"build": built - started, "total": ended - started, "tokens": tokens}))


def run_child(path: str, mode: str, env: dict[str, str]) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--child", path, mode], env=env, capture_output=True, text=True,
                         timeout=1800)
    if out.returncode:
        raise SystemExit(f"child failed ({path}, {mode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=600, help="stdlib files in the throughput corpus")
    parser.add_argument("--many", type=int, default=1000, help="shards of the many-shards case")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    sys.path.insert(0, str(HERE.parent / "tests"))
    from s3_server import CREDENTIALS, S3  # the tests' loopback server

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        s3 = S3()
        env = {**os.environ, **CREDENTIALS, "S3_ENDPOINT_URL": f"http://127.0.0.1:{s3.moto_port}",
               "ZEPHON_LOADER_CACHE": str(root / "cache")}
        documents = stdlib_corpus(root / "stdlib", args.files)
        cases = {"stdlib": (str(root / "stdlib"), s3.upload(root / "stdlib", "bench", "stdlib"))}
        for n in (10, args.many):
            small_shards(root / f"s{n}", n)
            cases[f"{n} shards"] = (str(root / f"s{n}"), s3.upload(root / f"s{n}", "bench", f"s{n}"))
            indexed = root / f"s{n}-index"
            small_shards(indexed, n)
            subprocess.run([sys.executable, "-m", "zephon.build_index", "jsonl", str(indexed)], check=True,
                           capture_output=True)
            cases[f"{n} shards + index"] = (str(indexed), s3.upload(indexed, "bench", f"s{n}-index"))
        print(f"corpus: {documents} stdlib files in 8 JSONL shards; S=2048, B=8, wrap, defaults otherwise; "
              f"{args.rounds} rounds, fresh subprocesses, local and S3 alternating; moto on 127.0.0.1")
        results: dict[tuple[str, str, str], list[dict[str, float]]] = {}
        for _ in range(args.rounds):
            for name, (local, remote) in cases.items():
                mode = "pass" if name == "stdlib" else "first"
                for where, path in (("local", local), ("s3", remote)):
                    # a fresh cache each time: the S3 run downloads, the local run hashes (both cold)
                    env["ZEPHON_LOADER_CACHE"] = str(root / f"cache-{time.monotonic_ns()}")
                    results.setdefault((name, mode, where), []).append(run_child(path, mode, env))
        s3.stop()

    def med(name, mode, where, key):
        return statistics.median(r[key] for r in results[(name, mode, where)])

    local_tps = med("stdlib", "pass", "local", "tokens") / med("stdlib", "pass", "local", "total")
    s3_tps = med("stdlib", "pass", "s3", "tokens") / med("stdlib", "pass", "s3", "total")
    steady = lambda where: (med("stdlib", "pass", where, "tokens")  # noqa: E731
                            / (med("stdlib", "pass", where, "total") - med("stdlib", "pass", where, "build")))
    print(f"\nthroughput, one pass ({med('stdlib', 'pass', 'local', 'tokens'):.0f} tokens):")
    print(f"  local {local_tps:,.0f} tok/s, S3 {s3_tps:,.0f} tok/s: S3/local {s3_tps / local_tps:.2f} "
          f"(after the build: local {steady('local'):,.0f}, S3 {steady('s3'):,.0f}, ratio "
          f"{steady('s3') / steady('local'):.2f})")
    print("\ntime to first batch (build + first batch), median seconds:")
    print(f"  {'case':<22} {'local':>8} {'S3':>8} {'S3/local':>9}   (S3 build alone)")
    for name in cases:
        if name == "stdlib":
            continue
        local, remote = med(name, "first", "local", "total"), med(name, "first", "s3", "total")
        print(f"  {name:<22} {local:8.2f} {remote:8.2f} {remote / local:9.2f}   ({med(name, 'first', 's3', 'build'):.2f})")


if __name__ == "__main__":
    main()
