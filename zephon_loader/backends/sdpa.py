"""``sdpa``: PyTorch scaled-dot-product attention, with exact block-causal attention for packed input.

Translation of AutoModel 0.7.0's SDPA branch (``[B, S, H, D] -> [B, H, S, D]``,
causal, binary padding masks, explicit 4D masks, windows), plus packed
documents: indexed document ids ``[B, S]`` or THD input with ``cu_seqlens``
become private call keywords (document ids and the window) that make the
callable run :func:`packed_sdpa`, block-causal by document with a window
counted in the document's own keys.

:func:`packed_sdpa` plans the documents once per call
(:func:`_document_plan`: tokens grouped by (row, id) in column order) and
either batches them in length buckets, one causal SDPA call per bucket
(:func:`_sdpa_segments`), or runs one dense SDPA under a ``[B, 1, S, S]``
block-causal mask, whichever costs less. Both are exact.
"""

from __future__ import annotations

from typing import Any, Callable, Final, cast

import torch
import torch.nn.functional as tF

from zephon_loader import fields
from zephon_loader.backends._checks import (
    CU_SEQLENS_PADDED,
    bad,
    check_cu_seqlens,
    classify_2d_mask,
    normalize_window,
    shape,
    to_device,
)

#: Public keywords of the SDPA callable (also accepted at initialization), as in AutoModel.
SDPA_PUBLIC_KWARGS: Final[frozenset[str]] = frozenset({"attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"})
#: Private SDPA keywords emitted by preprocess for packed (indexed or THD) input.
_DOC_IDS: Final = "_packed_document_ids"
_WINDOW: Final = "_window_left"
#: Every keyword the SDPA callable accepts.
SDPA_CALL_KWARGS: Final[frozenset[str]] = SDPA_PUBLIC_KWARGS | {_DOC_IDS, _WINDOW}


# =====================================================================================
# packed SDPA: block-causal attention by document id
# =====================================================================================

