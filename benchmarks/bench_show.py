"""What ``zephon-loader show --steps N`` costs for a step far into a run, with and without a nearby state.

    python benchmarks/bench_show.py [--step 10000] [--near 10] [--sequence-length 32] [--batch 1]

The bundled demo corpus and tokenizer, an endless stream (``passes: null``), a small row (S = 32, B = 1 by
default) so that 10,000 batches are feasible on a 2-core machine. Timed, in this process, each after one
untimed build: (1) ``show`` of step ``--step`` without a state: it reads and packs every batch from the start
of the pass; (2) with a state ``--near`` steps earlier (made once, untimed, with ``skip_batches``): it reads
``--near`` + 1 batches. Both include building the loader (shard listing, tokenizer, Zephon's pipeline).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step", type=int, default=10_000)
    parser.add_argument("--near", type=int, default=10)
    parser.add_argument("--sequence-length", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()

    import yaml

    from zephon_loader.build import build_text_loader
    from zephon_loader.cli.show import show

    data = Path(__file__).resolve().parents[1] / "zephon_loader" / "data"
    cfg = {"sources": [{"name": "stories", "path": str(data / "corpus/stories"), "weight": 2.0},
                       {"name": "notes", "path": str(data / "corpus/notes"), "weight": 1.0}],
           "tokenizer": {"path": str(data / "tokenizer"), "text_field": "text"},
           "sequence_length": args.sequence_length, "micro_batch_size": args.batch, "packing": {"algorithm": "wrap"},
           "seed": 1234, "read_ahead": 0, "passes": None}
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "bench.yaml"
        config.write_text(yaml.safe_dump({"dataloader": cfg}))
        state = Path(folder) / "state.json"
        started = time.perf_counter()
        with build_text_loader(config) as loader:
            built = time.perf_counter() - started
            loader.skip_batches(args.step - args.near)  # untimed: makes the nearby state
            loader.save_state(state)
        show(config, (0, 0))  # warm-up: caches (shard digests, line index)
        started = time.perf_counter()
        far = show(config, (args.step, args.step))
        without = time.perf_counter() - started
        started = time.perf_counter()
        near = show(config, (args.step, args.step), state)
        with_state = time.perf_counter() - started
    assert far["steps"] == near["steps"], "show from the start and from the state disagree"
    print(json.dumps({"step": args.step, "sequence_length": args.sequence_length, "micro_batch_size": args.batch,
                      "build_s": round(built, 2), "show_without_state_s": round(without, 2),
                      "show_with_state_s": round(with_state, 2), "state_steps_before": args.near,
                      "batches_read_per_s_without_state": round((args.step + 1) / without),
                      "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
