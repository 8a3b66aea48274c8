"""What a data-parallel job pays the loader per rank as it grows: state, checkpoint traffic, pass agreement.

    python benchmarks/bench_scale.py [--ranks 1,2,4,8,16] [--lanes 1,8] [--files 200] [--seq 512] [--batch 2]
                                     [--calls 3] [--passes 1] [--step-ms 0] [--scope job,rank]

For each N in ``--ranks`` and each factor f in ``--lanes``, N processes on this
machine form a gloo process group on loopback (as ``torchrun`` would:
``MASTER_ADDR``/``MASTER_PORT``, Zephon's rounds on its TCPStore through
``aggregate_store: torch://``) and each builds the loader with
``distributed.canonical_replicas`` = f·N, ``runtime.runner: threads`` (a
light runner: 16-32 ranks share this machine's cores), wrap packing,
``read_ahead`` 2, ``passes: 1`` and each ``distributed.state_scope`` of
``--scope`` (``job``: every lane in every rank's state, a collective;
``rank``: a rank's own lanes, no collective), over the Python standard library's
sources as JSONL (``--files`` files in 4 shards). Each rank then

1. reads ``--passes`` whole passes (``--step-ms``: sleeping that long per
   batch, a training step during which the read-ahead fills; 0: as fast as
   the data comes, a loop bound by the data) (the ranks' pass ends agreed:
   ``distributed.even_passes``), counting its batches, the collectives it
   ran on ``torch.distributed`` while doing so (``all_reduce``, ``broadcast``,
   ``all_gather``, ``barrier``, ``new_group``: counted by wrapping them; the
   loop itself runs none), the wall time blocked in them (a call, or the
   ``wait()`` of an asynchronous one) and the wall time in the loader's pass
   agreement (``ZephonLoader._agree``, wrapped: it also waits for the rank's
   next batch to be read, so it includes data time);
2. starts a new pass, takes 3 batches, lets the read-ahead fill, and calls
   ``state_dict()`` ``--calls`` times (all ranks together, after a barrier),
   counting the bytes its client sent to and read from the TCPStore during
   the calls (Zephon's ``TorchKVStore``, wrapped: values set/appended and
   values read); then ``load_state_dict()`` of the state into a second loader.

Printed per (N, lanes): state bytes per rank (JSON), bytes through the store
per ``state_dict()`` (all ranks' traffic: what rank 0's store serves), medians
of ``state_dict()`` and ``load_state_dict()`` (rank 0; the slowest rank bounds
a collective anyway), collectives per batch and agreement time per batch
(the mean over ranks), batches per rank. Then, per lane factor, a least-squares
fit of each quantity in N (and, for the store traffic, in N·L) with its value at
1,024 ranks. The machine's cores are shared by N processes: latencies at large
N measure this machine's oversubscription as much as the loader; counts and
bytes do not depend on it.
"""

from __future__ import annotations

import argparse
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

_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_object", "barrier", "new_group",
                "all_gather_into_tensor", "reduce_scatter")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Counters:
    def __init__(self) -> None:
        self.collectives = 0
        self.store_sent = 0
        self.store_read = 0
        self.agree_s = 0.0
        self.collective_s = 0.0


def _instrument(counters: _Counters) -> None:
    """Wrap torch.distributed's collectives and Zephon's TCPStore client to count what they carry."""
    import torch.distributed as dist
    from zephon._internal import kvstore

    class TimedWork:
        def __init__(self, work):
            self._work = work

        def wait(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return self._work.wait(*args, **kwargs)
            finally:
                counters.collective_s += time.perf_counter() - started

        def __getattr__(self, name):
            return getattr(self._work, name)

    def counting(fn):
        def wrapper(*args, **kwargs):
            counters.collectives += 1
            started = time.perf_counter()
            try:
                work = fn(*args, **kwargs)
            finally:
                counters.collective_s += time.perf_counter() - started
            return TimedWork(work) if kwargs.get("async_op") and work is not None else work
        return wrapper

    for name in _COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, counting(getattr(dist, name)))

    store = kvstore.TorchKVStore
    get, get_many, put, put_if_absent, append = (store.get, store.get_many, store._set, store._set_if_absent,
                                                 store._append)

    def _get(self, key):
        value = get(self, key)
        counters.store_read += len(value or b"")
        return value

    def _get_many(self, keys):
        values = get_many(self, keys)
        counters.store_read += sum(len(v or b"") for v in values)
        return values

    def _set(self, key, value):
        counters.store_sent += len(value)
        return put(self, key, value)

    def _set_if_absent(self, key, value):
        counters.store_sent += len(value)
        stored = put_if_absent(self, key, value)
        counters.store_read += len(stored or b"")
        return stored

    def _append(self, key, value):
        counters.store_sent += len(value)
        return append(self, key, value)

    store.get, store.get_many, store._set, store._set_if_absent, store._append = (
        _get, _get_many, _set, _set_if_absent, _append)


