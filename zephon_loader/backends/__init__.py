"""Attention-backend helpers for packed batches: ``sdpa``, ``fa4`` and ``te`` (docs/contract.md §8).

One module per backend translation (:mod:`.sdpa` with the packed-SDPA plan,
:mod:`.fa4`, :mod:`.te`), the checks they share in :mod:`._checks`, and the
three public functions in :mod:`.dispatch`, re-exported here.

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
  right-padded, indexed ids for TE, packed TE without ``max_seqlen``, a
  ``max_seqlen`` shorter than the longest document, ...) where AutoModel passes
  them on to a kernel that fails or silently misreads them; so are backward
  passes FA4's kernel for the GPU cannot run (see :mod:`.fa4`).
* Auxiliary tensors (masks, offsets, indices, ``learnable_sink``) are moved to
  the query's device (non-blocking when pinned) and windows become tuples, for
  every backend (AutoModel forwards them as given; the real kernels reject
  CPU offsets and TE asserts on a list window).
* TE's ``pad_between_seqs`` is set only when documents start at padded
  offsets other than their real ones (AutoModel sets it whenever padded offsets
  are passed, which turns TE's FlashAttention backends off).

TE (``transformer_engine.pytorch``) and FA4 (``flash_attn.cute``, PyPI
``flash-attn-4``) are imported lazily by :func:`initialize_attn_module_and_func`;
import failures of any kind become one :class:`ImportError` naming the install
command (``README.md``, "Install on a GPU machine", gives the order: CUDA torch
first, then the extras; TE with ``--no-build-isolation``). No caller tensor is
modified in place.
"""

from zephon_loader.backends._checks import ATTN_IMPLEMENTATIONS
from zephon_loader.backends.dispatch import (
    initialize_attn_module_and_func,
    postprocess_output_for_attn,
    preprocess_args_and_kwargs_for_attn,
)
from zephon_loader.backends.fa4 import FA4_DENSE_KWARGS, FA4_VARLEN_KWARGS
from zephon_loader.backends.sdpa import SDPA_CALL_KWARGS, packed_sdpa
from zephon_loader.backends.te import TE_FORWARD_KWARGS, TE_INIT_KWARGS

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
