"""Stateless mapping from collated Zephon tensors to AutoModel's packed input contract.

This is seed ``000`` (``nemo_automodel.components.datasets.zephon.attention``):
``adapt_model_inputs`` → optional ``enable_xdoc_attention``, plus the
construction-time ``require_supported_packing_contract``. Every function takes
an owned mapping, replaces entries, and never writes into an existing tensor.

Validation is separate from the transforms: :func:`check_training_batch`
checks every TrainingBatch invariant; ``adapt_model_inputs`` and
``enable_xdoc_attention`` run it on their input (a caller's batch), while
:func:`attention_document_ids` and :func:`join_subdocuments` are the bare
transforms the final map applies to what ``collate`` already guarantees.
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping, NotRequired, Required, TypedDict

import torch

from zephon_loader import fields as F
from zephon_loader.contract import DEFAULT_BLOCK_MASK_BUDGET_BYTES, PackingContract, validate_packing_contract
from zephon_loader.packing import _columns

#: Collated CPU tensors; AutoModel aliases are applied only when yielding.
#:
#: Token fields are ``[B, S]``: ``input_ids``/``labels`` int64 (labels ``-100``
#: where unsupervised), ``padding_mask`` bool (True at trailing padding),
#: ``document_ids`` int64 (1-based subdocument per row, 0 exactly at padding),
#: ``attention_document_ids`` int64 (like ``document_ids``, 0 also at
#: ineligible tokens; joined under xdoc). ``position_ids`` int64 is ``[B, S]``
#: or ``[A, B, S]`` (mRoPE). ``cu_seqlens`` int32 is Zephon's physical
#: ``[B, K]`` before the final map and the gathered ``[B, D + 1]`` after it.
TrainingBatch = TypedDict(
    "TrainingBatch",
    {
        F.INPUT_IDS: Required[torch.Tensor],
        F.LABELS: Required[torch.Tensor],
        F.PADDING_MASK: Required[torch.Tensor],
        F.POSITION_IDS: Required[torch.Tensor],
        F.DOCUMENT_IDS: NotRequired[torch.Tensor],
        F.ATTENTION_DOCUMENT_IDS: NotRequired[torch.Tensor],
        F.ATTENTION_ELIGIBILITY: NotRequired[torch.Tensor],
        F.ATTENTION_MASK: NotRequired[torch.Tensor],
        F.PACKED_SEQ_IDS: NotRequired[torch.Tensor],
        F.CU_SEQLENS: NotRequired[torch.Tensor],
        F.MAX_SEQLEN: NotRequired[int],
        F.PACKED_TOKEN_INDICES: NotRequired[torch.Tensor],
        F.QKV_FORMAT: NotRequired[str],
        F.SEQ_LENS: NotRequired[torch.Tensor],
        F.SEQ_LENS_PADDED: NotRequired[torch.Tensor],
    },
    total=False,
)
TrainingBatch.__doc__ = (
    "A collated batch of CPU tensors under the package's internal names (zephon_loader.fields), before the final "
    "map renames and adds the contract's fields. [B, S] int64 input_ids and labels (-100 where unsupervised), bool "
    "padding_mask (True at trailing padding), int64 position_ids ([B, S], or [3, B, S] mRoPE), int64 document_ids "
    "(1-based per row, 0 at padding), and attention_document_ids (0 also at ineligible tokens). See docs/contract.md."
)

_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _tensor(batch: Mapping[str, Any], name: str) -> torch.Tensor:
    if name not in batch:
        raise ValueError(f"{name}: missing from the batch (keys seen: {sorted(batch)}); expected a tensor")
    value = batch[name]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: got {type(value).__name__}, expected a torch.Tensor")
    return value


def _expect_dtype(name: str, tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...], wanted: str) -> None:
    if tensor.dtype not in dtypes:
        raise TypeError(f"{name}: got dtype {tensor.dtype}, expected {wanted}")


def _expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...], wanted: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: got shape {tuple(tensor.shape)}, expected {wanted} = {list(shape)}")


def _validate_positions(batch: Mapping[str, Any], batch_shape: tuple[int, int]) -> torch.Tensor:
    positions = _tensor(batch, F.POSITION_IDS)
    _expect_dtype(F.POSITION_IDS, positions, _INTEGER_DTYPES, "an integer dtype (int64)")
    if positions.ndim == 2:
        _expect_shape(F.POSITION_IDS, positions, batch_shape, "[batch, sequence]")
    elif positions.ndim == 3:
        if tuple(positions.shape[1:]) != batch_shape:
            raise ValueError(
                f"{F.POSITION_IDS}: got shape {tuple(positions.shape)}, expected [axes, batch, sequence] = "
                f"[A, {batch_shape[0]}, {batch_shape[1]}]"
            )
    else:
        raise ValueError(
            f"{F.POSITION_IDS}: got rank {positions.ndim} shape {tuple(positions.shape)}, expected "
            "[batch, sequence] or [axes, batch, sequence] (mRoPE)"
        )
    if positions.numel():
        low = int(positions.min())
        if low < 0:
            raise ValueError(f"{F.POSITION_IDS}: got minimum {low}, expected nonnegative positions")
    return positions


def padding_is_trailing(padding: torch.Tensor) -> bool:
    """Whether every row of a bool ``[B, S]`` mask is False, then True to its end (two tensor calls).

    A row is trailing padding exactly when it equals its running maximum (once True, True to the end).
    """
    if padding.shape[-1] < 2 or padding.numel() == 0:
        return True
    return torch.equal(padding, padding.cummax(dim=-1).values)


def _check_trailing_padding(padding: torch.Tensor) -> None:
    if not padding_is_trailing(padding):
        b, s = (int(i) for i in torch.nonzero(padding[:, :-1] & ~padding[:, 1:])[0])
        raise ValueError(
            f"{F.PADDING_MASK}: row {b} has padding at column {s} followed by a token; "
            "expected padding only at the end of each row"
        )


def _validate_document_ids(name: str, ids: torch.Tensor, padding: torch.Tensor) -> None:
    """ids: 1-based, 0 exactly at (trailing) padding, nondecreasing along each row's non-padding tokens."""
    if ids.numel() == 0:
        return
    low = int(ids.min())
    if low < 0:
        raise ValueError(f"{name}: got minimum {low}, expected nonnegative document ids")
    zero = ids.logical_not()
    if not torch.equal(zero, padding):
        b, s = (int(i) for i in torch.nonzero(zero != padding)[0])
        raise ValueError(
            f"{name}: got id {int(ids[b, s])} at row {b}, column {s} where {F.PADDING_MASK} is "
            f"{bool(padding[b, s])}; expected 0 exactly at padding and a 1-based id elsewhere"
        )
    # Padding is trailing (checked by the caller) and 0 exactly there, so the only
    # allowed decrease is the step into the padding tail: a decrease ending on a nonzero id is an error.
    decreasing = (ids.diff(dim=1) < 0) & ~padding[:, 1:]
    if bool(decreasing.any()):
        b, s = (int(i) for i in torch.nonzero(decreasing)[0])
        raise ValueError(
            f"{name}: row {b} decreases at column {s + 1} (id {int(ids[b, s + 1])} after {int(ids[b, s])}); "
            "expected subdocument ids increasing left to right"
        )


