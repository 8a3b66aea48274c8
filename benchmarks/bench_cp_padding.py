"""Context-parallel padding share (``contract.cp_size > 1``): how much of a pass the per-document padding takes.

    cd benchmarks && python bench_cp_padding.py [--stdlib-files 400] [--shape 8 4096]

For the bundled demo (its shape, 4 x 256) and for a corpus of Python standard library files (``--shape``,
default 8 x 4096), one pass with ``best_fit`` at ``cp_size`` 1, 2 and 4 (TE THD); prints the batches, the
padding ``stats()`` counts (``cp_padding_tokens``), its share of the real tokens and of the batches' token
slots, and the documents dropped as longer than a row (a row holds ``S`` tokens of padded documents under CP,
``S + 1`` without).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import yaml
from bench_first_batch import make_corpus

from zephon_loader import build_text_loader
from zephon_loader import fields as F
from zephon_loader.config import default_config_path


def one_pass(node: dict, cp_size: int) -> dict:
    node = dict(node, packing={"algorithm": "best_fit"},
                contract={"attn_implementation": "te", "qkv_format": "thd", "packed_mask_type": "document_ids",
                          "cp_size": cp_size})
    batches = slots = real = 0
    with build_text_loader(node) as loader:
        for batch in loader:
            batches += 1
            slots += batch[F.INPUT_IDS].numel()
            real += int((batch[F.ATTENTION_MASK] != 0).sum())
        stats = loader.stats()
    dropped = sum(v["documents"] for v in stats["dropped"].values())
    return {"batches": batches, "slots": slots, "real": real, "cp": stats["cp_padding_tokens"], "dropped": dropped}


def report(title: str, node: dict) -> None:
    print(f"\n{title}: shape {node['micro_batch_size']} x {node['sequence_length']}")
    for cp_size in (1, 2, 4):
        r = one_pass(node, cp_size)
        print(f"  cp_size {cp_size}: {r['batches']:5d} batches, {r['real']:9d} real tokens, cp padding {r['cp']:7d} "
              f"= {100 * r['cp'] / r['real']:5.2f}% of the real tokens, {100 * r['cp'] / r['slots']:5.2f}% of the "
              f"slots; dropped (longer than a row) {r['dropped']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stdlib-files", type=int, default=400)
    parser.add_argument("--shape", type=int, nargs=2, default=(8, 4096))
    args = parser.parse_args()
    demo = yaml.safe_load(default_config_path().read_text())["dataloader"]
    demo.pop("_target_", None)
    demo.update(base_dir=str(default_config_path().parent), runtime={"runner": "threads"})
    report("demo", demo)
    with tempfile.TemporaryDirectory(prefix="bench_cp_corpus_") as root:
        documents, size = make_corpus(Path(root) / "stdlib", args.stdlib_files)
        node = dict(demo, sources=[{"name": "stdlib", "path": str(Path(root) / "stdlib")}],
                    micro_batch_size=args.shape[0], sequence_length=args.shape[1])
        report(f"stdlib corpus ({documents} files, {size / 2**20:.1f} MiB)", node)


if __name__ == "__main__":
    main()
