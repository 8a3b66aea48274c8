"""Zephon ``SampleBatch`` of packed image-text records -> TrainingBatch with image fields.

Input: a batch from ``pack_sequences(S, first_fit|best_fit).batch(B)``: each
record is one row, ``{"packed_samples": [payload, ...]}``, whole processed
records in row order (:data:`zephon_loader.pipeline.image_records.PAYLOAD_FIELDS`).
Every token of every record is an input token: a row holds at most ``S``
tokens (records are never split, so no image is cut), and labels are the next
token inside the row.

Output keys (:mod:`zephon_loader.fields`), CPU tensors, ``[B, S]`` unless said:

==========================  =========  ==========================================================
key                         dtype      meaning
==========================  =========  ==========================================================
``INPUT_IDS``               int64      the records' tokens, left-aligned; ``pad_token_id`` after
``LABELS``                  int64      next token where it is a target (``loss_mask``), else
                                       ``IGNORE_INDEX``; also ``IGNORE_INDEX`` at a record's last
                                       token when ``mask_cross_document_labels``, at padding and
                                       at the last column
``PADDING_MASK``            bool       True at the trailing padding of each row
``POSITION_IDS``            int64      ``[3, B, S]``: each record's own mRoPE positions (from 0);
                                       the padding tail numbered ``0, 1, ...`` on every axis
``DOCUMENT_IDS``            int64      1-based record index within the row, 0 at padding
``ATTENTION_ELIGIBILITY``   bool       only with ``eligibility``: the processor's, False at padding
``SOURCE_IDS``              int64      each token's source index, ``-1`` at padding; only when the
                                       records carry ``SOURCE_MARKS`` (``return_source_ids``)
``MM_TOKEN_TYPE_IDS``       int64      1 at image placeholder tokens
``N_IMAGES_PER_SAMPLE``     int64      ``[B]`` images per row
``PIXEL_VALUES``            float32    ``[patches, D]``: every image's patch rows, row order then
                                       position order (only when the batch holds an image)
``IMAGE_GRID_THW``          int64      ``[images, 3]``, same order (only with an image)
==========================  =========  ==========================================================

A short batch (Zephon's last batch of a flush or of the stream) is completed
to ``B`` rows of padding. The gathering reads each record's arrays once (a
list over records); every index computation is vectorized.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from zephon_loader import fields as F
from zephon_loader.errors import described_error as _err
from zephon_loader.zephon_compat import ZephonKeys

__all__ = ["PACKED_SAMPLES", "collate_images"]

#: Zephon's ``pack_sequences`` envelope key: the ordered list of a row's record payloads.
PACKED_SAMPLES = "packed_samples"


def collate_images(
    zephon_batch: Any,
    *,
    sequence_length: int,
    micro_batch_size: int,
    pad_token_id: int,
    mask_cross_document_labels: bool,
    eligibility: bool,
) -> dict[str, torch.Tensor]:
    """Collate one packed image-text batch (see the module docstring for the keys).

    Args:
        zephon_batch: A ``zephon.SampleBatch`` of ``pack_sequences`` envelopes.
        sequence_length: ``S``, the row length (packing capacity).
        micro_batch_size: ``B``; a batch of fewer rows is completed with padding rows.
        pad_token_id: Id of padding tokens.
        mask_cross_document_labels: Mask the label at each record's last token
            (its target would be the next record's first token).
        eligibility: The processor emits ``attention_eligibility`` (every record carries it).

    Raises:
        TypeError / ValueError: A batch that is not what the image pipeline builds
        (more than ``B`` rows, a row longer than ``S``, missing payload fields).
    """
    records = getattr(zephon_batch, "records", None)
    if records is None:
        raise TypeError(_err("zephon_batch", type(zephon_batch).__name__, "a zephon.SampleBatch",
                             "Pass the batches of the image pipeline."))
    rows, length = int(micro_batch_size), int(sequence_length)
    if not 0 < len(records) <= rows:
        raise ValueError(_err("zephon_batch", f"{len(records)} rows", f"1 to micro_batch_size={rows}",
                              "Build the pipeline with batch(micro_batch_size)."))
    segments: list[dict[str, Any]] = []
    per_row: list[int] = []
    for record in records:
        payload = record.payload
        if not isinstance(payload, dict) or PACKED_SAMPLES not in payload:
            raise ValueError(_err("zephon_batch payload", type(payload).__name__,
                                  f"a pack_sequences envelope {{{PACKED_SAMPLES!r}: [...]}}",
                                  "Pack with pack_sequences (first_fit/best_fit), not pack_flat."))
        segments.extend(payload[PACKED_SAMPLES])
        per_row.append(len(payload[PACKED_SAMPLES]))

    # --- where every token goes --------------------------------------------------------------
    seg_rows = np.repeat(np.arange(len(per_row)), per_row)
    lengths = np.fromiter((len(s[ZephonKeys.TOKENS]) for s in segments), dtype=np.int64, count=len(segments))
    row_lengths = np.bincount(seg_rows, weights=lengths, minlength=rows).astype(np.int64)
    if int(row_lengths.max(initial=0)) > length:
        row = int(np.argmax(row_lengths))
        raise ValueError(_err(f"zephon_batch row {row}", f"{int(row_lengths[row])} tokens",
                              f"at most sequence_length={length}", "Pack with capacity sequence_length."))
    seg_end = np.cumsum(lengths)
    seg_start = seg_end - lengths  # in the concatenation of all segments
    row_first = np.concatenate([[0], np.cumsum(per_row)[:-1]]).astype(np.int64)  # first segment of each row
    row_offset = seg_start[row_first] if len(segments) else np.zeros(0, np.int64)  # concat offset of each row
    token_row = np.repeat(seg_rows, lengths)
    column = np.arange(int(seg_end[-1]) if len(segments) else 0) - row_offset[token_row]
    flat_index = torch.from_numpy(token_row * length + column)
    doc_ids = np.repeat(np.arange(len(segments)) - np.repeat(row_first, per_row) + 1, lengths)

    def gather(name: str, dtype: Any) -> np.ndarray:
        return np.concatenate([np.asarray(s[name], dtype=dtype) for s in segments], axis=-1)

    # --- token fields ------------------------------------------------------------------------
    cols = torch.arange(length)
    used = torch.from_numpy(row_lengths)
    padding = cols[None, :] >= used[:, None]  # [B, S]
    input_ids = torch.full((rows * length,), int(pad_token_id), dtype=torch.int64)
    input_ids[flat_index] = torch.from_numpy(gather(ZephonKeys.TOKENS, np.int64))
    input_ids = input_ids.view(rows, length)
    targets = torch.zeros(rows * length, dtype=torch.bool)
    targets[flat_index] = torch.from_numpy(gather(ZephonKeys.LOSS_MASK, np.bool_))
    targets = targets.view(rows, length)
    document_ids = torch.zeros(rows * length, dtype=torch.int64)
    document_ids[flat_index] = torch.from_numpy(doc_ids)
    document_ids = document_ids.view(rows, length)
    mm_types = torch.zeros(rows * length, dtype=torch.int64)
    mm_types[flat_index] = torch.from_numpy(gather(F.MM_TOKEN_TYPE_IDS, np.int64))
    mm_types = mm_types.view(rows, length)
    positions = (cols[None, :] - used[:, None]).clamp_min(0).expand(3, rows, length).reshape(3, -1).clone()
    positions[:, flat_index] = torch.from_numpy(gather(F.POSITION_IDS, np.int64))
    positions = positions.view(3, rows, length)

    # Label j is token j + 1 when that token is a target of the same record (or, without
    # cross-document masking, of the next record in the row).
    keep = targets[:, 1:] & ~padding[:, 1:]
    if mask_cross_document_labels:
        keep = keep & (document_ids[:, 1:] == document_ids[:, :-1])
    labels = torch.full((rows, length), F.IGNORE_INDEX, dtype=torch.int64)
    labels[:, :-1] = torch.where(keep, input_ids[:, 1:], labels[:, :-1])

    out: dict[str, torch.Tensor] = {
        F.INPUT_IDS: input_ids,
        F.LABELS: labels,
        F.PADDING_MASK: padding,
        F.POSITION_IDS: positions,
        F.DOCUMENT_IDS: document_ids,
        F.MM_TOKEN_TYPE_IDS: mm_types,
    }
    if eligibility:
        eligible = torch.zeros(rows * length, dtype=torch.bool)
        eligible[flat_index] = torch.from_numpy(gather(F.ATTENTION_ELIGIBILITY, np.bool_))
        out[F.ATTENTION_ELIGIBILITY] = eligible.view(rows, length)
    if segments and F.SOURCE_MARKS in segments[0]:  # every token is an input token: no shift
        source_ids = torch.full((rows * length,), F.SOURCE_ID_PADDING, dtype=torch.int64)
        source_ids[flat_index] = torch.from_numpy(gather(F.SOURCE_MARKS, np.int64) - 1)
        out[F.SOURCE_IDS] = source_ids.view(rows, length)

    # --- images, in row order then position order (segments are in that order) -------------------
    image_counts = np.fromiter((len(s[F.IMAGE_GRID_THW]) for s in segments), dtype=np.int64, count=len(segments))
    out[F.N_IMAGES_PER_SAMPLE] = torch.from_numpy(
        np.bincount(seg_rows, weights=image_counts, minlength=rows).astype(np.int64))
    if int(image_counts.sum()):
        with_images = [s for s, count in zip(segments, image_counts) if count]
        out[F.PIXEL_VALUES] = torch.from_numpy(np.concatenate([s[F.PIXEL_VALUES] for s in with_images], axis=0))
        out[F.IMAGE_GRID_THW] = torch.from_numpy(np.concatenate([s[F.IMAGE_GRID_THW] for s in with_images], axis=0))
    return out
