"""The final map stage: collated TrainingBatch → yielded AutoModel batch.

One pure function of the batch and of settings fixed at loader construction::

    attention_document_ids → [join_subdocuments] → contract fields → [metadata] → [THD] → aliases

Each property is validated once on the way from Zephon to the yield:

* :func:`finalize_collated` is what the loader runs (:class:`FinalMap`). It
  trusts what ``collate`` guarantees (shapes, dtypes, trailing padding,
  nonnegative positions, well-formed document ids) and checks only what no
  earlier stage does (the ``position_ids`` contract's positions-vs-documents
  agreement).
* :func:`finalize_batch` is the public entry for any other batch: it validates
  everything first (:func:`~zephon_loader.attention.check_training_batch`),
  then runs the same transform.
* :class:`FinalMap` is the stage as the loader's read-ahead runs it: a
  picklable callable that finalizes, applies the recipe's ``collate_wrapper``
  and pins memory.

The contract is validated once, by :meth:`FinalizeSettings.from_contract`.
``docs/contract.md`` (section 7, "The yielded batch") and the table in
:mod:`zephon_loader.fields` say what each contract yields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from zephon_loader import fields as F
from zephon_loader.attention import (attention_document_ids, check_training_batch, joined_positions,
                                     joined_positions_of_runs, require_supported_packing_contract)
from zephon_loader.contract import DEFAULT_BLOCK_MASK_BUDGET_BYTES, DEFAULT_PACKED_SEQUENCE_CONTRACT, PackingContract
from zephon_loader.packing import (compact_left, document_lengths, packed_sequence_metadata_of,
                                   single_document_metadata)

#: Internal keys the final map consumes; everything else not yielded by the
#: contract passes through unchanged (e.g. processor outputs like pixel values).
#: Zephon's physical ``cu_seqlens`` is replaced: AutoModel reads ``cu_seqlens``
#: as gathered-token offsets, so physical offsets must never reach it.
#: ``source_ids`` is yielded only when requested (``FinalizeSettings.source_ids``).
_CONSUMED = frozenset({F.DOCUMENT_IDS, F.ATTENTION_DOCUMENT_IDS, F.ATTENTION_ELIGIBILITY, F.CU_SEQLENS, F.CP_PADDING,
                       F.SOURCE_IDS})


@dataclass(frozen=True)
class FinalizeSettings:
    """Everything the final map needs, fixed (and validated) once per loader.

    Build it with :meth:`from_contract`, which runs
    :func:`~zephon_loader.attention.require_supported_packing_contract` (the
    one check of the contract on the way to the loader).

    Attributes:
        packing_contract: The model's contract, as a frozen
            :class:`~zephon_loader.packing.PackingContract`.
        packed_mask_type: ``packing_contract.packed_mask_type``.
        metadata: Yield the gathered-token bundle (required by the contract or requested).
        thd: Yield TE THD fields (``contract.qkv_format == "thd"``).
        xdoc: Cross-document attention: join each row's subdocuments.
        seq_idx: Yield ``seq_idx`` (``contract.seq_idx``).
        cp_size: ``contract.cp_size``; above 1 the batch's context-parallel padding (``fields.CP_PADDING``)
            is left out of the attention ids (so of ``seq_lens`` and the metadata) and kept in
            ``seq_lens_padded``/``cu_seqlens_padded``; metadata is then always on.
        source_ids: Yield the batch's ``source_ids`` (``return_source_ids``) as ``collate`` built it: per input
            token, whatever the contract, xdoc or context-parallel padding (a token's source is its record's).
    """

    packing_contract: PackingContract
    packed_mask_type: str
    metadata: bool
    thd: bool
    xdoc: bool
    seq_idx: bool = False
    cp_size: int = 1
    source_ids: bool = False

    @classmethod
    def from_contract(
        cls,
        packing_contract: object = DEFAULT_PACKED_SEQUENCE_CONTRACT,
        *,
        xdoc: bool = False,
        return_packed_sequence_metadata: bool = False,
        return_source_ids: bool = False,
        attention_eligibility: bool = False,
        micro_batch_size: int | None = None,
        sequence_length: int | None = None,
        block_mask_budget_bytes: int = DEFAULT_BLOCK_MASK_BUDGET_BYTES,
    ) -> "FinalizeSettings":
        """Validate the contract for this loader and freeze the final-map settings.

        Args:
            packing_contract: A :class:`~zephon_loader.packing.PackingContract`
                (validated when built: not checked again) or any duck-typed
                contract (validated here).
            xdoc, return_packed_sequence_metadata, attention_eligibility,
            micro_batch_size, sequence_length, block_mask_budget_bytes: As
                :func:`require_supported_packing_contract`; ``xdoc`` joins
                each row's subdocuments.
            return_source_ids: Yield ``source_ids`` (the batches must carry them: the loader's pipeline
                marks every record's tokens when the config sets ``return_source_ids``).

        Raises:
            TypeError/ValueError: As :func:`require_supported_packing_contract`,
                or ``xdoc`` / ``return_source_ids`` not a bool.
        """
        contract = require_supported_packing_contract(
            packing_contract,
            attention_eligibility=attention_eligibility,
            return_packed_sequence_metadata=return_packed_sequence_metadata,
            micro_batch_size=micro_batch_size,
            sequence_length=sequence_length,
            block_mask_budget_bytes=block_mask_budget_bytes,
        )
        if not isinstance(xdoc, bool):
            raise TypeError(f"xdoc: got {type(xdoc).__name__} {xdoc!r}, expected bool")
        if not isinstance(return_source_ids, bool):
            raise TypeError(f"return_source_ids: got {type(return_source_ids).__name__} {return_source_ids!r}, "
                            "expected bool")
        if xdoc and contract.cp_size > 1:
            raise ValueError(f"xdoc: got True with packing_contract.cp_size {contract.cp_size}, expected False: "
                             "TE's THD + CP attends within each padded document, a joined row is not one")
        return cls(
            packing_contract=contract,
            packed_mask_type=contract.packed_mask_type,
            metadata=(contract.requires_packed_sequence_metadata or return_packed_sequence_metadata
                      or contract.cp_size > 1),
            thd=contract.qkv_format == "thd",
            xdoc=xdoc,
            seq_idx=contract.seq_idx,
            cp_size=contract.cp_size,
            source_ids=return_source_ids,
        )

    @property
    def yielded_fields(self) -> tuple[str, ...]:
        """Names every yielded batch carries (``_packed_seq_ids`` only listed when always present)."""
        return F.yielded_fields(self.packed_mask_type, metadata=self.metadata, thd=self.thd, seq_idx=self.seq_idx,
                                cp=self.cp_size > 1, source_ids=self.source_ids)


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
    # B*S*S bytes, so passes over it are what costs. The comparison runs on the
    # narrowest integers that hold every id (int16 below 2**15: 20% faster than
    # int64's at [8, 2048] and [8, 8192] on CPU; equality is unchanged).
    high = int(ids.max()) if ids.numel() else 0
    narrow = ids.to(_narrowest_int(high))
    keys = torch.where(narrow != 0, narrow, -1)
    same = narrow.unsqueeze(2) == keys.unsqueeze(1)
    same.tril_()
    return same.unsqueeze(1)


def _narrowest_int(high: int) -> torch.dtype:
    """The narrowest signed integer dtype that holds ``-1 .. high`` (``high >= 0``)."""
    for dtype in (torch.int16, torch.int32):
        if high <= torch.iinfo(dtype).max:
            return dtype
    return torch.int64


def flash_varlen_kwargs(ids: torch.Tensor, *, documents_bound_length: bool = False) -> dict[str, Any]:
    """HF flash varlen kwargs over the flattened ``[B * S]`` axis.

    A segment starts at every row start and wherever the id changes within a
    row; padding runs are segments of their own (as AutoModel 0.7.0's
    ``packed_seq_params_from_doc_ids``).

    Args:
        ids: int64 ``[B, S]`` attention document ids (0 at padding).
        documents_bound_length: ``max_length`` is the longest *document*, as
            transformers' ``DataCollatorWithFlattening`` computes it over real
            tokens: padding runs are cut into segments no longer than that
            (a padding token attends only padding, so the cuts change no
            document's output, and no segment exceeds what the kernel sizes for).

    Returns:
        ``cu_seq_lens_q``/``cu_seq_lens_k``: the same int32 ``[segments + 1]``
        tensor; ``max_length_q``/``max_length_k``: the longest segment (int).
    """
    batch_size, sequence_length = ids.shape
    starts = torch.ones(batch_size, sequence_length, dtype=torch.bool, device=ids.device)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    if documents_bound_length:
        real = ids != 0
        if bool(real.any()):
            row_starts = starts & real
            longest_document = int(_segment_lengths(row_starts, real).max())
            # Column inside each padding run (runs are trailing; one per row at most, or a whole row).
            padding = ~real
            run_start = torch.where(padding, torch.arange(sequence_length, device=ids.device), sequence_length)
            first = run_start.min(dim=1, keepdim=True).values
            inside = torch.arange(sequence_length, device=ids.device).unsqueeze(0) - first
            starts |= padding & (inside % longest_document == 0)
    offsets = torch.nonzero(starts.flatten()).flatten()
    total = torch.tensor([batch_size * sequence_length], dtype=offsets.dtype, device=ids.device)
    cu = torch.cat([offsets, total]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return {F.CU_SEQ_LENS_Q: cu, F.CU_SEQ_LENS_K: cu, F.MAX_LENGTH_Q: longest, F.MAX_LENGTH_K: longest}


def _segment_lengths(starts: torch.Tensor, member: torch.Tensor) -> torch.Tensor:
    """Lengths of the segments that begin at ``starts`` (bool ``[B, S]``) and run over ``member`` tokens."""
    segment = torch.cumsum(starts.flatten().long(), 0) - 1  # index of the segment each token belongs to
    keep = member.flatten()
    return torch.bincount(segment[keep], minlength=int(starts.sum()))


def thd_fields(ids: torch.Tensor, spans: torch.Tensor | None = None) -> dict[str, Any]:
    """Transformer Engine THD lengths per document.

    Args:
        ids: int64 ``[B, S]`` attention document ids; zeros only at trailing
            padding (eligibility holes are refused for THD at construction), and
            at context-parallel padding when ``spans`` is given.
        spans: int64 ``[B, S]`` document ids over the padded layout (context
            parallelism: ``ids`` plus each document's padding), or ``None``
            (``ids``). Then ``cu_seqlens_padded`` is returned too: int32
            ``[B, width + 1]``, per row ``0`` and the running sum of
            ``seq_lens_padded`` (each row ends at ``S``), ``-1`` after.

    Returns:
        ``qkv_format``: ``"thd"``; ``seq_lens``: int64 ``[B, max_docs]``, real
        token count per document; ``seq_lens_padded``: int64 ``[B, max_docs]``,
        physical span per document, the last absorbing the row's trailing
        padding so each row sums to ``S``. Unused entries are ``-1000``. A row
        with no document holds one empty document spanning the row.
    """
    layout = ids if spans is None else spans
    counts = document_lengths(ids, int(layout.max()) if layout.numel() else 0)
    span_counts = counts if spans is None else document_lengths(spans)
    present = span_counts > 0
    documents = present.sum(dim=1)
    width = max(1, int(documents.max()))
    seq_lens = compact_left(counts, present, F.THD_SENTINEL, width)
    empty = documents == 0
    seq_lens[:, 0] = torch.where(empty, torch.zeros_like(seq_lens[:, 0]), seq_lens[:, 0])
    padding = (layout == 0).sum(dim=1)
    rows = torch.arange(ids.shape[0], device=ids.device)
    seq_lens_padded = seq_lens.clone() if spans is None else compact_left(span_counts, present, F.THD_SENTINEL, width)
    if spans is not None:
        seq_lens_padded[:, 0] = torch.where(empty, torch.zeros_like(seq_lens_padded[:, 0]), seq_lens_padded[:, 0])
    seq_lens_padded[rows, (documents - 1).clamp_min(0)] += padding
    out = {F.QKV_FORMAT: "thd", F.SEQ_LENS: seq_lens, F.SEQ_LENS_PADDED: seq_lens_padded}
    if spans is not None:
        used = seq_lens_padded != F.THD_SENTINEL
        offsets = seq_lens_padded.masked_fill(~used, 0).cumsum(dim=1, dtype=torch.int32).masked_fill_(~used, -1)
        out[F.CU_SEQLENS_PADDED] = torch.cat([torch.zeros_like(offsets[:, :1]), offsets], dim=1)
    return out


def sequence_index(document_ids: torch.Tensor) -> torch.Tensor:
    """int32 ``[B, S]``: transformers' ``seq_idx`` of a packed batch (``DataCollatorWithFlattening(return_seq_idx=True)``).

    The collator flattens a batch's documents into one row and gives every token the index of its document,
    0, 1, ... in order. Here the documents keep their rows: they are numbered in row-major order over the
    whole batch (the first document of row ``b`` continues the numbering of row ``b - 1``), so the real
    tokens of ``seq_idx.flatten()`` equal the collator's ``seq_idx`` of the same documents. Padding (id 0)
    is ``-1``, a value no document has: a kernel comparing neighbours' ``seq_idx`` (Mamba-2's chunk scan,
    ``causal_conv1d``) never joins padding to a document, in a row or in the batch flattened to one row.

    Args:
        document_ids: Integer ``[B, S]``, nonzero per document (a document is a run of one id in a row),
            0 at padding. Under xdoc, the joined ids (one document per row).

    >>> sequence_index(torch.tensor([[1, 1, 2, 0], [1, 1, 1, 1]])).tolist()
    [[0, 0, 1, -1], [2, 2, 2, 2]]
    """
    real = document_ids.bool()
    starts = real.clone()
    starts[:, 1:] &= document_ids[:, 1:] != document_ids[:, :-1]
    index = starts.view(-1).cumsum(0, dtype=torch.int32).view(document_ids.shape)
    return index.sub_(1).masked_fill_(~real, -1)  # our own fresh tensor


def hf_position_fields(
    ids: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor, labels: torch.Tensor, *, check: bool = True
) -> dict[str, Any]:
    """The ``position_ids`` contract (``attn_implementation: hf``): fields for a stock Hugging Face model.

    transformers 5 (``masking_utils.find_packed_sequence_indices``) starts a
    new sequence wherever ``position_ids[j] - position_ids[j - 1] != 1`` and
    builds the block-causal mask from that, when no ``attention_mask`` is
    passed and no KV cache is in use. This checks that its segmentation is
    exactly the rows' documents at every non-padding token (a new document
    starts at 0, positions step by 1 inside one; under xdoc the joined
    positions continue across subdocuments, so a row is one sequence).
    Padding columns are not compared: a pad token is only ever a key of later
    pad tokens (the mask is causal and padding is trailing), so whatever
    sequence transformers gives it cannot change a document's outputs; the
    loader's pad tail restarts at 0 and is a sequence of its own.

    The batch also carries :func:`flash_varlen_kwargs`: transformers' flash
    kernels (``flash_attention_2/3``) infer packing from ``position_ids`` only
    for a single flattened row (batch size 1) and otherwise run plain causal
    attention over the row; given ``cu_seq_lens_q/k`` and ``max_length_q/k``
    they run varlen attention over exactly these segments (the flattened
    ``[B * S]`` layout they use). The sdpa, eager and flex paths ignore them.

    Args:
        ids: int64 ``[B, S]`` attention document ids (0 at padding; no
            eligibility holes: refused for this contract at construction).
        positions: int64 ``[B, S]``, or ``[3, B, S]`` mRoPE positions (image-text records): then
            ``position_ids`` is yielded as ``[4, B, S]``, row 0 the text positions
            :func:`sequence_positions` (restarting at 0 at each document), as Qwen2-VL-style models
            take packed input; other multi-axis shapes are refused.
        check: Compare transformers' segmentation with ``ids`` (a caller's
            batch). ``collate`` derives the ids from Zephon's positions, so the
            loader's hot path skips it.
        padding: bool ``[B, S]``, True at trailing padding.
        labels: int64 ``[B, S]``, already shifted (``labels[j]`` = token ``j + 1``).

    Returns:
        ``shift_labels``: ``labels`` itself (Hugging Face's loss shifts
        ``labels`` again unless ``shift_labels`` is given); ``use_cache``:
        ``False`` (with a cache transformers ignores ``position_ids`` for
        masking); ``cu_seq_lens_q/k``, ``max_length_q/k`` as
        :func:`flash_varlen_kwargs` of ``ids`` with the documents bounding the length (what
        transformers' ``DataCollatorWithFlattening`` gives for the same documents).

    Raises:
        ValueError: Multi-axis positions, or positions whose segmentation
            differs from the documents (the row, column and values are named).
    """
    if positions.ndim == 3 and positions.shape[0] == 3:
        # Qwen2-VL-style models take [4, B, S]: text positions (from which transformers derives the packed
        # mask) before the three mRoPE axes. No flash kwargs: the model hands its kwargs to the vision tower
        # too, whose flash path sets cu_seq_lens itself.
        return {F.POSITION_IDS: torch.cat([sequence_positions(ids).unsqueeze(0), positions]),
                F.SHIFT_LABELS: labels, F.USE_CACHE: False}
    if positions.ndim != 2:
        raise ValueError(
            f"{F.POSITION_IDS}: got shape {tuple(positions.shape)} with packed_mask_type 'position_ids' "
            "(attn_implementation 'hf'); expected [batch, sequence] positions, or [3, batch, sequence] mRoPE "
            "positions (yielded as [4, batch, sequence], text positions first); use an AutoModel contract "
            "('document_ids' or 'block_causal') for other multi-axis positions"
        )
    if check and ids.shape[1] > 1:
        transformers_starts = positions.diff(dim=1) != 1
        document_starts = ids.diff(dim=1).bool()
        disagree = (transformers_starts != document_starts).logical_and_(~padding[:, 1:])
        if bool(disagree.any()):
            b, s = (int(i) for i in torch.nonzero(disagree)[0])
            j = s + 1
            what = "splits document" if bool(transformers_starts[b, s]) else "joins documents"
            raise ValueError(
                f"{F.POSITION_IDS}: row {b}, column {j}: positions {int(positions[b, s])} -> "
                f"{int(positions[b, j])} with attention document ids {int(ids[b, s])} -> {int(ids[b, j])}; "
                f"transformers starts a new sequence exactly where a position does not step by 1, so it "
                f"{what} here; expected positions restarting at 0 at each document start and increasing by 1 "
                "inside it (Zephon's pack_flat(emit_positions=True) output)"
            )
    return {F.SHIFT_LABELS: labels, F.USE_CACHE: False, **flash_varlen_kwargs(ids, documents_bound_length=True)}


def sequence_positions(ids: torch.Tensor) -> torch.Tensor:
    """int64 ``[B, S]``: each token's index inside its run of equal ``ids`` (a document, or the padding tail).

    >>> sequence_positions(torch.tensor([[1, 1, 2, 2, 2, 0, 0]])).tolist()
    [[0, 1, 0, 1, 2, 0, 1]]
    """
    columns = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first = torch.cummax(torch.where(starts, columns, torch.zeros_like(columns)), dim=1).values
    return columns - first


def finalize_batch(batch: Mapping[str, Any], settings: FinalizeSettings) -> dict[str, Any]:
    """Apply the final map stage to one batch from anywhere, validating it first.

    Args:
        batch: A :class:`~zephon_loader.attention.TrainingBatch`:
            ``input_ids``, ``labels``, ``padding_mask``, ``position_ids``,
            ``document_ids`` and optionally bool ``attention_eligibility``
            ``[B, S]`` and Zephon's physical ``cu_seqlens``. Not modified.
        settings: Fixed per loader (:meth:`FinalizeSettings.from_contract`).

    Returns:
        As :func:`finalize_collated`.

    Raises:
        ValueError/TypeError: Malformed batch (see
            :func:`~zephon_loader.attention.check_training_batch`), or as
            :func:`finalize_collated`.
    """
    check_training_batch(batch, batch.get(F.ATTENTION_ELIGIBILITY))
    if settings.source_ids:
        check_source_ids(batch)
    return finalize_collated(batch, settings, _validated=False)


def check_source_ids(batch: Mapping[str, Any]) -> None:
    """A caller's ``source_ids`` (:func:`finalize_batch`): int64 ``[B, S]`` like ``input_ids``, ``>= 0`` at every
    token and ``-1`` at trailing padding (what ``collate`` builds for the loader).

    Raises:
        ValueError: Missing, another dtype or shape, or a value that is not a source index or the padding's.
    """
    source_ids = batch.get(F.SOURCE_IDS)
    shape = tuple(batch[F.INPUT_IDS].shape)
    if not isinstance(source_ids, torch.Tensor) or source_ids.dtype != torch.int64 or tuple(source_ids.shape) != shape:
        seen = (type(source_ids).__name__ if not isinstance(source_ids, torch.Tensor)
                else f"{source_ids.dtype} {tuple(source_ids.shape)}")
        raise ValueError(f"{F.SOURCE_IDS}: got {seen} with return_source_ids, expected int64 {shape} like "
                         f"{F.INPUT_IDS} (each input token's source index, {F.SOURCE_ID_PADDING} at padding)")
    padding = batch[F.PADDING_MASK]
    wrong = (source_ids < 0) != padding
    wrong |= padding & (source_ids != F.SOURCE_ID_PADDING)
    if bool(wrong.any()):
        b, s = (int(i) for i in torch.nonzero(wrong)[0])
        raise ValueError(f"{F.SOURCE_IDS}: row {b}, column {s}: got {int(source_ids[b, s])} where "
                         f"{F.PADDING_MASK} is {bool(padding[b, s])}, expected a source index >= 0 at every token "
                         f"and {F.SOURCE_ID_PADDING} exactly at padding")


def finalize_collated(batch: Mapping[str, Any], settings: FinalizeSettings, *, _validated: bool = True) -> dict[str, Any]:
    """Apply the final map stage to a batch ``collate`` built (the loader's hot path).

    Nothing ``collate`` guarantees is checked again: int64 ``[B, S]`` tokens,
    labels and ``document_ids`` (1-based, nondecreasing, 0 exactly at
    trailing padding), bool ``padding_mask``, nonnegative int64 positions,
    bool eligibility. Pass anything else to :func:`finalize_batch`.

    Args:
        batch: A :class:`~zephon_loader.attention.TrainingBatch` from
            :func:`zephon_loader.collate.text.collate`. Not modified.
        settings: Fixed per loader (:meth:`FinalizeSettings.from_contract`).

    Returns:
        A new dict with AutoModel's names: ``input_ids``, ``labels``,
        ``position_ids``, ``padding_mask``, then the contract's fields
        (``docs/contract.md``, section 7),
        ``_packed_seq_ids`` when a row holds more than one document or
        metadata is on, and any extra (non-internal) keys of ``batch``
        unchanged.

    Raises:
        ValueError: Metadata requested for a batch without any valid token,
            or (``position_ids`` contract) positions that do not delimit the
            documents (:func:`hf_position_fields`).
    """
    work = dict(batch)
    if settings.xdoc:
        # join_subdocuments(attention_document_ids(...)) in fewer [B, S] tensors: the joined ids are 1 exactly
        # where a token is eligible and not padding.
        document_ids = work[F.DOCUMENT_IDS]
        member = document_ids.bool()
        eligibility = work.get(F.ATTENTION_ELIGIBILITY)
        if eligibility is not None:
            member &= eligibility
        work[F.ATTENTION_DOCUMENT_IDS] = member.to(torch.int64)
        positions = work[F.POSITION_IDS]
        # collate's ids start exactly where positions restart: rows that count up join in one pass.
        joined = joined_positions_of_runs(document_ids, positions) if _validated else None
        work[F.POSITION_IDS] = joined if joined is not None else joined_positions(document_ids, positions)
    elif settings.cp_size > 1:  # context-parallel padding attends nothing and is attended by nothing
        cp = work.get(F.CP_PADDING)
        if not isinstance(cp, torch.Tensor) or cp.dtype != torch.bool or cp.shape != work[F.DOCUMENT_IDS].shape:
            raise ValueError(
                f"{F.CP_PADDING}: got {type(cp).__name__ if not isinstance(cp, torch.Tensor) else (cp.dtype, tuple(cp.shape))} "
                f"with packing_contract.cp_size {settings.cp_size}, expected a bool [B, S] tensor marking each "
                "document's context-parallel padding (what collate builds from records padded by the loader's pipeline)"
            )
        work[F.ATTENTION_DOCUMENT_IDS] = work[F.DOCUMENT_IDS].masked_fill(cp, 0)
    else:
        work[F.ATTENTION_DOCUMENT_IDS] = attention_document_ids(work[F.DOCUMENT_IDS], work.get(F.ATTENTION_ELIGIBILITY))
    ids: torch.Tensor = work[F.ATTENTION_DOCUMENT_IDS]

    out: dict[str, Any] = {name: work[name] for name in F.ALWAYS}
    mask_type = settings.packed_mask_type
    if mask_type == "document_ids":
        out[F.ATTENTION_MASK] = ids
    elif mask_type == "block_causal":
        out[F.ATTENTION_MASK] = block_causal_mask(ids)
    elif mask_type == "flash_varlen":
        out.update(flash_varlen_kwargs(ids))
    else:
        out.update(hf_position_fields(ids, work[F.POSITION_IDS], work[F.PADDING_MASK], work[F.LABELS],
                                      check=not _validated))
    # The largest id, read once (xdoc's joined ids are <= 1: not needed).
    high = int(ids.max()) if ids.numel() and not settings.xdoc else 0
    if settings.metadata:
        # collate's ids are a running count of document starts (1 .. n per row) unless eligibility zeroed some.
        contiguous = _validated and F.ATTENTION_ELIGIBILITY not in work
        out.update(single_document_metadata(ids, member) if settings.xdoc
                   else packed_sequence_metadata_of(ids, high, contiguous=contiguous))
    if settings.thd:
        out.update(thd_fields(ids, work[F.DOCUMENT_IDS]) if settings.cp_size > 1 else thd_fields(ids))
    if settings.seq_idx:
        # Document membership, not attention: an ineligible token stays in its document's recurrence.
        document_ids = work[F.DOCUMENT_IDS]
        out[F.SEQ_IDX] = sequence_index(document_ids.bool() if settings.xdoc else document_ids)
    if settings.source_ids:
        # Per input token, built by collate (the record's source): no contract, xdoc or padding changes it.
        source_ids = work.get(F.SOURCE_IDS)
        if source_ids is None:
            raise ValueError(
                f"{F.SOURCE_IDS}: missing from the batch with return_source_ids, expected int64 [B, S] (what collate "
                f"builds from the records' {F.SOURCE_MARKS!r} field, added by the loader's pipeline when the config "
                "sets return_source_ids); build the loader from that config, or unset return_source_ids")
        out[F.SOURCE_IDS] = source_ids
    if settings.metadata or high > 1:
        out[F.PACKED_SEQ_IDS] = ids
    for name, value in work.items():
        if name not in out and name not in _CONSUMED:
            out[name] = value
    return out


class FinalMap:
    """The final map stage as a picklable callable: finalize, then the recipe's wrapper, then pinning.

    It receives what the loader's collate function built and trusts what
    :func:`~zephon_loader.collate.text.collate` guarantees
    (:func:`finalize_collated`): each property is validated once between
    Zephon and the yield, by collate. A batch from anywhere else must be
    checked first (:func:`~zephon_loader.attention.check_training_batch`, or
    use :func:`finalize_batch`).

    Calling it returns a new dict: :func:`finalize_collated`'s output, plus the
    batch's per-source accounting (``fields.SOURCE_COUNTS``) when present
    (the loader takes it out at the yield), passed through ``collate_wrapper``;
    with ``pin_memory`` every tensor is a pinned copy.

    Args:
        settings: Fixed per loader.
        collate_wrapper: AutoModel-style ``wrapper(collate_fn) -> collate_fn``;
            it receives the finalized batch as its "examples".
        pin_memory: Return pinned copies of the tensors (needs CUDA).
    """

    def __init__(
        self, settings: FinalizeSettings, collate_wrapper: Callable | None = None, pin_memory: bool = False
    ) -> None:
        self.settings = settings
        self._wrapped = collate_wrapper(_identity) if collate_wrapper is not None else None
        self.pin_memory = pin_memory

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        out = finalize_collated(batch, self.settings)
        if F.SOURCE_COUNTS in batch:  # accounting rides along to the yield, where the loader takes it out
            out[F.SOURCE_COUNTS] = batch[F.SOURCE_COUNTS]
        if self._wrapped is not None:
            out = self._wrapped(out)
        if self.pin_memory:
            out = {name: value.pin_memory() if isinstance(value, torch.Tensor) else value for name, value in out.items()}
        return out


def _identity(batch: Any) -> Any:
    return batch
