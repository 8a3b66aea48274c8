"""Loader throughput vs iterating the same Zephon pipeline and calling ``to_training`` directly.

    python benchmarks/bench_loader.py [CONFIG] [--rounds 3]

Same config for both (default: the bundled demo), one process, each side
timed from its first ``iter()`` to exhaustion (worker start-up included on
both sides, building excluded on both), alternating
rounds so machine noise hits both sides alike. Prints non-padding tokens/s
per side (median over rounds) and the ratio loader / direct. Goal: >= 0.95.

"direct" = ``pipeline.build_pipeline`` → ``iter`` → ``SampleBatch.to_training(
return_labels=True, return_padding_mask=True)``: the least a training loop
on Zephon must do. "loader" adds document ids, the final
map for the configured contract, read-ahead and the torchdata graph.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from zephon_loader import fields as F
from zephon_loader.builders import build_text_loader
from zephon_loader.config import read_loader_config
from zephon_loader.config import default_config_path
from zephon_loader.pipeline import build_pipeline


def direct_tokens_per_s(config_path: Path, passes: int) -> tuple[float, int]:
    cfg = read_loader_config(config_path)
    with tempfile.TemporaryDirectory(prefix="bench_loader_") as work_dir:
        pipeline = build_pipeline(cfg, work_dir=work_dir).pipeline
        tokens = batches = 0
        start = time.perf_counter()
        for _ in range(passes):
            iterator = iter(pipeline)
            try:
                for batch in iterator:
                    out = batch.to_training(return_labels=True, return_padding_mask=True)
                    tokens += int((~out["padding_mask"]).sum())
                    batches += 1
            finally:
                iterator.close()
        return tokens / (time.perf_counter() - start), batches


def loader_tokens_per_s(config_path: Path, passes: int, read_ahead: int | None = None) -> tuple[float, int]:
    tokens = batches = 0
    config = read_loader_config(config_path)
    if read_ahead is not None:
        config = dataclasses.replace(config, read_ahead=read_ahead)
    with build_text_loader(config) as loader:
        start = time.perf_counter()  # like the direct side: timed from the first iter(), not from building
        for _ in range(passes):
            # The same pass (epoch 0) each time, like the direct side: a new epoch would rebuild the pipeline.
            loader.set_epoch(0)
            for batch in loader:
                tokens += int((~batch[F.PADDING_MASK]).sum())
                batches += 1
    return tokens / (time.perf_counter() - start), batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", type=Path, default=default_config_path())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=4, help="full passes over the stream per measurement")
    args = parser.parse_args()
    print(f"config {args.config}  torch {torch.__version__}  threads {torch.get_num_threads()}")
    read_ahead = read_loader_config(args.config).read_ahead
    sides = {
        "direct": lambda: direct_tokens_per_s(args.config, args.passes),
        f"loader (read_ahead={read_ahead})": lambda: loader_tokens_per_s(args.config, args.passes),
        "loader (read_ahead=0)": lambda: loader_tokens_per_s(args.config, args.passes, read_ahead=0),
    }
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for round_index in range(args.rounds):
        # Rotate which side goes first so machine noise and warm caches favour none.
        names = list(sides)
        names = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in names:
            rate, batches = sides[name]()
            rates[name].append(rate)
            print(f"  round {round_index}  {name:24s} {rate:12,.0f} tokens/s  ({batches} batches)")
    direct = statistics.median(rates["direct"])
    print(f"median direct {direct:,.0f} tokens/s")
    for name in list(sides)[1:]:
        median = statistics.median(rates[name])
        print(f"median {name} {median:,.0f} tokens/s | ratio to direct {median / direct:.3f}")


if __name__ == "__main__":
    main()
