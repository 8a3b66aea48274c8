"""Attention-backend helpers for packed batches: ``sdpa``, ``fa4`` and ``te`` (SPEC §7).

The three public functions have the names and signatures of NeMo AutoModel
0.7.0's ``nemo_automodel.components.attention.utils`` and are used the same
way inside an attention layer::

    attn_module, attn_func = initialize_attn_module_and_func("sdpa", H, D, Dv, D**-0.5, num_gqa_groups=Hkv)
    ...
    q, k, v, attn_kwargs = preprocess_args_and_kwargs_for_attn(q, k, v, attention_mask, "sdpa", **kwargs)
    out = attn_func(q, k, v, **attn_kwargs)
    out = postprocess_output_for_attn(out, "sdpa")

Layouts: ``q``/``k``/``v`` are BSHD ``[batch, sequence, heads, head_dim]`` or
THD ``[tokens, heads, head_dim]`` (``k``/``v`` may have fewer heads: GQA;
``v`` may have its own head dim ``Dv``). Any floating dtype the backend
accepts (SDPA: fp32/fp16/bf16; FA4 and TE kernels: fp16/bf16 on CUDA).

``attention_mask`` forms:

* ``[B, S]`` binary padding mask, bool or 0/1 (1/True = valid token);
* ``[B, S]`` *indexed* document ids, integer, 1-based per row, 0 at excluded
  tokens (padding or ineligible); recognised by a value > 1 somewhere in the
  batch (AutoModel's rule, so a batch where every row holds one document is a
  padding mask);
* ``[B | 1, 1 | H, Sq, Skv]`` explicit mask (bool, True = attend, or additive float).

A binary mask keeps AutoModel's SDPA semantics exactly (causal & key mask, a
window counted in columns, padded queries attend to earlier valid keys);
with indexed ids the window counts the document's own keys and excluded
queries output zeros. The two agree on valid tokens unless a window spans a
hole inside a row's valid tokens (pass indexed ids or FA4 metadata for that).

Window convention (user-facing ``window_size=(left, right)``): for ``sdpa`` and
``fa4`` a positive ``left`` counts visible keys *including* the current token
(key ``j`` is visible from query ``i`` iff ``i - left < j <= i``); a negative
or ``None`` left is unbounded; ``left == 0`` is an error. A scalar means
``(left, 0)``. ``right`` only matters for non-causal use (every branch here is
causal). The ``te`` branch forwards Transformer Engine's own distances
unchanged (TE's ``(W, 0)`` shows ``W + 1`` keys).

Where this module deliberately differs from AutoModel 0.7.0 (each is tested):

* ``sdpa`` + indexed ids: block-causal by document id (AutoModel uses the ids as
  a plain key mask and so attends across documents). The window counts keys of
  the *same document* (the eligible-token stream), so results equal per-document
  attention even across eligibility holes; excluded query tokens output zeros.
  An exact per-document fast path is used automatically (see :func:`packed_sdpa`).
* ``sdpa`` + THD input: supported with ``cu_seqlens`` (AutoModel transposes the
  wrong axes); the output is restored to ``[T, H, Dv]`` by postprocess.
* ``sdpa`` + explicit 4D mask + window: the mask is combined with the causal
  band (AutoModel silently drops the explicit mask when a window is set).
* ``window_size`` left ``0`` is a ``ValueError`` for ``sdpa`` too (AutoModel
  builds an all-masked mask).
* Metadata keys passed as ``None`` count as absent (AutoModel tests key presence).
* The SDPA callable enables GQA whenever k/v have fewer heads than q, even
  without ``num_gqa_groups`` (AutoModel's raises inside SDPA then).
* Malformed layouts raise ``ValueError`` up front (dtype/rank of ``cu_seqlens``,
  ``packed_token_indices`` without ``cu_seqlens``, a TE padding mask that is not
  right-padded, indexed ids for TE, packed TE without ``max_seqlen``, ...)
  where AutoModel passes them on to a kernel that fails or silently misreads them.

TE (``transformer_engine.pytorch``) and FA4 (``flash_attn.cute``, PyPI
``flash-attn-4``) are imported lazily by :func:`initialize_attn_module_and_func`;
import failures of any kind become one :class:`ImportError` naming the extra to
install. No caller tensor is modified in place.
"""

from __future__ import annotations

import importlib
import operator
from types import ModuleType
from typing import Any, Callable, Final, cast

import torch
import torch.nn.functional as tF
from torch import nn

from zephon_loader import fields

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "FA4_DENSE_KWARGS",
    "FA4_VARLEN_KWARGS",
    "SDPA_CALL_KWARGS",
    "TE_FORWARD_KWARGS",
    "TE_INIT_KWARGS",
    "initialize_attn_module_and_func",
    "packed_sdpa",
    "postprocess_output_for_attn",
    "preprocess_args_and_kwargs_for_attn",
]

#: Backend names this module implements.
ATTN_IMPLEMENTATIONS: Final[tuple[str, ...]] = ("sdpa", "fa4", "te")

# --- pinned third-party keyword names ---------------------------------------------
# Every keyword this module passes to a kernel is listed here; tests check these
# sets against literal expectations (CPU) and against the installed kernels'
# signatures (GPU), so a renamed argument upstream fails loudly.

