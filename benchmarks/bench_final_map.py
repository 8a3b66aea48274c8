"""Collate, final-map and metadata speed, side by side with AutoModel 0.7.0, in one run.

    cd benchmarks && python bench_final_map.py [--repeats 30]

Single thread. For [8, 8192] and [32, 4096] batches with ~16 documents per row
(random lengths, ~5% trailing padding, a few ineligible tokens), prints the
median time of:

* our vectorized ``build_packed_sequence_metadata`` vs AutoModel 0.7.0's
  (the ratio is the speed-up; goal: >= 12x at both shapes);
* the whole final map stage as the loader runs it (``FinalMap``: it trusts
  what collate guarantees) per contract, and its ratio to building the
  metadata alone (goal at [8, 8192]: <= 2x for the FA4 contract, document ids
  + metadata, and for xdoc with metadata); each contract is timed in
  alternation with the metadata alone, call by call, and the ratio printed is
  the median of those pairs' ratios (a machine whose speed drifts during the
  run moves both sides of a pair alike); ``finalize_batch`` (which validates
  a caller's batch first) for comparison;
* for ``block_causal``, the dense ``[B, 1, S, S]`` bool mask's floor: its
  ``B * S * S`` bytes written once (``torch.ones``), which no construction of
  the dense mask the contract asks for can beat;
* ``collate`` of a Zephon ``SampleBatch`` of the same shape, as the loader
  calls it (to_training, the checks of Zephon's output, document ids, label
  masking), and with the records' source marks (``return_source_ids``: the
  ``source_ids`` field is built there; the final map passes it on).

Allocations: glibc's dynamic mmap and trim thresholds make a ``[B, S]`` tensor
allocated per call cost page faults in some processes and not in others (the
same code timed 2-5x apart from one run to the next), so the script pins them
first (``timing.pin_allocator``) and the figures compare computation;
``--default-allocator`` leaves glibc as it is.

The script only uses names that exist in earlier versions too, so the same
command run against an older checkout (``PYTHONPATH=<old checkout>``) gives
the "before" column; contracts an older version does not know are skipped.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from timing import median_seconds, paired_median_seconds, pin_allocator
from zephon import SampleBatch, SampleMeta, SampleRecord

from zephon_loader import fields as F
from zephon_loader.collate.text import collate
from zephon_loader.finalize.final_map import FinalizeSettings, finalize_batch
from zephon_loader.finalize.final_map import FinalMap
from zephon_loader.packing import build_packed_sequence_metadata
from zephon_loader.contract import PackingContract


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


def zephon_batch(batch: dict, source_marks: bool = False) -> SampleBatch:
    """The Zephon ``SampleBatch`` (rows of ``S + 1`` tokens, as ``pack_flat(S + 1).batch(B)`` emits) whose
    collated form has ``batch``'s padding and subdocument layout (the extra last column repeats the last one)."""
    tokens = torch.cat([batch[F.INPUT_IDS], batch[F.INPUT_IDS][:, -1:]], dim=1).numpy()
    positions = batch[F.POSITION_IDS]
    positions = torch.cat([positions, positions[:, -1:] + 1], dim=1).numpy().astype(np.int32)
    padding = batch[F.PADDING_MASK].sum(dim=1).tolist()
    records = []
    for row, pad in enumerate(padding):
        meta = SampleMeta(
            sample_id=(0, 0, row), lane_id=0, chunk_id=0, chunk_offset=row,
            tags={"_packing_metadata": {"padding_length": pad + 1 if pad else 0}},
        )
        payload = {"tokens": tokens[row], "positions": positions[row]}
        if source_marks:  # three sources in turn, one per document; 0 at the packer's padding
            marks = (positions[row] == 0).cumsum().astype(np.int32) % 3 + 1
            marks[len(marks) - (pad + 1 if pad else 0):] = 0
            payload[F.SOURCE_MARKS] = marks
        records.append(SampleRecord(meta=meta, payload=payload))
    return SampleBatch(tuple(records))


