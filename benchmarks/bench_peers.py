"""zephon_loader side by side with AutoModel 0.7.0's neat packing and TorchTitan 0.3.0's HF text loader.

    python benchmarks/bench_peers.py [--files 600] [--rounds 2] [--contract block_causal]

The peers are optional benchmark dependencies, installed under the constraints
file into an environment of their own (TorchTitan pins ``datasets`` and
``huggingface_hub`` versions the project's ``.venv`` does not have)::

    python3 -m venv .venv-peers
    .venv-peers/bin/python -m pip install -c scripts/constraints.txt torch==2.13.0
    .venv-peers/bin/python -m pip install -c scripts/constraints.txt -e ".[hf]" torchtitan==0.3.0
    .venv-peers/bin/python -m pip install -c scripts/constraints.txt --no-deps nemo-automodel==0.7.0
    .venv-peers/bin/python benchmarks/bench_peers.py

A peer that does not import is skipped with the reason. The corpus is the
Python standard library's ``.py`` files as JSONL (one record per file, the
bundled tokenizer), ``S = 2048``, ``B = 8``, each loader as a new user builds
it: its defaults, except that this loader packs with ``wrap`` (its default
``first_fit`` drops every file longer than a row, like AutoModel's
``drop_long_samples`` default does). Every measurement runs in a fresh
subprocess, the loaders in alternating order over ``--rounds`` rounds (machine
noise hits all alike); medians are printed, as ratios to this loader:

* first batch: from the start of building to the first batch;
* build + epoch: from the start of building to the end of one pass;
* steady tokens/s: input tokens per second after the first batch (AutoModel
  packs the whole corpus in its build, so its pass is only collation);
* peak RSS of the process;
* input tokens of one pass (non-padding input positions), next to the
  corpus' tokens with BOS and EOS: where the differences come from is
  explained in ``tests/test_token_accounting.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from bench_first_batch import make_corpus  # benchmarks/ is on sys.path when run as a script
from timing import rotated

S, B = 2048, 8
LOADERS = ("zephon_loader", "torchtitan", "automodel")


def _tokenizer_dir() -> str:
    from zephon_loader.config import package_data_dir

    return str(package_data_dir() / "tokenizer")


def _peak_rss_mib() -> float:
    peaks = (resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return max(peaks) / 1024  # KiB -> MiB on Linux


def _run_pass(build, count) -> dict[str, float]:
    """Time ``build()`` and one pass over what it returns; ``count(batch)`` gives a batch's input tokens."""
    start = time.perf_counter()
    loader = build()
    first = None
    total = steady = batches = 0
    for batch in loader:
        n = count(batch)
        if first is None:
            first = time.perf_counter()
        else:
            steady += n
        total += n
        batches += 1
    end = time.perf_counter()
    return {"first_batch_s": first - start, "build_epoch_s": end - start,
            "steady_tokens_per_s": steady / (end - first) if end > first else 0.0,
            "peak_rss_mib": _peak_rss_mib(), "batches": batches, "input_tokens": total}


def child_zephon_loader(corpus: Path, contract: str) -> dict[str, float]:
    from transformers import PreTrainedTokenizerFast  # noqa: F401 - imports outside the timed part, as the peers'
    # children have theirs (TorchTitan's datasets and tokenizer, AutoModel's AutoTokenizer): zephon_loader imports
    # transformers lazily, at the build, which would otherwise count ~1.3 s of module import as first-batch time.

    from zephon_loader import build_text_loader

    config = {"sources": [{"name": "stdlib", "path": str(corpus)}], "tokenizer": {"path": _tokenizer_dir()},
              "sequence_length": S, "micro_batch_size": B, "packing": {"algorithm": "wrap"}}
    if contract != "default":
        config["contract"] = {"packed_mask_type": contract}
    holder = {}

    def build():
        holder["loader"] = build_text_loader(config)
        return holder["loader"]

    result = _run_pass(build, lambda batch: int((~batch["padding_mask"]).sum()))
    loader = holder["loader"]
    stats = loader.stats()
    result["delivered_tokens"] = sum(source["delivered"]["tokens"] for source in stats["sources"].values())
    result["label_only_tokens"] = stats.get("label_only_tokens")
    loader.close()
    return result