def check_training_batch(
    batch: Mapping[str, Any], attention_eligibility: torch.Tensor | None = None
) -> None:
    """Check every TrainingBatch invariant the final map relies on (docs/contract.md §4, §6).

    ``collate`` guarantees these for the batches it builds; call this on any
    other batch (a user's, one decoded from a saved state) before the bare
    transforms (:func:`attention_document_ids`, :func:`join_subdocuments`,
    :func:`zephon_loader.finalize.final_map.finalize_collated`).

    Args:
        batch: int64 ``input_ids``/``labels`` ``[B, S]``, bool ``padding_mask``
            ``[B, S]`` (True = pad, trailing), integer ``position_ids``
            ``[B, S]`` or ``[A, B, S]`` (nonnegative) and int64
            ``document_ids`` ``[B, S]`` (1-based, nondecreasing along a row,
            0 exactly at padding). Not modified.
        attention_eligibility: Optional bool ``[B, S]``.

    Raises:
        ValueError: Wrong rank/shape, negative ids or positions, padding that
            is not trailing, ids nonzero at padding or zero elsewhere, ids
            decreasing along a row.
        TypeError: Wrong dtype or non-tensor values.
    """
    input_ids = _tensor(batch, F.INPUT_IDS)
    if input_ids.ndim != 2:
        raise ValueError(f"{F.INPUT_IDS}: got shape {tuple(input_ids.shape)}, expected rank 2 [batch, sequence]")
    _expect_dtype(F.INPUT_IDS, input_ids, (torch.int64,), "torch.int64")
    shape = tuple(input_ids.shape)
    labels = _tensor(batch, F.LABELS)
    _expect_dtype(F.LABELS, labels, (torch.int64,), "torch.int64")
    _expect_shape(F.LABELS, labels, shape, "[batch, sequence] like input_ids")
    padding = _tensor(batch, F.PADDING_MASK)
    _expect_dtype(F.PADDING_MASK, padding, (torch.bool,), "torch.bool (True = padding)")
    _expect_shape(F.PADDING_MASK, padding, shape, "[batch, sequence] like input_ids")
    _check_trailing_padding(padding)
    _validate_positions(batch, shape)
    ids = _tensor(batch, F.DOCUMENT_IDS)
    _expect_dtype(F.DOCUMENT_IDS, ids, (torch.int64,), "torch.int64")
    _expect_shape(F.DOCUMENT_IDS, ids, shape, "[batch, sequence] like input_ids")
    _validate_document_ids(F.DOCUMENT_IDS, ids, padding)
    if attention_eligibility is None:
        return
    if not isinstance(attention_eligibility, torch.Tensor):
        raise TypeError(
            f"{F.ATTENTION_ELIGIBILITY}: got {type(attention_eligibility).__name__}, expected a bool tensor"
        )
    _expect_dtype(F.ATTENTION_ELIGIBILITY, attention_eligibility, (torch.bool,), "torch.bool (True = eligible)")
    _expect_shape(F.ATTENTION_ELIGIBILITY, attention_eligibility, shape, "[batch, sequence] like input_ids")


