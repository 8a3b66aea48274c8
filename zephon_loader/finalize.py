"""The final map stage: collated TrainingBatch → yielded AutoModel batch.

One pure function of the batch and of settings fixed at loader construction::

    adapt_model_inputs → [enable_xdoc_attention] → contract fields → [metadata] → [THD] → aliases

See SPEC §6 and the table in :mod:`zephon_loader.fields` for what each
contract yields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from zephon_loader import fields as F
from zephon_loader.attention import (
    DEFAULT_BLOCK_MASK_BUDGET_BYTES,
    adapt_model_inputs,
    join_subdocuments,
    require_supported_packing_contract,
)
from zephon_loader.packing import (
    DEFAULT_PACKED_SEQUENCE_CONTRACT,
    build_packed_sequence_metadata,
    compact_left,
    document_lengths,
    validate_packing_contract,
)

#: Internal keys the final map consumes; everything else not yielded by the
#: contract passes through unchanged (e.g. processor outputs like pixel values).
#: Zephon's physical ``cu_seqlens`` is replaced: AutoModel reads ``cu_seqlens``
#: as gathered-token offsets, so physical offsets must never reach it.
_CONSUMED = frozenset({F.DOCUMENT_IDS, F.ATTENTION_DOCUMENT_IDS, F.ATTENTION_ELIGIBILITY, F.CU_SEQLENS})


@dataclass(frozen=True)
class FinalizeSettings:
    """Everything the final map needs, fixed (and validated) once per loader.

    Build it with :meth:`from_contract`, which runs
    :func:`~zephon_loader.attention.require_supported_packing_contract`.

    Attributes:
        packing_contract: The model's contract (duck-typed).
        packed_mask_type: Normalized ``contract.packed_mask_type``.
        metadata: Yield the gathered-token bundle (required by the contract or requested).
        thd: Yield TE THD fields (``contract.qkv_format == "thd"``).
        xdoc: Cross-document attention: join each row's subdocuments.
    """

    packing_contract: Any
    packed_mask_type: str
    metadata: bool
    thd: bool
    xdoc: bool

    @classmethod
    def from_contract(
        cls,
        packing_contract: object = DEFAULT_PACKED_SEQUENCE_CONTRACT,
        *,
        xdoc: bool = False,
        return_packed_sequence_metadata: bool = False,
        attention_eligibility: bool = False,
        micro_batch_size: int | None = None,
        sequence_length: int | None = None,
        block_mask_budget_bytes: int = DEFAULT_BLOCK_MASK_BUDGET_BYTES,
    ) -> "FinalizeSettings":
        """Validate the contract for this loader and freeze the final-map settings.

        Raises:
            TypeError/ValueError: As :func:`require_supported_packing_contract`,
                or ``xdoc`` not a bool.
        """
        require_supported_packing_contract(
            packing_contract,
            attention_eligibility=attention_eligibility,
            return_packed_sequence_metadata=return_packed_sequence_metadata,
            micro_batch_size=micro_batch_size,
            sequence_length=sequence_length,
            block_mask_budget_bytes=block_mask_budget_bytes,
        )
        if not isinstance(xdoc, bool):
            raise TypeError(f"xdoc: got {type(xdoc).__name__} {xdoc!r}, expected bool")
        mask_type, requires, qkv_format = validate_packing_contract(packing_contract)
        return cls(
            packing_contract=packing_contract,
            packed_mask_type=mask_type,
            metadata=requires or return_packed_sequence_metadata,
            thd=qkv_format == "thd",
            xdoc=xdoc,
        )

    @property
    def yielded_fields(self) -> tuple[str, ...]:
        """Names every yielded batch carries (``_packed_seq_ids`` only listed when always present)."""
        return F.yielded_fields(self.packed_mask_type, metadata=self.metadata, thd=self.thd)


def block_causal_mask(ids: torch.Tensor) -> torch.Tensor:
    """AutoModel 0.7.0's indexed-ids → 4D mask conversion.

    Args:
        ids: int64 ``[B, S]`` attention document ids (0 = excluded).

    Returns:
        bool ``[B, 1, S, S]``: True where query ``i`` may attend key ``j``:
        same nonzero id and ``j <= i``. Rows of excluded queries are all False.
    """
    # Excluded keys get id -1, which no query id (>= 0) equals; excluded queries (id 0)
    # then match nothing. One comparison pass and one in-place tril: the mask is
    # B*S*S bytes, so passes over it are what costs.
    keys = torch.where(ids != 0, ids, torch.full_like(ids, -1))
    same = ids.unsqueeze(2) == keys.unsqueeze(1)
    same.tril_()
    return same.unsqueeze(1)


def flash_varlen_kwargs(ids: torch.Tensor) -> dict[str, Any]:
    """HF flash varlen kwargs over the flattened ``[B * S]`` axis.

    A segment starts at every row start and wherever the id changes within a
    row; padding runs are segments of their own (as AutoModel 0.7.0's
    ``packed_seq_params_from_doc_ids``).

    Args:
        ids: int64 ``[B, S]`` attention document ids.

    Returns:
        ``cu_seq_lens_q``/``cu_seq_lens_k``: the same int32 ``[segments + 1]``
        tensor; ``max_length_q``/``max_length_k``: the longest segment (int).
    """
    batch_size, sequence_length = ids.shape
    starts = torch.ones(batch_size, sequence_length, dtype=torch.bool, device=ids.device)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    offsets = torch.nonzero(starts.flatten()).flatten()
    total = torch.tensor([batch_size * sequence_length], dtype=offsets.dtype, device=ids.device)
    cu = torch.cat([offsets, total]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return {F.CU_SEQ_LENS_Q: cu, F.CU_SEQ_LENS_K: cu, F.MAX_LENGTH_Q: longest, F.MAX_LENGTH_K: longest}


def thd_fields(ids: torch.Tensor) -> dict[str, Any]:
    """Transformer Engine THD lengths per document.

    Args:
        ids: int64 ``[B, S]`` attention document ids; zeros only at trailing
            padding (eligibility holes are refused for THD at construction).

    Returns:
        ``qkv_format``: ``"thd"``; ``seq_lens``: int64 ``[B, max_docs]``, real
        token count per document; ``seq_lens_padded``: int64 ``[B, max_docs]``,
        physical span per document, the last absorbing the row's trailing
        padding so each row sums to ``S``. Unused entries are ``-1000``. A row
        with no document holds one empty document spanning the row.
    """
    counts = document_lengths(ids)
    present = counts > 0
    documents = present.sum(dim=1)
    width = max(1, int(documents.max()))
    seq_lens = compact_left(counts, present, F.THD_SENTINEL, width)
    empty = documents == 0
    seq_lens[:, 0] = torch.where(empty, torch.zeros_like(seq_lens[:, 0]), seq_lens[:, 0])
    padding = (ids == 0).sum(dim=1)
    rows = torch.arange(ids.shape[0], device=ids.device)
    seq_lens_padded = seq_lens.clone()
    seq_lens_padded[rows, (documents - 1).clamp_min(0)] += padding
    return {F.QKV_FORMAT: "thd", F.SEQ_LENS: seq_lens, F.SEQ_LENS_PADDED: seq_lens_padded}


def finalize_batch(batch: Mapping[str, Any], settings: FinalizeSettings) -> dict[str, Any]:
    """Apply the final map stage to one collated batch.

    Args:
        batch: A :class:`~zephon_loader.attention.TrainingBatch` from collate:
            ``input_ids``, ``labels``, ``padding_mask``, ``position_ids``,
            ``document_ids`` and optionally bool ``attention_eligibility``
            ``[B, S]`` and Zephon's physical ``cu_seqlens``. Not modified.
        settings: Fixed per loader (:meth:`FinalizeSettings.from_contract`).

    Returns:
        A new dict with AutoModel's names: ``input_ids``, ``labels``,
        ``position_ids``, ``padding_mask``, then the contract's fields (SPEC §6),
        ``_packed_seq_ids`` when a row holds more than one document or
        metadata is on, and any extra (non-internal) keys of ``batch``
        unchanged.

    Raises:
        ValueError/TypeError: Malformed batch (see ``adapt_model_inputs``), or
            metadata requested for a batch without any valid token.
    """
    work = dict(batch)
    eligibility = work.pop(F.ATTENTION_ELIGIBILITY, None)
    adapt_model_inputs(work, eligibility)
    if settings.xdoc:  # validated by adapt_model_inputs above; the contract by from_contract
        join_subdocuments(work)
    ids: torch.Tensor = work[F.ATTENTION_DOCUMENT_IDS]

    out: dict[str, Any] = {name: work[name] for name in F.ALWAYS}
    if settings.packed_mask_type == "document_ids":
        out[F.ATTENTION_MASK] = ids
    elif settings.packed_mask_type == "block_causal":
        out[F.ATTENTION_MASK] = block_causal_mask(ids)
    else:
        out.update(flash_varlen_kwargs(ids))
    if settings.metadata:
        out.update(build_packed_sequence_metadata(ids))
    if settings.thd:
        out.update(thd_fields(ids))
    if settings.metadata or bool((ids > 1).any()):
        out[F.PACKED_SEQ_IDS] = ids
    for name, value in work.items():
        if name not in out and name not in _CONSUMED:
            out[name] = value
    return out