def _document_plan(doc_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Group the tokens of ``doc_ids`` by (row, id), keeping column order.

    Args:
        doc_ids: int64 ``[B, S]``; 0 = excluded token, any positive id = document
            within its row (ids need not be increasing).

    Returns:
        ``token``: int64 ``[N]`` flat positions ``b * S + s`` of the N
        non-excluded tokens, grouped by document, in column order inside each;
        ``start``/``length``: int64 ``[docs]`` offsets into ``token`` and token
        counts; ``rank``/``doc``: int64 ``[N]`` position of each token inside
        its document and that document's index.
    """
    _, seq = doc_ids.shape
    flat = doc_ids.reshape(-1)
    token = torch.nonzero(flat > 0).squeeze(1)
    ids = flat[token]
    row = torch.div(token, seq, rounding_mode="floor")
    # Stable sort by id, then stable sort by row: groups by (row, id), keeps column order.
    order = torch.argsort(ids, stable=True)
    order = order[torch.argsort(row[order], stable=True)]
    token, ids, row = token[order], ids[order], row[order]
    new_doc = torch.ones_like(token, dtype=torch.bool)
    if token.numel() > 1:
        new_doc[1:] = (row[1:] != row[:-1]) | (ids[1:] != ids[:-1])
    start = torch.nonzero(new_doc).squeeze(1)
    length = torch.diff(start, append=start.new_tensor([token.numel()]))
    doc_of_token = torch.cumsum(new_doc.long(), 0) - 1
    rank = torch.arange(token.numel(), device=token.device) - start[doc_of_token]
    return {"token": token, "start": start, "length": length, "rank": rank, "doc": doc_of_token}


def _band(length: int, window_left: int | None, device: torch.device) -> torch.Tensor | None:
    """Bool ``[L, L]`` causal band (``i - left < j <= i``), or None when plain causal suffices."""
    if window_left is None or window_left >= length:
        return None
    i = torch.arange(length, device=device)
    diff = i[:, None] - i[None, :]
    return (diff >= 0) & (diff < window_left)


def _sdpa_segments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: dict[str, torch.Tensor],
    buckets: list[tuple[int, int]],
    bucket_order: torch.Tensor,
    *,
    window_left: int | None,
    dropout_p: float,
    scale: float | None,
) -> torch.Tensor:
    """Per-document causal SDPA, documents batched in length buckets (one kernel call per bucket).

    Every document of a bucket is gathered into a right-padded ``[n, L]`` slot
    grid; with causal masking a real query never sees the pad slots behind it,
    so no key mask is needed (a window becomes one shared ``[L, L]`` band).
    Outputs of all buckets are concatenated with one zero row and put back in
    place with a single gather (excluded tokens read the zero row).

    Args:
        q: ``[B, H, S, D]``; k: ``[B, Hkv, S, D]``; v: ``[B, Hkv, S, Dv]``
            (cheapest when they are transposed views of BSHD memory).
        plan: from :func:`_document_plan`.
        buckets: ``(count, padded_length)`` per bucket, in ``bucket_order`` order.
        bucket_order: int64 ``[docs]`` document indices sorted by bucket.

    Returns:
        ``[B, H, S, Dv]`` (a transposed view of BSHD memory), zeros at excluded tokens.
    """
    batch, heads, seq, _ = q.shape
    kv_heads, dv = k.shape[1], v.shape[-1]
    groups = heads // kv_heads
    device = q.device
    qf = q.transpose(1, 2).reshape(batch * seq, heads, q.shape[-1])
    kf = k.transpose(1, 2).reshape(batch * seq, kv_heads, k.shape[-1])
    vf = v.transpose(1, 2).reshape(batch * seq, kv_heads, dv)
    token, start, length = plan["token"], plan["start"], plan["length"]

    # Slot grid of every document, documents in bucket order, each padded to its bucket's width;
    # pad slots repeat the document's last token (a causal query never sees them).
    counts = torch.tensor([n for n, _ in buckets], dtype=torch.long, device=device)
    widths = torch.repeat_interleave(torch.tensor([w for _, w in buckets], dtype=torch.long, device=device), counts)
    first_slot = torch.cumsum(widths, 0) - widths  # [docs] row of each document's slot 0 (bucket order)
    doc_of_slot = torch.repeat_interleave(bucket_order, widths)
    slot = torch.arange(doc_of_slot.numel(), device=device) - torch.repeat_interleave(first_slot, widths)
    slot_token = token[start[doc_of_slot] + torch.minimum(slot, length[doc_of_slot] - 1)]
    row_base = torch.empty_like(first_slot).index_copy(0, bucket_order, first_slot)
    # One gather per tensor (one scatter in backward), split into per-bucket grids.
    sizes = [n * w for n, w in buckets]
    q_parts = torch.split(qf[slot_token], sizes)
    k_parts = torch.split(kf[slot_token], sizes)
    v_parts = torch.split(vf[slot_token], sizes)

    outputs: list[torch.Tensor] = []
    for (count, width), qp, kp, vp in zip(buckets, q_parts, k_parts, v_parts):  # per bucket, never per document
        qb = qp.view(count, width, heads, -1).transpose(1, 2)  # [n, H, L, D] view of [n, L, H, D] memory
        kb = kp.view(count, width, kv_heads, -1).transpose(1, 2)
        vb = vp.view(count, width, kv_heads, dv).transpose(1, 2)
        band = _band(width, window_left, device)
        if band is None:
            ob = tF.scaled_dot_product_attention(
                qb, kb, vb, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=groups > 1
            )
        else:
            if groups > 1:
                kb = kb.repeat_interleave(groups, dim=1)
                vb = vb.repeat_interleave(groups, dim=1)
            ob = tF.scaled_dot_product_attention(qb, kb, vb, attn_mask=band, dropout_p=dropout_p, scale=scale)
        outputs.append(ob.transpose(1, 2).reshape(count * width, heads, dv))
    outputs.append(q.new_zeros(1, heads, dv))
    stacked = torch.cat(outputs)
    row_of_token = row_base[plan["doc"]] + plan["rank"]
    source_row = torch.full((batch * seq,), stacked.shape[0] - 1, dtype=torch.long, device=device)
    source_row = source_row.index_copy(0, token, row_of_token)
    return stacked.index_select(0, source_row).reshape(batch, seq, heads, dv).transpose(1, 2)


def _block_causal_mask(doc_ids: torch.Tensor, plan: dict[str, torch.Tensor], window_left: int | None) -> torch.Tensor:
    """Bool ``[B, 1, S, S]``: same nonzero id, key column <= query column, within the window (in document rank)."""
    batch, seq = doc_ids.shape
    col = torch.arange(seq, device=doc_ids.device)
    mask = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (doc_ids[:, :, None] > 0) & (col[None, :] <= col[:, None])
    if window_left is not None:
        rank = torch.zeros(batch * seq, dtype=torch.long, device=doc_ids.device)
        rank = rank.index_copy(0, plan["token"], plan["rank"]).reshape(batch, seq)
        mask = mask & (rank[:, None, :] > rank[:, :, None] - window_left)
    return mask[:, None]


def packed_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    document_ids: torch.Tensor,
    *,
    window_left: int | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    strategy: str = "auto",
) -> torch.Tensor:
    """Block-causal SDPA by document id: every document attends causally to itself only.

    Equal to attention computed separately per document (the document being
    the row's tokens with that id, in column order), with an optional window
    counting the document's own keys including the current one.

    Two exact strategies:

    * ``"segments"``: documents are gathered into length buckets (lengths within
      a factor sqrt(2) share a bucket, padded to the bucket's longest) and each
      bucket is one causal SDPA call over ``[docs_in_bucket, H, L, D]``; work is
      about ``sum(len^2)`` instead of ``B * S^2``, with the fast causal kernels.
      Python iterates over buckets (at most ~2*log2(S)), never over documents
      or tokens; one host sync reads the bucket sizes.
    * ``"dense"``: one SDPA call with a ``[B, 1, S, S]`` bool block-causal mask.

    ``"auto"`` picks ``"segments"`` unless its padded work exceeds the dense work.

    Args:
        q: ``[B, H, S, D]`` (or ``[H, S, D]`` for one packed stream), float.
        k: ``[B, Hkv, S, D]`` (``[Hkv, S, D]``); ``H % Hkv == 0``.
        v: ``[B, Hkv, S, Dv]`` (``[Hkv, S, Dv]``).
        document_ids: integer ``[B, S]`` (``[1, S]`` or ``[S]`` for the 3-D form);
            0 = excluded token (padding/ineligible), positive = document id.
        window_left: visible keys including the current token, or None.
        dropout_p: attention dropout probability.
        scale: softmax scale (None: ``1/sqrt(D)``).
        strategy: ``"auto"``, ``"segments"`` or ``"dense"``.

    Returns:
        ``[B, H, S, Dv]`` (``[H, S, Dv]``) in q's dtype; zeros at excluded queries.
    """
    squeeze = q.ndim == 3
    if squeeze:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    doc_ids = document_ids.reshape(q.shape[0], -1) if squeeze else document_ids
    if doc_ids.shape != (q.shape[0], q.shape[2]) or k.shape[2] != q.shape[2]:
        raise bad(
            "sdpa",
            "document ids",
            f"shape {shape(document_ids)} for q {shape(q)} and k {shape(k)}",
            "[batch, sequence] matching q and k (no KV cache with packed documents)",
        )
    if strategy not in ("auto", "segments", "dense"):
        raise bad("sdpa", "strategy", repr(strategy), "'auto', 'segments' or 'dense'")
    doc_ids = to_device(doc_ids, q.device, torch.long)
    plan = _document_plan(doc_ids)
    batch, heads, seq, _ = q.shape
    out: torch.Tensor
    if strategy != "dense":
        length = plan["length"]
        # Lengths within a factor sqrt(2) share a bucket (float rounding only moves a
        # document to a neighbouring bucket, never affects exactness).
        bucket = torch.floor(2 * torch.log2(length.to(torch.float32))).long()
        bucket_ids, inverse, counts = torch.unique(bucket, return_inverse=True, return_counts=True)
        padded = torch.zeros_like(bucket_ids).scatter_reduce(0, inverse, length, "amax", include_self=False)
        host = torch.stack([counts, padded]).tolist() if bucket_ids.numel() else [[], []]
        buckets = list(zip(host[0], host[1]))
        segment_work = sum(n * L * L for n, L in buckets)
        if strategy == "segments" or segment_work <= batch * seq * seq:
            out = _sdpa_segments(
                q, k, v, plan, buckets, torch.argsort(inverse, stable=True),
                window_left=window_left, dropout_p=dropout_p, scale=scale,
            )
            return out[0] if squeeze else out
    # Excluded queries would have no visible key; let them see themselves and zero their
    # output afterwards, so no kernel ever meets a fully masked row (no NaN on any backend).
    excluded = doc_ids == 0
    diagonal = torch.eye(seq, dtype=torch.bool, device=q.device)
    mask = _block_causal_mask(doc_ids, plan, window_left) | (diagonal & excluded[:, :, None])[:, None]
    groups = heads // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = tF.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    out = torch.where(excluded[:, None, :, None], 0.0, out)
    return out[0] if squeeze else out


def _thd_document_ids(cu_seqlens: torch.Tensor, cu_seqlens_padded: torch.Tensor | None, tokens: int) -> torch.Tensor:
    """int64 ``[1, T]`` 1-based document ids of a THD stream, 0 outside every document.

    Document ``i`` holds ``cu_seqlens[i+1] - cu_seqlens[i]`` tokens starting at
    ``cu_seqlens_padded[i]`` (or ``cu_seqlens[i]``); gaps and the tail are 0.
    """
    cu = cu_seqlens.to(torch.long)
    lengths = cu[1:] - cu[:-1]
    starts = (to_device(cu_seqlens_padded, cu.device, torch.long) if cu_seqlens_padded is not None else cu)[:-1]
    position = torch.arange(tokens, device=cu.device)
    doc = torch.searchsorted(starts, position, right=True) - 1
    inside = (doc >= 0) & (position < (starts + lengths)[doc.clamp_min(0)]) if starts.numel() else position < 0
    return torch.where(inside, doc + 1, 0).unsqueeze(0)



# =====================================================================================
# the callable, preprocess and postprocess
# =====================================================================================


def make_sdpa_func(
    softmax_scale: float, attn_mask_type: str, num_gqa_groups: int | None, defaults: dict[str, Any]
) -> Callable[..., torch.Tensor]:
    """SDPA callable with AutoModel's defaults plus the packed (document-id) path."""
    unexpected = defaults.keys() - SDPA_PUBLIC_KWARGS
    if unexpected:
        raise TypeError(f"Unsupported SDPA attention kwargs: {sorted(unexpected)}")
    default_attn_mask = cast("torch.Tensor | None", defaults.get("attn_mask"))
    default_dropout_p = float(defaults.get("dropout_p", 0.0))
    default_is_causal = bool(defaults.get("is_causal", attn_mask_type == "causal"))
    default_scale = cast("float | None", defaults.get("scale", softmax_scale))
    default_enable_gqa = bool(defaults.get("enable_gqa", num_gqa_groups is not None))

    def attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **call_kwargs: Any) -> torch.Tensor:
        """Scaled dot-product attention in SDPA layout.

        Args:
            q: ``[B, H, Sq, D]`` (or ``[H, T, D]`` from THD input), float.
            k: ``[B, Hkv, Skv, D]`` (``[Hkv, T, D]``).
            v: ``[B, Hkv, Skv, Dv]`` (``[Hkv, T, Dv]``).
            **call_kwargs: ``attn_mask`` (bool/additive, broadcastable to
                ``[B, H, Sq, Skv]``), ``dropout_p``, ``is_causal``, ``scale``,
                ``enable_gqa``; or, from preprocess on packed input,
                ``_packed_document_ids`` (int64 ``[B, S]``) and ``_window_left``,
                which select exact block-causal attention (:func:`packed_sdpa`).

        Returns:
            ``[B, H, Sq, Dv]`` (``[H, T, Dv]``); zeros at excluded packed tokens.
        """
        unexpected_call = call_kwargs.keys() - SDPA_CALL_KWARGS
        if unexpected_call:
            raise TypeError(f"Unsupported SDPA attention kwargs: {sorted(unexpected_call)}")
        dropout_p = float(call_kwargs.get("dropout_p", default_dropout_p))
        scale = cast("float | None", call_kwargs.get("scale", default_scale))
        doc_ids = call_kwargs.get(_DOC_IDS)
        if doc_ids is not None:
            if call_kwargs.get("attn_mask") is not None:
                raise bad("sdpa", "attn_mask", "a mask together with packed document ids", "one of the two")
            return packed_sdpa(
                q, k, v, doc_ids, window_left=call_kwargs.get(_WINDOW), dropout_p=dropout_p, scale=scale
            )
        attn_mask = cast("torch.Tensor | None", call_kwargs.get("attn_mask", default_attn_mask))
        is_causal = bool(call_kwargs.get("is_causal", default_is_causal))
        enable_gqa = bool(call_kwargs.get("enable_gqa", default_enable_gqa)) or q.shape[-3] != k.shape[-3]
        if enable_gqa and attn_mask is not None:
            groups = q.shape[-3] // k.shape[-3]
            k = k.repeat_interleave(groups, dim=-3)
            v = v.repeat_interleave(groups, dim=-3)
            enable_gqa = False
        return tF.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )

    return attn_func


def preprocess_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """SDPA layout ``[B, H, S, D]`` (THD: ``[H, T, D]``) and the callable's keywords.

    Binary masks keep AutoModel's causal & key-mask semantics; indexed ids and
    THD offsets become the private packed keywords (document ids int64
    ``[B, S]`` on q's device, window left or None). Every mask is moved to q's
    device.
    """
    left, right = normalize_window(kwargs.get("window_size", (-1, 0)), "sdpa")
    if q.ndim == 3:
        return _preprocess_sdpa_thd(q, k, v, attention_mask, kwargs, left)
    attn_kwargs: dict[str, Any] = {}
    # [B, S, H, D] -> [B, H, S, D]; views until we know a copy is useful.
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q_len, kv_len = q.shape[-2], k.shape[-2]
    key_mask: torch.Tensor | None = None
    explicit_mask: torch.Tensor | None = None
    has_padding_mask = False
    if attention_mask is not None:
        if attention_mask.ndim == 2:
            if attention_mask.shape[0] != q.shape[0] or attention_mask.shape[1] < kv_len:
                raise bad(
                    "sdpa", fields.ATTENTION_MASK, f"shape {shape(attention_mask)}",
                    f"[batch={q.shape[0]}, sequence>={kv_len}] (padding mask or document ids)",
                )
            kind, has_padding_mask = classify_2d_mask(attention_mask, "sdpa")
            if kind == "indexed":
                if attention_mask.shape[1] != kv_len or q_len != kv_len:
                    raise bad(
                        "sdpa", fields.ATTENTION_MASK, f"document ids of shape {shape(attention_mask)} with q length "
                        f"{q_len} and k length {kv_len}", "[batch, sequence] with equal q and k lengths",
                    )
                attn_kwargs[_DOC_IDS] = to_device(attention_mask, q.device, torch.long)
                attn_kwargs[_WINDOW] = left
                attn_kwargs["is_causal"] = False
                # Views, not copies: the packed path gathers tokens from BSHD memory directly.
                return q, k, v, attn_kwargs
            key_mask = to_device(attention_mask, q.device, torch.bool)
        elif attention_mask.ndim == 4:
            b, h = attention_mask.shape[:2]
            if b not in (1, q.shape[0]) or h not in (1, q.shape[1]) or attention_mask.shape[2:] != (q_len, kv_len):
                raise bad(
                    "sdpa", fields.ATTENTION_MASK, f"shape {shape(attention_mask)}",
                    f"an explicit mask broadcastable to [{q.shape[0]}, {q.shape[1]}, {q_len}, {kv_len}]",
                )
            if attention_mask.dtype != torch.bool and not attention_mask.dtype.is_floating_point:
                raise bad("sdpa", fields.ATTENTION_MASK, f"a 4D mask of dtype {attention_mask.dtype}",
                          "bool (True = attend) or an additive float mask")
            explicit_mask = to_device(attention_mask, q.device)
        else:
            raise bad(
                "sdpa", fields.ATTENTION_MASK, f"shape {shape(attention_mask)}",
                "[batch, sequence] (padding mask or document ids) or [batch, 1, sequence, sequence]",
            )
    if left is not None or right is not None or has_padding_mask:
        kv_offset = max(kv_len - q_len, 0)
        q_pos = torch.arange(q_len, device=q.device) + kv_offset
        kv_pos = torch.arange(kv_len, device=q.device)
        causal_mask = kv_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
        if left is not None:
            causal_mask = causal_mask & (kv_pos.unsqueeze(0) > q_pos.unsqueeze(1) - left)
        if right is not None:
            causal_mask = causal_mask & (kv_pos.unsqueeze(0) <= q_pos.unsqueeze(1) + right)
        if has_padding_mask:
            assert key_mask is not None
            key_mask = key_mask[..., -kv_len:]
            causal_mask = causal_mask.unsqueeze(0).unsqueeze(0) & key_mask[:, None, None, :]
        if explicit_mask is not None:
            # Deliberate difference: AutoModel drops the explicit mask when a window is set.
            if explicit_mask.dtype == torch.bool:
                causal_mask = explicit_mask & causal_mask
            else:
                causal_mask = explicit_mask.masked_fill(~causal_mask, float("-inf"))
        attn_kwargs["attn_mask"] = causal_mask
        attn_kwargs["is_causal"] = False
    elif explicit_mask is not None:
        attn_kwargs["attn_mask"] = explicit_mask
        attn_kwargs["is_causal"] = False
    else:
        attn_kwargs["is_causal"] = True
    return q.contiguous(), k.contiguous(), v.contiguous(), attn_kwargs


def _preprocess_sdpa_thd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: dict[str, Any],
    left: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """THD for SDPA: ``[T, H, D] -> [H, T, D]`` plus document ids from ``cu_seqlens``."""
    if attention_mask is not None:
        raise bad("sdpa", fields.ATTENTION_MASK, f"shape {shape(attention_mask)} with THD q {shape(q)}",
                  "None (THD documents come from cu_seqlens)")
    cu_seqlens = kwargs.get(fields.CU_SEQLENS)
    if cu_seqlens is None:
        raise bad("sdpa", fields.CU_SEQLENS, "None with THD q " + str(shape(q)),
                  "a 1-D [documents + 1] tensor describing the packed stream")
    if k.shape[0] != q.shape[0]:
        raise bad("sdpa", "k", f"{k.shape[0]} tokens", f"q's {q.shape[0]} tokens (packed self-attention)")
    cu_seqlens = check_cu_seqlens(cu_seqlens, "sdpa", fields.CU_SEQLENS, dtype=None)
    padded = kwargs.get(CU_SEQLENS_PADDED)
    if padded is not None:
        padded = check_cu_seqlens(padded, "sdpa", "cu_seqlens_padded", dtype=None)
        if padded.shape != cu_seqlens.shape:
            raise bad(
                "sdpa", "cu_seqlens_padded", f"shape {shape(padded)}", f"cu_seqlens' shape {shape(cu_seqlens)}"
            )
    doc_ids = _thd_document_ids(to_device(cu_seqlens, q.device), padded, q.shape[0])
    attn_kwargs = {_DOC_IDS: doc_ids, _WINDOW: left, "is_causal": False}
    return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_kwargs


def postprocess_sdpa(x: torch.Tensor) -> torch.Tensor:
    """SDPA ``[B, H, S, Dv]`` -> ``[B, S, H, Dv]``; THD ``[H, T, Dv]`` -> ``[T, H, Dv]`` (contiguous)."""
    if x.ndim == 4:
        return x.transpose(1, 2).contiguous()
    if x.ndim == 3:
        return x.transpose(0, 1).contiguous()
    raise bad("sdpa", "x", f"shape {shape(x)}", "[batch, heads, sequence, head_dim] or [heads, tokens, head_dim]")
