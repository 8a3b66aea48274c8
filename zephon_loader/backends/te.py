"""``te``: Transformer Engine's ``DotProductAttention`` (``transformer_engine.pytorch``; follows 2.20.2).

Translation of AutoModel 0.7.0's TE branch: a right-padded binary ``[B, S]``
mask becomes TE's ``[B, 1, 1, S]`` bool padding mask (True = masked) with
``padding_causal``; packed THD input takes int32 offsets (``cu_seqlens``, or
the legacy ``cu_seqlens_q``/``cu_seqlens_kv``), optionally with physical
``*_padded`` offsets. Windows are TE's own distances (TE's ``(W, 0)`` shows
``W + 1`` keys), forwarded unchanged except for the container.

What TE 2.20 needs and does not check, or checks with an ``assert``, is done
here before the module runs:

* every tensor on the query's device (the loader yields pinned CPU
  metadata): the padding mask and all offsets are moved, without blocking
  when pinned;
* windows as tuples of ints, at initialization and per call (TE's
  ``check_set_window_size`` compares with tuple literals, so a YAML/JSON
  ``[-1, 0]`` fails its assert);
* ``max_seqlen`` covering the longest document of its offsets;
* ``pad_between_seqs`` set from the offsets: True only when some document
  starts at a padded offset other than its real one (TE turns its faster
  FlashAttention backends off when it is True, and switches it on by itself
  whenever padded offsets are passed). Tail padding after the last document
  does not count. One host read of the offsets, free for CPU tensors.
"""

from __future__ import annotations

from typing import Any, Callable, Final, cast

import torch
from torch import nn

from zephon_loader import fields
from zephon_loader.backends._checks import (
    CU_SEQLENS_PADDED,
    bad,
    check_cu_seqlens,
    check_max_seqlen,
    classify_2d_mask,
    shape,
    to_device,
    window_pair,
)
from zephon_loader.backends._imports import import_optional

#: ``transformer_engine.pytorch.DotProductAttention.__init__`` keywords we pass (TE 2.20).
TE_INIT_KWARGS: Final[frozenset[str]] = frozenset(
    {"num_attention_heads", "kv_channels", "attn_mask_type", "qkv_format", "softmax_scale", "num_gqa_groups"}
)
#: ``DotProductAttention.forward`` keywords :func:`preprocess_te` emits (TE 2.20).
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
#: TE's ``DotProductAttention`` is built from source against the installed torch (its documented way).
_INSTALL: Final = "pip install --no-build-isolation 'zephon-loader[te]'"


def import_dot_product_attention() -> type[nn.Module]:
    """Return ``transformer_engine.pytorch.DotProductAttention`` (lazy; ImportError if unusable)."""
    te = import_optional("transformer_engine.pytorch", "te", "NVIDIA Transformer Engine", _INSTALL)
    cls = getattr(te, "DotProductAttention", None)
    if cls is None:
        raise ImportError(
            f"attn_impl='te': transformer_engine.pytorch has no DotProductAttention; install a supported "
            f"version with: {_INSTALL}"
        )
    return cast(type[nn.Module], cls)


def make_te_module(
    num_attention_heads: int,
    num_qk_channels: int,
    num_v_channels: int,
    softmax_scale: float,
    attn_mask_type: str,
    qkv_format: str,
    num_gqa_groups: int | None,
    init_kwargs: dict[str, Any],
) -> tuple[nn.Module, Callable[..., torch.Tensor]]:
    """Build TE's ``DotProductAttention`` and return ``(module, module.__call__)``.

    ``init_kwargs`` are extra ``DotProductAttention`` keywords (e.g.
    ``attention_dropout``), forwarded as given except ``window_size``, which
    becomes a tuple of ints (TE asserts on a list).
    """
    extra = dict(init_kwargs)
    if extra.get("window_size") is not None:
        extra["window_size"] = window_pair(extra["window_size"], "te")
    dot_product_attention = import_dot_product_attention()
    module = dot_product_attention(
        num_attention_heads=num_attention_heads,
        kv_channels=(num_qk_channels, num_v_channels),
        attn_mask_type=attn_mask_type,
        qkv_format=qkv_format,
        softmax_scale=softmax_scale,
        num_gqa_groups=num_gqa_groups,
        **extra,
    )
    return module, module.__call__