#: ``flash_attn.cute.flash_attn_varlen_func`` keywords we pass (FA4 4.0.0b36).
FA4_VARLEN_KWARGS: Final[frozenset[str]] = frozenset(
    {
        "cu_seqlens_q",
        "cu_seqlens_k",
        "max_seqlen_q",
        "max_seqlen_k",
        "softmax_scale",
        "causal",
        "window_size",
        "softcap",
        "learnable_sink",
    }
)
#: ``flash_attn.cute.flash_attn_func`` keywords we pass (FA4 4.0.0b36).
FA4_DENSE_KWARGS: Final[frozenset[str]] = frozenset(
    {"softmax_scale", "causal", "window_size", "softcap", "learnable_sink"}
)
#: ``transformer_engine.pytorch.DotProductAttention.__init__`` keywords we pass (TE 2.20).
TE_INIT_KWARGS: Final[frozenset[str]] = frozenset(
    {"num_attention_heads", "kv_channels", "attn_mask_type", "qkv_format", "softmax_scale", "num_gqa_groups"}
)
#: ``DotProductAttention.forward`` keywords :func:`preprocess_args_and_kwargs_for_attn` emits (TE 2.20).
TE_FORWARD_KWARGS: Final[frozenset[str]] = frozenset(
    {
        "attention_mask",
        "qkv_format",
        "cu_seqlens_q",
        "cu_seqlens_kv",
        "cu_seqlens_q_padded",
        "cu_seqlens_kv_padded",
        "max_seqlen_q",
        "max_seqlen_kv",
        "attn_mask_type",
        "window_size",
        "pad_between_seqs",
    }
)

# --- keywords of the callables returned here ----------------------------------------
#: Public keywords of the SDPA callable (also accepted at initialization), as in AutoModel.
_SDPA_PUBLIC_KWARGS: Final[frozenset[str]] = frozenset({"attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"})
#: Private SDPA keywords emitted by preprocess for packed (indexed or THD) input.
_SDPA_DOC_IDS: Final = "_packed_document_ids"
_SDPA_WINDOW: Final = "_window_left"
#: Every keyword the SDPA callable accepts.
SDPA_CALL_KWARGS: Final[frozenset[str]] = _SDPA_PUBLIC_KWARGS | {_SDPA_DOC_IDS, _SDPA_WINDOW}

_FA4_PADDED_SHAPE: Final = "_fa4_padded_output_shape"
_FA4_CALL_KWARGS: Final[frozenset[str]] = frozenset(
    {
        "causal",
        "window_size",
        "cu_seqlens_q",
        "cu_seqlens_kv",
        "max_seqlen_q",
        "max_seqlen_kv",
        "softcap",
        "learnable_sink",
        fields.PACKED_TOKEN_INDICES,
        _FA4_PADDED_SHAPE,
    }
)

_CU_SEQLENS_PADDED: Final = "cu_seqlens_padded"
_FLATTEN_HINT: Final = (
    "flatten the batch-major metadata once at model entry, after pipeline microbatch splitting, with "
    "zephon_loader.packing.flatten_packed_sequence_metadata(packed_token_indices, cu_seqlens, "
    "batch_size=B, sequence_length=S) (same as AutoModel's nemo_automodel.components.models.common."
    "packing.flatten_packed_sequence_metadata)"
)


# =====================================================================================
# lazy imports
# =====================================================================================


def _import_optional(module: str, attn_impl: str, extra: str, package: str) -> ModuleType:
    """Import an optional kernel module, turning any failure into one ImportError.

    Broad on purpose: without CUDA, TE raises ``RuntimeError`` at import and
    ``flash_attn.cute`` can raise ``FileNotFoundError`` (no nvcc) or cutlass errors.
    """
    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - see docstring
        raise ImportError(
            f"attn_impl={attn_impl!r} needs {package} ({module}) with a working CUDA setup, but importing it "
            f"failed with {type(exc).__name__}: {exc}. Install it with: pip install 'zephon-loader[{extra}]'"
        ) from exc


def _import_te_dot_product_attention() -> type[nn.Module]:
    """Return ``transformer_engine.pytorch.DotProductAttention`` (lazy; ImportError if unusable)."""
    te = _import_optional("transformer_engine.pytorch", "te", "te", "NVIDIA Transformer Engine")
    cls = getattr(te, "DotProductAttention", None)
    if cls is None:
        raise ImportError(
            "attn_impl='te': transformer_engine.pytorch has no DotProductAttention; install a supported "
            "version with: pip install 'zephon-loader[te]'"
        )
    return cast(type[nn.Module], cls)


def _import_fa4() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Return FA4's ``(flash_attn_func, flash_attn_varlen_func)`` (lazy; ImportError if unusable)."""
    cute = _import_optional("flash_attn.cute", "fa4", "fa4", "FlashAttention-4 (PyPI flash-attn-4)")
    dense = getattr(cute, "flash_attn_func", None)
    varlen = getattr(cute, "flash_attn_varlen_func", None)
    if dense is None or varlen is None:
        raise ImportError(
            "attn_impl='fa4': flash_attn.cute lacks flash_attn_func/flash_attn_varlen_func; install "
            "FlashAttention-4 with: pip install 'zephon-loader[fa4]'"
        )
    return dense, varlen


# =====================================================================================
# validation helpers
# =====================================================================================


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _bad(attn_impl: str, argument: str, seen: str, expected: str, hint: str = "") -> ValueError:
    """A ValueError naming the argument, what was seen and what was expected."""
    message = f"attn_impl={attn_impl!r}: {argument}: got {seen}; expected {expected}."
    return ValueError(f"{message} {hint}" if hint else message)


