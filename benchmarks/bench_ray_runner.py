"""``runtime.runner: ray`` versus ``threads`` on the same corpus, side by side in one run.

Builds a JSONL corpus of ``--docs`` documents (50-400 words) and a small local
BPE tokenizer, then reads one pass with each runner (``S = 1024``, ``B = 4``)
and prints the time to the first batch (under ``ray``: starting a local Ray
instance and the tokenize actors), the tokens per second after it, and
whether both passes yielded the same ``input_ids``.

Measured on the 2-core development machine (shared with other jobs, load
average 4-5; 6,000 documents, 1.38M tokens, ``tokenize_parallelism: 2`` for
both): threads first batch 0.6-0.7 s, 279k-292k tokens/s after it; ray first
batch 12.5-16.4 s (``ray.init`` about 5-7 s, then two actor processes each
importing Zephon), 339k-415k tokens/s after it (the actors tokenize outside
the trainer's process); the same batches. A pass shorter than about a minute
is slower under ray: the start-up dominates.

Usage: ``python benchmarks/bench_ray_runner.py [--docs 6000] [--tokenize-parallelism 2]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

from conftest import make_texts, text_config, train_tokenizer, write_jsonl_shards  # noqa: E402
from zephon_loader import fields as F  # noqa: E402
from zephon_loader.build import build_text_loader  # noqa: E402


def one_pass(config: dict) -> tuple[list[torch.Tensor], float, float, int]:
    """``(input_ids per batch, seconds to the first batch, seconds after it, real tokens)``."""
    started = time.perf_counter()
    with build_text_loader(config) as loader:
        iterator = iter(loader)
        batches = [next(iterator)]
        first = time.perf_counter()
        batches.extend(iterator)
        done = time.perf_counter()
    tokens = sum(int((~batch[F.PADDING_MASK]).sum()) for batch in batches)
    return [batch[F.INPUT_IDS] for batch in batches], first - started, done - first, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=6000)
    parser.add_argument("--tokenize-parallelism", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_ray_runner_"))
    texts = make_texts(args.docs, seed=1, min_words=50, max_words=400)
    tokenizer = train_tokenizer(texts[:500], root / "tokenizer")
    data = write_jsonl_shards(root / "web", [{"text": text} for text in texts], shards=4)
    results = {}
    for runner in ("threads", "ray"):
        runtime = {"runner": runner, "tokenize_parallelism": args.tokenize_parallelism}
        config = text_config(data, tokenizer, sequence_length=1024, micro_batch_size=4, runtime=runtime)
        ids, first, rest, tokens = one_pass(config)
        results[runner] = ids
        print(f"{runner:8s} batches={len(ids)} tokens={tokens} first_batch={first:.1f}s "
              f"tokens/s_after_first={tokens / rest:,.0f}", flush=True)
    same = len(results["ray"]) == len(results["threads"]) and all(
        torch.equal(a, b) for a, b in zip(results["ray"], results["threads"]))
    print(f"same batches: {same}")


if __name__ == "__main__":
    main()
