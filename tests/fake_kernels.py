"""Pure-torch stand-ins for the real kernels, exactly as strict as they are.

* :class:`FakeFA4`: ``flash_attn.cute.flash_attn_func`` / ``flash_attn_varlen_func``
  of flash-attn-4 4.0.0b36, with the same parameter lists (``qv``,
  ``min_seqlen_k``, ``scheduler_metadata``, ... included; the GPU tests compare
  them with the installed kernel's).
* :class:`FakeDotProductAttention`: ``transformer_engine.pytorch.DotProductAttention``
  of Transformer Engine 2.20, same ``__init__``/``forward`` parameter lists.

"As strict as the real kernels" means: what the real one asserts, the fake
asserts (int32 contiguous offsets of shape ``[batch + 1]``, every tensor on the
query's device, ``learnable_sink`` shape and dtype, TE's tuple-only window
check); what the real one converts or silently accepts, the fake does too
(FA4 indexes the window pair and takes a list; neither checks ``max_seqlen``);
and no conversion the kernel does not do (the old fakes turned a TE window
list into a tuple). The one documented leniency: the real kernels take
fp16/bf16 on CUDA only, the fakes also fp32 on CPU so the CPU tests can
compare with an fp32 reference. Backward limits of FA4's kernels (SM90 GQA
needs ``head_dim == head_dim_v``; SM100/SM110's dedicated head-dim-256
backward has no local window and no sink) are raised during backward, as the
kernel does, for the arch named by ``FLASH_ATTENTION_ARCH``.

On the ``meta`` device the fakes check every argument (shapes, dtypes,
devices) and return empty outputs of the right shape: there are no values to
compute with. The tests use that to check device placement on a CPU-only
machine (q/k/v on ``meta``, the loader's metadata on CPU).
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any, Callable, Iterator
from unittest import mock

import torch
from torch import nn

from zephon_loader import backends


def flat(x: torch.Tensor) -> torch.Tensor:
    """``[B, S, H, D]`` -> ``[B*S, H, D]``."""
    return x.reshape(-1, *x.shape[2:])


def _doc_positions(starts: torch.Tensor, lengths: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per stream row: document index (-1 outside) and position inside it."""
    t = torch.arange(tokens, device=starts.device)
    doc = torch.searchsorted(starts, t, right=True) - 1
    inside = (doc >= 0) & (t < (starts + lengths)[doc.clamp_min(0)]) if starts.numel() else t < 0
    doc = torch.where(inside, doc, -1)
    return doc, torch.where(inside, t - starts[doc.clamp_min(0)], 0)


def _masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``[T, H, D]`` attention under a ``[T, T]`` bool mask; rows with no key give 0. Returns (out, lse[H, T])."""
    groups = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kr) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    logits = scores if sink is None else torch.cat([scores, sink.to(q.dtype)[:, None, None].expand(-1, q.shape[0], 1)], -1)
    lse = torch.logsumexp(logits, -1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, vr), lse


def _same_device(q: torch.Tensor, named: dict[str, Any]) -> None:
    """The real kernels reject tensors off the query's device (FA4 asserts CUDA; TE fails inside)."""
    for name, value in named.items():
        if isinstance(value, torch.Tensor):
            assert value.device == q.device, f"{name} is on {value.device}, q on {q.device}"


# =====================================================================================
# FlashAttention-4 4.0.0b36
# =====================================================================================


def _fa4_arch() -> int | None:
    """``FLASH_ATTENTION_ARCH`` as FA4 parses it (``sm_90a`` -> 90); the fakes have no device to ask."""
    override = os.environ.get("FLASH_ATTENTION_ARCH")
    if not override:
        return None
    match = re.match(r"^(?:sm_?|SM_?)?(\d+)(\d)([af]?)$", override)
    assert match is not None, f"Invalid arch format: {override}"
    return int(match.group(1)) * 10 + int(match.group(2))