def _unknown_impl(attn_impl: object) -> ValueError:
    """The ValueError for a backend name this module does not implement."""
    return ValueError(f"attn_impl: got {attn_impl!r}; expected one of {list(ATTN_IMPLEMENTATIONS)}.")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_impl: str) -> None:
    """Check that q/k/v form one BSHD or THD layout (batch/token and head axes consistent)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise _bad(attn_impl, name, type(t).__name__, "a torch.Tensor")
    if q.ndim not in (3, 4):
        raise _bad(
            attn_impl,
            "q",
            f"shape {_shape(q)}",
            "BSHD [batch, sequence, heads, head_dim] or THD [tokens, heads, head_dim]",
        )
    if k.ndim != q.ndim or v.ndim != q.ndim:
        raise _bad(attn_impl, "k/v", f"shapes {_shape(k)} and {_shape(v)} with q {_shape(q)}", f"rank {q.ndim} like q")
    if q.ndim == 4 and (k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]):
        raise _bad(attn_impl, "k/v", f"batch sizes {k.shape[0]}/{v.shape[0]}", f"q's batch size {q.shape[0]}")
    if k.shape[:-1] != v.shape[:-1]:
        raise _bad(attn_impl, "v", f"shape {_shape(v)}", f"the leading dims of k {_shape(k)[:-1]}")
    if k.shape[-1] != q.shape[-1]:
        raise _bad(attn_impl, "k", f"head_dim {k.shape[-1]}", f"q's head_dim {q.shape[-1]}")
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise _bad(attn_impl, "k", f"{kv_heads} heads with q {heads} heads", "a divisor of q's head count (GQA)")


def _normalize_window(window_size: Any, attn_impl: str) -> tuple[int | None, int | None]:
    """User-facing ``window_size`` -> ``(left, right)``, ``None`` meaning unbounded.

    ``left`` counts visible keys including the current token; a scalar means
    ``(left, 0)``; ``None``/negative left -> ``None``; ``0`` -> ValueError;
    right ``None``/``<= 0`` -> ``None``.
    """
    if window_size is None:
        return None, None
    if isinstance(window_size, (tuple, list)):
        if len(window_size) != 2:
            raise _bad(attn_impl, "window_size", repr(window_size), "(left, right) or a single left size")
        left, right = window_size
    else:
        left, right = window_size, 0

    def as_int(x: Any) -> int | None:
        if x is None:
            return None
        if isinstance(x, bool):
            raise _bad(attn_impl, "window_size", repr(window_size), "ints or None")
        try:
            return operator.index(x)
        except TypeError:
            raise _bad(attn_impl, "window_size", repr(window_size), "ints or None") from None

    left_i, right_i = as_int(left), as_int(right)
    if left_i == 0:
        raise _bad(
            attn_impl,
            "window_size",
            repr(window_size),
            "a left size >= 1 (it counts visible keys including the current token) or None/-1 for unbounded",
        )
    return (None if left_i is None or left_i < 0 else left_i), (None if right_i is None or right_i <= 0 else right_i)


def _as_int(value: Any, attn_impl: str, argument: str) -> int:
    """A Python int from an int-like (not bool) ``value``."""
    if isinstance(value, bool):
        raise _bad(attn_impl, argument, repr(value), "an int")
    try:
        return operator.index(value)
    except TypeError:
        raise _bad(attn_impl, argument, f"{type(value).__name__} {value!r}", "an int") from None


def _check_cu_seqlens(
    value: Any, attn_impl: str, argument: str, *, dtype: torch.dtype | None = torch.int32
) -> torch.Tensor:
    """Validate a flat ``[documents + 1]`` cumulative-lengths tensor (``dtype=None``: any integer dtype)."""
    if not isinstance(value, torch.Tensor):
        raise _bad(attn_impl, argument, type(value).__name__, "a 1-D int32 tensor [documents + 1]")
    if value.ndim == 2:
        raise _bad(
            attn_impl,
            argument,
            f"batch-major shape {_shape(value)}",
            "flat [documents + 1]",
            f"Unflattened packed metadata: {_FLATTEN_HINT}.",
        )
    if value.ndim != 1 or value.numel() < 1:
        raise _bad(attn_impl, argument, f"shape {_shape(value)}", "a 1-D tensor [documents + 1]")
    if dtype is not None and value.dtype != dtype:
        raise _bad(attn_impl, argument, f"dtype {value.dtype}", f"{dtype}")
    if dtype is None and (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool):
        raise _bad(attn_impl, argument, f"dtype {value.dtype}", "an integer dtype")
    return value


def _classify_2d_mask(mask: torch.Tensor, attn_impl: str) -> tuple[str, bool]:
    """Classify a ``[B, S]`` mask as ``"binary"`` or ``"indexed"``; also report whether any token is excluded.

    One host sync. Bool masks are binary; integer masks are indexed when some
    value exceeds 1; float masks must be 0/1. Negative values are refused.
    """
    if mask.dtype == torch.bool:
        return "binary", not bool(mask.all().item())
    if mask.dtype.is_floating_point:
        if mask.numel() == 0:
            return "binary", False
        non_binary, has_zero = torch.stack([((mask != 0) & (mask != 1)).any(), (mask == 0).any()]).tolist()
        if non_binary:
            raise _bad(attn_impl, fields.ATTENTION_MASK, f"a {mask.dtype} mask with values other than 0/1",
                       "a bool or 0/1 padding mask, or integer document ids")
        return "binary", has_zero
    if mask.dtype.is_complex:
        raise _bad(attn_impl, fields.ATTENTION_MASK, f"dtype {mask.dtype}", "bool or an integer dtype")
    if mask.numel() == 0:
        return "binary", False
    low, high = torch.aminmax(mask)
    low_i, high_i = torch.stack([low, high]).tolist()
    if low_i < 0:
        raise _bad(attn_impl, fields.ATTENTION_MASK, f"a negative value {low_i}", "nonnegative document ids or a 0/1 mask")
    return ("indexed" if high_i > 1 else "binary"), low_i == 0


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
        raise _bad(
            "sdpa",
            "document ids",
            f"shape {_shape(document_ids)} for q {_shape(q)} and k {_shape(k)}",
            "[batch, sequence] matching q and k (no KV cache with packed documents)",
        )
    if strategy not in ("auto", "segments", "dense"):
        raise _bad("sdpa", "strategy", repr(strategy), "'auto', 'segments' or 'dense'")
    doc_ids = doc_ids.to(device=q.device, dtype=torch.long)
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
    starts = (cu_seqlens_padded.to(device=cu.device, dtype=torch.long) if cu_seqlens_padded is not None else cu)[:-1]
    position = torch.arange(tokens, device=cu.device)
    doc = torch.searchsorted(starts, position, right=True) - 1
    inside = (doc >= 0) & (position < (starts + lengths)[doc.clamp_min(0)]) if starts.numel() else position < 0
    return torch.where(inside, doc + 1, 0).unsqueeze(0)


# =====================================================================================
# initialize
# =====================================================================================


def initialize_attn_module_and_func(
    attn_impl: str,
    num_attention_heads: int,
    num_qk_channels: int,
    num_v_channels: int,
    softmax_scale: float,
    attn_mask_type: str = "causal",
    qkv_format: str = "bshd",
    num_gqa_groups: int | None = None,
    **kwargs: Any,
) -> tuple[nn.Module | None, Callable[..., torch.Tensor]]:
    """Build the attention module (TE only) and the callable an attention layer invokes.

    Args:
        attn_impl: ``"sdpa"``, ``"fa4"`` or ``"te"``.
        num_attention_heads: query heads ``H``.
        num_qk_channels: query/key head dim ``D``.
        num_v_channels: value head dim ``Dv``.
        softmax_scale: softmax scale (typically ``D ** -0.5``).
        attn_mask_type: ``"causal"`` makes causal the default for SDPA/FA4
            calls; forwarded to TE's ``DotProductAttention``.
        qkv_format: ``"bshd"`` or ``"thd"`` (TE); FA4 accepts only ``"bshd"``.
        num_gqa_groups: KV heads ``Hkv`` (enables GQA for SDPA; TE's ``num_gqa_groups``).
        **kwargs: SDPA: defaults for ``attn_mask``, ``dropout_p``, ``is_causal``,
            ``scale``, ``enable_gqa``. TE: extra ``DotProductAttention`` kwargs
            (e.g. ``attention_dropout``). FA4: none.

    Returns:
        ``(module, attn_func)``: the TE module (``None`` for SDPA/FA4) and a
        callable ``attn_func(q, k, v, **attn_kwargs) -> Tensor`` taking the
        output of :func:`preprocess_args_and_kwargs_for_attn`. SDPA returns
        ``[B, H, S, Dv]`` (``[H, T, Dv]`` for THD); FA4 returns BSHD
        ``[B, S, H, Dv]`` (zeros at excluded tokens) or ``[T, H, Dv]``; TE
        returns its own ``[..., H * Dv]`` output.

    Raises:
        ValueError: unknown ``attn_impl``; FA4 with ``qkv_format != "bshd"``.
        TypeError: unsupported SDPA/FA4 keyword arguments.
        ImportError: TE or FA4 missing or unusable (with the install command).
    """
    if attn_impl == "te":
        dot_product_attention = _import_te_dot_product_attention()
        module = dot_product_attention(
            num_attention_heads=num_attention_heads,
            kv_channels=(num_qk_channels, num_v_channels),
            attn_mask_type=attn_mask_type,
            qkv_format=qkv_format,
            softmax_scale=softmax_scale,
            num_gqa_groups=num_gqa_groups,
            **kwargs,
        )
        return module, module.__call__
    if attn_impl == "sdpa":
        return None, _make_sdpa_func(softmax_scale, attn_mask_type, num_gqa_groups, kwargs)
    if attn_impl == "fa4":
        if kwargs:
            raise TypeError(f"Unsupported FA4 initialization kwargs: {sorted(kwargs)}")
        if qkv_format != "bshd":
            raise _bad(
                "fa4", fields.QKV_FORMAT, repr(qkv_format), "'bshd'", "Pre-packed THD is unsupported by native FA4."
            )
        flash_attn_func, flash_attn_varlen_func = _import_fa4()
        return None, _make_fa4_func(flash_attn_func, flash_attn_varlen_func, softmax_scale, attn_mask_type)
    raise _unknown_impl(attn_impl)


def _make_sdpa_func(
    softmax_scale: float, attn_mask_type: str, num_gqa_groups: int | None, defaults: dict[str, Any]
) -> Callable[..., torch.Tensor]:
    """SDPA callable with AutoModel's defaults plus the packed (document-id) path."""
    unexpected = defaults.keys() - _SDPA_PUBLIC_KWARGS
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
        doc_ids = call_kwargs.get(_SDPA_DOC_IDS)
        if doc_ids is not None:
            if call_kwargs.get("attn_mask") is not None:
                raise _bad("sdpa", "attn_mask", "a mask together with packed document ids", "one of the two")
            return packed_sdpa(
                q, k, v, doc_ids, window_left=call_kwargs.get(_SDPA_WINDOW), dropout_p=dropout_p, scale=scale
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


def _make_fa4_func(
    flash_attn_func: Callable[..., Any],
    flash_attn_varlen_func: Callable[..., Any],
    softmax_scale: float,
    attn_mask_type: str,
) -> Callable[..., torch.Tensor]:
    """FA4 callable: dense or varlen kernel, restoring gathered output to padded BSHD."""
    default_causal = attn_mask_type == "causal"

    def attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **call_kwargs: Any) -> torch.Tensor:
        """Run dense or varlen FA4.

        Args:
            q: ``[B, S, H, D]`` (dense) or ``[T, H, D]`` (varlen), fp16/bf16 on CUDA.
            k: ``[B, S, Hkv, D]`` or ``[T, Hkv, D]``.
            v: like ``k`` with head dim ``Dv``.
            **call_kwargs: ``causal``, ``window_size`` (kernel convention:
                distances excluding the current token), ``softcap``,
                ``learnable_sink`` (``[H]``), ``cu_seqlens_q``/``cu_seqlens_kv``
                (int32 ``[docs + 1]``), ``max_seqlen_q``/``max_seqlen_kv`` (int),
                ``packed_token_indices`` (int64 ``[T]`` into ``B * S``) and
                ``_fa4_padded_output_shape`` ``(B, S, H, Dv)``.

        Returns:
            ``[B, S, H, Dv]`` (dense, or varlen restored with zeros at excluded
            tokens) or ``[T, H, Dv]`` (varlen without a padded shape). Never
            aliases q, k or v.
        """
        unexpected = call_kwargs.keys() - _FA4_CALL_KWARGS
        if unexpected:
            raise TypeError(f"Unsupported FA4 attention kwargs: {sorted(unexpected)}")
        common: dict[str, Any] = {
            "softmax_scale": softmax_scale,
            "causal": bool(call_kwargs.get("causal", default_causal)),
            "window_size": call_kwargs.get("window_size", (None, None)),
        }
        # FA4's SM100/SM110 dedicated head-dim-256 forward kernel has no local attention.
        if (
            q.shape[-1] == 256
            and v.shape[-1] == 256
            and any(bound is not None for bound in common["window_size"])
            and q.is_cuda
            and torch.cuda.get_device_capability(q.device)[0] in (10, 11)
        ):
            raise _bad(
                "fa4", "window_size", f"{common['window_size']} with head_dim 256 on SM100/SM110",
                "no window for this head dim on this GPU", "Use attn_impl='sdpa' for this window.",
            )
        for option in ("softcap", "learnable_sink"):
            if call_kwargs.get(option) is not None:
                common[option] = call_kwargs[option]
        cu_seqlens_q = call_kwargs.get("cu_seqlens_q")
        if cu_seqlens_q is None:
            output, _lse = flash_attn_func(q, k, v, **common)
            return output
        max_seqlen_q = call_kwargs.get("max_seqlen_q")
        output, _lse = flash_attn_varlen_func(
            q,
            k,
            v,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=call_kwargs.get("cu_seqlens_kv", cu_seqlens_q),
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=call_kwargs.get("max_seqlen_kv", max_seqlen_q),
            **common,
        )
        padded_shape = call_kwargs.get(_FA4_PADDED_SHAPE)
        if padded_shape is None:
            return output
        indices = call_kwargs.get(fields.PACKED_TOKEN_INDICES)
        if indices is None:
            return output.reshape(padded_shape)
        padded = output.new_zeros((padded_shape[0] * padded_shape[1], *output.shape[1:]))
        return padded.index_copy(0, indices, output).reshape(padded_shape)

    return attn_func


# =====================================================================================
# preprocess
# =====================================================================================


def preprocess_args_and_kwargs_for_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    attn_impl: str,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Put q/k/v in the backend layout and build the callable's keyword arguments.

    Args:
        q: ``[B, S, H, D]`` (BSHD) or ``[T, H, D]`` (THD), float.
        k: ``[B, S, Hkv, D]`` or ``[T, Hkv, D]``.
        v: like ``k`` with value head dim ``Dv``.
        attention_mask: None; ``[B, S]`` padding mask (bool or 0/1, 1 = valid)
            or indexed document ids (int, values > 1 somewhere, 0 = excluded);
            or an explicit ``[B, 1, S, S]`` mask (SDPA only). TE accepts only a
            right-padded binary ``[B, S]`` mask; packed TE needs None.
        attn_impl: ``"sdpa"``, ``"fa4"`` or ``"te"``.
        **kwargs: backend metadata:

            * ``window_size``: ``(left, right)``; SDPA/FA4 ``left`` counts
              visible keys including the current token (None/negative =
              unbounded, 0 = error); TE distances are forwarded unchanged
              (default ``(-1, 0)``).
            * FA4 packed: ``cu_seqlens`` int32 ``[D + 1]``, ``packed_token_indices``
              int ``[T]`` into ``B * S``, ``max_seqlen`` int (flat, see
              ``flatten_packed_sequence_metadata``); ``softcap``, ``learnable_sink``.
            * TE packed (THD q/k/v): ``cu_seqlens`` int32 ``[D + 1]``, optional
              ``cu_seqlens_padded`` (same shape, int32), ``max_seqlen`` int; or
              the legacy ``cu_seqlens_q``/``cu_seqlens_kv`` (+ ``_padded``,
              ``max_seqlen_q``/``max_seqlen_kv``).
            * SDPA THD: ``cu_seqlens`` ``[D + 1]`` (+ optional ``cu_seqlens_padded``).

    Returns:
        ``(q, k, v, attn_kwargs)``: SDPA transposes to ``[B, H, S, D]`` (THD:
        ``[H, T, D]``; contiguous copies, except transposed views for packed
        input, whose callable gathers tokens itself); FA4 keeps BSHD, or
        gathers packed input to ``[T, H, D]`` (the callable restores
        ``[B, S, H, Dv]``); TE keeps its input layout. ``attn_kwargs`` holds
        tensors (masks int64/bool/int32 offsets) and Python scalars only.

    Raises:
        ValueError: a layout the selected backend cannot consume (the message
            names the argument, what was seen and what was expected), or an
            unknown ``attn_impl``.
    """
    if attn_impl not in ATTN_IMPLEMENTATIONS:
        raise _unknown_impl(attn_impl)
    _check_qkv(q, k, v, attn_impl)
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise _bad(attn_impl, fields.ATTENTION_MASK, type(attention_mask).__name__, "a torch.Tensor or None")
    if attn_impl == "te":
        return _preprocess_te(q, k, v, attention_mask, kwargs)
    if attn_impl == "fa4":
        return _preprocess_fa4(q, k, v, attention_mask, kwargs)
    return _preprocess_sdpa(q, k, v, attention_mask, kwargs)


def _preprocess_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    left, right = _normalize_window(kwargs.get("window_size", (-1, 0)), "sdpa")
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
                raise _bad(
                    "sdpa", fields.ATTENTION_MASK, f"shape {_shape(attention_mask)}",
                    f"[batch={q.shape[0]}, sequence>={kv_len}] (padding mask or document ids)",
                )
            kind, has_padding_mask = _classify_2d_mask(attention_mask, "sdpa")
            if kind == "indexed":
                if attention_mask.shape[1] != kv_len or q_len != kv_len:
                    raise _bad(
                        "sdpa", fields.ATTENTION_MASK, f"document ids of shape {_shape(attention_mask)} with q length "
                        f"{q_len} and k length {kv_len}", "[batch, sequence] with equal q and k lengths",
                    )
                attn_kwargs[_SDPA_DOC_IDS] = attention_mask.to(device=q.device, dtype=torch.long)
                attn_kwargs[_SDPA_WINDOW] = left
                attn_kwargs["is_causal"] = False
                # Views, not copies: the packed path gathers tokens from BSHD memory directly.
                return q, k, v, attn_kwargs
            key_mask = attention_mask.to(device=q.device, dtype=torch.bool)
        elif attention_mask.ndim == 4:
            b, h = attention_mask.shape[:2]
            if b not in (1, q.shape[0]) or h not in (1, q.shape[1]) or attention_mask.shape[2:] != (q_len, kv_len):
                raise _bad(
                    "sdpa", fields.ATTENTION_MASK, f"shape {_shape(attention_mask)}",
                    f"an explicit mask broadcastable to [{q.shape[0]}, {q.shape[1]}, {q_len}, {kv_len}]",
                )
            if attention_mask.dtype != torch.bool and not attention_mask.dtype.is_floating_point:
                raise _bad("sdpa", fields.ATTENTION_MASK, f"a 4D mask of dtype {attention_mask.dtype}",
                           "bool (True = attend) or an additive float mask")
            explicit_mask = attention_mask.to(device=q.device)
        else:
            raise _bad(
                "sdpa", fields.ATTENTION_MASK, f"shape {_shape(attention_mask)}",
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
        raise _bad("sdpa", fields.ATTENTION_MASK, f"shape {_shape(attention_mask)} with THD q {_shape(q)}",
                   "None (THD documents come from cu_seqlens)")
    cu_seqlens = kwargs.get(fields.CU_SEQLENS)
    if cu_seqlens is None:
        raise _bad("sdpa", fields.CU_SEQLENS, "None with THD q " + str(_shape(q)),
                   "a 1-D [documents + 1] tensor describing the packed stream")
    if k.shape[0] != q.shape[0]:
        raise _bad("sdpa", "k", f"{k.shape[0]} tokens", f"q's {q.shape[0]} tokens (packed self-attention)")
    cu_seqlens = _check_cu_seqlens(cu_seqlens, "sdpa", fields.CU_SEQLENS, dtype=None)
    padded = kwargs.get(_CU_SEQLENS_PADDED)
    if padded is not None:
        padded = _check_cu_seqlens(padded, "sdpa", "cu_seqlens_padded", dtype=None)
        if padded.shape != cu_seqlens.shape:
            raise _bad(
                "sdpa", "cu_seqlens_padded", f"shape {_shape(padded)}", f"cu_seqlens' shape {_shape(cu_seqlens)}"
            )
    doc_ids = _thd_document_ids(cu_seqlens.to(q.device), padded, q.shape[0])
    attn_kwargs = {_SDPA_DOC_IDS: doc_ids, _SDPA_WINDOW: left, "is_causal": False}
    return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_kwargs


def _preprocess_fa4(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    thd_hint = (
        "Native FA4 consumes BSHD plus gathered-token metadata; pre-packed THD is unsupported (use NEAT packing)."
    )
    if q.ndim != 4:
        raise _bad("fa4", "q", f"THD shape {_shape(q)}", "BSHD [batch, sequence, heads, head_dim]", thd_hint)
    if kwargs.get(fields.QKV_FORMAT) == "thd":
        raise _bad("fa4", fields.QKV_FORMAT, "'thd'", "'bshd' (or absent)", thd_hint)
    if kwargs.get(_CU_SEQLENS_PADDED) is not None:
        raise _bad("fa4", "cu_seqlens_padded", "a tensor (physical THD offsets)", "None", thd_hint)
    if attention_mask is not None and attention_mask.ndim != 2:
        raise _bad(
            "fa4", fields.ATTENTION_MASK, f"shape {_shape(attention_mask)}",
            "None or a [batch, sequence] mask (FA4 has no dense-mask entry point, even with cu_seqlens)",
            "Use attn_impl='sdpa' or 'te' for explicit masks.",
        )
    attn_kwargs: dict[str, Any] = {"causal": True}
    left, right = _normalize_window(kwargs.get("window_size", (-1, 0)), "fa4")
    # The kernel's left window excludes the current token; ours includes it.
    attn_kwargs["window_size"] = (None if left is None else left - 1, right)
    for option in ("softcap", "learnable_sink"):
        if kwargs.get(option) is not None:
            attn_kwargs[option] = kwargs[option]

    cu_seqlens = kwargs.get(fields.CU_SEQLENS)
    indices = kwargs.get(fields.PACKED_TOKEN_INDICES)
    max_seqlen = kwargs.get(fields.MAX_SEQLEN)
    if cu_seqlens is None and indices is not None:
        raise _bad("fa4", fields.PACKED_TOKEN_INDICES, "a tensor without cu_seqlens", "cu_seqlens and max_seqlen with it")
    if cu_seqlens is None and attention_mask is not None:
        if attention_mask.shape != q.shape[:2]:
            raise _bad(
                "fa4", fields.ATTENTION_MASK, f"shape {_shape(attention_mask)}", f"[batch, sequence] = {list(q.shape[:2])}"
            )
        if attention_mask.numel() == 0:
            raise _bad("fa4", fields.ATTENTION_MASK, "an empty mask", "at least one valid token")
        kind, _ = _classify_2d_mask(attention_mask, "fa4")
        if kind == "indexed":
            raise _bad(
                "fa4", fields.ATTENTION_MASK, "indexed document ids without packed metadata",
                "cu_seqlens, packed_token_indices and max_seqlen from the dataset", f"Then {_FLATTEN_HINT}.",
            )
        valid = attention_mask.to(dtype=torch.bool, device=q.device)
        seqlens = valid.sum(dim=-1)
        seqlens = seqlens[seqlens > 0]
        if seqlens.numel() == 0:
            raise _bad("fa4", fields.ATTENTION_MASK, "no valid token", "at least one valid token")
        indices = torch.nonzero(valid.flatten(), as_tuple=False).flatten()
        cu_seqlens = tF.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
        max_seqlen = int(seqlens.max().item())
    if cu_seqlens is not None:
        cu_seqlens = _check_cu_seqlens(cu_seqlens, "fa4", fields.CU_SEQLENS)
        if indices is not None:
            if not isinstance(indices, torch.Tensor) or indices.ndim != 1:
                seen = f"shape {_shape(indices)}" if isinstance(indices, torch.Tensor) else type(indices).__name__
                hint = f"Unflattened packed metadata: {_FLATTEN_HINT}." if isinstance(indices, torch.Tensor) else ""
                raise _bad(
                    "fa4", fields.PACKED_TOKEN_INDICES, seen, "a flat [tokens] index tensor into batch * sequence", hint
                )
            if indices.dtype.is_floating_point or indices.dtype == torch.bool:
                raise _bad("fa4", fields.PACKED_TOKEN_INDICES, f"dtype {indices.dtype}", "an integer dtype (int64)")
        if max_seqlen is None:
            raise _bad("fa4", fields.MAX_SEQLEN, "None with cu_seqlens", "the int length of the longest document")
        max_seqlen = _as_int(max_seqlen, "fa4", fields.MAX_SEQLEN)
        if k.shape[:2] != q.shape[:2]:
            raise _bad("fa4", "k", f"shape {_shape(k)}", f"q's [batch, sequence] {list(q.shape[:2])} for packed input")
        attn_kwargs["cu_seqlens_q"] = cu_seqlens
        attn_kwargs["cu_seqlens_kv"] = cu_seqlens
        attn_kwargs["max_seqlen_q"] = max_seqlen
        attn_kwargs["max_seqlen_kv"] = max_seqlen
        padded_output_shape = (*q.shape[:-1], v.shape[-1])
        flat_q = q.reshape(-1, *q.shape[2:])
        flat_k = k.reshape(-1, *k.shape[2:])
        flat_v = v.reshape(-1, *v.shape[2:])
        if indices is None:
            q, k, v = flat_q, flat_k, flat_v
        else:
            indices = indices.to(device=q.device, dtype=torch.long)
            q = flat_q.index_select(0, indices)
            k = flat_k.index_select(0, indices)
            v = flat_v.index_select(0, indices)
            attn_kwargs[fields.PACKED_TOKEN_INDICES] = indices
        attn_kwargs[_FA4_PADDED_SHAPE] = padded_output_shape
    elif kwargs.get("cu_seqlens_q") is not None or kwargs.get("cu_seqlens_kv") is not None:
        raise _bad(
            "fa4", "cu_seqlens_q/cu_seqlens_kv", "physical varlen offsets with BSHD q",
            "packed metadata as cu_seqlens + packed_token_indices + max_seqlen", thd_hint,
        )
    return q, k, v, attn_kwargs


def _preprocess_te(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    attn_kwargs: dict[str, Any] = {"window_size": kwargs.get("window_size", (-1, 0))}
    cu_seqlens = kwargs.get(fields.CU_SEQLENS)
    if attention_mask is not None:
        if attention_mask.ndim != 2:
            raise _bad(
                "te", fields.ATTENTION_MASK, f"shape {_shape(attention_mask)}", "a 2D [batch, sequence] padding mask",
                "For packed sequences, use THD with cu_seqlens and attention_mask=None.",
            )
        if q.ndim != 4 or attention_mask.shape != q.shape[:2]:
            raise _bad("te", fields.ATTENTION_MASK, f"shape {_shape(attention_mask)} with q {_shape(q)}",
                       "BSHD q with a [batch, sequence] mask of the same leading shape")
        if cu_seqlens is not None:
            raise _bad("te", fields.ATTENTION_MASK, "a mask together with cu_seqlens", "None for packed THD input")
        kind, _ = _classify_2d_mask(attention_mask, "te")
        if kind == "indexed":
            raise _bad(
                "te", fields.ATTENTION_MASK, "indexed document ids", "a binary [batch, sequence] padding mask",
                "For packed documents, use THD q/k/v with cu_seqlens (+ cu_seqlens_padded) and attention_mask=None.",
            )
        valid = attention_mask.to(torch.bool)
        if valid.shape[1] > 1 and bool((valid[:, 1:] & ~valid[:, :-1]).any().item()):
            raise _bad("te", fields.ATTENTION_MASK, "a valid token after padding", "a right-padded mask (TE derives "
                       "per-row lengths from it)")
        attn_kwargs["attn_mask_type"] = "padding_causal"
        attn_kwargs["attention_mask"] = valid.logical_not().unsqueeze(1).unsqueeze(2)
        return q, k, v, attn_kwargs
    if cu_seqlens is not None:
        if q.ndim != 3:
            raise _bad("te", "q", f"BSHD shape {_shape(q)} with cu_seqlens", "THD [tokens, heads, head_dim]")
        cu_seqlens = _check_cu_seqlens(cu_seqlens, "te", fields.CU_SEQLENS)
        padded = kwargs.get(_CU_SEQLENS_PADDED)
        max_seqlen = kwargs.get(fields.MAX_SEQLEN)
        if max_seqlen is None:
            raise _bad("te", fields.MAX_SEQLEN, "None with cu_seqlens", "the int length of the longest document")
        max_seqlen = _as_int(max_seqlen, "te", fields.MAX_SEQLEN)
        attn_kwargs.update(
            {
                "qkv_format": "thd",
                "attn_mask_type": "padding_causal",
                "cu_seqlens_q": cu_seqlens,
                "cu_seqlens_kv": cu_seqlens,
            }
        )
        if padded is not None:
            padded = _check_cu_seqlens(padded, "te", "cu_seqlens_padded")
            if padded.shape != cu_seqlens.shape:
                raise _bad(
                    "te", "cu_seqlens_padded", f"shape {_shape(padded)}", f"cu_seqlens' shape {_shape(cu_seqlens)}"
                )
            attn_kwargs.update(
                {"cu_seqlens_q_padded": padded, "cu_seqlens_kv_padded": padded, "pad_between_seqs": True}
            )
        attn_kwargs["max_seqlen_q"] = max_seqlen
        attn_kwargs["max_seqlen_kv"] = max_seqlen
        return q, k, v, attn_kwargs
    cu_q, cu_kv = kwargs.get("cu_seqlens_q"), kwargs.get("cu_seqlens_kv")
    if cu_q is not None or cu_kv is not None:
        if cu_q is None or cu_kv is None:
            raise _bad("te", "cu_seqlens_q/cu_seqlens_kv", "only one of the two", "both (or cu_seqlens)")
        if q.ndim != 3:
            raise _bad("te", "q", f"BSHD shape {_shape(q)} with cu_seqlens_q", "THD [tokens, heads, head_dim]")
        attn_kwargs.update(
            {
                "qkv_format": "thd",
                "attn_mask_type": "padding_causal",
                "cu_seqlens_q": _check_cu_seqlens(cu_q, "te", "cu_seqlens_q"),
                "cu_seqlens_kv": _check_cu_seqlens(cu_kv, "te", "cu_seqlens_kv"),
            }
        )
        if kwargs.get("cu_seqlens_q_padded") is not None:
            attn_kwargs["cu_seqlens_q_padded"] = _check_cu_seqlens(
                kwargs["cu_seqlens_q_padded"], "te", "cu_seqlens_q_padded"
            )
            attn_kwargs["pad_between_seqs"] = True
        if kwargs.get("cu_seqlens_kv_padded") is not None:
            attn_kwargs["cu_seqlens_kv_padded"] = _check_cu_seqlens(
                kwargs["cu_seqlens_kv_padded"], "te", "cu_seqlens_kv_padded"
            )
        for name in ("max_seqlen_q", "max_seqlen_kv"):
            if kwargs.get(name) is not None:
                attn_kwargs[name] = _as_int(kwargs[name], "te", name)
        return q, k, v, attn_kwargs
    if q.ndim == 3:
        raise _bad("te", fields.CU_SEQLENS, f"None with THD q {_shape(q)}", "int32 [documents + 1] offsets and max_seqlen")
    return q, k, v, attn_kwargs


# =====================================================================================
# postprocess
# =====================================================================================


def postprocess_output_for_attn(x: torch.Tensor, attn_impl: str) -> torch.Tensor:
    """Bring the callable's output back to the model layout.

    Args:
        x: SDPA ``[B, H, S, Dv]`` -> ``[B, S, H, Dv]``; SDPA THD ``[H, T, Dv]``
            -> ``[T, H, Dv]`` (contiguous). FA4 and TE outputs are returned as is.
        attn_impl: ``"sdpa"``, ``"fa4"`` or ``"te"``.

    Raises:
        ValueError: unknown ``attn_impl`` or an SDPA output of another rank.
    """
    if attn_impl == "sdpa":
        if x.ndim == 4:
            return x.transpose(1, 2).contiguous()
        if x.ndim == 3:
            return x.transpose(0, 1).contiguous()
        raise _bad("sdpa", "x", f"shape {_shape(x)}", "[batch, heads, sequence, head_dim] or [heads, tokens, head_dim]")
    if attn_impl in ("fa4", "te"):
        return x
    raise _unknown_impl(attn_impl)
