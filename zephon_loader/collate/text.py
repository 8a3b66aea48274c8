"""Zephon ``SampleBatch`` -> TrainingBatch (docs/contract.md §4).

:func:`collate` calls ``SampleBatch.to_training(return_labels=True, ...)``
(next-token shift, padding mask, Zephon's physical ``cu_seqlens``), derives
``document_ids`` and applies the label-masking options, and completes the
short batch Zephon delivers at each flush and at the end of the stream to
``B`` rows with all-padding rows. Everything is vectorized; nothing modifies
a tensor or array it did not create.

Collate owns Zephon's output: it is the one place that checks it (dtypes,
shapes, nonnegative positions, trailing padding, ``IGNORE_INDEX`` labels at
padding), each with one cheap pass (the two padding checks with none when a
pass over the mask finds no padding, as in most packed batches), and it
derives ``document_ids`` so that they are well formed by construction. The
final map trusts this (:func:`zephon_loader.finalize.final_map.finalize_collated`).

Shapes: Zephon packs rows of ``S + 1`` tokens; after the shift every
per-token field is ``[B, S]``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from zephon_loader import fields as F
from zephon_loader.attention import padding_is_trailing
from zephon_loader.errors import described_error as _err
from zephon_loader.zephon_compat import ZephonKeys as Z

__all__ = ["TextCollate", "collate", "document_ids_from_positions", "next_token_starts_document"]


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"tensor of shape {tuple(t.shape)} dtype {t.dtype}"
    return type(t).__name__


def _document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, S]``: True where a subdocument starts (position 0 on every axis, or column 0)."""
    zero = position_ids.logical_not()  # == 0, in a cheaper pass
    if position_ids.dim() == 3:
        zero = zero.all(dim=0)
    zero[:, 0] = True  # `zero` is a fresh tensor, never the caller's
    return zero


def _ids_from_starts(starts: torch.Tensor, padding_mask: torch.Tensor | None) -> torch.Tensor:
    """int64 ``[B, S]``: 1-based subdocument ids from bool starts, 0 at padding (``None``: the batch has none)."""
    ids = torch.cumsum(starts, dim=1, dtype=torch.int64)
    return ids if padding_mask is None else ids.masked_fill_(padding_mask, 0)  # our own fresh tensor


def _next_starts(starts: torch.Tensor, last_next_starts: torch.Tensor) -> torch.Tensor:
    """bool ``[B, S]``: whether each column's label target starts a subdocument (``last``: the dropped token)."""
    return torch.cat([starts[:, 1:], last_next_starts[:, None]], dim=1)


def _check_positions(position_ids: Any, where: str) -> None:
    if not isinstance(position_ids, torch.Tensor):
        raise TypeError(_err(where, _describe(position_ids), "a torch.Tensor", "Pass int64 positions."))
    if position_ids.dtype != torch.int64:
        raise TypeError(_err(where, _describe(position_ids), "dtype torch.int64", "Cast with .long()."))
    if position_ids.dim() not in (2, 3) or position_ids.shape[-1] < 1:
        raise ValueError(
            _err(where, _describe(position_ids), "[B, S] or [A, B, S] with S >= 1", "Pass input-aligned positions.")
        )
    low = int(position_ids.min()) if position_ids.numel() else 0
    if low < 0:
        raise ValueError(_err(where, f"minimum {low}", "nonnegative positions", "Positions are local per subdocument."))


def _check_padding_mask(padding_mask: Any, shape: tuple[int, ...], where: str) -> None:
    if not isinstance(padding_mask, torch.Tensor) or padding_mask.dtype != torch.bool:
        raise TypeError(_err(where, _describe(padding_mask), "a bool tensor (True = padding)", "Pass a bool mask."))
    if tuple(padding_mask.shape) != shape:
        raise ValueError(_err(where, _describe(padding_mask), f"shape {shape}", "Align the mask with the tokens."))
    if not padding_is_trailing(padding_mask):
        row = int((padding_mask[:, :-1] & ~padding_mask[:, 1:]).any(dim=1).nonzero()[0])
        raise ValueError(
            _err(where, f"a non-padding token after padding in row {row}", "trailing padding only",
                 "Padding must be the tail of each row.")
        )


