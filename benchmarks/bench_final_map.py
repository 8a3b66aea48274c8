"""Final-map and metadata speed, side by side with AutoModel 0.7.0, in one run.

    python benchmarks/bench_final_map.py [--repeats 30]

Single thread. For [8, 8192] and [32, 4096] batches with ~16 documents per row
(random lengths, ~5% trailing padding, a few ineligible tokens), prints the
median time of:

* our vectorized ``build_packed_sequence_metadata`` vs AutoModel 0.7.0's
  (the ratio is the speed-up; goal: >= 8x);
* the whole final map stage (``finalize_batch``) per contract
  (goal: < 1 ms for [8, 8192] with the FA4 contract, document ids + metadata).
"""

from __future__ import annotations

import argparse

import torch
from timing import median_seconds

from zephon_loader import fields as F
from zephon_loader.finalize import FinalizeSettings, finalize_batch
from zephon_loader.packing import PackingContract, build_packed_sequence_metadata


def packed_batch(batch_size: int, sequence_length: int, documents: int, seed: int = 0) -> dict:
    """A collated batch: ``documents`` random-length subdocuments per row, then padding."""
    generator = torch.Generator().manual_seed(seed)
    padding = torch.randint(0, sequence_length // 10, (batch_size,), generator=generator)
    used = sequence_length - padding
    columns = torch.arange(sequence_length).expand(batch_size, -1)
    # Random cut points per row (duplicates merge, so "about" `documents` per row).
    cuts = (torch.rand(batch_size, documents - 1, generator=generator) * used.unsqueeze(1)).long().clamp_min(1)
    starts = torch.zeros(batch_size, sequence_length, dtype=torch.bool)
    starts[:, 0] = True
    starts.scatter_(1, cuts, True)
    is_padding = columns >= used.unsqueeze(1)
    ids = starts.long().cumsum(dim=1).masked_fill(is_padding, 0)
    start_column = torch.where(starts | (columns == used.unsqueeze(1)), columns, torch.zeros_like(columns))
    positions = columns - start_column.cummax(dim=1).values
    eligibility = torch.rand(batch_size, sequence_length, generator=generator) > 0.001
    return {
        F.INPUT_IDS: torch.randint(0, 50_000, (batch_size, sequence_length), generator=generator),
        F.LABELS: torch.randint(0, 50_000, (batch_size, sequence_length), generator=generator),
        F.PADDING_MASK: is_padding,
        F.POSITION_IDS: positions,
        F.DOCUMENT_IDS: ids,
        F.ATTENTION_ELIGIBILITY: eligibility,
    }


def median_ms(fn, repeats: int) -> float:
    return median_seconds(fn, repeats) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        from nemo_automodel.components.datasets.packing import (
            build_packed_sequence_metadata as automodel_metadata,
        )
    except ImportError:
        automodel_metadata = None
        print("nemo-automodel 0.7.0 not importable (pip install --no-deps nemo-automodel==0.7.0): no ratio")

    contracts = {
        "fa4 (document_ids + metadata)": (PackingContract("document_ids", True), False),
        "document_ids": (PackingContract("document_ids"), False),
        "document_ids + metadata, xdoc": (PackingContract("document_ids", True), True),
        "flash_varlen (no eligibility)": (PackingContract("flash_varlen"), False),
        "te thd (no eligibility)": (PackingContract("document_ids", False, "thd"), False),
        "block_causal [B,1,S,S]": (PackingContract("block_causal"), False),
    }
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, repeats {args.repeats}")
    for batch_size, sequence_length in ((8, 8192), (32, 4096)):
        batch = packed_batch(batch_size, sequence_length, documents=16)
        ids = batch[F.DOCUMENT_IDS].masked_fill(~batch[F.ATTENTION_ELIGIBILITY], 0)
        docs = float((batch[F.DOCUMENT_IDS].amax(dim=1)).float().mean())
        print(f"\n[{batch_size}, {sequence_length}]  {docs:.1f} documents per row")
        ours = median_ms(lambda: build_packed_sequence_metadata(ids), args.repeats)
        line = f"  metadata   ours {ours:8.3f} ms"
        if automodel_metadata is not None:
            theirs = median_ms(lambda: automodel_metadata(ids), args.repeats)
            line += f" | AutoModel 0.7.0 {theirs:8.3f} ms | speed-up {theirs / ours:5.1f}x"
        print(line)
        for name, (contract, xdoc) in contracts.items():
            physical = contract.packed_mask_type == "flash_varlen" or contract.qkv_format == "thd"
            sample = {k: v for k, v in batch.items() if not (physical and k == F.ATTENTION_ELIGIBILITY)}
            settings = FinalizeSettings.from_contract(
                contract, xdoc=xdoc, attention_eligibility=F.ATTENTION_ELIGIBILITY in sample
            )
            repeats = 3 if contract.packed_mask_type == "block_causal" and not settings.thd else args.repeats
            elapsed = median_ms(lambda: finalize_batch(sample, settings), repeats)
            print(f"  final map  {name:32s} {elapsed:8.3f} ms")


if __name__ == "__main__":
    main()