def _rank(rank: int, world: int, lanes: int, scope: str, port: int, args: dict, out: str) -> None:
    try:
        import torch.distributed as dist

        from zephon_loader import build_text_loader
        from zephon_loader.config import package_data_dir

        counters = _Counters()
        _instrument(counters)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        config = {
            "sources": [{"name": "stdlib", "path": args["corpus"]}],
            "tokenizer": {"path": str(package_data_dir() / "tokenizer")},
            "sequence_length": args["seq"],
            "micro_batch_size": args["batch"],
            "packing": {"algorithm": "wrap"},
            "runtime": {"runner": "threads"},
            "distributed": {"canonical_replicas": lanes, "run_id": f"bench-scale-{world}-{lanes}-{scope}",
                            "state_scope": scope},
        }
        result: dict = {}
        with build_text_loader(config) as loader:
            agree = getattr(loader, "_agree", None)
            if agree is not None:
                def timed_agree(*a, **k):
                    started = time.perf_counter()
                    try:
                        return agree(*a, **k)
                    finally:
                        counters.agree_s += time.perf_counter() - started
                loader._agree = timed_agree
            dist.barrier()
            counters.collectives, counters.collective_s = 0, 0.0
            start = time.perf_counter()
            step = args["step_ms"] / 1e3

            def count(batches) -> int:
                n = 0
                for _ in batches:
                    n += 1
                    if step:
                        time.sleep(step)  # a training step (the loop's own work), during which the read-ahead fills
                return n

            result["batches_per_pass"] = [count(loader) for _ in range(args["passes"])]
            result["pass_s"] = (time.perf_counter() - start) / max(1, args["passes"])
            result["collectives"] = counters.collectives
            result["agree_s"] = counters.agree_s
            result["collective_s"] = counters.collective_s
            it = iter(loader)
            for _ in range(3):
                next(it)
            deadline = time.monotonic() + 60
            read_ahead = getattr(loader, "_read_ahead", None)
            while read_ahead is not None and read_ahead.buffered < read_ahead.depth and time.monotonic() < deadline:
                time.sleep(0.01)
            times = []
            dist.barrier()
            counters.store_sent = counters.store_read = 0
            for _ in range(args["calls"]):
                dist.barrier()
                started = time.perf_counter()
                state = loader.state_dict()
                times.append(time.perf_counter() - started)
            result["store_sent"] = counters.store_sent / args["calls"]
            result["store_read"] = counters.store_read / args["calls"]
            result["state_dict_s"] = statistics.median(times)
            result["state_json_bytes"] = len(json.dumps(state))
            result["lanes_in_state"] = len(state.get("lanes") or range(lanes))
        config["distributed"]["run_id"] += "-load"
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


def measure(world: int, lanes: int, scope: str, args: dict, folder: Path) -> list[dict]:
    context = mp.get_context("spawn")
    port = _free_port()
    outs = [str(folder / f"n{world}-l{lanes}-{scope}-rank{rank}.json") for rank in range(world)]
    processes = [context.Process(target=_rank, args=(rank, world, lanes, scope, port, args, outs[rank]))
                 for rank in range(world)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + 1800
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for out, process in zip(outs, processes):
        if process.is_alive():
            process.kill()
        error = Path(out).with_suffix(".error")
        if process.exitcode != 0:
            raise SystemExit(f"N={world}, lanes {lanes}: {error.read_text() if error.exists() else f'exit {process.exitcode}'}")
    return [json.loads(Path(out).read_text()) for out in outs]


def _fit(xs: list[float], values: list[float]) -> tuple[float, float]:
    """Least-squares ``a + b * x``."""
    mean_x, mean_v = statistics.fmean(xs), statistics.fmean(values)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (v - mean_v) for x, v in zip(xs, values)) / spread if spread else 0.0
    return mean_v - slope * mean_x, slope