def _fa4_resolve(causal: bool, left: int | None, right: int | None) -> tuple[bool, bool, int | None, int | None]:
    """``interface._resolve_causal_local_window``: (causal, local, left, right)."""
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    if left is not None or right is not None:
        if left is None and right == 0:
            return True, False, None, None
        return False, True, left, right
    return causal, False, left, right


class FakeFA4:
    """``flash_attn.cute`` 4.0.0b36 stand-in: ``flash_attn_varlen_func`` / ``flash_attn_func`` in pure torch.

    Semantics of ``interface._flash_attn_fwd``: ``causal`` forces the right
    window to 0; ``window_size=(left, right)`` are distances *excluding* the
    current token (key j visible from query i iff ``i - left <= j <= i + right``,
    None unbounded), positions local to each ``cu_seqlens`` document;
    ``softcap=0`` is off. Returns ``(out, lse)``.
    """

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def flash_attn_varlen_func(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        qv: torch.Tensor | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
        min_seqlen_k: int | None = None,
        seqused_q: torch.Tensor | None = None,
        seqused_k: torch.Tensor | None = None,
        gather_kv_indices: torch.Tensor | None = None,
        page_table: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int | None, int | None] = (None, None),
        learnable_sink: torch.Tensor | None = None,
        softcap: float = 0.0,
        num_splits: int = 1,
        pack_gqa: bool | None = None,
        deterministic: bool = False,
        score_mod: Callable | None = None,
        score_mod_bwd: Callable | None = None,
        mask_mod: Callable | None = None,
        block_sparse_tensors: Any = None,
        aux_tensors: list | None = None,
        aux_scalars: tuple | None = None,
        return_lse: bool = False,
        scheduler_metadata: Any = None,
        seqlen_k_per_split: int | None = None,
        disable_scheduler_metadata: bool = False,
        gather_bwd_recompute_p: bool = False,
        gather_bwd_token_chunk: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append({"kind": "varlen", "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
                           "max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k, "causal": causal,
                           "window_size": window_size, "softcap": softcap, "learnable_sink": learnable_sink,
                           "softmax_scale": softmax_scale, "devices": _devices(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                                              learnable_sink)})
        not_modelled = {"qv": qv, "min_seqlen_k": min_seqlen_k, "seqused_q": seqused_q, "seqused_k": seqused_k,
                        "gather_kv_indices": gather_kv_indices, "page_table": page_table, "score_mod": score_mod,
                        "mask_mod": mask_mod, "block_sparse_tensors": block_sparse_tensors,
                        "aux_tensors": aux_tensors, "scheduler_metadata": scheduler_metadata}
        assert all(value is None for value in not_modelled.values()), "fake FA4 models none of these arguments"
        assert q.ndim == k.ndim == v.ndim == 3, "varlen takes [total, heads, dim]"
        assert cu_seqlens_q is not None and cu_seqlens_k is not None, "the fake models cu_seqlens varlen only"
        self._check_common(q, k, v, window_size, learnable_sink, {"cu_seqlens_q": cu_seqlens_q,
                                                                   "cu_seqlens_k": cu_seqlens_k})
        batch = cu_seqlens_q.shape[0] - 1
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            assert cu.dtype == torch.int32, f"{name} must be int32"
            assert cu.shape == (batch + 1,), f"{name} must have shape (batch_size + 1,)"
            assert cu.stride(0) == 1, f"{name} must be contiguous"
        if q.device.type == "meta":
            return q.new_empty(*q.shape[:2], v.shape[-1]), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
        assert torch.equal(cu_seqlens_q, cu_seqlens_k) and q.shape[0] == k.shape[0], "self-attention only in this fake"
        cu = cu_seqlens_q.long()
        lengths = cu[1:] - cu[:-1]
        assert int(cu[-1]) <= q.shape[0]
        causal, _local, left, right = _fa4_resolve(causal, window_size[0], window_size[1])
        doc, pos = _doc_positions(cu[:-1], lengths, q.shape[0])
        allowed = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0)
        if causal:
            allowed &= pos[None, :] <= pos[:, None]
        if left is not None:
            allowed &= pos[None, :] >= pos[:, None] - left
        if right is not None:
            allowed &= pos[None, :] <= pos[:, None] + right
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        out, lse = _masked_attention(q, k, v, allowed, scale, softcap or None, learnable_sink)
        self._backward_limits(q, k, v, causal, window_size, learnable_sink, out)
        return out, lse

    def flash_attn_func(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        qv: torch.Tensor | None = None,
        gather_kv_indices: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int | None, int | None] = (None, None),
        learnable_sink: torch.Tensor | None = None,
        softcap: float = 0.0,
        num_splits: int = 1,
        pack_gqa: bool | None = None,
        deterministic: bool = False,
        score_mod: Callable | None = None,
        score_mod_bwd: Callable | None = None,
        mask_mod: Callable | None = None,
        aux_tensors: list | None = None,
        aux_scalars: tuple | None = None,
        block_sparse_tensors: Any = None,
        block_sparse_tensors_bwd: Any = None,
        return_lse: bool = False,
        gather_bwd_recompute_p: bool = False,
        gather_bwd_token_chunk: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        not_modelled = {"qv": qv, "gather_kv_indices": gather_kv_indices, "score_mod": score_mod,
                        "mask_mod": mask_mod, "aux_tensors": aux_tensors, "block_sparse_tensors": block_sparse_tensors}
        assert all(value is None for value in not_modelled.values()), "fake FA4 models none of these arguments"
        assert q.ndim == k.ndim == v.ndim == 4, "dense FA4 takes [batch, seqlen, heads, dim]"
        b, s = q.shape[:2]
        assert k.shape[:2] == v.shape[:2] == (b, s), "the fake models self-attention (seqlen_k == seqlen_q)"
        self._check_common(q, k, v, window_size, learnable_sink, {})
        if q.device.type == "meta":
            self.calls.append({"kind": "dense", "devices": _devices(q, k, v, learnable_sink)})
            return q.new_empty(b, s, q.shape[2], v.shape[-1]), q.new_empty(b, q.shape[2], s, dtype=torch.float32)
        cu = (torch.arange(b + 1, device=q.device) * s).to(torch.int32)
        out, lse = self.flash_attn_varlen_func(
            flat(q), flat(k), flat(v), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=s, max_seqlen_k=s,
            softmax_scale=softmax_scale, causal=causal, window_size=window_size, learnable_sink=learnable_sink,
            softcap=softcap,
        )
        self.calls[-1]["kind"] = "dense"
        return out.reshape(b, s, *out.shape[1:]), lse.reshape(q.shape[2], b, s).transpose(0, 1)

    @staticmethod
    def _check_common(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        window_size: Any,
        learnable_sink: torch.Tensor | None,
        offsets: dict[str, torch.Tensor],
    ) -> None:
        """What ``_flash_attn_fwd`` asserts for every call."""
        assert q.dtype == k.dtype == v.dtype, "q, k, v, and qv must have the same dtype"
        assert q.shape[-2] % k.shape[-2] == 0, "num_head must be divisible by num_head_kv"
        window_size[0], window_size[1]  # noqa: B018 - the kernel indexes the pair (a list works, a scalar fails)
        if learnable_sink is not None:
            assert learnable_sink.shape == (q.shape[-2],)
            assert learnable_sink.dtype in (torch.float16, torch.bfloat16, torch.float32), (
                "learnable_sink must be float16, bfloat16, or float32"
            )
        _same_device(q, {"k": k, "v": v, "learnable_sink": learnable_sink, **offsets})

    @staticmethod
    def _backward_limits(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        window_size: Any,
        sink: torch.Tensor | None,
        out: torch.Tensor,
    ) -> None:
        """The asserts FA4's backward kernels hit (``flash_bwd_sm90``, ``sm100_hd256_2cta_fmha_backward``)."""
        arch = _fa4_arch()
        if arch is None or not out.requires_grad:
            return
        reason = None
        if arch // 10 == 9 and q.shape[-2] != k.shape[-2] and q.shape[-1] != v.shape[-1]:
            reason = "GQA backward requires head_dim == head_dim_v"
        hd256 = arch // 10 in (10, 11) and q.shape[-1] == v.shape[-1] == 256
        if hd256 and os.environ.get("FLASH_ATTENTION_HD256_GENERIC_BWD", "0") != "1":
            if _fa4_resolve(causal, window_size[0], window_size[1])[1]:
                reason = "SM100 backward with head_dim=256 does not support local attention"
            elif sink is not None:
                reason = "SM100 backward with head_dim=256 does not support learnable_sink"
        if reason is not None:

            def fail(grad: torch.Tensor) -> torch.Tensor:
                raise AssertionError(reason)

            out.register_hook(fail)


