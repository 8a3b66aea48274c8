"""Argument checks and normalizations shared by the ``sdpa``, ``fa4`` and ``te`` translations.

Every error is a :class:`ValueError` made by :func:`bad`: it names the backend,
the argument, what was seen and what was expected (plus a hint where one
helps). Normalizations return new objects and never modify a caller's tensor:
windows become tuples of Python ints, offsets and indices move to the query's
device (:func:`to_device`).
"""

from __future__ import annotations

import operator
from typing import Any, Final

import torch

from zephon_loader import fields

#: Backend names this package implements.
ATTN_IMPLEMENTATIONS: Final[tuple[str, ...]] = ("sdpa", "fa4", "te")

#: Physical THD offsets (documents placed at padded starts) for ``sdpa`` and ``te``.
CU_SEQLENS_PADDED: Final = fields.CU_SEQLENS_PADDED

FLATTEN_HINT: Final = (
    "flatten the batch-major metadata once at model entry, after pipeline microbatch splitting, with "
    "zephon_loader.packing.flatten_packed_sequence_metadata(packed_token_indices, cu_seqlens, "
    "batch_size=B, sequence_length=S) (same as AutoModel's nemo_automodel.components.models.common."
    "packing.flatten_packed_sequence_metadata)"
)


def shape(t: torch.Tensor) -> tuple[int, ...]:
    """``t.shape`` as a plain tuple (for messages)."""
    return tuple(t.shape)


def bad(attn_impl: str, argument: str, seen: str, expected: str, hint: str = "") -> ValueError:
    """A ValueError naming the argument, what was seen and what was expected."""
    message = f"attn_impl={attn_impl!r}: {argument}: got {seen}; expected {expected}."
    return ValueError(f"{message} {hint}" if hint else message)


def unknown_impl(attn_impl: object) -> ValueError:
    """The ValueError for a backend name this package does not implement."""
    return ValueError(f"attn_impl: got {attn_impl!r}; expected one of {list(ATTN_IMPLEMENTATIONS)}.")