def attention_document_ids(document_ids: torch.Tensor, attention_eligibility: torch.Tensor | None) -> torch.Tensor:
    """The bare eligibility transform: ``document_ids`` where eligible, 0 elsewhere.

    Args:
        document_ids: int64 ``[B, S]``, 0 at padding (not validated here).
        attention_eligibility: bool ``[B, S]`` or ``None`` (every token eligible).

    Returns:
        int64 ``[B, S]``: ``document_ids`` itself when ``attention_eligibility``
        is ``None``, else a new tensor.
    """
    if attention_eligibility is None:
        return document_ids
    return torch.where(attention_eligibility, document_ids, 0)


def adapt_model_inputs(
    batch: MutableMapping[str, Any], attention_eligibility: torch.Tensor | None = None
) -> TrainingBatch:
    """Prepare attention membership from collated document ids.

    Runs after ``to_training``, so ids already align with the shifted, padded
    input tokens. Validates the batch first (:func:`check_training_batch`).

    Args:
        batch: Owned mapping with int64 ``input_ids``/``labels`` ``[B, S]``,
            bool ``padding_mask`` ``[B, S]`` (True = pad), integer
            ``position_ids`` ``[B, S]`` or ``[A, B, S]`` (nonnegative) and int64
            ``document_ids`` ``[B, S]`` (1-based, increasing left to right, 0
            exactly at padding). Entries are replaced; no tensor is written.
        attention_eligibility: Optional bool ``[B, S]``; False marks tokens
            (e.g. synthetic image tokens) that must neither attend nor be
            attended, independently of padding.

    Returns:
        The same mapping with int64 ``attention_document_ids`` ``[B, S]``:
        ``document_ids`` where eligible, 0 at ineligible tokens and padding.

    Raises:
        ValueError: Wrong rank/shape, negative ids or positions, ids nonzero at
            padding or zero elsewhere, ids decreasing along a row.
        TypeError: Wrong dtype or non-tensor values.
    """
    check_training_batch(batch, attention_eligibility)
    batch[F.ATTENTION_DOCUMENT_IDS] = attention_document_ids(batch[F.DOCUMENT_IDS], attention_eligibility)
    return batch  # type: ignore[return-value]


