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

``--shape BxS`` overrides the config's micro-batch size and sequence length;
``--stdlib-files N`` replaces its sources with N files of the Python standard
library as JSONL (``bench_first_batch.make_corpus``: heavy-tailed, real), so that
a long row shape such as 8x8192 still has many batches per pass.

``--runner`` overrides the config's Zephon runner on both sides (threads
workers compete with the consumer for Python's GIL on few cores; ``inline``
runs Zephon in the consumer's thread). ``--step-ms`` adds a simulated training
step per batch on both sides (a sleep: like GPU work, it releases the GIL), the
time read-ahead exists to overlap.

``--own-cost`` measures what the loader itself costs a batch, apart from
Zephon: one pass of Zephon's batches is pulled first, then replayed through
the loader (Zephon's iterator replaced by that list; the same batches, checked
equal to a live pass) and through ``to_training`` alone, in alternating
rounds. The difference is the loader's own work per batch (collate's checks
and document ids, label masking, the final map, accounting, the nodes), much
steadier from run to run than a throughput ratio. With Zephon running in the
consumer's process (``inline``/``threads``), its engine and the loader share
Python's lock, so what of the loader's work holds the lock adds to Zephon's
time: the script prints ``direct / (direct + own cost)``, the ratio if none
of it overlapped Zephon. At small batches (the demo's 4x256) that is what
the throughput ratio comes to; at long rows the loader's tensor kernels run
with the lock released, beside Zephon, and the ratio is higher.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from zephon_loader import fields as F
from zephon_loader.build import build_text_loader
from zephon_loader.config import read_loader_config
from zephon_loader.config import default_config_path
from zephon_loader.nodes.source import _Stream
from zephon_loader.pipeline.text import build_pipeline
from zephon_loader.tokenizing import TOKENIZERS_PARALLELISM, fit_tokenizer_threads

from timing import rotated  # benchmarks/ is on sys.path when run as a script


def _config(config_path: Path, runner: str | None, **overrides: Any) -> Any:
    """The config both sides read: the file's, with ``overrides`` (shape, sources) and ``runner`` applied."""
    cfg = read_loader_config(config_path)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    if runner is not None:
        cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, runner=runner))
    return cfg


def _shape(text: str) -> tuple[int, int]:
    rows, _, length = text.lower().partition("x")
    try:
        return int(rows), int(length)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape: got {text!r}, expected BxS such as 8x8192") from None


def direct_tokens_per_s(cfg: Any, passes: int, step_s: float = 0.0) -> tuple[float, int]:
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
                    if step_s:
                        time.sleep(step_s)
            finally:
                iterator.close()
        return tokens / (time.perf_counter() - start), batches


def loader_tokens_per_s(cfg: Any, passes: int, read_ahead: int | None = None, step_s: float = 0.0) -> tuple[float, int]:
    tokens = batches = 0
    config = cfg
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
                if step_s:
                    time.sleep(step_s)
    return tokens / (time.perf_counter() - start), batches


@contextlib.contextmanager
def replayed(batches: list[Any]) -> Iterator[list[int]]:
    """Every Zephon stream started inside yields ``batches`` instead of reading (the engine is still built:
    the loader's anchors read Zephon's position from it). Yields a one-item list: the batches replayed so far."""
    start = _Stream.start
    replayed_count = [0]

    def replay_batches() -> Iterator[Any]:
        for batch in batches:
            replayed_count[0] += 1
            yield batch

    def replay(stream: Any, checkpoint: Any, skip: Any) -> None:
        start(stream, checkpoint, skip)
        stream.iterator = replay_batches()

    _Stream.start = replay
    try:
        yield replayed_count
    finally:
        _Stream.start = start


