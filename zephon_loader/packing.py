"""Packed-sequence contracts and gathered-token metadata.

A *packing contract* is the model's statement of how it wants packed rows
represented (SPEC §5). It is duck-typed like AutoModel 0.7.0's
``PackedSequenceContract``/``PackingCapabilities``: any object with

* ``packed_mask_type``: ``"block_causal"``, ``"document_ids"``, ``"flash_varlen"``
  (AutoModel's three) or ``"position_ids"`` (stock Hugging Face models, which
  derive the mask from ``position_ids`` themselves; ``attn_implementation: hf``);
* ``requires_packed_sequence_metadata``: ``bool``;
* optionally ``qkv_format``: ``"bshd"`` (default) or ``"thd"`` (Transformer Engine THD).

A contract is validated once, where it enters the package: a
:class:`PackingContract` checks its fields when it is constructed (and is
frozen), and :meth:`PackingContract.of` turns any duck-typed contract into
one. Everything downstream takes the :class:`PackingContract` as valid.

The metadata helpers here are vectorized equivalents of AutoModel 0.7.0's
``build_packed_sequence_metadata`` and ``flatten_packed_sequence_metadata``:
same outputs, same sentinels, no Python loop over rows or documents.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol, TypedDict, runtime_checkable

import torch
import torch.nn.functional as tF

from zephon_loader import fields as F

PackedMaskType = Literal["block_causal", "document_ids", "flash_varlen", "position_ids"]
QKVFormat = Literal["bshd", "thd"]

PACKED_MASK_TYPES: Final[frozenset[str]] = frozenset({"block_causal", "document_ids", "flash_varlen", "position_ids"})
QKV_FORMATS: Final[frozenset[str]] = frozenset({"bshd", "thd"})

#: AutoModel 0.7.0 attention names that take HF flash varlen kwargs.
FLASH_ATTENTION_IMPLEMENTATIONS: Final[frozenset[str]] = frozenset(
    {"flash_attention_2", "flash_attention_3", "flash_attention_4"}
)
#: Attention names AutoModel 0.7.0 maps to its default (block-causal) representation.
DENSE_ATTENTION_IMPLEMENTATIONS: Final[frozenset[str]] = frozenset({"sdpa", "eager", "flex", "te"})
#: Stock Hugging Face models (transformers >= 5, any of its attention kernels): no
#: ``attention_mask``; the model derives the packed mask from ``position_ids``.
HF_ATTENTION_IMPLEMENTATION: Final = "hf"


@runtime_checkable
class PackedSequenceContract(Protocol):
    """Structural model contract consumed while building packed batches."""

    @property
    def packed_mask_type(self) -> PackedMaskType:
        """Packed attention representation the model consumes."""
        ...

    @property
    def requires_packed_sequence_metadata(self) -> bool:
        """Whether the model consumes gathered-token indices and cumulative lengths."""
        ...


@dataclass(frozen=True)
class PackingContract:
    """A concrete packing contract (what YAML and :func:`contract_for_attention` build).

    Constructing one validates it (the only place a contract is checked);
    it is frozen, so every later holder can trust its fields.

    Attributes:
        packed_mask_type: ``"block_causal"`` (bool ``[B, 1, S, S]`` mask),
            ``"document_ids"`` (int64 ``[B, S]`` ids), ``"flash_varlen"``
            (HF varlen kwargs over physical segments) or ``"position_ids"``
            (no mask: a stock Hugging Face model derives the block-causal mask
            from ``position_ids`` restarting at 0 per document).
        requires_packed_sequence_metadata: Yield ``packed_token_indices``,
            ``cu_seqlens`` and ``max_seqlen`` (AutoModel's gathered-token
            bundle). Not with ``"position_ids"``.
        qkv_format: ``"bshd"``, or ``"thd"`` to also yield TE THD ``seq_lens``
            and ``seq_lens_padded``. Not with ``"position_ids"``.
    """

    packed_mask_type: PackedMaskType = "block_causal"
    requires_packed_sequence_metadata: bool = False
    qkv_format: QKVFormat = "bshd"

    def __post_init__(self) -> None:
        _check_contract(self)

    @classmethod
    def of(cls, contract: object) -> "PackingContract":
        """The validated, frozen form of any contract (returned as is when it already is one).

        Args:
            contract: A :class:`PackingContract`, or any object with
                ``packed_mask_type``, ``requires_packed_sequence_metadata`` and
                optionally ``qkv_format`` (AutoModel's ``PackingCapabilities``;
                a missing or ``None`` ``qkv_format`` means ``"bshd"``).

        Raises:
            TypeError/ValueError: As :func:`validate_packing_contract`.
        """
        if type(contract) is cls:
            return contract  # type: ignore[return-value]
        return cls(*_contract_fields(contract))  # type: ignore[arg-type]  # __post_init__ checks the values

    @property
    def fields(self) -> tuple[str, bool, str]:
        """``(packed_mask_type, requires_packed_sequence_metadata, qkv_format)``."""
        return self.packed_mask_type, self.requires_packed_sequence_metadata, self.qkv_format


def validate_packing_contract(contract: object) -> tuple[str, bool, str]:
    """Check a duck-typed contract and return its normalized fields.

    A :class:`PackingContract` was checked when it was constructed: its fields
    are returned without checking again.

    Args:
        contract: Any object with ``packed_mask_type``,
            ``requires_packed_sequence_metadata`` and optionally ``qkv_format``.

    Returns:
        ``(packed_mask_type, requires_packed_sequence_metadata, qkv_format)``,
        with a missing or ``None`` ``qkv_format`` normalized to ``"bshd"``.

    Raises:
        TypeError: A required attribute is missing or has the wrong type.
        ValueError: An attribute has an unknown value, or ``"position_ids"``
            with metadata or ``qkv_format`` ``"thd"``.
    """
    if type(contract) is PackingContract:
        return contract.fields
    return _check_contract(contract)


def _contract_fields(contract: object) -> tuple[Any, Any, Any]:
    """The three raw fields of a duck-typed contract (``qkv_format`` missing or ``None`` → ``"bshd"``)."""
    name = type(contract).__name__
    for attribute in ("packed_mask_type", "requires_packed_sequence_metadata"):
        if not hasattr(contract, attribute):
            raise TypeError(
                f"packing_contract: {name} has no attribute {attribute!r}; expected an object with "
                "packed_mask_type and requires_packed_sequence_metadata (e.g. AutoModel's "
                "PackingCapabilities or zephon_loader.PackingContract)"
            )
    return (
        contract.packed_mask_type,  # type: ignore[attr-defined]
        contract.requires_packed_sequence_metadata,  # type: ignore[attr-defined]
        getattr(contract, "qkv_format", None) or "bshd",
    )


def _check_contract(contract: object) -> tuple[str, bool, str]:
    mask_type, requires, qkv_format = _contract_fields(contract)
    if not isinstance(mask_type, str) or mask_type not in PACKED_MASK_TYPES:
        raise ValueError(
            f"packing_contract.packed_mask_type: got {mask_type!r}, expected one of {sorted(PACKED_MASK_TYPES)}"
        )
    if not isinstance(requires, bool):
        raise TypeError(
            "packing_contract.requires_packed_sequence_metadata: got "
            f"{type(requires).__name__} {requires!r}, expected bool"
        )
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"packing_contract.qkv_format: got {qkv_format!r}, expected one of {sorted(QKV_FORMATS)}")
    if mask_type == "position_ids" and requires:
        raise ValueError(
            "packing_contract.requires_packed_sequence_metadata: got True with packed_mask_type 'position_ids' "
            "(attn_implementation 'hf'); a stock Hugging Face model never reads the gathered-token bundle "
            "(packed_token_indices, cu_seqlens, max_seqlen), it derives the mask from position_ids; set it to "
            "False, or use attn_implementation 'fa4' (document_ids + metadata) for a model that consumes it"
        )
    if mask_type == "position_ids" and qkv_format == "thd":
        raise ValueError(
            "packing_contract.qkv_format: got 'thd' with packed_mask_type 'position_ids' (attn_implementation "
            "'hf'); THD is Transformer Engine's packed layout, which stock Hugging Face models do not take; use "
            "qkv_format 'bshd', or attn_implementation 'te' for THD"
        )
    return mask_type, requires, qkv_format


#: Block-causal masks without metadata: AutoModel 0.7.0's default for callers without requirements.
DEFAULT_PACKED_SEQUENCE_CONTRACT: Final[PackingContract] = PackingContract()


def contract_for_attention(
    attn_implementation: str,
    *,
    requires_packed_sequence_metadata: bool = False,
    packed_mask_type: PackedMaskType | None = None,
    qkv_format: QKVFormat = "bshd",
) -> PackingContract:
    """Map an AutoModel attention name to a contract, as AutoModel 0.7.0's
    ``get_packing_capabilities`` does.

    * ``fa4`` (native FA4): ``document_ids`` with metadata (always).
    * ``flash_attention_2/3/4``: ``flash_varlen``.
    * ``sdpa``, ``eager``, ``flex``, ``te``: the model's own ``packed_mask_type``
      when it declares one, else ``block_causal``.
    * ``hf`` (not an AutoModel name): ``position_ids`` — for stock Hugging
      Face models (transformers >= 5, any kernel), which build the packed
      block-causal mask themselves from ``position_ids`` restarting at 0 per
      document when no ``attention_mask`` is passed and no KV cache is in use
      (the batch carries ``use_cache=False``). No metadata, no eligibility.

    Args:
        attn_implementation: The model's attention implementation name.
        requires_packed_sequence_metadata: The model consumes the gathered-token
            bundle (recurrent/hybrid models); forced on for ``fa4``.
        packed_mask_type: The model's declared mask type, if any (ignored by
            ``fa4`` and flash implementations, as in AutoModel).
        qkv_format: ``"thd"`` to yield TE THD fields (``te`` only).

    Raises:
        ValueError: Unknown attention name, ``thd`` with a backend other than
            ``te``, or ``hf`` with metadata or another ``packed_mask_type``.
    """
    if attn_implementation == HF_ATTENTION_IMPLEMENTATION:
        if packed_mask_type not in (None, "position_ids"):
            raise ValueError(
                f"packed_mask_type: got {packed_mask_type!r} with attn_implementation 'hf'; a stock Hugging Face "
                "model derives its packed mask from position_ids ('position_ids'); remove packed_mask_type, or "
                "name the model's AutoModel attention implementation instead of 'hf'"
            )
        mask_type: str = "position_ids"
    elif attn_implementation == "fa4":
        mask_type = "document_ids"
        requires_packed_sequence_metadata = True
    elif attn_implementation in FLASH_ATTENTION_IMPLEMENTATIONS:
        mask_type = "flash_varlen"
    elif attn_implementation in DENSE_ATTENTION_IMPLEMENTATIONS:
        mask_type = packed_mask_type or "block_causal"
    else:
        known = sorted(FLASH_ATTENTION_IMPLEMENTATIONS | DENSE_ATTENTION_IMPLEMENTATIONS | {"fa4", "hf"})
        raise ValueError(f"attn_implementation: got {attn_implementation!r}, expected one of {known}")
    if qkv_format == "thd" and attn_implementation != "te":
        raise ValueError(
            f"qkv_format: 'thd' is Transformer Engine's packed layout, but attn_implementation is "
            f"{attn_implementation!r}; use attn_implementation 'te' or qkv_format 'bshd'"
        )
    return PackingContract(
        packed_mask_type=mask_type,  # type: ignore[arg-type]
        requires_packed_sequence_metadata=requires_packed_sequence_metadata,
        qkv_format=qkv_format,
    )


#: Batch-major gathered-token metadata (valid after microbatch splitting).
PackedSequenceMetadata = TypedDict(
    "PackedSequenceMetadata",
    {F.PACKED_TOKEN_INDICES: torch.Tensor, F.CU_SEQLENS: torch.Tensor, F.MAX_SEQLEN: int},
)


def _check_ids(name: str, ids: torch.Tensor) -> None:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name}: got {type(ids).__name__}, expected an int64 tensor [batch, sequence]")
    if ids.ndim != 2:
        raise ValueError(f"{name}: got shape {tuple(ids.shape)}, expected rank 2 [batch, sequence]")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"{name}: got dtype {ids.dtype}, expected an integer dtype (int64)")


def document_lengths(ids: torch.Tensor, max_id: int | None = None) -> torch.Tensor:
    """Token count of every document id in every row.

    Args:
        ids: Integer ``[B, S]``; ``0`` marks excluded tokens, ``d > 0`` document ``d``.
            Must be nonnegative (callers validate).
        max_id: ``ids.max()`` when the caller already knows it.

    Returns:
        int64 ``[B, D]`` with ``D = max(1, ids.max())``; entry ``[b, d-1]`` counts
        tokens of row ``b`` with id ``d`` (0 for absent ids).
    """
    batch_size = ids.shape[0]
    if max_id is None:
        max_id = int(ids.max()) if ids.numel() else 0
    counts = torch.zeros(batch_size, max(1, max_id) + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(1, ids.to(torch.int64), torch.ones_like(ids, dtype=torch.int64))
    return counts[:, 1:]


def compact_left(values: torch.Tensor, keep: torch.Tensor, fill: int, width: int) -> torch.Tensor:
    """Move the kept entries of each row to the left, in order, filling the rest.

    Args:
        values: ``[B, N]`` tensor.
        keep: bool ``[B, N]``.
        fill: Value of the unused entries.
        width: Columns of the result (at least the largest kept count per row).

    Returns:
        ``[B, width]`` tensor of ``values.dtype``.
    """
    batch_size = values.shape[0]
    # Dropped entries are scattered into one spare column past `width`, then cut off.
    out = torch.full((batch_size, width + 1), fill, dtype=values.dtype, device=values.device)
    slot = torch.where(keep, keep.cumsum(dim=1) - 1, width)
    out.scatter_(1, slot, values)
    return out[:, :width]


def build_packed_sequence_metadata(attention_document_ids: torch.Tensor) -> PackedSequenceMetadata:
    """Gathered-token metadata for indexed attention document ids (vectorized).

    Output equals AutoModel 0.7.0's
    ``nemo_automodel.components.datasets.packing.build_packed_sequence_metadata``.

    Args:
        attention_document_ids: Integer ``[B, S]``: 1-based document id per
            token within its row, ``0`` at excluded tokens (padding,
            ineligible). Ids need not be contiguous.

    Returns:
        ``packed_token_indices``: int64 ``[B, S]``, the column index where the
        id is nonzero, ``-1`` elsewhere (row-local).
        ``cu_seqlens``: int32 ``[B, D + 1]`` with ``D = max(1, ids.max())``:
        per row ``0``, then the cumulative token counts of each present id in
        id order (absent ids skipped), then ``-1``; a row with no valid token
        is ``[0, -1, ...]``.
        ``max_seqlen``: Python int, the longest document in the batch.
        The offsets describe the stream *after gathering* nonzero tokens.

    Raises:
        ValueError: Rank other than 2, negative ids, or no valid token.
        TypeError: Non-integer dtype.
    """
    ids = attention_document_ids
    _check_ids("attention_document_ids", ids)
    low, high = (int(v) for v in ids.aminmax()) if ids.numel() else (0, 0)
    if low < 0:
        raise ValueError(f"attention_document_ids: got minimum {low}, expected nonnegative ids")
    if high == 0:
        raise ValueError(
            f"attention_document_ids: no valid (nonzero) token in a batch of shape {tuple(ids.shape)}; "
            "expected at least one token that is neither padding nor ineligible"
        )
    batch_size, sequence_length = ids.shape
    # `ids.bool()` is a cheaper pass than `ids != 0`; a scalar `other` avoids a [B, S] fill.
    valid = ids.bool()
    packed_token_indices = torch.where(valid, torch.arange(sequence_length, device=ids.device), -1)

    # Column d of `counts` holds the token count of id d (column 0, excluded tokens, is zeroed):
    # its running sum is [0, c_1, c_1 + c_2, ...], i.e. cu_seqlens before absent ids are skipped.
    if high == 1:  # one id per row (xdoc's joined rows, single documents): its count is the row's valid tokens
        counts = tF.pad(valid.sum(dim=1, keepdim=True), (1, 0))
    else:
        counts = torch.zeros(batch_size, high + 1, dtype=torch.int64, device=ids.device)
        counts.scatter_add_(1, ids.to(torch.int64), torch.ones_like(ids, dtype=torch.int64))
        counts[:, 0] = 0
    keep = counts > 0
    keep[:, 0] = True  # the leading 0 of every row
    cu_seqlens = compact_left(counts.cumsum(dim=1, dtype=torch.int32), keep, -1, high + 1)
    return {
        F.PACKED_TOKEN_INDICES: packed_token_indices,
        F.CU_SEQLENS: cu_seqlens,
        F.MAX_SEQLEN: int(counts.max()),
    }


def flatten_packed_sequence_metadata(
    packed_token_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    batch_size: int,
    sequence_length: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten batch-major metadata to one gathered token stream (model entry).

    Same contract as AutoModel 0.7.0's
    ``nemo_automodel.components.models.common.packing.flatten_packed_sequence_metadata``:
    call it once per (micro)batch after pipeline-parallel splitting.

    Args:
        packed_token_indices: int64 ``[B, S]`` row-local indices with ``-1``
            at excluded tokens, or an already flat ``[T]`` tensor of indices
            into ``B * S``.
        cu_seqlens: int32 ``[B, D + 1]`` row-local cumulative lengths with
            ``-1`` after each row's last boundary, or already flat ``[D' + 1]``.
        batch_size: ``B`` of the padded layout.
        sequence_length: ``S`` of the padded layout.

    Returns:
        ``(indices, cu_seqlens)``: int64 ``[T]`` indices into the flattened
        ``[B * S]`` axis and ``[documents + 1]`` cumulative lengths (dtype of
        the input ``cu_seqlens``) over the gathered stream.

    Raises:
        ValueError: Layout mismatch, or boundaries that do not start at zero,
            decrease, or fail to cover each row's valid tokens.
    """
    if packed_token_indices.ndim == 1 and cu_seqlens.ndim == 1:
        bad = cu_seqlens.numel() < 2 or bool(
            (cu_seqlens[0] != 0)
            | (cu_seqlens[-1] != packed_token_indices.numel())
            | (cu_seqlens[1:] < cu_seqlens[:-1]).any()
        )
        if bad:
            raise ValueError(
                f"cu_seqlens: flat metadata must start at 0, be nondecreasing and end at the token count "
                f"{packed_token_indices.numel()}; got {cu_seqlens.tolist()[:8]}{'...' if cu_seqlens.numel() > 8 else ''}"
            )
        return packed_token_indices.to(torch.int64), cu_seqlens
    if tuple(packed_token_indices.shape) != (batch_size, sequence_length) or cu_seqlens.ndim != 2:
        raise ValueError(
            "packed_token_indices/cu_seqlens: got shapes "
            f"{tuple(packed_token_indices.shape)} and {tuple(cu_seqlens.shape)}, expected "
            f"[{batch_size}, {sequence_length}] and [{batch_size}, documents + 1] (or both already flat)"
        )
    if cu_seqlens.shape[0] != batch_size or cu_seqlens.shape[1] == 0:
        raise ValueError(
            f"cu_seqlens: got shape {tuple(cu_seqlens.shape)}, expected [{batch_size}, documents + 1] "
            "with at least one boundary per row"
        )
    valid_tokens = packed_token_indices >= 0
    valid_boundaries = cu_seqlens >= 0
    # Boundaries are a valid prefix per row: no valid entry after a -1.
    prefix_ok = valid_boundaries.int().diff(dim=1).le(0).all(dim=1) if cu_seqlens.shape[1] > 1 else valid_boundaries[:, 0]
    counts = valid_boundaries.sum(dim=1)
    last = cu_seqlens.gather(1, (counts - 1).clamp_min(0).unsqueeze(1)).squeeze(1)
    pairs = valid_boundaries[:, 1:] & valid_boundaries[:, :-1]
    deltas = cu_seqlens[:, 1:] - cu_seqlens[:, :-1]
    row_bad = (
        (counts == 0)
        | (cu_seqlens[:, 0] != 0)
        | ~prefix_ok
        | (last != valid_tokens.sum(dim=1))
        | ((deltas < 0) & pairs).any(dim=1)
    )
    lengths = deltas[pairs]
    if bool(row_bad.any()) or lengths.numel() == 0:
        bad_rows = torch.nonzero(row_bad).flatten().tolist()[:8]
        raise ValueError(
            "cu_seqlens: every row must start at 0, be nondecreasing, keep -1 only after its last boundary "
            f"and end at its count of valid packed_token_indices; rows {bad_rows} do not"
            + ("" if bad_rows else " (no document at all)")
        )
    offsets = torch.arange(batch_size, device=packed_token_indices.device).unsqueeze(1) * sequence_length
    flat_indices = (packed_token_indices + offsets)[valid_tokens].to(torch.int64)
    flat_cu = tF.pad(torch.cumsum(lengths, dim=0, dtype=cu_seqlens.dtype), (1, 0))
    return flat_indices, flat_cu
