"""What a new epoch costs before Zephon starts reading: the loader's rebuild of the epoch's pipeline.

    python benchmarks/bench_epoch_rebuild.py [--vocab 65536] [--epochs 5] [--tokenizer DIR]

Every epoch gets a new Zephon pipeline (the epoch's shuffle seed). This times
that rebuild (``ZephonSource``'s ``pipeline_for_epoch``, called at the first
``iter()`` of each epoch) and, from a profile of the same calls, the part spent
inside Zephon's own constructors (work source, ops, ``tokenize``, ``pack_flat``,
``batch``, ``options``); goal: at most 50 ms per epoch beyond Zephon's own.
Run it with ``PYTHONPATH=<older checkout>`` for the "before" column.

The tokenizer matters: reloading and re-saving a real one costs about a
second per epoch. Without ``--tokenizer`` a byte-level BPE of ``--vocab``
entries is trained on the corpus (the Python standard library's sources) and
the bundled 512-entry tokenizer is measured too.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from bench_first_batch import make_corpus  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


def train_tokenizer(corpus: Path, out: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [json.loads(line)["text"] for shard in sorted(corpus.glob("*.jsonl")) for line in open(shard)]
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<pad>", "<eos>", "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                            bos_token="<bos>").save_pretrained(out)
    return out


def measure(corpus: Path, tokenizer: Path, epochs: int) -> dict[str, float]:
    from zephon_loader import build_text_loader

    config = {"sources": [{"name": "stdlib", "path": str(corpus)}], "tokenizer": {"path": str(tokenizer)},
              "sequence_length": 2048, "micro_batch_size": 8, "packing": {"algorithm": "wrap"}}
    with build_text_loader(config) as loader:
        rebuild = loader._source._pipeline_for_epoch  # what the source calls at the first iter() of an epoch
        times = []
        for epoch in range(1, epochs + 1):
            start = time.perf_counter()
            rebuild(epoch)
            times.append(time.perf_counter() - start)
        profile = cProfile.Profile()
        profile.enable()
        for epoch in range(1, epochs + 1):
            rebuild(epoch)
        profile.disable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    total = sum(tt for (_file, _line, _name), (_cc, _nc, tt, _ct, _callers) in stats.items())
    zephon = sum(tt for (file, _line, _name), (_cc, _nc, tt, _ct, _callers) in stats.items()
                 if f"{os.sep}zephon{os.sep}" in file)
    median = statistics.median(times)
    return {"rebuild_ms": median * 1e3, "zephon_share": zephon / total if total else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=65536, help="entries of the tokenizer trained on the corpus")
    parser.add_argument("--tokenizer", type=Path, help="a local tokenizer folder instead of training one")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--files", type=int, default=300, help="stdlib files in the corpus")
    args = parser.parse_args()
    from zephon_loader.config import package_data_dir

    with tempfile.TemporaryDirectory() as root:
        corpus = Path(root) / "stdlib"
        documents, _size = make_corpus(corpus, args.files)
        tokenizers = {"bundled (512)": package_data_dir() / "tokenizer"}
        if args.tokenizer is not None:
            tokenizers[str(args.tokenizer)] = args.tokenizer
        else:
            trained = train_tokenizer(corpus, Path(root) / "tokenizer", args.vocab)
            size = (trained / "tokenizer.json").stat().st_size / 2**20
            tokenizers[f"trained ({args.vocab}, {size:.1f} MiB)"] = trained
        print(f"corpus: {documents} stdlib files; S=2048, B=8, wrap; {args.epochs} epochs")
        print(f"{'tokenizer':>28} {'rebuild per epoch ms':>21} {'in Zephon':>10} {'beyond Zephon ms':>17}")
        for name, folder in tokenizers.items():
            result = measure(corpus, folder, args.epochs)
            beyond = result["rebuild_ms"] * (1 - result["zephon_share"])
            print(f"{name:>28} {result['rebuild_ms']:>21.1f} {result['zephon_share']:>9.0%} {beyond:>17.1f}"
                  "  (goal <= 50)")


if __name__ == "__main__":
    main()
