"""Packing contracts: how a model wants packed rows represented. Imports no torch.

A *packing contract* is duck-typed like AutoModel 0.7.0's
``PackedSequenceContract``/``PackingCapabilities``: any object with

* ``packed_mask_type``: ``"block_causal"``, ``"document_ids"``, ``"flash_varlen"``
  (AutoModel's three) or ``"position_ids"`` (stock Hugging Face models, which
  derive the mask from ``position_ids`` themselves; ``attn_implementation: hf``);
* ``requires_packed_sequence_metadata``: ``bool``;
* optionally ``qkv_format``: ``"bshd"`` (default) or ``"thd"`` (Transformer Engine THD);
* optionally ``seq_idx``: ``bool`` (default False), also yield transformers' ``seq_idx``;
* optionally ``cp_size``: ``int`` >= 1 (default 1), the context-parallel size the rows are laid out for
  (``> 1``: TE THD only, every document padded to a multiple of ``2 * cp_size``).

A contract is validated once, where it enters the package: a
:class:`PackingContract` checks its fields when it is constructed (and is
frozen), and :meth:`PackingContract.of` turns any duck-typed contract into
one. Everything downstream takes the :class:`PackingContract` as valid.
See ``docs/contract.md`` for what each contract yields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol, runtime_checkable

#: Default cap on a block-causal ``[B, 1, S, S]`` bool mask: 1 GiB per batch.
DEFAULT_BLOCK_MASK_BUDGET_BYTES: Final = 1 << 30

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
        seq_idx: Also yield ``seq_idx`` int32 ``[B, S]`` as transformers'
            ``DataCollatorWithFlattening(return_seq_idx=True)`` names and numbers it
            (document boundaries for Mamba-2 / linear-attention layers).
        cp_size: Context-parallel size. ``> 1`` (``qkv_format`` ``"thd"`` only):
            every document is padded to a multiple of ``2 * cp_size`` before
            packing, and ``cu_seqlens_padded``/``seq_lens_padded`` describe that
            layout (TE THD + CP; docs/contract.md §7).
    """

    packed_mask_type: PackedMaskType = "block_causal"
    requires_packed_sequence_metadata: bool = False
    qkv_format: QKVFormat = "bshd"
    seq_idx: bool = False
    cp_size: int = 1

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

    @property
    def cp_padding(self) -> int:
        """The multiple every document is padded to: ``2 * cp_size``, or 0 without context parallelism."""
        return 2 * self.cp_size if self.cp_size > 1 else 0


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


def _contract_fields(contract: object) -> tuple[Any, Any, Any, Any, Any]:
    """The raw fields of a duck-typed contract (``qkv_format`` missing or ``None`` → ``"bshd"``, ``seq_idx``
    missing or ``None`` → False, ``cp_size`` missing or ``None`` → 1)."""
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
        _or(getattr(contract, "seq_idx", None), False),
        _or(getattr(contract, "cp_size", None), 1),
    )


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _check_contract(contract: object) -> tuple[str, bool, str]:
    mask_type, requires, qkv_format, seq_idx, cp_size = _contract_fields(contract)
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
    if not isinstance(seq_idx, bool):
        raise TypeError(f"packing_contract.seq_idx: got {type(seq_idx).__name__} {seq_idx!r}, expected bool")
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"packing_contract.cp_size: got {cp_size!r}, expected an int >= 1")
    if cp_size > 1 and qkv_format != "thd":
        raise ValueError(
            f"packing_contract.cp_size: got {cp_size} with qkv_format {qkv_format!r}, expected qkv_format 'thd': "
            "per-document padding for context parallelism is Transformer Engine's THD layout (cu_seqlens_padded); "
            "set qkv_format 'thd' (attn_implementation 'te'), or cp_size 1 (a 'bshd' model splits the row itself "
            "and needs no padding)"
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
    seq_idx: bool = False,
    cp_size: int = 1,
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
        seq_idx, cp_size: As :class:`PackingContract`.

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
        seq_idx=seq_idx,
        cp_size=cp_size,
    )
