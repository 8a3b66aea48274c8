"""The one table of field names.

Every batch key the package reads or writes is spelled here and nowhere else:
the internal :class:`~zephon_loader.attention.TrainingBatch` keys (left side of
the data flow) and the AutoModel 0.7.0 aliases the loader yields (right side).
Other modules import these constants; a renamed AutoModel field is a one-line
change in this file.

Yielded batch per packed contract (docs/contract.md §7), ``ids`` = attention document ids:

==========================  ===================================================
contract                    fields added to the always-present ones
==========================  ===================================================
``document_ids``            ``attention_mask`` = ids, int64 ``[B, S]``
``block_causal``            ``attention_mask`` bool ``[B, 1, S, S]``
``flash_varlen``            ``cu_seq_lens_q/k`` int32 ``[segments + 1]``,
                            ``max_length_q/k`` int (no ``attention_mask``)
requires metadata           ``packed_token_indices`` int64 ``[B, S]``,
                            ``cu_seqlens`` int32 ``[B, D + 1]``, ``max_seqlen``
``qkv_format == "thd"``     ``qkv_format``, ``seq_lens``/``seq_lens_padded``
                            int64 ``[B, max_docs]`` (``-1000`` sentinel)
``cp_size > 1``             metadata (always) and ``cu_seqlens_padded`` int32
                            ``[B, D + 1]`` (``-1`` tail), the padded layout
``seq_idx`` requested       ``seq_idx`` int32 ``[B, S]`` (document index in the
                            batch, ``-1`` at padding)
``return_source_ids``       ``source_ids`` int64 ``[B, S]`` (mixture source of
                            each input token, ``-1`` at padding)
``position_ids`` (``hf``)   no ``attention_mask``: ``shift_labels`` (the same
                            tensor as ``labels``, already shifted, so Hugging
                            Face's loss does not shift again),
                            ``use_cache=False`` (transformers derives the
                            packed mask from ``position_ids`` only without a
                            KV cache) and the ``flash_varlen`` fields (its
                            flash kernels read packing from ``position_ids``
                            only for a single flattened row)
==========================  ===================================================

Always present: ``input_ids``, ``labels``, ``position_ids``, ``padding_mask``;
``_packed_seq_ids`` when a row holds more than one document or metadata is
required.
"""

from __future__ import annotations

from typing import Final

# --- token fields (internal and yielded names coincide) -----------------------
INPUT_IDS: Final = "input_ids"
LABELS: Final = "labels"
PADDING_MASK: Final = "padding_mask"
POSITION_IDS: Final = "position_ids"

# --- internal document membership ---------------------------------------------
DOCUMENT_IDS: Final = "document_ids"
ATTENTION_DOCUMENT_IDS: Final = "attention_document_ids"
#: Optional per-token bool from a processor; False = neither attends nor is attended.
ATTENTION_ELIGIBILITY: Final = "attention_eligibility"
#: Per-token marker of context-parallel padding (``contract.cp_size > 1``): the pad tokens appended to each
#: document before packing so that it spans a multiple of ``2 * cp_size``. A payload field (uint8, 1 at such
#: padding) through Zephon's packer, a bool ``[B, S]`` in the TrainingBatch; never yielded.
CP_PADDING: Final = "cp_padding"

#: Per-batch ``[[component id, documents, tokens], ...]`` from Zephon's row provenance
#: (:func:`zephon_loader.stats.batch_source_counts`); the loader counts it into ``stats()``
#: when the batch is yielded, and never yields it.
SOURCE_COUNTS: Final = "_source_counts"

# --- packed-sequence metadata (AutoModel's gathered-token bundle) ---------------
PACKED_TOKEN_INDICES: Final = "packed_token_indices"
#: Before the final map: Zephon's physical offsets; after: gathered-token offsets.
CU_SEQLENS: Final = "cu_seqlens"
MAX_SEQLEN: Final = "max_seqlen"

# --- yielded attention representations ------------------------------------------
ATTENTION_MASK: Final = "attention_mask"
PACKED_SEQ_IDS: Final = "_packed_seq_ids"
CU_SEQ_LENS_Q: Final = "cu_seq_lens_q"
CU_SEQ_LENS_K: Final = "cu_seq_lens_k"
MAX_LENGTH_Q: Final = "max_length_q"
MAX_LENGTH_K: Final = "max_length_k"
QKV_FORMAT: Final = "qkv_format"
SEQ_LENS: Final = "seq_lens"
SEQ_LENS_PADDED: Final = "seq_lens_padded"
#: TE's physical offsets of each document (``contract.cp_size > 1``): int32 ``[B, D + 1]``, row-local.
CU_SEQLENS_PADDED: Final = "cu_seqlens_padded"
#: int32 ``[B, S]``: the sequence each token belongs to, numbered 0, 1, ... over the whole batch in row-major
#: order, -1 at trailing padding (transformers' ``DataCollatorWithFlattening(return_seq_idx=True)`` name and
#: numbering; Mamba-2 / hybrid kernels reset their state where it changes). Yielded on request (``contract.seq_idx``).
SEQ_IDX: Final = "seq_idx"
#: int64 ``[B, S]``: the mixture source each input token came from, its index in the config's ``sources``
#: (``SOURCE_ID_PADDING`` at the row's trailing padding and in padding rows), aligned with ``input_ids``
#: (``labels[b, j]`` is the target predicted from that token). Yielded on request (``return_source_ids``).
SOURCE_IDS: Final = "source_ids"
#: ``source_ids`` of padding tokens (no source: a value no source index has).
SOURCE_ID_PADDING: Final = -1
#: Per-token payload field through Zephon's packer (``return_source_ids``): int32 ``[n]``, the record's source
#: index + 1 at every token of the record (its context-parallel padding included). ``pack_flat`` slices it with
#: the tokens and pads it with 0; ``collate`` turns it into ``SOURCE_IDS``. Never yielded.
SOURCE_MARKS: Final = "source_marks"
#: Hugging Face's name for labels already aligned with the logits (its loss does not shift them).
SHIFT_LABELS: Final = "shift_labels"
#: Hugging Face's KV-cache switch; ``False`` lets transformers derive the packed mask from positions.
USE_CACHE: Final = "use_cache"