def median_ms(fn, repeats: int) -> float:
    return median_seconds(fn, repeats) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--default-allocator", action="store_true",
                        help="leave glibc's allocation thresholds as they are (timings then vary between runs)")
    args = parser.parse_args()
    allocator = "allocator: default" if args.default_allocator else pin_allocator()
    torch.set_num_threads(1)
    try:
        from nemo_automodel.components.datasets.packing import (
            build_packed_sequence_metadata as automodel_metadata,
        )
    except ImportError:
        automodel_metadata = None
        print("nemo-automodel 0.7.0 not importable (pip install --no-deps nemo-automodel==0.7.0): no ratio")

    # name: (packed_mask_type, metadata, qkv_format, xdoc[, seq_idx])
    contracts = {
        "fa4 (document_ids + metadata)": ("document_ids", True, "bshd", False),
        "fa4 + seq_idx": ("document_ids", True, "bshd", False, True),
        "fa4 + source_ids": ("document_ids", True, "bshd", False, "source_ids"),
        "xdoc + metadata + source_ids": ("document_ids", True, "bshd", True, "source_ids"),
        "te thd + source_ids": ("document_ids", False, "thd", False, "source_ids"),
        "hf + seq_idx (no eligibility)": ("position_ids", False, "bshd", False, True),
        "document_ids": ("document_ids", False, "bshd", False),
        "document_ids + metadata, xdoc": ("document_ids", True, "bshd", True),
        "hf (position_ids, no eligibility)": ("position_ids", False, "bshd", False),
        "flash_varlen (no eligibility)": ("flash_varlen", False, "bshd", False),
        "te thd (no eligibility)": ("document_ids", False, "thd", False),
        "block_causal [B,1,S,S]": ("block_causal", False, "bshd", False),
    }
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, repeats {args.repeats}, {allocator}")
    for batch_size, sequence_length in ((8, 8192), (32, 4096)):
        batch = packed_batch(batch_size, sequence_length, documents=16)
        ids = batch[F.DOCUMENT_IDS].masked_fill(~batch[F.ATTENTION_ELIGIBILITY], 0)
        docs = float((batch[F.DOCUMENT_IDS].amax(dim=1)).float().mean())
        print(f"\n[{batch_size}, {sequence_length}]  {docs:.1f} documents per row")
        ours = median_ms(lambda: build_packed_sequence_metadata(ids), args.repeats)
        line = f"  metadata   ours {ours:8.3f} ms"
        if automodel_metadata is not None:
            theirs = median_ms(lambda: automodel_metadata(ids), args.repeats)
            line += f" | AutoModel 0.7.0 {theirs:8.3f} ms | speed-up {theirs / ours:5.1f}x (goal >= 12x)"
        print(line)
        for name, (mask_type, metadata, qkv_format, xdoc, *extra) in contracts.items():
            source_ids = extra == ["source_ids"]
            try:
                options = {"seq_idx": True} if extra and not source_ids else {}
                contract = PackingContract(mask_type, metadata, qkv_format, **options)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                print(f"  final map  {name:34s}  (contract unknown to this version)")
                continue
            physical = mask_type in ("flash_varlen", "position_ids") or qkv_format == "thd"
            sample = {k: v for k, v in batch.items() if not (physical and k == F.ATTENTION_ELIGIBILITY)}
            try:
                settings = FinalizeSettings.from_contract(
                    contract, xdoc=xdoc, attention_eligibility=F.ATTENTION_ELIGIBILITY in sample,
                    **({"return_source_ids": True} if source_ids else {}),
                )
            except TypeError:
                print(f"  final map  {name:34s}  (return_source_ids unknown to this version)")
                continue
            if source_ids:  # what collate builds: each token's source, -1 at padding
                marks = (batch[F.POSITION_IDS] == 0).cumsum(dim=1) % 3
                sample[F.SOURCE_IDS] = marks.masked_fill(batch[F.PADDING_MASK], -1)
            final_map = FinalMap(settings)
            if mask_type == "block_causal":
                elapsed = median_ms(lambda: final_map(sample), 3)
                ratio = elapsed / ours
            else:  # timed in alternation with the metadata alone: the ratio of calls made a moment apart
                seconds, _, ratio = paired_median_seconds(lambda: final_map(sample),
                                                          lambda: build_packed_sequence_metadata(ids), args.repeats)
                elapsed = seconds * 1e3
            print(f"  final map  {name:34s} {elapsed:8.3f} ms = {ratio:5.1f}x metadata alone"
                  + ("  (goal at [8, 8192]: <= 2x)" if metadata and mask_type == "document_ids" else ""))
            if mask_type == "block_causal":
                # What any dense mask costs at least: its B*S*S bytes written once into fresh memory.
                floor = median_ms(lambda: torch.ones(batch_size, 1, sequence_length, sequence_length,
                                                     dtype=torch.bool), 3)
                size = batch_size * sequence_length**2 / 2**20
                print(f"  dense mask {size:.0f} MiB written once (torch.ones, the floor) {floor:8.3f} ms = "
                      f"{floor / ours:5.1f}x metadata alone")
            if name.startswith("fa4"):
                validating = median_ms(lambda: finalize_batch(sample, settings), args.repeats)
                print(f"  finalize_batch (validates a caller's batch) {' ' * 13}{validating:8.3f} ms")
        raw = zephon_batch(batch)
        collated = collate(raw, mask_cross_document_labels=True, physical_cu_seqlens=False)
        assert torch.equal(collated[F.DOCUMENT_IDS], batch[F.DOCUMENT_IDS]), "collate benchmark batch is off"
        elapsed = median_ms(
            lambda: collate(raw, mask_cross_document_labels=True, physical_cu_seqlens=False,
                            micro_batch_size=batch_size, pad_token_id=0),
            args.repeats,
        )
        print(f"  collate    Zephon SampleBatch -> TrainingBatch      {elapsed:8.3f} ms")
        marked = zephon_batch(batch, source_marks=True)
        if F.SOURCE_IDS in collate(marked, mask_cross_document_labels=True, physical_cu_seqlens=False):
            with_ids, without, ratio = paired_median_seconds(
                lambda: collate(marked, mask_cross_document_labels=True, physical_cu_seqlens=False,
                                micro_batch_size=batch_size, pad_token_id=0),
                lambda: collate(raw, mask_cross_document_labels=True, physical_cu_seqlens=False,
                                micro_batch_size=batch_size, pad_token_id=0), args.repeats)
            print(f"  collate    + source marks -> source_ids             {with_ids * 1e3:8.3f} ms = "
                  f"{ratio:5.2f}x without ({(with_ids - without) * 1e3:+.3f} ms)")


if __name__ == "__main__":
    main()
