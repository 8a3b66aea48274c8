"""``fa4``: FlashAttention-4 (``flash_attn.cute``, PyPI ``flash-attn-4``; follows 4.0.0b36).

Translation of AutoModel 0.7.0's FA4 branch. Packed batches reach the varlen
kernel as gathered tokens: BSHD q/k/v are gathered with the flat
``packed_token_indices`` into ``[T, H, D]`` streams described by int32
``cu_seqlens``, and the callable scatters the output back to ``[B, S, H, Dv]``
(zeros at excluded tokens). A binary padding mask is unpadded the same way; no
mask runs the dense kernel. Windows follow the user convention (left counts
visible keys including the current token) and are translated to the kernel's
(distances excluding it).

What the b36 kernels need and do not check, or check only deep inside, is
done here, before any kernel call:

* every tensor on the query's device (the loader yields pinned CPU
  metadata; the kernel asserts CUDA inputs): offsets, indices and
  ``learnable_sink`` are moved, without blocking when pinned;
* windows as tuples of ints (a YAML/JSON list is converted);
* ``max_seqlen`` covering the longest document (the kernel trusts it);
* ``learnable_sink`` of shape ``[H]`` in fp16/bf16/fp32, ``softcap`` a
  finite number >= 0;
* backward limits of the kernel chosen for the GPU (``FLASH_ATTENTION_ARCH``
  overrides the device's compute capability, as in FA4): SM90's GQA backward
  needs ``head_dim == head_dim_v``; SM100/SM110's dedicated head-dim-256
  backward has no local (sliding-window) attention and no ``learnable_sink``.
  Both are refused when a gradient will be needed, never for a forward-only
  call, and a causal right-only window is not local.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from typing import Any, Callable, Final

import torch
import torch.nn.functional as tF

from zephon_loader import fields
from zephon_loader.backends._checks import (
    CU_SEQLENS_PADDED,
    FLATTEN_HINT,
    bad,
    check_cu_seqlens,
    check_max_seqlen,
    classify_2d_mask,
    normalize_window,
    shape,
    to_device,
)
from zephon_loader.backends._imports import import_optional

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

_PADDED_SHAPE: Final = "_fa4_padded_output_shape"
#: Every keyword the FA4 callable accepts.
_CALL_KWARGS: Final[frozenset[str]] = frozenset(
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
        _PADDED_SHAPE,
    }
)
#: ``learnable_sink`` dtypes FA4 4.0.0b36 accepts.
_SINK_DTYPES: Final = (torch.float16, torch.bfloat16, torch.float32)
_INSTALL: Final = "pip install 'zephon-loader[fa4]'"
_THD_HINT: Final = (
    "Native FA4 consumes BSHD plus gathered-token metadata; pre-packed THD is unsupported (use NEAT packing)."
)


def import_fa4() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Return FA4's ``(flash_attn_func, flash_attn_varlen_func)`` (lazy; ImportError if unusable)."""
    cute = import_optional("flash_attn.cute", "fa4", "FlashAttention-4 (PyPI flash-attn-4)", _INSTALL)
    dense = getattr(cute, "flash_attn_func", None)
    varlen = getattr(cute, "flash_attn_varlen_func", None)
    if dense is None or varlen is None:
        raise ImportError(
            "attn_impl='fa4': flash_attn.cute lacks flash_attn_func/flash_attn_varlen_func; install "
            f"FlashAttention-4 with: {_INSTALL}"
        )
    return dense, varlen


# =====================================================================================
# the callable
# =====================================================================================