def summarize(world: int, lanes: int, scope: str, results: list[dict]) -> dict:
    zero = results[0]
    batches = [sum(r["batches_per_pass"]) for r in results]
    return {
        "N": world, "L": lanes, "scope": scope,
        "state_kB": max(r["state_json_bytes"] for r in results) / 1e3,
        "lanes_in_state": max(r["lanes_in_state"] for r in results),
        "store_kB": sum(r["store_sent"] + r["store_read"] for r in results) / 1e3,
        "state_dict_ms": zero["state_dict_s"] * 1e3,
        "load_ms": zero["load_state_dict_s"] * 1e3,
        "collectives_per_batch": statistics.fmean(r["collectives"] / max(1, b) for r, b in zip(results, batches)),
        "agree_ms_per_batch": statistics.fmean(r["agree_s"] * 1e3 / max(1, b) for r, b in zip(results, batches)),
        "blocked_ms_per_batch": statistics.fmean(r["collective_s"] * 1e3 / max(1, b)
                                                 for r, b in zip(results, batches)),
        "batches": sorted(set(tuple(r["batches_per_pass"]) for r in results)),
        "pass_s": zero["pass_s"],
    }


HEADER = ("| N | L | scope | lanes in a state | state/rank (kB JSON, largest) | store traffic per state_dict() (kB, all ranks) | state_dict() ms | "
          "load_state_dict() ms | collectives/batch | in collectives ms/batch | in _agree ms/batch | batches/rank per pass |")


def row(s: dict) -> str:
    return (f"| {s['N']} | {s['L']} | {s['scope']} | {s['lanes_in_state']} | {s['state_kB']:.1f} | {s['store_kB']:.1f} | {s['state_dict_ms']:.0f} | "
            f"{s['load_ms']:.1f} | {s['collectives_per_batch']:.3f} | {s['blocked_ms_per_batch']:.3f} | "
            f"{s['agree_ms_per_batch']:.2f} | "
            f"{'/'.join(str(list(b)) for b in s['batches'])} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="1,2,4,8,16")
    parser.add_argument("--lanes", default="1,8", help="canonical_replicas as multiples of N")
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="a training step per batch (a sleep): the read-ahead fills meanwhile, as in training")
    parser.add_argument("--scope", default="job,rank", help="distributed.state_scope values to measure")
    parser.add_argument("--json", help="also write the rows here")
    options = parser.parse_args()
    ranks = [int(n) for n in options.ranks.split(",")]
    factors = [int(f) for f in options.lanes.split(",")]
    summaries = []
    with tempfile.TemporaryDirectory(prefix="bench_scale_") as root:
        corpus = Path(root) / "stdlib"
        documents, size = make_corpus(corpus, options.files)
        args = {"corpus": str(corpus), "seq": options.seq, "batch": options.batch, "calls": options.calls,
                "passes": options.passes, "step_ms": options.step_ms}
        print(f"corpus: {documents} stdlib files in 4 shards, {size / 2**20:.1f} MiB; S={options.seq}, "
              f"B={options.batch}, runner threads, read_ahead 2, step {options.step_ms:g} ms, defaults otherwise; "
              f"{os.cpu_count()} cores",
              flush=True)
        print(HEADER)
        print("|---" * (HEADER.count("|") - 1) + "|",
              flush=True)
        for world in ranks:
            for factor in factors:
                if world == 1 and factor != factors[0] and factor * world in {f * world for f in factors[:1]}:
                    continue
                for scope in options.scope.split(","):
                    summary = summarize(world, factor * world, scope,
                                        measure(world, factor * world, scope, args, Path(root)))
                    summaries.append(summary)
                    print(row(summary), flush=True)
    if options.json:
        Path(options.json).write_text(json.dumps(summaries, indent=1))
    for factor in factors:
        for scope in options.scope.split(","):
            points = [s for s in summaries if s["L"] == factor * s["N"] and s["N"] > 1 and s["scope"] == scope]
            if len(points) < 2:
                continue
            ns = [s["N"] for s in points]
            print(f"\nL = {factor}*N, state_scope {scope}: fit a + b*N over N={ns}, value at N=1,024 "
                  f"(L={factor * 1024}):")
            for key in ("state_kB", "store_kB", "state_dict_ms", "load_ms", "collectives_per_batch",
                        "blocked_ms_per_batch", "agree_ms_per_batch"):
                a, b = _fit(ns, [s[key] for s in points])
                print(f"  {key:<22} a={a:10.3f} b={b:+10.4f}/rank -> {a + b * 1024:12.2f} at 1,024 ranks")
            nl = [s["N"] * s["L"] for s in points]
            a, b = _fit(nl, [s["store_kB"] for s in points])
            print(f"  store_kB in N*L         a={a:10.3f} b={b:+10.5f}/(rank*lane) -> "
                  f"{(a + b * 1024 * factor * 1024) / 1e6:12.2f} GB at 1,024 ranks x {factor * 1024} lanes")


if __name__ == "__main__":
    main()