def _devices(*tensors: torch.Tensor | None) -> list[torch.device]:
    return [t.device for t in tensors if t is not None]


# =====================================================================================
# Transformer Engine 2.20
# =====================================================================================


def check_set_window_size(attn_mask_type: str, window_size: Any = None) -> Any:
    """TE 2.20's ``utils.check_set_window_size``: compares with tuple literals, so a list fails its asserts."""
    if "causal" in attn_mask_type:
        if window_size is None:
            return (-1, 0)
        if window_size == (-1, -1) or (window_size[0] >= 0 and window_size[1] != 0):
            return (window_size[0], 0)
        if window_size != (-1, 0) and (window_size[0] < 0 or window_size[1] != 0):
            raise AssertionError("window_size should be (-1, 0) or (>=0, 0) for attn_mask_type=" + attn_mask_type)
        return window_size
    if attn_mask_type in ["no_mask", "padding", "arbitrary"]:
        if window_size is None or window_size == (-1, 0):
            return (-1, -1)
        if window_size != (-1, -1) and (window_size[0] < 0 or window_size[1] < 0):
            raise AssertionError("window_size should be (-1, -1) or (>=0, >=0) for attn_mask_type=" + attn_mask_type)
        return window_size
    raise AssertionError("Invalid attn_mask_type: " + attn_mask_type)