def make_fa4_func(
    softmax_scale: float, attn_mask_type: str, qkv_format: str, init_kwargs: dict[str, Any]
) -> Callable[..., torch.Tensor]:
    """The FA4 callable: dense or varlen kernel, restoring gathered output to padded BSHD.

    Raises:
        TypeError: any ``init_kwargs`` (FA4 takes none).
        ValueError: ``qkv_format != "bshd"``.
        ImportError: FA4 missing or unusable.
    """
    if init_kwargs:
        raise TypeError(f"Unsupported FA4 initialization kwargs: {sorted(init_kwargs)}")
    if qkv_format != "bshd":
        raise bad("fa4", fields.QKV_FORMAT, repr(qkv_format), "'bshd'", "Pre-packed THD is unsupported by native FA4.")
    flash_attn_func, flash_attn_varlen_func = import_fa4()
    default_causal = attn_mask_type == "causal"

    def attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **call_kwargs: Any) -> torch.Tensor:
        """Run dense or varlen FA4.

        Args:
            q: ``[B, S, H, D]`` (dense) or ``[T, H, D]`` (varlen), fp16/bf16 on CUDA.
            k: ``[B, S, Hkv, D]`` or ``[T, Hkv, D]``.
            v: like ``k`` with head dim ``Dv``.
            **call_kwargs: ``causal``, ``window_size`` (kernel convention:
                distances excluding the current token, None unbounded; a list
                is taken as a tuple), ``softcap``, ``learnable_sink`` (``[H]``),
                ``cu_seqlens_q``/``cu_seqlens_kv`` (int32 ``[docs + 1]``),
                ``max_seqlen_q``/``max_seqlen_kv`` (int),
                ``packed_token_indices`` (int64 ``[T]`` into ``B * S``) and
                ``_fa4_padded_output_shape`` ``(B, S, H, Dv)``; tensors on q's
                device (as preprocess leaves them).

        Returns:
            ``[B, S, H, Dv]`` (dense, or varlen restored with zeros at excluded
            tokens) or ``[T, H, Dv]`` (varlen without a padded shape). Never
            aliases q, k or v.

        Raises:
            TypeError: unknown keywords.
            ValueError: a malformed window, or a backward the kernel for this
                GPU cannot run (see the module docstring).
        """
        unexpected = call_kwargs.keys() - _CALL_KWARGS
        if unexpected:
            raise TypeError(f"Unsupported FA4 attention kwargs: {sorted(unexpected)}")
        causal = bool(call_kwargs.get("causal", default_causal))
        window = _kernel_window(call_kwargs.get("window_size"))
        sink = call_kwargs.get("learnable_sink")
        _check_backward_support(q, k, v, causal, window, sink)
        common: dict[str, Any] = {"softmax_scale": softmax_scale, "causal": causal, "window_size": window}
        if call_kwargs.get("softcap") is not None:
            common["softcap"] = call_kwargs["softcap"]
        if sink is not None:
            common["learnable_sink"] = sink
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
        padded_shape = call_kwargs.get(_PADDED_SHAPE)
        if padded_shape is None:
            return output
        indices = call_kwargs.get(fields.PACKED_TOKEN_INDICES)
        if indices is None:
            return output.reshape(padded_shape)
        padded = output.new_zeros((padded_shape[0] * padded_shape[1], *output.shape[1:]))
        return padded.index_copy(0, indices, output).reshape(padded_shape)

    return attn_func


def _kernel_window(window: Any) -> tuple[int | None, int | None]:
    """A kernel-convention window as a tuple of ints/None (a list becomes a tuple; None = unbounded)."""
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise bad("fa4", "window_size", repr(window), "a (left, right) pair of ints or None (kernel convention)")
    bounds = []
    for bound in window:
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, numbers.Integral)):
            raise bad("fa4", "window_size", repr(window), "a (left, right) pair of ints or None (kernel convention)")
        bounds.append(None if bound is None else int(bound))
    return bounds[0], bounds[1]


def _fa4_arch(device: torch.device) -> int | None:
    """The compute capability FA4 picks its kernels for, as ``major * 10 + minor``.

    FA4 reads ``FLASH_ATTENTION_ARCH`` (``"sm_90a"``, ``"90"``, ``"100"``) before
    the device; without it, the capability of ``device`` (None off CUDA: no
    kernel will run there).
    """
    override = os.environ.get("FLASH_ATTENTION_ARCH")
    if override:
        match = re.fullmatch(r"(?:sm_?)?(\d+)(\d)[af]?", override.strip(), flags=re.IGNORECASE)
        if match is None:
            raise bad("fa4", "FLASH_ATTENTION_ARCH", repr(override), "an arch such as 'sm_90a', '90' or '100'")
        return int(match.group(1)) * 10 + int(match.group(2))
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def _is_local(causal: bool, left: int | None, right: int | None) -> bool:
    """Whether FA4 treats the (kernel-convention) window as local attention rather than (non-)causal."""
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal:
        right = 0
    if left is None and right is None:
        return False
    return not (left is None and right == 0)