def to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` on ``device`` (and ``dtype``), copied without blocking the host when ``t`` is pinned.

    The loader yields pinned CPU tensors; the kernels need every tensor on the
    query's device. Returns ``t`` itself when nothing changes (never a copy
    to modify, never an in-place change).
    """
    non_blocking = t.device.type == "cpu" and device.type != "cpu" and t.is_pinned()
    return t.to(device=device, dtype=dtype, non_blocking=non_blocking)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_impl: str) -> None:
    """Check that q/k/v form one BSHD or THD layout (batch/token and head axes consistent)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise bad(attn_impl, name, type(t).__name__, "a torch.Tensor")
    if q.ndim not in (3, 4):
        raise bad(
            attn_impl,
            "q",
            f"shape {shape(q)}",
            "BSHD [batch, sequence, heads, head_dim] or THD [tokens, heads, head_dim]",
        )
    if k.ndim != q.ndim or v.ndim != q.ndim:
        raise bad(attn_impl, "k/v", f"shapes {shape(k)} and {shape(v)} with q {shape(q)}", f"rank {q.ndim} like q")
    if q.ndim == 4 and (k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]):
        raise bad(attn_impl, "k/v", f"batch sizes {k.shape[0]}/{v.shape[0]}", f"q's batch size {q.shape[0]}")
    if k.shape[:-1] != v.shape[:-1]:
        raise bad(attn_impl, "v", f"shape {shape(v)}", f"the leading dims of k {shape(k)[:-1]}")
    if k.shape[-1] != q.shape[-1]:
        raise bad(attn_impl, "k", f"head_dim {k.shape[-1]}", f"q's head_dim {q.shape[-1]}")
    heads, kv_heads = q.shape[-2], k.shape[-2]
    if kv_heads == 0 or heads % kv_heads != 0:
        raise bad(attn_impl, "k", f"{kv_heads} heads with q {heads} heads", "a divisor of q's head count (GQA)")


def _window_int(value: Any, window_size: Any, attn_impl: str, argument: str) -> int | None:
    """One window bound as a Python int (numpy/torch ints accepted), or None."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise bad(attn_impl, argument, repr(window_size), "ints or None")
    try:
        return operator.index(value)
    except TypeError:
        raise bad(attn_impl, argument, repr(window_size), "ints or None") from None


def normalize_window(window_size: Any, attn_impl: str) -> tuple[int | None, int | None]:
    """User-facing ``window_size`` (``sdpa``/``fa4`` convention) -> ``(left, right)``, None = unbounded.

    ``left`` counts visible keys including the current token; a scalar means
    ``(left, 0)``; ``None``/negative left -> ``None``; ``0`` -> ValueError;
    right ``None``/``<= 0`` -> ``None``. Lists (YAML/JSON configs) are accepted
    and come back as a tuple.
    """
    if window_size is None:
        return None, None
    if isinstance(window_size, (tuple, list)):
        if len(window_size) != 2:
            raise bad(attn_impl, "window_size", repr(window_size), "(left, right) or a single left size")
        left, right = window_size
    else:
        left, right = window_size, 0
    left_i = _window_int(left, window_size, attn_impl, "window_size")
    right_i = _window_int(right, window_size, attn_impl, "window_size")
    if left_i == 0:
        raise bad(
            attn_impl,
            "window_size",
            repr(window_size),
            "a left size >= 1 (it counts visible keys including the current token) or None/-1 for unbounded",
        )
    return (None if left_i is None or left_i < 0 else left_i), (None if right_i is None or right_i <= 0 else right_i)


def window_pair(window_size: Any, attn_impl: str, argument: str = "window_size") -> tuple[int, int]:
    """A kernel-convention ``(left, right)`` pair of Python ints, from a tuple or a list.

    No value is changed (TE checks its own conventions); only the container
    becomes a tuple, which kernels such as TE's ``check_set_window_size``
    require (they compare with tuple literals, so ``[-1, 0]`` fails there).
    """
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise bad(attn_impl, argument, repr(window_size), "a (left, right) pair of ints")
    left, right = (_window_int(x, window_size, attn_impl, argument) for x in window_size)
    if left is None or right is None:
        raise bad(attn_impl, argument, repr(window_size), "a (left, right) pair of ints (-1 = unbounded)")
    return left, right


def as_int(value: Any, attn_impl: str, argument: str) -> int:
    """A Python int from an int-like (not bool) ``value``."""
    if isinstance(value, bool):
        raise bad(attn_impl, argument, repr(value), "an int")
    try:
        return operator.index(value)
    except TypeError:
        raise bad(attn_impl, argument, f"{type(value).__name__} {value!r}", "an int") from None


def check_cu_seqlens(
    value: Any, attn_impl: str, argument: str, *, dtype: torch.dtype | None = torch.int32
) -> torch.Tensor:
    """Validate a flat ``[documents + 1]`` cumulative-lengths tensor (``dtype=None``: any integer dtype)."""
    if not isinstance(value, torch.Tensor):
        raise bad(attn_impl, argument, type(value).__name__, "a 1-D int32 tensor [documents + 1]")
    if value.ndim == 2:
        raise bad(
            attn_impl,
            argument,
            f"batch-major shape {shape(value)}",
            "flat [documents + 1]",
            f"Unflattened packed metadata: {FLATTEN_HINT}.",
        )
    if value.ndim != 1 or value.numel() < 1:
        raise bad(attn_impl, argument, f"shape {shape(value)}", "a 1-D tensor [documents + 1]")
    if dtype is not None and value.dtype != dtype:
        raise bad(attn_impl, argument, f"dtype {value.dtype}", f"{dtype}")
    if dtype is None and (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool):
        raise bad(attn_impl, argument, f"dtype {value.dtype}", "an integer dtype")
    return value


def check_max_seqlen(
    value: Any, cu_seqlens: torch.Tensor, attn_impl: str, argument: str, offsets: str
) -> int:
    """``value`` as an int that covers the longest document of ``cu_seqlens``.

    The kernels size their work by ``max_seqlen`` and do not check it: one too
    small silently drops keys and queries. One host read of ``cu_seqlens``
    (free for the loader's CPU tensors; a sync when the offsets live on a GPU).

    Args:
        value: the int-like ``max_seqlen`` given.
        cu_seqlens: validated flat ``[documents + 1]`` offsets it must cover.
        argument / offsets: the two argument names, for the message.
    """
    max_seqlen = as_int(value, attn_impl, argument)
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item()) if cu_seqlens.numel() > 1 else 0
    if max_seqlen < longest:
        raise bad(
            attn_impl,
            argument,
            str(max_seqlen),
            f"at least the longest document in {offsets} ({longest} tokens)",
            "The kernels do not check it and would silently leave tokens out; pass the dataset's max_seqlen.",
        )
    return max_seqlen


def classify_2d_mask(mask: torch.Tensor, attn_impl: str) -> tuple[str, bool]:
    """Classify a ``[B, S]`` mask as ``"binary"`` or ``"indexed"``; also report whether any token is excluded.

    One host read, on the mask's own device. Bool masks are binary; integer
    masks are indexed when some value exceeds 1; float masks must be 0/1.
    Negative values are refused.
    """
    if mask.dtype == torch.bool:
        return "binary", not bool(mask.all().item())
    if mask.dtype.is_floating_point:
        if mask.numel() == 0:
            return "binary", False
        non_binary, has_zero = torch.stack([((mask != 0) & (mask != 1)).any(), (mask == 0).any()]).tolist()
        if non_binary:
            raise bad(attn_impl, fields.ATTENTION_MASK, f"a {mask.dtype} mask with values other than 0/1",
                      "a bool or 0/1 padding mask, or integer document ids")
        return "binary", has_zero
    if mask.dtype.is_complex:
        raise bad(attn_impl, fields.ATTENTION_MASK, f"dtype {mask.dtype}", "bool or an integer dtype")
    if mask.numel() == 0:
        return "binary", False
    low, high = torch.aminmax(mask)
    low_i, high_i = torch.stack([low, high]).tolist()
    if low_i < 0:
        raise bad(attn_impl, fields.ATTENTION_MASK, f"a negative value {low_i}", "nonnegative document ids or a 0/1 mask")
    return ("indexed" if high_i > 1 else "binary"), low_i == 0