#: Fields every yielded batch carries, whatever the contract.
ALWAYS: Final[tuple[str, ...]] = (INPUT_IDS, LABELS, POSITION_IDS, PADDING_MASK)

#: Hugging Face's flash varlen kwargs (``flash_varlen``; text batches of the ``hf`` contract).
FLASH_KWARGS: Final = (CU_SEQ_LENS_Q, CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K)
#: Fields added per packed mask type (docs/contract.md §7).
BY_MASK_TYPE: Final[dict[str, tuple[str, ...]]] = {
    "document_ids": (ATTENTION_MASK,),
    "block_causal": (ATTENTION_MASK,),
    "flash_varlen": FLASH_KWARGS,
    "position_ids": (SHIFT_LABELS, USE_CACHE, *FLASH_KWARGS),
}

#: Fields added when the contract requires (or the user requests) packed metadata.
METADATA: Final[tuple[str, ...]] = (PACKED_TOKEN_INDICES, CU_SEQLENS, MAX_SEQLEN)

#: Fields added for Transformer Engine THD (``qkv_format == "thd"``).
THD: Final[tuple[str, ...]] = (QKV_FORMAT, SEQ_LENS, SEQ_LENS_PADDED)

#: Sentinel filling unused ``seq_lens``/``seq_lens_padded`` entries (TE convention).
THD_SENTINEL: Final = -1000
#: Label value ignored by the loss (torch ``cross_entropy``'s default ``ignore_index``).
IGNORE_INDEX: Final = -100

# --- image-text batches (Hugging Face's Qwen2-VL layout; zephon_loader.collate.image) ---
#: float32 ``[patches, patch_dim]``: every image's patch rows, in row order then position order.
PIXEL_VALUES: Final = "pixel_values"
#: int64 ``[images, 3]``: ``(t, h, w)`` patch grid of each image, same order as ``pixel_values``.
IMAGE_GRID_THW: Final = "image_grid_thw"
#: int64 ``[B, S]``: 1 at image placeholder tokens, 0 elsewhere (transformers 5's processors return it).
MM_TOKEN_TYPE_IDS: Final = "mm_token_type_ids"
#: int64 ``[B]``: images per row (AutoModel's pipeline-parallel media chunking reads it).
N_IMAGES_PER_SAMPLE: Final = "n_images_per_sample"
#: Yielded by every image-text batch; ``PIXEL_VALUES``/``IMAGE_GRID_THW`` only when the batch holds an image.
IMAGE_ALWAYS: Final[tuple[str, ...]] = (MM_TOKEN_TYPE_IDS, N_IMAGES_PER_SAMPLE)
IMAGE_MEDIA: Final[tuple[str, ...]] = (PIXEL_VALUES, IMAGE_GRID_THW)


def yielded_fields(
    packed_mask_type: str, *, metadata: bool, thd: bool, seq_idx: bool = False, cp: bool = False,
    source_ids: bool = False,
) -> tuple[str, ...]:
    """Names a yielded batch carries for one contract, in yield order.

    ``_packed_seq_ids`` is left out: it depends on the batch (present when a
    row holds more than one document) unless ``metadata`` is on, where it is
    always present.

    Args:
        packed_mask_type: ``"block_causal"``, ``"document_ids"``, ``"flash_varlen"`` or ``"position_ids"``.
        metadata: Whether the gathered-token metadata bundle is yielded.
        thd: Whether TE THD fields are yielded.
        seq_idx: Whether ``seq_idx`` is yielded.
        cp: Context-parallel layout (``cp_size > 1``): ``cu_seqlens_padded`` after the THD fields.
        source_ids: Whether ``source_ids`` is yielded (last).

    Raises:
        ValueError: On an unknown ``packed_mask_type``.
    """
    if packed_mask_type not in BY_MASK_TYPE:
        raise ValueError(
            f"packed_mask_type: got {packed_mask_type!r}, expected one of {sorted(BY_MASK_TYPE)}"
        )
    names = ALWAYS + BY_MASK_TYPE[packed_mask_type]
    if metadata:
        names += METADATA + (PACKED_SEQ_IDS,)
    if thd:
        names += THD
    if cp:
        names += (CU_SEQLENS_PADDED,)
    if seq_idx:
        names += (SEQ_IDX,)
    if source_ids:
        names += (SOURCE_IDS,)
    return names