def _te_mask_type(mask_type: str) -> str:
    mask_type = mask_type.replace(",", "_")
    return "padding_causal" if mask_type == "causal_padding" else mask_type


class FakeDotProductAttention(nn.Module):
    """``transformer_engine.pytorch.DotProductAttention`` (TE 2.20) stand-in in pure torch.

    Semantics: ``qkv_format='thd'``: document i holds ``cu_seqlens_q[i+1] -
    cu_seqlens_q[i]`` rows starting at ``cu_seqlens_q_padded[i]`` when
    ``pad_between_seqs`` (else at ``cu_seqlens_q[i]``, as TE's FlashAttention
    backends read it); ``pad_between_seqs=None`` is TE's auto-detection (True
    whenever padded offsets are passed, unless they are the very same tensor
    objects). Rows outside every document are zero. ``'bshd'`` with a padding
    mask type: ``attention_mask`` ``[B, 1, 1, S]`` bool, True = masked; like the
    fused kernels only the per-row valid count is used (right padding). Causal
    masks are top-left; ``window_size=(l, r)`` shows keys ``i - l .. i + r``
    (-1 unbounded; causal forces r = 0). Output ``[T, H * Dv]`` or ``[B, S, H * Dv]``.
    """

    instances: list["FakeDotProductAttention"] = []

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int | tuple[int, int],
        num_gqa_groups: int | None = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        window_size: tuple[int, int] | None = None,
        bottom_right_diagonal: bool | None = None,
        softcap: float = 0.0,
        sequence_parallel: bool = False,
        tp_size: int = 1,
        get_rng_state_tracker: Callable | None = None,
        tp_group: Any = None,
        layer_number: int | None = None,
        attention_type: str = "self",
        cp_group: Any = None,
        cp_global_ranks: list[int] | None = None,
        cp_stream: Any = None,
        cp_comm_type: str = "p2p",
        softmax_scale: float | None = None,
        softmax_type: str = "vanilla",
        return_max_logit: bool | None = False,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.init_kwargs = dict(
            num_attention_heads=num_attention_heads, kv_channels=kv_channels, num_gqa_groups=num_gqa_groups,
            attention_dropout=attention_dropout, qkv_format=qkv_format, attn_mask_type=attn_mask_type,
            softmax_scale=softmax_scale, window_size=window_size,
        )
        self.heads = num_attention_heads
        self.qkv_format = qkv_format
        self.attn_mask_type = _te_mask_type(attn_mask_type)
        self.window_size = check_set_window_size(self.attn_mask_type, window_size)
        dim = kv_channels if isinstance(kv_channels, int) else kv_channels[0]
        self.softmax_scale = softmax_scale if softmax_scale is not None else dim**-0.5
        self.calls: list[dict[str, Any]] = []
        FakeDotProductAttention.instances.append(self)

    def forward(
        self,
        query_layer: torch.Tensor | None = None,
        key_layer: torch.Tensor | None = None,
        value_layer: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        qkv_format: str | None = None,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_kv: torch.Tensor | None = None,
        cu_seqlens_q_padded: torch.Tensor | None = None,
        cu_seqlens_kv_padded: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_kv: int | None = None,
        attn_mask_type: str | None = None,
        window_size: tuple[int, int] | None = None,
        bottom_right_diagonal: bool | None = None,
        softcap: float | None = None,
        checkpoint_core_attention: bool = False,
        core_attention_bias_type: str = "no_bias",
        core_attention_bias: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
        fast_zero_fill: bool = True,
        inference_params: Any = None,
        pad_between_seqs: bool | None = None,
        fp8_output: bool | None = False,
        bf16_backward: bool | None = False,
        num_splits: int | None = 1,
        score_mod: Callable | None = None,
        score_mod_bprop: Callable | None = None,
        score_mod_tensors: dict[str, torch.Tensor] | None = None,
        score_mod_bprop_tensors: dict[str, torch.Tensor] | None = None,
        qkv_layer: torch.Tensor | None = None,
        kv_layer: torch.Tensor | None = None,
        qkv_interleave_dim: int = -3,
        thd_attention_policies: list[dict[str, Any]] | None = None,
        thd_attention_policy_dispatch: str = "auto",
    ) -> torch.Tensor:
        q, k, v = query_layer, key_layer, value_layer
        assert q is not None and k is not None and v is not None, "the fake models separate q/k/v only"
        assert core_attention_bias is None and alibi_slopes is None and inference_params is None
        assert score_mod is None and qkv_layer is None and kv_layer is None and thd_attention_policies is None
        fmt = qkv_format or self.qkv_format
        mask_type = _te_mask_type(attn_mask_type or self.attn_mask_type)
        assert mask_type in {"causal", "padding_causal", "no_mask", "padding"}, mask_type
        window = check_set_window_size(mask_type, window_size if window_size is not None else self.window_size)
        left, right = window[0], window[1]
        causal = "causal" in mask_type
        pad_between_seqs_arg = pad_between_seqs
        if pad_between_seqs is None:
            if fmt == "thd":
                same = cu_seqlens_q_padded is cu_seqlens_q and cu_seqlens_kv_padded is cu_seqlens_kv
                pad_between_seqs = not same and (cu_seqlens_q_padded is not None or cu_seqlens_kv_padded is not None)
            else:
                pad_between_seqs = False
        _same_device(q, {"k": k, "v": v, "attention_mask": attention_mask, "cu_seqlens_q": cu_seqlens_q,
                         "cu_seqlens_kv": cu_seqlens_kv, "cu_seqlens_q_padded": cu_seqlens_q_padded,
                         "cu_seqlens_kv_padded": cu_seqlens_kv_padded})
        self.calls.append({"qkv_format": fmt, "attn_mask_type": mask_type, "window": (left, right),
                           "window_arg": window_size, "pad_between_seqs": pad_between_seqs_arg,
                           "pads_between_seqs": pad_between_seqs,
                           "devices": _devices(q, attention_mask, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                                               cu_seqlens_kv_padded)})
        out_rows = q.shape[0] if fmt == "thd" else q.shape[0] * q.shape[1]
        if fmt == "thd":
            assert q.ndim == 3 and attention_mask is None and "padding" in mask_type
            for cu in (cu_seqlens_q, cu_seqlens_kv):
                assert cu is not None and cu.dtype == torch.int32 and cu.ndim == 1
            assert cu_seqlens_q.shape == cu_seqlens_kv.shape
            for padded in (cu_seqlens_q_padded, cu_seqlens_kv_padded):
                assert padded is None or (padded.dtype == torch.int32 and padded.shape == cu_seqlens_q.shape)
            if q.device.type == "meta":
                return q.new_empty(q.shape[0], q.shape[1] * v.shape[-1])
            assert torch.equal(cu_seqlens_q, cu_seqlens_kv), "self-attention only in this fake"
            cu = cu_seqlens_q.long()
            lengths = cu[1:] - cu[:-1]
            if pad_between_seqs:
                assert cu_seqlens_q_padded is not None and torch.equal(cu_seqlens_q_padded, cu_seqlens_kv_padded)
                starts = cu_seqlens_q_padded.long()[:-1]
            else:
                starts = cu[:-1]
            doc, pos = _doc_positions(starts, lengths, q.shape[0])
            valid = doc >= 0
            same = (doc[:, None] == doc[None, :]) & valid[:, None]
        elif fmt == "bshd":
            b, s = q.shape[:2]
            if "padding" in mask_type:
                assert attention_mask is not None and attention_mask.dtype == torch.bool
                assert attention_mask.shape == (b, 1, 1, s)
            else:
                assert attention_mask is None
            if q.device.type == "meta":
                return q.new_empty(b, s, q.shape[2] * v.shape[-1])
            if "padding" in mask_type:
                lengths = (~attention_mask).reshape(b, s).sum(-1)
            else:
                lengths = torch.full((b,), s, device=q.device)
            rows = torch.arange(b, device=q.device).repeat_interleave(s)
            pos = torch.arange(s, device=q.device).repeat(b)
            valid = pos < lengths[rows]
            same = (rows[:, None] == rows[None, :]) & valid[:, None] & valid[None, :]
            q, k, v = flat(q), flat(k), flat(v)
        else:
            raise AssertionError(f"fake TE does not model qkv_format={fmt!r}")
        allowed = same
        if causal:
            allowed &= pos[None, :] <= pos[:, None]
        if left >= 0:
            allowed &= pos[None, :] >= pos[:, None] - left
        if right >= 0 and not causal:
            allowed &= pos[None, :] <= pos[:, None] + right
        out, _ = _masked_attention(q, k, v, allowed, self.softmax_scale)
        out = torch.where(valid[:, None, None], out, 0.0).reshape(out_rows, -1)
        return out if fmt == "thd" else out.reshape(b, s, -1)


# =====================================================================================
# injecting the fakes in place of the lazy imports
# =====================================================================================


@contextlib.contextmanager
def fake_fa4() -> Iterator[FakeFA4]:
    """Make ``initialize_attn_module_and_func("fa4", ...)`` use a fresh :class:`FakeFA4`."""
    fake = FakeFA4()
    with mock.patch.object(backends.fa4, "import_fa4", lambda: (fake.flash_attn_func, fake.flash_attn_varlen_func)):
        yield fake


@contextlib.contextmanager
def fake_te() -> Iterator[type[FakeDotProductAttention]]:
    """Make ``initialize_attn_module_and_func("te", ...)`` build :class:`FakeDotProductAttention` modules."""
    FakeDotProductAttention.instances.clear()
    with mock.patch.object(backends.te, "import_dot_product_attention", lambda: FakeDotProductAttention):
        yield FakeDotProductAttention