def own_cost(cfg: Any, rounds: int) -> None:
    """Per-batch times of the loader over replayed batches, ``to_training`` alone, and live Zephon (see --own-cost)."""
    with tempfile.TemporaryDirectory(prefix="bench_loader_") as work_dir:
        recorded = build_pipeline(cfg, work_dir=work_dir).pipeline
        iterator = iter(recorded)
        try:
            batches = list(iterator)
        finally:
            iterator.close()
    with build_text_loader(cfg) as live:
        expected = list(live)
    loaders = {f"loader (read_ahead={depth})": dataclasses.replace(cfg, read_ahead=depth)
               for depth in dict.fromkeys((cfg.read_ahead, 0))}
    with replayed(batches) as replayed_count, contextlib.ExitStack() as stack:
        built = {name: stack.enter_context(build_text_loader(config)) for name, config in loaders.items()}
        for name, loader in built.items():
            before = replayed_count[0]
            got = list(loader)
            if replayed_count[0] - before != len(batches):
                raise SystemExit(f"{name}: the loader did not read the replayed batches (Zephon's stream start "
                                 "changed?); the measurement would include Zephon")
            same = len(got) == len(expected) and all(
                a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
                                             for k in a) for a, b in zip(got, expected))
            if not same:
                raise SystemExit(f"{name}: the replayed pass differs from a live pass; the measurement would not "
                                 "be of the loader's real work")

        def through(loader: Any) -> Callable[[], int]:
            def one_pass() -> int:
                loader.set_epoch(0)
                return sum(1 for _ in loader)
            return one_pass

        def to_training() -> int:
            for batch in batches:
                batch.to_training(return_labels=True, return_padding_mask=True)
            return len(batches)

        def direct() -> int:
            count = 0
            iterator = iter(live_pipeline)
            try:
                for batch in iterator:
                    batch.to_training(return_labels=True, return_padding_mask=True)
                    count += 1
            finally:
                iterator.close()
            return count

        with tempfile.TemporaryDirectory(prefix="bench_loader_") as work_dir:
            live_pipeline = build_pipeline(cfg, work_dir=work_dir).pipeline
            sides = {"direct (live Zephon + to_training)": direct, "to_training alone": to_training,
                     **{name: through(loader) for name, loader in built.items()}}
            per_batch: dict[str, list[float]] = {name: [] for name in sides}
            for round_index in range(rounds):
                for name in rotated(list(sides), round_index):
                    start = time.perf_counter()
                    count = sides[name]()
                    per_batch[name].append((time.perf_counter() - start) / count * 1e6)
    median = {name: statistics.median(times) for name, times in per_batch.items()}
    print(f"{len(batches)} batches a pass, {rounds} rounds, medians per batch:")
    for name, us in median.items():
        print(f"  {name:36s} {us:9.1f} us")
    direct_us, alone_us = median["direct (live Zephon + to_training)"], median["to_training alone"]
    for name in built:
        own = median[name] - alone_us
        print(f"{name}: own cost {own:.1f} us a batch = {own / direct_us:.1%} of direct; "
              f"ratio if none of it overlapped Zephon: {direct_us / (direct_us + own):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", type=Path, default=default_config_path())
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=4, help="full passes over the stream per measurement")
    parser.add_argument("--runner", choices=("threads", "inline", "process"), default=None,
                        help="Zephon runner on both sides (default: the config's)")
    parser.add_argument("--step-ms", type=float, default=0.0, help="simulated training step per batch (a sleep)")
    parser.add_argument("--shape", type=_shape, default=None, help="BxS: micro_batch_size x sequence_length")
    parser.add_argument("--stdlib-files", type=int, default=0,
                        help="read N Python standard library files (JSONL) instead of the config's sources")
    parser.add_argument("--own-cost", action="store_true",
                        help="the loader's own work per batch, over one pass of Zephon's batches replayed")
    args = parser.parse_args()
    if args.own_cost and (args.step_ms or args.passes != parser.get_default("passes")):
        parser.error("--own-cost times one replayed pass a round with an empty consumer: "
                     "it takes no --step-ms or --passes")
    with tempfile.TemporaryDirectory(prefix="bench_loader_corpus_") as corpus_root:
        overrides: dict[str, Any] = {}
        if args.shape is not None:
            overrides.update(micro_batch_size=args.shape[0], sequence_length=args.shape[1])
        if args.stdlib_files:
            from bench_first_batch import make_corpus
            from zephon_loader.config.schema import SourceConfig

            documents, size = make_corpus(Path(corpus_root) / "stdlib", args.stdlib_files)
            print(f"corpus: {documents} stdlib files, {size / 2**20:.1f} MiB of text")
            overrides["sources"] = (SourceConfig(name="stdlib", path=str(Path(corpus_root) / "stdlib")),)
        run(args, _config(args.config, args.runner, **overrides))


def run(args: argparse.Namespace, cfg: Any) -> None:
    step = args.step_ms / 1000
    fit_tokenizer_threads()  # the loader's default, for both sides from the first round
    print(f"config {args.config}  shape {cfg.micro_batch_size}x{cfg.sequence_length}  runner {cfg.runtime.runner}  "
          f"step {args.step_ms} ms  torch {torch.__version__}  "
          f"threads {torch.get_num_threads()}  "
          f"{TOKENIZERS_PARALLELISM}={os.environ.get(TOKENIZERS_PARALLELISM, '(unset)')}")
    if args.own_cost:
        own_cost(cfg, args.rounds)
        return
    read_ahead = cfg.read_ahead
    sides = {
        "direct": lambda: direct_tokens_per_s(cfg, args.passes, step),
        f"loader (read_ahead={read_ahead})": lambda: loader_tokens_per_s(cfg, args.passes, None, step),
        "loader (read_ahead=0)": lambda: loader_tokens_per_s(cfg, args.passes, 0, step),
    }
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for round_index in range(args.rounds):
        for name in rotated(list(sides), round_index):
            rate, batches = sides[name]()
            rates[name].append(rate)
            print(f"  round {round_index}  {name:24s} {rate:12,.0f} tokens/s  ({batches} batches)")
    direct = statistics.median(rates["direct"])
    print(f"median direct {direct:,.0f} tokens/s")
    for name in list(sides)[1:]:
        median = statistics.median(rates[name])
        # Each round's pair was measured side by side: the median of their ratios is what machine noise
        # (which moves both sides of a round alike) disturbs least.
        paired = [rate / base for rate, base in zip(rates[name], rates["direct"])]
        print(f"median {name} {median:,.0f} tokens/s | ratio to direct {statistics.median(paired):.3f} "
              f"(rounds {min(paired):.3f}-{max(paired):.3f})")


if __name__ == "__main__":
    main()