def preprocess_te(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """TE keywords for the module's forward; q/k/v are returned unchanged.

    Every tensor in the returned keywords is on q's device: the bool
    ``attention_mask`` ``[B, 1, 1, S]`` (True = masked) or int32 offsets
    ``[docs + 1]``. ``window_size`` is a tuple of ints (default ``(-1, 0)``).
    """
    window = kwargs.get("window_size")
    attn_kwargs: dict[str, Any] = {"window_size": (-1, 0) if window is None else window_pair(window, "te")}
    cu_seqlens = kwargs.get(fields.CU_SEQLENS)
    if attention_mask is not None:
        return q, k, v, attn_kwargs | _padding_mask_kwargs(q, attention_mask, cu_seqlens)
    if cu_seqlens is not None:
        return q, k, v, attn_kwargs | _packed_kwargs(q, cu_seqlens, kwargs)
    cu_q, cu_kv = kwargs.get("cu_seqlens_q"), kwargs.get("cu_seqlens_kv")
    if cu_q is not None or cu_kv is not None:
        return q, k, v, attn_kwargs | _varlen_kwargs(q, cu_q, cu_kv, kwargs)
    if q.ndim == 3:
        raise bad("te", fields.CU_SEQLENS, f"None with THD q {shape(q)}", "int32 [documents + 1] offsets and max_seqlen")
    return q, k, v, attn_kwargs


def _padding_mask_kwargs(q: torch.Tensor, attention_mask: torch.Tensor, cu_seqlens: Any) -> dict[str, Any]:
    """BSHD with a right-padded binary ``[B, S]`` mask -> TE's ``padding_causal`` with a ``[B, 1, 1, S]`` mask."""
    if attention_mask.ndim != 2:
        raise bad(
            "te", fields.ATTENTION_MASK, f"shape {shape(attention_mask)}", "a 2D [batch, sequence] padding mask",
            "For packed sequences, use THD with cu_seqlens and attention_mask=None.",
        )
    if q.ndim != 4 or attention_mask.shape != q.shape[:2]:
        raise bad("te", fields.ATTENTION_MASK, f"shape {shape(attention_mask)} with q {shape(q)}",
                  "BSHD q with a [batch, sequence] mask of the same leading shape")
    if cu_seqlens is not None:
        raise bad("te", fields.ATTENTION_MASK, "a mask together with cu_seqlens", "None for packed THD input")
    kind, _ = classify_2d_mask(attention_mask, "te")
    if kind == "indexed":
        raise bad(
            "te", fields.ATTENTION_MASK, "indexed document ids", "a binary [batch, sequence] padding mask",
            "For packed documents, use THD q/k/v with cu_seqlens (+ cu_seqlens_padded) and attention_mask=None.",
        )
    valid = attention_mask.to(torch.bool)
    if valid.shape[1] > 1 and bool((valid[:, 1:] & ~valid[:, :-1]).any().item()):
        raise bad("te", fields.ATTENTION_MASK, "a valid token after padding", "a right-padded mask (TE derives "
                  "per-row lengths from it)")
    masked = to_device(valid.logical_not().unsqueeze(1).unsqueeze(2), q.device)
    return {"attn_mask_type": "padding_causal", "attention_mask": masked}


def _packed_kwargs(q: torch.Tensor, cu_seqlens: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """THD with ``cu_seqlens`` (+ ``cu_seqlens_padded``) and ``max_seqlen``: one offsets tensor for q and kv."""
    if q.ndim != 3:
        raise bad("te", "q", f"BSHD shape {shape(q)} with cu_seqlens", "THD [tokens, heads, head_dim]")
    cu_seqlens = check_cu_seqlens(cu_seqlens, "te", fields.CU_SEQLENS)
    max_seqlen = kwargs.get(fields.MAX_SEQLEN)
    if max_seqlen is None:
        raise bad("te", fields.MAX_SEQLEN, "None with cu_seqlens", "the int length of the longest document")
    max_seqlen = check_max_seqlen(max_seqlen, cu_seqlens, "te", fields.MAX_SEQLEN, fields.CU_SEQLENS)
    offsets = to_device(cu_seqlens, q.device)
    out: dict[str, Any] = {
        "qkv_format": "thd",
        "attn_mask_type": "padding_causal",
        "cu_seqlens_q": offsets,
        "cu_seqlens_kv": offsets,
    }
    padded = kwargs.get(CU_SEQLENS_PADDED)
    if padded is not None:
        padded = _check_padded(padded, cu_seqlens, "cu_seqlens_padded", fields.CU_SEQLENS)
        padded_offsets = to_device(padded, q.device)
        out.update(
            {
                "cu_seqlens_q_padded": padded_offsets,
                "cu_seqlens_kv_padded": padded_offsets,
                "pad_between_seqs": _pads_between(cu_seqlens, padded),
            }
        )
    out["max_seqlen_q"] = max_seqlen
    out["max_seqlen_kv"] = max_seqlen
    return out


def _varlen_kwargs(q: torch.Tensor, cu_q: Any, cu_kv: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """THD with TE's own ``cu_seqlens_q``/``cu_seqlens_kv`` (+ ``_padded``, ``max_seqlen_q``/``_kv``)."""
    if cu_q is None or cu_kv is None:
        raise bad("te", "cu_seqlens_q/cu_seqlens_kv", "only one of the two", "both (or cu_seqlens)")
    if q.ndim != 3:
        raise bad("te", "q", f"BSHD shape {shape(q)} with cu_seqlens_q", "THD [tokens, heads, head_dim]")
    offsets = {
        "q": check_cu_seqlens(cu_q, "te", "cu_seqlens_q"),
        "kv": check_cu_seqlens(cu_kv, "te", "cu_seqlens_kv"),
    }
    out: dict[str, Any] = {
        "qkv_format": "thd",
        "attn_mask_type": "padding_causal",
        "cu_seqlens_q": to_device(offsets["q"], q.device),
        "cu_seqlens_kv": to_device(offsets["kv"], q.device),
    }
    pads: list[bool] = []
    for side, cu in offsets.items():
        name = f"cu_seqlens_{side}"
        if kwargs.get(f"{name}_padded") is not None:
            padded = _check_padded(kwargs[f"{name}_padded"], cu, f"{name}_padded", name)
            out[f"{name}_padded"] = to_device(padded, q.device)
            pads.append(_pads_between(cu, padded))
        max_name = f"max_seqlen_{side}"
        if kwargs.get(max_name) is not None:
            out[max_name] = check_max_seqlen(kwargs[max_name], cu, "te", max_name, name)
    if pads:
        out["pad_between_seqs"] = any(pads)
    return out


def _check_padded(padded: Any, cu_seqlens: torch.Tensor, argument: str, offsets: str) -> torch.Tensor:
    """Validate physical offsets: int32, the shape of the real ``offsets``."""
    padded = check_cu_seqlens(padded, "te", argument)
    if padded.shape != cu_seqlens.shape:
        raise bad("te", argument, f"shape {shape(padded)}", f"{offsets}' shape {shape(cu_seqlens)}")
    return padded


def _pads_between(cu_seqlens: torch.Tensor, padded: torch.Tensor) -> bool:
    """Whether some document starts at another padded offset than its real one (tail padding aside)."""
    starts = to_device(padded[:-1], cu_seqlens.device)
    return bool((starts != cu_seqlens[:-1]).any().item())