def _check_backward_support(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    window: tuple[int | None, int | None],
    sink: torch.Tensor | None,
) -> None:
    """Refuse, before the forward, a backward the FA4 kernel for this GPU asserts against.

    Only when a gradient will be needed (grad mode on and q, k, v or the sink
    requires grad): forward-only calls run on every kernel.
    """
    leaves = [t for t in (q, k, v, sink) if isinstance(t, torch.Tensor)]
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in leaves)):
        return
    arch = _fa4_arch(q.device)
    if arch is None:
        return
    heads, kv_heads, head_dim, head_dim_v = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    if arch // 10 == 9 and heads != kv_heads and head_dim != head_dim_v:
        raise bad(
            "fa4", "v", f"head_dim {head_dim_v} with q/k head_dim {head_dim} and GQA ({heads} query heads over "
            f"{kv_heads} KV heads) on SM{arch}",
            "head_dim_v == head_dim: FA4's SM90 GQA backward requires equal head dims",
            "Use attn_impl='sdpa' or 'te' for this shape, or run it without gradients.",
        )
    generic_hd256_backward = os.environ.get("FLASH_ATTENTION_HD256_GENERIC_BWD", "0") == "1"
    if arch // 10 in (10, 11) and head_dim == head_dim_v == 256 and not generic_hd256_backward:
        hint = (
            "Use attn_impl='sdpa' or run it without gradients (FLASH_ATTENTION_HD256_GENERIC_BWD=1 selects FA4's "
            "generic SM100 backward instead)."
        )
        if _is_local(causal, *window):
            raise bad(
                "fa4", "window_size", f"{window} (kernel convention) with head_dim 256 and gradients on SM{arch}",
                "no local window: FA4's dedicated head-dim-256 SM100/SM110 backward has no sliding-window "
                "attention (the forward does)", hint,
            )
        if sink is not None:
            raise bad(
                "fa4", "learnable_sink", f"a tensor with head_dim 256 and gradients on SM{arch}",
                "None: FA4's dedicated head-dim-256 SM100/SM110 backward has no learnable_sink", hint,
            )


# =====================================================================================
# preprocess
# =====================================================================================


