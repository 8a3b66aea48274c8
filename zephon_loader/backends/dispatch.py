"""The three public functions: check what every backend shares, then hand over to ``sdpa``, ``fa4`` or ``te``."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from zephon_loader import fields
from zephon_loader.backends import fa4, sdpa, te
from zephon_loader.backends._checks import ATTN_IMPLEMENTATIONS, bad, check_qkv, unknown_impl


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
            (e.g. ``attention_dropout``; a ``window_size`` list becomes a
            tuple). FA4: none.

    Returns:
        ``(module, attn_func)``: the TE module (``None`` for SDPA/FA4) and a
        callable ``attn_func(q, k, v, **attn_kwargs) -> Tensor`` taking the
        output of :func:`preprocess_args_and_kwargs_for_attn`. SDPA returns
        ``[B, H, S, Dv]`` (``[H, T, Dv]`` for THD); FA4 returns BSHD
        ``[B, S, H, Dv]`` (zeros at excluded tokens) or ``[T, H, Dv]``; TE
        returns its own ``[..., H * Dv]`` output.

    Raises:
        ValueError: unknown ``attn_impl``; FA4 with ``qkv_format != "bshd"``;
            a malformed TE ``window_size``.
        TypeError: unsupported SDPA/FA4 keyword arguments.
        ImportError: TE or FA4 missing or unusable (with the install command).
    """
    if attn_impl == "te":
        return te.make_te_module(
            num_attention_heads, num_qk_channels, num_v_channels, softmax_scale, attn_mask_type, qkv_format,
            num_gqa_groups, kwargs,
        )
    if attn_impl == "sdpa":
        return None, sdpa.make_sdpa_func(softmax_scale, attn_mask_type, num_gqa_groups, kwargs)
    if attn_impl == "fa4":
        return None, fa4.make_fa4_func(softmax_scale, attn_mask_type, qkv_format, kwargs)
    raise unknown_impl(attn_impl)


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
            right-padded binary ``[B, S]`` mask; packed TE needs None. Any
            device: masks are read where they live and moved to q's device.
        attn_impl: ``"sdpa"``, ``"fa4"`` or ``"te"``.
        **kwargs: backend metadata, on any device (CPU, pinned, or q's):

            * ``window_size``: ``(left, right)`` (a list is accepted); SDPA/FA4
              ``left`` counts visible keys including the current token
              (None/negative = unbounded, 0 = error); TE distances are
              forwarded unchanged (default ``(-1, 0)``).
            * FA4 packed: ``cu_seqlens`` int32 ``[D + 1]``, ``packed_token_indices``
              int ``[T]`` into ``B * S``, ``max_seqlen`` int >= the longest
              document (flat, see ``flatten_packed_sequence_metadata``);
              ``softcap`` (float >= 0), ``learnable_sink`` (``[H]``).
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
        tensors on q's device (masks int64/bool, int32 offsets) and Python
        scalars and tuples only.

    Raises:
        ValueError: a layout the selected backend cannot consume (the message
            names the argument, what was seen and what was expected), or an
            unknown ``attn_impl``.
    """
    if attn_impl not in ATTN_IMPLEMENTATIONS:
        raise unknown_impl(attn_impl)
    check_qkv(q, k, v, attn_impl)
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise bad(attn_impl, fields.ATTENTION_MASK, type(attention_mask).__name__, "a torch.Tensor or None")
    if attn_impl == "te":
        return te.preprocess_te(q, k, v, attention_mask, kwargs)
    if attn_impl == "fa4":
        return fa4.preprocess_fa4(q, k, v, attention_mask, kwargs)
    return sdpa.preprocess_sdpa(q, k, v, attention_mask, kwargs)


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
        return sdpa.postprocess_sdpa(x)
    if attn_impl in ("fa4", "te"):
        return x
    raise unknown_impl(attn_impl)