def enable_xdoc_attention(batch: MutableMapping[str, Any], packing_contract: object) -> TrainingBatch:
    """Join attention and position ranges inside each packed row (cross-document attention).

    * ``attention_document_ids``: every nonzero entry of a row becomes 1;
      excluded tokens (ineligible, padding) stay 0.
    * ``position_ids``: subdocument ``k`` of a row is shifted by
      ``offset_k = offset_(k-1) + max_coord(k-1) + 1`` (``offset_1 = 0``), where
      ``max_coord(j)`` is the largest position of subdocument ``j`` over all its
      tokens (ineligible included) and all axes. ``[A, B, S]`` positions shift
      every axis by the same offset. Padding positions are left as they are.

    Args:
        batch: Owned mapping as returned by :func:`adapt_model_inputs`
            (``document_ids``, ``attention_document_ids`` int64 ``[B, S]``;
            ``position_ids`` ``[B, S]`` or ``[A, B, S]``, local per subdocument).
        packing_contract: The model's contract, validated like
            :func:`require_supported_packing_contract`.

    Returns:
        The same mapping with joined ``attention_document_ids`` and translated
        ``position_ids`` (new tensors; the inputs are untouched).

    Raises:
        ValueError/TypeError: Invalid contract or batch (see :func:`adapt_model_inputs`).
    """
    validate_packing_contract(packing_contract)
    ids = _tensor(batch, F.DOCUMENT_IDS)
    if F.ATTENTION_DOCUMENT_IDS not in batch:
        raise ValueError(
            f"{F.ATTENTION_DOCUMENT_IDS}: missing; expected adapt_model_inputs to run before enable_xdoc_attention"
        )
    attention_ids = _tensor(batch, F.ATTENTION_DOCUMENT_IDS)
    padding = _tensor(batch, F.PADDING_MASK)
    if ids.ndim != 2:
        raise ValueError(f"{F.DOCUMENT_IDS}: got shape {tuple(ids.shape)}, expected rank 2 [batch, sequence]")
    _expect_dtype(F.DOCUMENT_IDS, ids, (torch.int64,), "torch.int64")
    _expect_dtype(F.ATTENTION_DOCUMENT_IDS, attention_ids, (torch.int64,), "torch.int64")
    _expect_shape(F.ATTENTION_DOCUMENT_IDS, attention_ids, tuple(ids.shape), "[batch, sequence] like document_ids")
    _expect_shape(F.PADDING_MASK, padding, tuple(ids.shape), "[batch, sequence] like document_ids")
    _expect_dtype(F.PADDING_MASK, padding, (torch.bool,), "torch.bool (True = padding)")
    _check_trailing_padding(padding)
    _validate_document_ids(F.DOCUMENT_IDS, ids, padding)
    if bool(((attention_ids != 0) & (attention_ids != ids)).any()):
        raise ValueError(
            f"{F.ATTENTION_DOCUMENT_IDS}: must equal {F.DOCUMENT_IDS} or 0 at every token; "
            "expected the output of adapt_model_inputs"
        )
    _validate_positions(batch, tuple(ids.shape))
    return join_subdocuments(batch)


def join_subdocuments(batch: MutableMapping[str, Any]) -> TrainingBatch:
    """The bare xdoc transform, on a batch whose invariants are already known to hold.

    Used by the final map (``collate`` guarantees the invariants, or
    ``finalize_batch`` checked them); call :func:`enable_xdoc_attention` on
    anything else.
    """
    batch[F.ATTENTION_DOCUMENT_IDS] = batch[F.ATTENTION_DOCUMENT_IDS].clamp(max=1)  # ids are nonnegative
    batch[F.POSITION_IDS] = joined_positions(batch[F.DOCUMENT_IDS], batch[F.POSITION_IDS])
    return batch  # type: ignore[return-value]