def preprocess_fa4(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """FA4 layout and keywords: dense BSHD, or gathered ``[T, H, D]`` streams with varlen offsets.

    Every tensor in the returned keywords is on q's device: int32
    ``cu_seqlens_q``/``cu_seqlens_kv`` ``[docs + 1]``, int64
    ``packed_token_indices`` ``[T]``, ``learnable_sink`` ``[H]``. Masks are
    read where they live (one host read; free for the loader's CPU tensors).
    """
    if q.ndim != 4:
        raise bad("fa4", "q", f"THD shape {shape(q)}", "BSHD [batch, sequence, heads, head_dim]", _THD_HINT)
    if kwargs.get(fields.QKV_FORMAT) == "thd":
        raise bad("fa4", fields.QKV_FORMAT, "'thd'", "'bshd' (or absent)", _THD_HINT)
    if kwargs.get(CU_SEQLENS_PADDED) is not None:
        raise bad("fa4", "cu_seqlens_padded", "a tensor (physical THD offsets)", "None", _THD_HINT)
    if attention_mask is not None and attention_mask.ndim != 2:
        raise bad(
            "fa4", fields.ATTENTION_MASK, f"shape {shape(attention_mask)}",
            "None or a [batch, sequence] mask (FA4 has no dense-mask entry point, even with cu_seqlens)",
            "Use attn_impl='sdpa' or 'te' for explicit masks.",
        )
    attn_kwargs: dict[str, Any] = {"causal": True}
    left, right = normalize_window(kwargs.get("window_size", (-1, 0)), "fa4")
    # The kernel's left window excludes the current token; ours includes it.
    attn_kwargs["window_size"] = (None if left is None else left - 1, right)
    if kwargs.get("softcap") is not None:
        attn_kwargs["softcap"] = _check_softcap(kwargs["softcap"])
    if kwargs.get("learnable_sink") is not None:
        attn_kwargs["learnable_sink"] = _check_sink(kwargs["learnable_sink"], q)

    cu_seqlens = kwargs.get(fields.CU_SEQLENS)
    indices = kwargs.get(fields.PACKED_TOKEN_INDICES)
    max_seqlen = kwargs.get(fields.MAX_SEQLEN)
    if cu_seqlens is None and indices is not None:
        raise bad("fa4", fields.PACKED_TOKEN_INDICES, "a tensor without cu_seqlens", "cu_seqlens and max_seqlen with it")
    derived = cu_seqlens is None and attention_mask is not None
    if derived:
        indices, cu_seqlens, max_seqlen = _unpad(attention_mask, q)
    if cu_seqlens is not None:
        cu_seqlens = check_cu_seqlens(cu_seqlens, "fa4", fields.CU_SEQLENS)
        if indices is not None:
            if not isinstance(indices, torch.Tensor) or indices.ndim != 1:
                seen = f"shape {shape(indices)}" if isinstance(indices, torch.Tensor) else type(indices).__name__
                hint = f"Unflattened packed metadata: {FLATTEN_HINT}." if isinstance(indices, torch.Tensor) else ""
                raise bad(
                    "fa4", fields.PACKED_TOKEN_INDICES, seen, "a flat [tokens] index tensor into batch * sequence", hint
                )
            if indices.dtype.is_floating_point or indices.dtype == torch.bool:
                raise bad("fa4", fields.PACKED_TOKEN_INDICES, f"dtype {indices.dtype}", "an integer dtype (int64)")
        if max_seqlen is None:
            raise bad("fa4", fields.MAX_SEQLEN, "None with cu_seqlens", "the int length of the longest document")
        if not derived:
            max_seqlen = check_max_seqlen(max_seqlen, cu_seqlens, "fa4", fields.MAX_SEQLEN, fields.CU_SEQLENS)
        if k.shape[:2] != q.shape[:2]:
            raise bad("fa4", "k", f"shape {shape(k)}", f"q's [batch, sequence] {list(q.shape[:2])} for packed input")
        cu_seqlens = to_device(cu_seqlens, q.device).contiguous()
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
            indices = to_device(indices, q.device, torch.long)
            q = flat_q.index_select(0, indices)
            k = flat_k.index_select(0, indices)
            v = flat_v.index_select(0, indices)
            attn_kwargs[fields.PACKED_TOKEN_INDICES] = indices
        attn_kwargs[_PADDED_SHAPE] = padded_output_shape
    elif kwargs.get("cu_seqlens_q") is not None or kwargs.get("cu_seqlens_kv") is not None:
        raise bad(
            "fa4", "cu_seqlens_q/cu_seqlens_kv", "physical varlen offsets with BSHD q",
            "packed metadata as cu_seqlens + packed_token_indices + max_seqlen", _THD_HINT,
        )
    return q, k, v, attn_kwargs


def _unpad(attention_mask: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Gathered-token metadata of a binary ``[B, S]`` mask, computed on the mask's device.

    Returns:
        int64 indices ``[T]`` of the valid tokens into ``B * S``, int32
        ``cu_seqlens`` ``[rows with a valid token + 1]`` and the longest row.
    """
    if attention_mask.shape != q.shape[:2]:
        raise bad(
            "fa4", fields.ATTENTION_MASK, f"shape {shape(attention_mask)}", f"[batch, sequence] = {list(q.shape[:2])}"
        )
    if attention_mask.numel() == 0:
        raise bad("fa4", fields.ATTENTION_MASK, "an empty mask", "at least one valid token")
    kind, _ = classify_2d_mask(attention_mask, "fa4")
    if kind == "indexed":
        raise bad(
            "fa4", fields.ATTENTION_MASK, "indexed document ids without packed metadata",
            "cu_seqlens, packed_token_indices and max_seqlen from the dataset", f"Then {FLATTEN_HINT}.",
        )
    valid = attention_mask.to(dtype=torch.bool)
    seqlens = valid.sum(dim=-1)
    seqlens = seqlens[seqlens > 0]
    if seqlens.numel() == 0:
        raise bad("fa4", fields.ATTENTION_MASK, "no valid token", "at least one valid token")
    indices = torch.nonzero(valid.flatten(), as_tuple=False).flatten()
    cu_seqlens = tF.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, int(seqlens.max().item())


def _check_softcap(value: Any) -> float:
    """``softcap`` as a float; FA4 caps scores with ``softcap * tanh(s / softcap)`` (0 = off)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise bad("fa4", "softcap", repr(value), "a finite number >= 0 (0 disables capping)")
    return float(value)


def _check_sink(sink: Any, q: torch.Tensor) -> torch.Tensor:
    """``learnable_sink`` ``[H]`` (fp16/bf16/fp32) moved to q's device (differentiably)."""
    heads = q.shape[-2]
    if not isinstance(sink, torch.Tensor) or sink.shape != (heads,) or sink.dtype not in _SINK_DTYPES:
        seen = f"{sink.dtype} tensor of shape {shape(sink)}" if isinstance(sink, torch.Tensor) else type(sink).__name__
        raise bad("fa4", "learnable_sink", seen, f"a [heads={heads}] float16/bfloat16/float32 tensor")
    return to_device(sink, q.device)
