"""How the loader's state and its cost grow with the number of data-parallel ranks.

    python benchmarks/bench_scale.py [--ranks 1,2,4,8] [--files 320] [--seq 8192] [--batch 8] [--calls 5]
                                     [--passes 2]

For each N, N processes on this machine form a gloo process group on loopback
(as ``torchrun`` would: ``MASTER_ADDR``/``MASTER_PORT``) and each builds the
loader with the defaults (``read_ahead`` 2, ``passes: 1``, wrap packing,
``canonical_replicas`` 8) over the Python standard library's sources as JSONL
(``--files`` files in 4 shards: heavy-tailed). Each rank then

1. reads two whole passes, counting its batches (every rank the same, when
   the ranks agree on the pass end; ``carried``: batches of the first pass
   the rank had left at its end, delivered first in the second);
2. starts a new pass, takes 3 batches, lets the read-ahead fill, and calls
   ``state_dict()`` ``--calls`` times (a collective: all ranks together),
   measuring its latency, then ``load_state_dict()`` of it into a second loader.

Printed per N: state bytes per rank (JSON and ``torch.save``), medians of
``state_dict()`` and ``load_state_dict()``, batches per rank in the pass; then,
for each quantity, a least-squares line in N and its value at 1,024 ranks.
The numbers are rank 0's (the slowest rank bounds a collective anyway).
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_first_batch import make_corpus  # noqa: E402  (the same stdlib corpus)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, world: int, port: int, args: dict, out: str) -> None:
    try:
        import torch
        import torch.distributed as dist

        from zephon_loader import build_text_loader
        from zephon_loader.config import package_data_dir

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        config = {
            "sources": [{"name": "stdlib", "path": args["corpus"]}],
            "tokenizer": {"path": str(package_data_dir() / "tokenizer")},
            "sequence_length": args["seq"],
            "micro_batch_size": args["batch"],
            "packing": {"algorithm": "wrap"},
            "distributed": {"canonical_replicas": 8, "run_id": f"bench-scale-{world}"},
        }
        result: dict = {}
        with build_text_loader(config) as loader:
            start = time.perf_counter()
            result["batches_per_pass"] = [sum(1 for _ in loader) for _ in range(args["passes"])]
            result["pass_s"] = (time.perf_counter() - start) / max(1, args["passes"])
            result["carried"] = loader.stats().get("carried_batches", 0) if args["passes"] else None
            it = iter(loader)
            for _ in range(3):
                next(it)
            deadline = time.monotonic() + 60
            read_ahead = getattr(loader, "_read_ahead", None)
            while read_ahead is not None and read_ahead.buffered < read_ahead.depth and time.monotonic() < deadline:
                time.sleep(0.01)
            times = []
            for _ in range(args["calls"]):
                dist.barrier()
                started = time.perf_counter()
                state = loader.state_dict()
                times.append(time.perf_counter() - started)
            result["state_dict_s"] = statistics.median(times)
            result["state_json_bytes"] = len(json.dumps(state))
            buffer = io.BytesIO()
            torch.save(state, buffer)
            result["state_torch_bytes"] = buffer.tell()
        config["distributed"]["run_id"] = f"bench-scale-{world}-load"
        with build_text_loader(config) as other:
            times = []
            for _ in range(args["calls"]):
                started = time.perf_counter()
                other.load_state_dict(state)
                times.append(time.perf_counter() - started)
            result["load_state_dict_s"] = statistics.median(times)
        dist.barrier()
        dist.destroy_process_group()
        Path(out).write_text(json.dumps(result))
    except BaseException:
        Path(out).with_suffix(".error").write_text(traceback.format_exc())
        raise


def measure(world: int, args: dict, folder: Path) -> list[dict]:
    context = mp.get_context("spawn")
    port = _free_port()
    outs = [str(folder / f"n{world}-rank{rank}.json") for rank in range(world)]
    processes = [context.Process(target=_rank, args=(rank, world, port, args, outs[rank])) for rank in range(world)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(1800)
    for out, process in zip(outs, processes):
        if process.is_alive():
            process.kill()
        error = Path(out).with_suffix(".error")
        if process.exitcode != 0:
            raise SystemExit(f"N={world}: {error.read_text() if error.exists() else f'exit {process.exitcode}'}")
    return [json.loads(Path(out).read_text()) for out in outs]


def _fit(ns: list[int], values: list[float]) -> tuple[float, float]:
    """Least-squares ``a + b * N``."""
    mean_n, mean_v = statistics.fmean(ns), statistics.fmean(values)
    spread = sum((n - mean_n) ** 2 for n in ns)
    slope = sum((n - mean_n) * (v - mean_v) for n, v in zip(ns, values)) / spread if spread else 0.0
    return mean_v - slope * mean_n, slope


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="1,2,4,8")
    parser.add_argument("--files", type=int, default=320)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--passes", type=int, default=2,
                        help="whole passes read first (0: none; a loader whose ranks fall out of step needs 0)")
    options = parser.parse_args()
    ranks = [int(n) for n in options.ranks.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as root:
        corpus = Path(root) / "stdlib"
        documents, size = make_corpus(corpus, options.files)
        args = {"corpus": str(corpus), "seq": options.seq, "batch": options.batch, "calls": options.calls,
                "passes": options.passes}
        print(f"corpus: {documents} stdlib files in 4 shards, {size / 2**20:.1f} MiB; S={options.seq}, "
              f"B={options.batch}, canonical_replicas 8, defaults otherwise; {os.cpu_count()} cores")
        rows = {}
        for world in ranks:
            results = measure(world, args, Path(root))
            rows[world] = results
            zero = results[0]
            print(f"N={world}: state {zero['state_json_bytes'] / 1e3:.1f} kB JSON, "
                  f"{zero['state_torch_bytes'] / 1e3:.1f} kB torch.save per rank; state_dict() "
                  f"{zero['state_dict_s'] * 1e3:.0f} ms, load_state_dict() {zero['load_state_dict_s'] * 1e3:.0f} ms "
                  f"(medians of {options.calls}); batches per rank in passes 1 and 2 "
                  f"{[r['batches_per_pass'] for r in results]}, carried from 1 into 2 "
                  f"{[r['carried'] for r in results]}; a pass {zero['pass_s']:.1f} s", flush=True)
    # One rank runs no round (Zephon's local path): fit the growth over the multi-rank points when there are two.
    fitted = [n for n in ranks if n > 1] if len([n for n in ranks if n > 1]) >= 2 else ranks
    if len(fitted) > 1:
        print(f"fit a + b*N over N={fitted}, value at N=1024:")
        for key, unit, scale in (("state_json_bytes", "kB", 1e-3), ("state_torch_bytes", "kB", 1e-3),
                                 ("state_dict_s", "ms", 1e3), ("load_state_dict_s", "ms", 1e3)):
            values = [rows[n][0][key] * scale for n in fitted]
            a, b = _fit(fitted, values)
            print(f"  {key:<18} a={a:9.2f} b={b:+9.3f} {unit}/rank -> {a + b * 1024:10.1f} {unit} at 1,024 ranks")


if __name__ == "__main__":
    main()