def joined_positions(document_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``position_ids`` with each row's subdocuments continuing one another (a new tensor; inputs untouched).

    Subdocument ``k`` of a row is shifted by ``offset_k = offset_(k-1) + max_coord(k-1) + 1`` (``offset_1 =
    0``), ``max_coord`` its largest position over all axes; padding (id 0) is not shifted.

    Args:
        document_ids: int64 ``[B, S]``, 1-based, 0 at padding.
        position_ids: integer ``[B, S]`` or ``[A, B, S]``, nonnegative, local per subdocument.

    Returns:
        ``position_ids + offset_k`` of each token's subdocument, ``position_ids``' shape and dtype.
    """
    coords = position_ids if position_ids.ndim == 2 else position_ids.amax(dim=0)
    # The per-subdocument maxima and their running sums are computed in float32 when that is exact (every
    # joined position below 2**24, as at any real sequence length): on CPU its scatter-max takes half the
    # time of int64's. Past that, in int64. The per-token work is int64 and in place, so the batch
    # allocates one [B, S] tensor beyond the float32 copy (fresh allocations cost page faults).
    offsets, total = _subdocument_offsets(document_ids, coords.to(torch.float32))
    if total >= _FLOAT32_EXACT:
        offsets, _ = _subdocument_offsets(document_ids, coords.to(torch.int64))
    per_token = offsets.to(torch.int64).gather(1, document_ids)
    if position_ids.ndim == 2 and position_ids.dtype == torch.int64:
        return per_token.add_(position_ids)
    return position_ids + per_token.to(position_ids.dtype)


def joined_positions_of_runs(document_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor | None:
    """:func:`joined_positions` for ``collate``'s ids when every row counts up by one: else ``None``.

    With ids that start a new subdocument exactly where the position is 0 (or at column 0), as ``collate``
    derives them, and positions that count up by one inside each subdocument (Zephon's text rows), each
    subdocument's offset (``offset + max + 1`` of the one before) is the previous joined position plus one:
    a row's joined positions are its column-0 position plus the column, padding (id 0) left as it is. That
    is proved with one int64 maximum and a few int32 elementwise passes and built with one add, instead of
    the general per-subdocument maxima (~2x faster at [8, 8192]). Any other rows (a position that neither counts up nor restarts at 0, positions
    at or past 2**31, multi-axis positions, a single column) return ``None``: call :func:`joined_positions`.

    Args:
        document_ids: int64 ``[B, S]`` from ``collate`` (1-based running count of position-0 starts, 0 at
            trailing padding). Not checked: other ids may get a wrong answer, not ``None``.
        position_ids: int64 ``[B, S]``, nonnegative.

    Returns:
        int64 ``[B, S]`` (a new tensor), or ``None``.
    """
    if position_ids.ndim != 2 or position_ids.shape[1] < 2 or position_ids.dtype != torch.int64:
        return None
    if int(position_ids.max()) >= 2**31:  # int32 below holds every position exactly
        return None
    narrow = position_ids.to(torch.int32)
    following = narrow[:, 1:]
    # > 0 exactly where a position neither restarts at 0 nor counts up by one (no int32 overflow: both < 2**31).
    stray = torch.minimum(following.sub(narrow[:, :-1]).sub_(1).abs_(), following)
    if int(stray.max()) > 0:
        return None
    joined = position_ids[:, :1] + _columns(position_ids.shape[1], position_ids.device)
    if bool(document_ids[:, -1].all()):  # padding is trailing: no row ends in padding, so none has any
        return joined
    return torch.where(document_ids.bool(), joined, position_ids)


# Integers from 0 to 2**24 are exact in float32, and so is every sum of them that stays below it.
_FLOAT32_EXACT = 2**24


def _subdocument_offsets(document_ids: torch.Tensor, coords: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Each row's ``offset_k`` per subdocument id, in ``coords``' dtype, and the largest row total.

    Args:
        document_ids: int64 ``[B, S]``, 1-based, 0 at padding.
        coords: ``[B, S]`` nonnegative coordinates (the largest over the axes), integer or float32.

    Returns:
        ``[B, D + 1]`` (``D`` the largest id): column ``d`` holds ``offset_d``, column 0 (padding) 0 and an
        absent id its successor's offset; and ``max over rows of sum_k (max_coord(k) + 1)``, one past the
        largest joined position, as a float (0 for an empty batch). In float32 a total below 2**24
        proves every value exact: a coordinate at or past 2**24 rounds to at least 2**24 (so does its
        span, and the total), and a running sum can only round once it reaches 2**24, after which the
        sums of nonnegative values never come back below it.
    """
    batch_size = document_ids.shape[0]
    max_id = int(document_ids.max()) if document_ids.numel() else 0
    # Column d: max_coord(d) for present ids, -1 for absent ones and for padding; +1 makes it the span.
    largest = torch.full((batch_size, max_id + 1), -1, dtype=coords.dtype, device=document_ids.device)
    largest.scatter_reduce_(1, document_ids, coords, reduce="amax", include_self=True)
    largest[:, 0] = -1
    spans = largest.add_(1)
    ends = spans.cumsum(dim=1)
    total = float(ends[:, -1].max()) if batch_size else 0.0
    return ends.sub_(spans), total


def require_supported_packing_contract(
    packing_contract: object,
    *,
    attention_eligibility: bool = False,
    return_packed_sequence_metadata: bool = False,
    micro_batch_size: int | None = None,
    sequence_length: int | None = None,
    block_mask_budget_bytes: int = DEFAULT_BLOCK_MASK_BUDGET_BYTES,
) -> PackingContract:
    """Validate the model's packed interface once, at loader construction.

    Builders call this before any Zephon source or worker starts (through
    :meth:`zephon_loader.finalize.final_map.FinalizeSettings.from_contract`); the
    contract is fixed for the loader's life and never rechecked per batch.

    Args:
        packing_contract: A :class:`~zephon_loader.packing.PackingContract`
            (checked when it was built), or any object with
            ``packed_mask_type``, ``requires_packed_sequence_metadata`` and
            optional ``qkv_format`` (checked now).
        attention_eligibility: Whether a processor supplies per-token eligibility.
        return_packed_sequence_metadata: The user asks for the gathered-token
            bundle (a contract that requires it gets it regardless).
        micro_batch_size, sequence_length: ``B`` and ``S``, to size a block-causal mask.
        block_mask_budget_bytes: Largest ``[B, 1, S, S]`` bool mask allowed per batch.

    Returns:
        The contract as a (frozen, validated) :class:`~zephon_loader.packing.PackingContract`.

    Raises:
        TypeError: Missing contract attributes or wrong types.
        ValueError: Unknown values, or a combination the loader cannot build
            (the message says what to use instead).
    """
    contract = PackingContract.of(packing_contract)
    mask_type, qkv_format = contract.packed_mask_type, contract.qkv_format
    if not isinstance(return_packed_sequence_metadata, bool):
        raise TypeError(
            "return_packed_sequence_metadata: got "
            f"{type(return_packed_sequence_metadata).__name__}, expected bool"
        )
    if mask_type == "position_ids" and attention_eligibility:
        raise ValueError(
            "packing_contract.packed_mask_type: 'position_ids' (attn_implementation 'hf') lets the model derive "
            "its mask from position_ids, which cannot exclude ineligible tokens inside a document, but an "
            "eligibility field is configured; remove eligibility_field, or use an AutoModel attention "
            "implementation with packed_mask_type 'document_ids' (+ metadata) or 'block_causal'"
        )
    if mask_type == "position_ids" and return_packed_sequence_metadata:
        raise ValueError(
            "return_packed_sequence_metadata: got True with packed_mask_type 'position_ids' (attn_implementation "
            "'hf'); a stock Hugging Face model never reads packed_token_indices/cu_seqlens/max_seqlen; set it to "
            "False, or use attn_implementation 'fa4' (document_ids + metadata) for a model that consumes them"
        )
    if attention_eligibility and mask_type == "flash_varlen":
        raise ValueError(
            "packing_contract.packed_mask_type: 'flash_varlen' describes physical segments and cannot exclude "
            "ineligible tokens inside a document (the hole would split it), but an eligibility field is "
            "configured; use packed_mask_type 'document_ids' with requires_packed_sequence_metadata=True, "
            "or 'block_causal'"
        )
    if attention_eligibility and qkv_format == "thd":
        raise ValueError(
            "packing_contract.qkv_format: 'thd' (seq_lens_padded) describes physical spans and cannot exclude "
            "ineligible tokens inside a document, but an eligibility field is configured; use "
            "packed_mask_type 'document_ids' with requires_packed_sequence_metadata=True and qkv_format 'bshd'"
        )
    if contract.cp_size > 1 and sequence_length is not None and sequence_length % contract.cp_padding:
        raise ValueError(
            f"sequence_length: got {sequence_length} with packing_contract.cp_size {contract.cp_size}, expected a "
            f"multiple of 2 * cp_size = {contract.cp_padding} (every document and the row's padding span a multiple)"
        )
    if mask_type == "block_causal" and micro_batch_size is not None and sequence_length is not None:
        for name, value in (("micro_batch_size", micro_batch_size), ("sequence_length", sequence_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: got {value!r}, expected a positive int")
        cost = micro_batch_size * sequence_length * sequence_length
        if cost > block_mask_budget_bytes:
            raise ValueError(
                f"packing_contract.packed_mask_type: a 'block_causal' mask [B, 1, S, S] = "
                f"[{micro_batch_size}, 1, {sequence_length}, {sequence_length}] costs {cost:,} bytes per batch, "
                f"over the budget of {block_mask_budget_bytes:,}; use packed_mask_type 'document_ids' "
                "(with metadata for FA4), a smaller micro_batch_size/sequence_length, or raise "
                "block_mask_budget_bytes"
            )
    return contract