def child_torchtitan(corpus: Path, contract: str) -> dict[str, float]:
    from datasets import load_dataset
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets import text_datasets
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    shards = sorted(str(p) for p in corpus.glob("*.jsonl"))
    text_datasets.DATASETS["stdlib"] = DatasetConfig(
        path=str(corpus), loader=lambda _path: load_dataset("json", data_files=shards, split="train", streaming=True),
        sample_processor=lambda sample: sample["text"])
    def build():
        tokenizer = HuggingFaceTokenizer(tokenizer_path=_tokenizer_dir())
        config = HuggingFaceTextDataLoader.Config(dataset="stdlib", infinite=False)
        return HuggingFaceTextDataLoader(config, dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=S,
                                         local_batch_size=B)

    # Greedy concatenation: no padding, every input position is a token.
    return _run_pass(build, lambda batch: batch[0]["input"].numel())


def child_automodel(corpus: Path, contract: str) -> dict[str, float]:
    import torch
    from nemo_automodel.components.datasets.loader import NeatPackingConfig
    from nemo_automodel.components.datasets.packing import DEFAULT_PACKED_SEQUENCE_CONTRACT
    from transformers import AutoTokenizer

    def build():
        tokenizer = AutoTokenizer.from_pretrained(_tokenizer_dir())
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        samples = []
        for shard in sorted(corpus.glob("*.jsonl")):
            for line in open(shard):
                ids = [bos, *tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"], eos]
                samples.append({"input_ids": ids[:-1], "labels": ids[1:]})  # AutoModel's datasets shift per document
        packing = (DEFAULT_PACKED_SEQUENCE_CONTRACT if contract == "default" else  # its contract is duck-typed
                   SimpleNamespace(packed_mask_type=contract, requires_packed_sequence_metadata=False))
        dataset, collate = NeatPackingConfig(packed_sequence_size=S).build(
            samples, pad_token_id=tokenizer.pad_token_id, packing_contract=packing)
        return torch.utils.data.DataLoader(dataset, batch_size=B, collate_fn=collate)

    def count(batch):
        ids = batch.get("_packed_seq_ids")
        if ids is None:
            ids = batch["attention_mask"] if batch["attention_mask"].ndim == 2 else batch["labels"].ne(-100)
        return int((ids != 0).sum())

    return _run_pass(build, count)


def child_count(corpus: Path) -> dict[str, int]:
    """The corpus: documents, and tokens with BOS and EOS (what every loader starts from)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(_tokenizer_dir(), split_special_tokens=True)
    documents = tokens = longest = 0
    lengths = []
    for shard in sorted(corpus.glob("*.jsonl")):
        for line in open(shard):
            n = len(tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"]) + 2
            documents += 1
            tokens += n
            lengths.append(n)
    short = sum(n for n in lengths if n - 1 <= S)
    return {"documents": documents, "tokens": tokens, "tokens_in_short_documents": short,
            "short_documents": sum(1 for n in lengths if n - 1 <= S)}


def child(name: str, corpus: Path, contract: str) -> None:
    if name == "count":
        print(json.dumps(child_count(corpus)))
        return
    result = {"zephon_loader": child_zephon_loader, "torchtitan": child_torchtitan,
              "automodel": child_automodel}[name](corpus, contract)
    print(json.dumps(result))


def _missing(name: str) -> str | None:
    """Why a loader cannot run in this interpreter, or None."""
    modules = {"zephon_loader": ["zephon_loader", "transformers"],
               "torchtitan": ["torchtitan.hf_datasets.text_datasets", "datasets"],
               "automodel": ["nemo_automodel.components.datasets.llm.neat_packing", "datasets", "transformers"]}[name]
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    done = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["import failed"])[-1]
        return f"{last} (install it under the constraints file: see this script's docstring)"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=600, help="stdlib files in the corpus")
    parser.add_argument("--rounds", type=int, default=2, help="rounds (each loader once per round, alternating)")
    parser.add_argument("--contract", default="default",
                        help="packed_mask_type for zephon_loader and AutoModel (default: each one's own default, "
                             "block_causal); TorchTitan yields positions only")
    parser.add_argument("--child", nargs=3, metavar=("NAME", "CORPUS", "CONTRACT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]), args.child[2])
        return
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    available = []
    for name in LOADERS:
        reason = _missing(name)
        if reason is None:
            available.append(name)
        else:
            print(f"skipped {name}: {reason}")
    if "zephon_loader" not in available:
        sys.exit("zephon_loader itself does not import here")

    def run(name: str, corpus: Path) -> dict:
        done = subprocess.run([sys.executable, __file__, "--child", name, str(corpus), args.contract], env=env,
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    with tempfile.TemporaryDirectory() as root:
        corpus = Path(root) / "stdlib"
        documents, size = make_corpus(corpus, args.files)
        count = run("count", corpus)
        print(f"corpus: {documents} stdlib files, {size / 2**20:.1f} MiB of text, {count['tokens']:,} tokens with "
              f"BOS/EOS ({count['short_documents']} files, {count['tokens_in_short_documents']:,} tokens, fit a "
              f"row); S={S}, B={B}; {os.cpu_count()} CPUs, affinity {len(os.sched_getaffinity(0))}; "
              f"contract {args.contract}; python {sys.version.split()[0]}")
        results: dict[str, list[dict]] = {name: [] for name in available}
        for round_index in range(args.rounds):
            for name in rotated(available, round_index):
                result = run(name, corpus)
                results[name].append(result)
                print(f"  round {round_index} {name:14s} " + json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                                                       for k, v in result.items()}))
    med = {name: {key: statistics.median(r[key] for r in runs) for key in
                  ("first_batch_s", "build_epoch_s", "steady_tokens_per_s", "peak_rss_mib")}
           for name, runs in results.items()}
    for name, runs in results.items():
        med[name]["input_tokens"] = runs[-1]["input_tokens"]
    ours = med["zephon_loader"]
    print(f"\n{'':14s} {'first batch s':>14s} {'build+epoch s':>14s} {'steady tok/s':>13s} {'peak RSS MiB':>13s} "
          f"{'input tokens':>13s}")
    for name, m in med.items():
        print(f"{name:14s} {m['first_batch_s']:>14.2f} {m['build_epoch_s']:>14.2f} {m['steady_tokens_per_s']:>13,.0f} "
              f"{m['peak_rss_mib']:>13.0f} {m['input_tokens']:>13,}")
    print("\nratios, ours / theirs (time: < 1 is ours faster; tokens/s: > 1 is ours faster; RSS: > 1 is ours more)")
    for name, m in med.items():
        if name == "zephon_loader":
            continue
        print(f"  vs {name:11s} first batch {ours['first_batch_s'] / m['first_batch_s']:.2f}x | build+epoch "
              f"{ours['build_epoch_s'] / m['build_epoch_s']:.2f}x | steady tokens/s "
              + (f"{ours['steady_tokens_per_s'] / m['steady_tokens_per_s']:.2f}x" if m['steady_tokens_per_s'] else "n/a")
              + f"{' (not comparable: AutoModel packs in its build)' if name == 'automodel' else ''} | peak RSS "
              f"{ours['peak_rss_mib'] / m['peak_rss_mib']:.2f}x | input tokens "
              f"{ours['input_tokens'] / m['input_tokens']:.5f}x ({ours['input_tokens'] - m['input_tokens']:+,})")
    label_only = results["zephon_loader"][-1].get("label_only_tokens")
    print(f"\ntokens: corpus {count['tokens']:,} with BOS/EOS in {count['documents']} documents; zephon_loader "
          f"delivers them all, {label_only:,} of them (one per full row) as labels only, so its input tokens are "
          f"{ours['input_tokens']:,}; TorchTitan and AutoModel shift per document (one input less per document) "
          "and TorchTitan drops its last partial row; AutoModel's drop_long_samples default drops every document "
          "longer than a row")


if __name__ == "__main__":
    main()