def _check_padding_labels(labels: torch.Tensor, padding_mask: torch.Tensor, where: str) -> None:
    """``IGNORE_INDEX`` at every padding position (two tensor calls: on few cores each one hands Python's
    lock to Zephon's threads and back, so the hot path counts calls, not bytes)."""
    if torch.equal(labels.masked_fill(padding_mask, F.IGNORE_INDEX), labels):
        return
    b, s = (int(i) for i in torch.nonzero(labels.ne(F.IGNORE_INDEX).logical_and_(padding_mask))[0])
    raise ValueError(_err(where, f"a supervised label at padding (row {b}, column {s}: {int(labels[b, s])})",
                          f"{F.IGNORE_INDEX} at every padding position",
                          "meta.padding_length disagrees with the padding mask; check the Zephon version."))


def document_ids_from_positions(position_ids: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
    """Subdocument ids of input-aligned tokens (docs/contract.md §4).

    A new subdocument starts at column 0 and wherever the position is 0 on
    every axis. Ids are 1-based, increase left to right within a row, and are
    0 exactly at padding.

    Args:
        position_ids: int64 ``[B, S]`` or ``[A, B, S]`` (multi-axis RoPE), nonnegative.
        padding_mask: bool ``[B, S]``, True at trailing padding.

    Returns:
        int64 ``[B, S]``.

    Raises:
        TypeError / ValueError: wrong type, dtype, rank or shape; negative
        positions; padding that is not a trailing run.
    """
    _check_positions(position_ids, F.POSITION_IDS)
    _check_padding_mask(padding_mask, tuple(position_ids.shape[-2:]), F.PADDING_MASK)
    return _ids_from_starts(_document_starts(position_ids), padding_mask)


def next_token_starts_document(
    position_ids: torch.Tensor, last_next_starts: torch.Tensor | None = None
) -> torch.Tensor:
    """Bool ``[B, S]``: True at column ``j`` when the label target (token ``j + 1``) starts a new subdocument.

    Args:
        position_ids: int64 ``[B, S]`` or ``[A, B, S]``, input-aligned.
        last_next_starts: bool ``[B]``: whether the token after the last input
            column (the final label target, dropped by the shift) starts a new
            subdocument. ``None`` means it does not.
    """
    _check_positions(position_ids, F.POSITION_IDS)
    starts = _document_starts(position_ids)
    batch = starts.shape[0]
    if last_next_starts is None:
        last_next_starts = torch.zeros(batch, dtype=torch.bool)
    if (
        not isinstance(last_next_starts, torch.Tensor)
        or last_next_starts.dtype != torch.bool
        or tuple(last_next_starts.shape) != (batch,)
    ):
        raise ValueError(_err("last_next_starts", _describe(last_next_starts), f"bool [{batch}]", "Pass one flag per row."))
    return _next_starts(starts, last_next_starts)


def _last_packed_position_is_zero(zephon_batch: Any) -> torch.Tensor:
    """Whether each packed row's final token (index ``S``, a label target only) has position 0 on every axis.

    ``to_training`` drops that token, so it is read from the records: one
    scalar (or one per axis) per row, compared at once in one NumPy call.
    """
    last = [np.asarray(record.payload[Z.POSITIONS])[..., -1] for record in zephon_batch.records]
    zero = np.equal(last, 0)  # one array of the B values (or [B, A] for multi-axis positions)
    if zero.ndim > 1:
        zero = zero.all(axis=tuple(range(1, zero.ndim)))
    return torch.from_numpy(zero)


def _pad_rows(result: dict[str, torch.Tensor], rows: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """``result`` completed to ``rows`` rows with all-padding rows (new tensors; the inputs are not modified).

    A padding row follows Zephon's convention for a pad tail: pad ids, label
    ``IGNORE_INDEX``, padding mask True, document id 0, positions ``0..S-1``
    (the tail is numbered as its own run), eligibility False (``pack_flat``
    pads aligned fields with 0) and one physical segment ``[0, S, ..., S]``.
    """
    input_ids = result[F.INPUT_IDS]
    present, length = input_ids.shape
    missing = rows - present
    if missing == 0:
        return result

    def extend(tensor: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor, fill], dim=-2)

    positions = result[F.POSITION_IDS]
    tail_positions = torch.arange(length, dtype=positions.dtype).expand(*positions.shape[:-2], missing, length)
    out = dict(result)
    out[F.INPUT_IDS] = extend(input_ids, torch.full((missing, length), pad_token_id, dtype=input_ids.dtype))
    out[F.LABELS] = extend(result[F.LABELS], torch.full((missing, length), F.IGNORE_INDEX, dtype=torch.int64))
    out[F.PADDING_MASK] = extend(result[F.PADDING_MASK], torch.ones(missing, length, dtype=torch.bool))
    out[F.POSITION_IDS] = extend(positions, tail_positions)
    out[F.DOCUMENT_IDS] = extend(result[F.DOCUMENT_IDS], torch.zeros(missing, length, dtype=torch.int64))
    for name in (F.ATTENTION_ELIGIBILITY, F.CP_PADDING):  # eligibility False, no context-parallel padding
        if name in result:
            out[name] = extend(result[name], torch.zeros(missing, length, dtype=torch.bool))
    if F.SOURCE_IDS in result:
        out[F.SOURCE_IDS] = extend(result[F.SOURCE_IDS],
                                   torch.full((missing, length), F.SOURCE_ID_PADDING, dtype=torch.int64))
    if F.CU_SEQLENS in result:
        cu = result[F.CU_SEQLENS]
        segments = torch.full((missing, cu.shape[1]), length, dtype=cu.dtype)
        segments[:, 0] = 0
        out[F.CU_SEQLENS] = extend(cu, segments)
    return out


def collate(
    zephon_batch: Any,
    *,
    mask_cross_document_labels: bool,
    eos_mask_loss: bool = False,
    eos_token_id: int | None = None,
    eligibility: bool | None = None,
    physical_cu_seqlens: bool = True,
    micro_batch_size: int | None = None,
    pad_token_id: int | None = None,
) -> dict[str, torch.Tensor]:
    """Turn one Zephon ``SampleBatch`` (from ``pack_flat(S + 1).batch(B)``) into a TrainingBatch.

    Returned keys (:mod:`zephon_loader.fields`), CPU tensors:

    ==========================  =========  ====================================================
    key                         dtype      shape / meaning
    ==========================  =========  ====================================================
    ``INPUT_IDS``               int64      ``[B, S]`` tokens ``[:, :-1]`` of each packed row
    ``LABELS``                  int64      ``[B, S]`` tokens ``[:, 1:]``; ``IGNORE_INDEX`` at
                                           padding, unsupervised (chat loss mask) and masked
                                           tokens
    ``PADDING_MASK``            bool       ``[B, S]`` True at trailing padding
    ``POSITION_IDS``            int64      ``[B, S]`` Zephon's segment-local positions
    ``DOCUMENT_IDS``            int64      ``[B, S]`` 1-based subdocument index, 0 at padding
    ``CU_SEQLENS``              int32      ``[B, K]`` Zephon's physical segment offsets
                                           (padding run included; rows padded with ``S``)
    ``ATTENTION_ELIGIBILITY``   bool       ``[B, S]`` only when the batch carries it
    ``CP_PADDING``              bool       ``[B, S]`` True at context-parallel padding, only when
                                           the records carry it (``contract.cp_size > 1``)
    ``SOURCE_IDS``              int64      ``[B, S]`` each input token's source index (its
                                           record's ``SOURCE_MARKS`` - 1), ``-1`` at padding; only
                                           when the records carry marks (``return_source_ids``)
    ==========================  =========  ====================================================

    Context-parallel padding (records padded before packing, ``fields.CP_PADDING``
    in the payload): the label of a padding token and the label whose target
    is a padding token are ``IGNORE_INDEX``; tokens, positions (a document's
    padding continues its positions) and document ids are Zephon's.

    Label masking:

    * ``mask_cross_document_labels`` (required; pass True unless cross-document
      attention is on): the last token of a subdocument whose target is the
      first token of the next subdocument gets ``IGNORE_INDEX`` — including the
      last column, whose target is the dropped ``S + 1``-th token. Positional,
      independent of token ids.
    * ``eos_mask_loss`` + ``eos_token_id``: Zephon's semantics — labels are
      masked where the *input* token equals ``eos_token_id``, i.e. the
      prediction made *from* EOS (``EOS -> BOS``/next document) is dropped
      while ``... -> EOS`` stays supervised. Matching is by id: EOS tokens
      inside a document are masked too, and if BOS == EOS the prediction after
      BOS is masked as well. With Zephon's ``BOS ... EOS`` bracketing this
      masks the same labels as ``mask_cross_document_labels`` plus any
      in-document EOS.

    Args:
        zephon_batch: A ``zephon.SampleBatch`` whose records are flat
            ``pack_flat(emit_positions=True)`` payloads.
        mask_cross_document_labels: See above.
        eos_mask_loss: See above.
        eos_token_id: Required when ``eos_mask_loss``; ignored otherwise.
        physical_cu_seqlens: Also return Zephon's physical ``CU_SEQLENS``. The
            loader passes False: the final map replaces them (metadata) or
            drops them, and computing them is a quarter of this function's time.
        eligibility: Carry ``fields.ATTENTION_ELIGIBILITY`` from the payload:
            ``None`` = when present, ``True`` = required, ``False`` = never.
        micro_batch_size: ``B``. A batch with fewer records (Zephon's
            ``batch(B, drop_last=False)`` delivers the short batch left at each
            flush and at the end of the stream) is completed with all-padding
            rows: ``pad_token_id`` ids, ``IGNORE_INDEX`` labels, padding mask
            True, document id 0, positions ``0..S-1``, eligibility False,
            physical ``cu_seqlens`` ``[0, S, ..., S]``. More records than ``B``
            is an error. ``None``: the batch keeps its own row count.
        pad_token_id: The pipeline's pad id; required with ``micro_batch_size``.

    Raises:
        TypeError / ValueError: bad arguments, or Zephon output that is not
        what this module expects (missing positions, wrong dtype/shape,
        non-trailing padding, unmasked padding labels).
    """
    _check_arguments(mask_cross_document_labels, eos_mask_loss, eos_token_id, eligibility, micro_batch_size,
                     pad_token_id)
    return _collate(zephon_batch, mask_cross_document_labels, eos_mask_loss, eos_token_id, eligibility,
                    physical_cu_seqlens, micro_batch_size, pad_token_id)


def _check_arguments(mask_cross_document_labels: Any, eos_mask_loss: Any, eos_token_id: Any, eligibility: Any,
                     micro_batch_size: Any, pad_token_id: Any) -> None:
    """:func:`collate`'s fixed arguments (checked once per loader by :class:`TextCollate`)."""
    if not isinstance(mask_cross_document_labels, bool):
        raise TypeError(_err("mask_cross_document_labels", repr(mask_cross_document_labels), "a bool",
                             "Pass True unless cross-document attention is on."))
    if not isinstance(eos_mask_loss, bool):
        raise TypeError(_err("eos_mask_loss", repr(eos_mask_loss), "a bool", "Pass True or False."))
    if eos_mask_loss and (
        eos_token_id is None or isinstance(eos_token_id, bool)
        or not isinstance(eos_token_id, (int, np.integer)) or eos_token_id < 0
    ):
        raise ValueError(_err("eos_token_id", repr(eos_token_id), "a nonnegative int when eos_mask_loss=True",
                              "Pass the EOS id the pipeline appends (tokenizer.eos_token_id)."))
    if eligibility is not None and not isinstance(eligibility, bool):
        raise TypeError(_err("eligibility", repr(eligibility), "None, True or False", "Pass a bool or None."))
    if micro_batch_size is not None:
        for name, value, low in (("micro_batch_size", micro_batch_size, 1), ("pad_token_id", pad_token_id, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(_err(name, repr(value), f"an int >= {low} when micro_batch_size is set",
                                      "Pass the loader's B and the pipeline's pad_token_id."))


def _collate(zephon_batch: Any, mask_cross_document_labels: bool, eos_mask_loss: bool, eos_token_id: int | None,
             eligibility: bool | None, physical_cu_seqlens: bool, micro_batch_size: int | None,
             pad_token_id: int | None) -> dict[str, torch.Tensor]:
    """:func:`collate` of checked arguments."""
    if not hasattr(zephon_batch, "to_training") or not hasattr(zephon_batch, "records"):
        raise TypeError(
            _err("zephon_batch", type(zephon_batch).__name__, "a zephon.SampleBatch",
                 "Pass the batches a ZephonSource / zephon.Pipeline yields.")
        )
    records = zephon_batch.records
    if len(records) == 0:
        raise ValueError(_err("zephon_batch", "an empty batch", "at least one record",
                              "Zephon's batch(B) never emits an empty batch; check the pipeline."))
    if micro_batch_size is not None and len(records) > micro_batch_size:
        raise ValueError(_err("zephon_batch", f"{len(records)} records",
                              f"at most micro_batch_size={micro_batch_size}",
                              "Build the pipeline with batch(micro_batch_size)."))
    first = records[0].payload
    if not isinstance(first, dict):
        raise TypeError(_err("zephon_batch.records[0].payload", type(first).__name__, "a dict (pack_flat output)",
                             "Build the pipeline with pack_flat(...).batch(B)."))
    if Z.POSITIONS not in first:
        raise ValueError(
            _err("zephon_batch payload", sorted(map(str, first)), f"a {Z.POSITIONS!r} field",
                 "Build the pipeline with pack_flat(..., emit_positions=True).")
        )
    has_elig = F.ATTENTION_ELIGIBILITY in first
    if eligibility and not has_elig:
        raise ValueError(
            _err("zephon_batch payload", sorted(map(str, first)), f"a {F.ATTENTION_ELIGIBILITY!r} field",
                 "Set eligibility_field in build_pipeline, or pass eligibility=None/False.")
        )
    carry_elig = has_elig and eligibility is not False
    carry_cp = F.CP_PADDING in first
    carry_source = F.SOURCE_MARKS in first

    out = zephon_batch.to_training(
        return_labels=True,
        return_padding_mask=True,
        return_cu_seqlens=physical_cu_seqlens,
        ignore_index=F.IGNORE_INDEX,
        extra_fields=([F.ATTENTION_ELIGIBILITY] * carry_elig + [F.CP_PADDING] * carry_cp
                      + [F.SOURCE_MARKS] * carry_source),
        eos_mask_loss=eos_mask_loss,
        eos_token_id=int(eos_token_id) if eos_mask_loss else None,
        exclude_fields=(Z.IDS, Z.TEXTS),
    )

    # --- validate what Zephon returned --------------------------------------------------
    input_ids = out.get(Z.TOKENS)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.int64 or input_ids.dim() != 2:
        raise ValueError(_err(f"to_training()[{Z.TOKENS!r}]", _describe(input_ids), "int64 [B, S]",
                              "Check the Zephon version (0.2.x) and that payload tokens are integers."))
    shape = tuple(input_ids.shape)
    if shape[1] < 1:
        raise ValueError(_err(f"to_training()[{Z.TOKENS!r}]", _describe(input_ids), "S >= 1",
                              "Pack to at least 2 tokens (seq_len >= 1)."))
    for key, dtype in ((Z.LABELS, torch.int64), (Z.POSITIONS, torch.int64), (Z.PADDING_MASK, torch.bool)):
        value = out.get(key)
        if not isinstance(value, torch.Tensor) or value.dtype != dtype or tuple(value.shape) != shape:
            raise ValueError(_err(f"to_training()[{key!r}]", _describe(value), f"{dtype} of shape {shape}",
                                  "Check the Zephon version (0.2.x)."))
    labels, positions, padding = out[Z.LABELS], out[Z.POSITIONS], out[Z.PADDING_MASK]
    _check_positions(positions, f"to_training()[{Z.POSITIONS!r}]")
    # Most packed batches have no padding at all: then the mask is trivially trailing and no label sits at
    # padding, so one pass over the mask stands for those two checks (four tensor calls) and the ids' fill.
    padded = bool(padding.any())
    if padded:
        _check_padding_mask(padding, shape, f"to_training()[{Z.PADDING_MASK!r}]")
        _check_padding_labels(labels, padding, f"to_training()[{Z.LABELS!r}]")
    cu = out.get(Z.CU_SEQLENS)
    if physical_cu_seqlens and (
        not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 2 or cu.shape[0] != shape[0]
    ):
        raise ValueError(_err(f"to_training()[{Z.CU_SEQLENS!r}]", _describe(cu), f"int32 [{shape[0]}, K]",
                              "Check the Zephon version (0.2.x)."))

    # --- derive ------------------------------------------------------------------------
    starts = _document_starts(positions)
    document_ids = _ids_from_starts(starts, padding if padded else None)
    if mask_cross_document_labels:
        crossing = _next_starts(starts, _last_packed_position_is_zero(zephon_batch))
        labels = labels.masked_fill(crossing, F.IGNORE_INDEX)

    result: dict[str, torch.Tensor] = {
        F.INPUT_IDS: input_ids,
        F.LABELS: labels,
        F.PADDING_MASK: padding,
        F.POSITION_IDS: positions,
        F.DOCUMENT_IDS: document_ids,
    }
    if physical_cu_seqlens:
        result[F.CU_SEQLENS] = cu
    if carry_cp:
        cp = out.get(F.CP_PADDING)
        if not isinstance(cp, torch.Tensor) or tuple(cp.shape) != shape:
            raise ValueError(_err(f"to_training()[{F.CP_PADDING!r}]", _describe(cp), f"shape {shape}",
                                  "The context-parallel padding marker must be per-token."))
        cp = cp.bool()
        # Unsupervised: a padding token's label, and the label whose target (the next token) is padding.
        last_target = torch.from_numpy(np.asarray(
            [np.asarray(record.payload[F.CP_PADDING])[-1] for record in zephon_batch.records]) != 0)
        target = torch.cat([cp[:, 1:], last_target[:, None]], dim=1)
        result[F.LABELS] = labels.masked_fill(cp | target, F.IGNORE_INDEX)
        result[F.CP_PADDING] = cp
    if carry_source:
        # Sliced like input_ids by to_training (tokens [:, :-1]); the packer's padding holds 0.
        marks = out.get(F.SOURCE_MARKS)
        if not isinstance(marks, torch.Tensor) or tuple(marks.shape) != shape or marks.dtype.is_floating_point:
            raise ValueError(_err(f"to_training()[{F.SOURCE_MARKS!r}]", _describe(marks), f"integers of shape {shape}",
                                  "The source marks must be per-token (the loader's record checks add them)."))
        result[F.SOURCE_IDS] = marks.to(torch.int64) - 1  # a new tensor: 0 (padding) -> SOURCE_ID_PADDING
    if carry_elig:
        elig = out.get(F.ATTENTION_ELIGIBILITY)
        if not isinstance(elig, torch.Tensor) or tuple(elig.shape) != shape:
            raise ValueError(_err(f"to_training()[{F.ATTENTION_ELIGIBILITY!r}]", _describe(elig), f"shape {shape}",
                                  "The eligibility field must be per-token."))
        result[F.ATTENTION_ELIGIBILITY] = elig != 0
    if micro_batch_size is not None:
        result = _pad_rows(result, int(micro_batch_size), int(pad_token_id))
    return result


class TextCollate:
    """:func:`collate` with its fixed arguments checked once, at construction: what the loader runs per batch.

    Picklable. Keyword arguments as :func:`collate`'s (``physical_cu_seqlens`` defaults to True there too).
    """

    def __init__(self, *, mask_cross_document_labels: bool, eos_mask_loss: bool = False,
                 eos_token_id: int | None = None, eligibility: bool | None = None, physical_cu_seqlens: bool = True,
                 micro_batch_size: int | None = None, pad_token_id: int | None = None) -> None:
        _check_arguments(mask_cross_document_labels, eos_mask_loss, eos_token_id, eligibility, micro_batch_size,
                         pad_token_id)
        self.arguments = (mask_cross_document_labels, eos_mask_loss, eos_token_id, eligibility,
                          bool(physical_cu_seqlens), micro_batch_size, pad_token_id)

    def __call__(self, zephon_batch: Any) -> dict[str, torch.Tensor]:
        return _collate(zephon_batch, *self.arguments)
