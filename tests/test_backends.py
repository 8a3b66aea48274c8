"""CPU tests of ``zephon_loader.backends`` (docs/contract.md §8).

* Equivalence: for random packed batches every backend equals attention
  computed separately per document (plain fp32 softmax(QK^T)V, causal, with
  the window), forward and backward. SDPA runs torch's real kernels; FA4 and
  TE run the pure-torch fakes of ``fake_kernels`` (flash-attn-4 4.0.0b36's
  ``flash_attn_func``/``flash_attn_varlen_func`` and Transformer Engine
  2.20's ``DotProductAttention``, as strict as the real kernels), injected
  in place of the lazy imports.
* Pinned third-party keyword names.
* Compatibility with nemo-automodel 0.7.0 (skipped if it does not import),
  including each deliberate difference.
* Every ValueError, the ImportError paths, and no in-place modification.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zephon_loader import backends
from zephon_loader.backends import (
    FA4_DENSE_KWARGS,
    FA4_VARLEN_KWARGS,
    SDPA_CALL_KWARGS,
    TE_FORWARD_KWARGS,
    TE_INIT_KWARGS,
    initialize_attn_module_and_func,
    packed_sdpa,
    postprocess_output_for_attn,
    preprocess_args_and_kwargs_for_attn,
)

from fake_kernels import FakeDotProductAttention, FakeFA4, fake_fa4, fake_te  # tests/fake_kernels.py

PROPERTY = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TOL = {"atol": 2e-5, "rtol": 1e-4}


# =====================================================================================
# random packed batches
# =====================================================================================


@dataclass
class Case:
    """A packed batch: ``document_ids`` (0 at padding) and ``ids`` (0 also at holes), plus head config."""

    document_ids: torch.Tensor  # int64 [B, S]
    ids: torch.Tensor  # int64 [B, S] attention document ids
    heads: int
    kv_heads: int
    head_dim: int
    v_dim: int
    window: int | None  # user convention: visible keys including the current token
    seed: int

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def tensors(self) -> list[torch.Tensor]:
        """Leaf fp32 BSHD q/k/v with requires_grad."""
        g = torch.Generator().manual_seed(self.seed)
        b, s = self.ids.shape
        q = torch.randn(b, s, self.heads, self.head_dim, generator=g)
        k = torch.randn(b, s, self.kv_heads, self.head_dim, generator=g)
        v = torch.randn(b, s, self.kv_heads, self.v_dim, generator=g)
        return [t.requires_grad_() for t in (q, k, v)]

    def documents(self, ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Flat ``b * S + s`` token indices of every document, in column order."""
        ids = self.ids if ids is None else ids
        seq = ids.shape[1]
        docs = []
        for b in range(ids.shape[0]):
            for d in sorted(set(ids[b].tolist()) - {0}):
                docs.append(b * seq + torch.nonzero(ids[b] == d).squeeze(1))
        return docs

    def flat_metadata(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Gathered-token metadata, already flat: indices int64 [T], cu_seqlens int32 [D+1], max_seqlen."""
        docs = self.documents()
        lengths = torch.tensor([len(d) for d in docs])
        cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
        return torch.cat(docs), cu, int(lengths.max())

    def batch_major_metadata(self) -> tuple[torch.Tensor, torch.Tensor]:
        """docs/contract.md §6 batch-major pair: indices [B, S] (-1 excluded), cu_seqlens int32 [B, D+1] (-1 unused)."""
        b_size, seq = self.ids.shape
        indices = torch.where(self.ids > 0, torch.arange(seq).expand(b_size, seq), -1)
        width = int(self.ids.max()) + 1
        cu = torch.full((b_size, width), -1, dtype=torch.int32)
        for b in range(b_size):
            counts = [int((self.ids[b] == d).sum()) for d in sorted(set(self.ids[b].tolist()) - {0})]
            row = [0] + torch.cumsum(torch.tensor(counts, dtype=torch.long), 0).tolist() if counts else [0]
            cu[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
        return indices, cu


@st.composite
def cases(
    draw: st.DrawFn,
    *,
    holes: bool = True,
    padding: bool = True,
    docs: str = "any",  # "any" | "multi" (row 0 holds >= 2 documents after holes) | "single"
    window: bool = True,
    max_rows: int = 4,
    max_seq: int = 24,
) -> Case:
    rows = draw(st.integers(1, max_rows))
    seq = draw(st.integers(4, max_seq))
    document_ids = torch.zeros(rows, seq, dtype=torch.long)
    for b in range(rows):
        used = seq - (draw(st.integers(0, seq // 2)) if padding else 0)
        low = 2 if docs == "multi" and b == 0 else 1
        count = 1 if docs == "single" else draw(st.integers(low, min(5, used)))
        cuts = sorted(draw(st.sets(st.integers(1, used - 1), min_size=count - 1, max_size=count - 1)))
        bounds = [0, *cuts, used]
        for d in range(count):
            document_ids[b, bounds[d] : bounds[d + 1]] = d + 1
    ids = document_ids.clone()
    if holes:
        for b in range(rows):
            for col in draw(st.sets(st.integers(0, seq - 1), max_size=seq // 3)):
                ids[b, col] = 0
    if docs == "multi" and int(ids.max()) <= 1:
        ids[0, int(torch.nonzero(document_ids[0] == 2)[0])] = 2
    if int(ids.max()) == 0:
        ids[0, 0] = document_ids[0, 0]
    kv_heads = draw(st.sampled_from([1, 2]))
    return Case(
        document_ids=document_ids,
        ids=ids,
        heads=kv_heads * draw(st.sampled_from([1, 2])),
        kv_heads=kv_heads,
        head_dim=8,
        v_dim=draw(st.sampled_from([8, 4])),
        window=draw(st.none() | st.integers(1, seq + 1)) if window else None,
        seed=draw(st.integers(0, 2**16)),
    )


# =====================================================================================
# the reference: attention computed separately per document
# =====================================================================================


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: list[torch.Tensor], window: int | None, scale: float
) -> torch.Tensor:
    """Plain per-document attention.

    Args:
        q: ``[N, H, D]``; k: ``[N, Hkv, D]``; v: ``[N, Hkv, Dv]`` (fp32, flat tokens).
        documents: int64 index tensors into ``N``, each one document in token order.
        window: visible keys including the current token (document-local), or None.

    Returns:
        ``[N, H, Dv]``: softmax(q k^T * scale) v per document, causal; 0 outside documents.
    """
    groups = q.shape[1] // k.shape[1]
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    for idx in documents:
        qd = q[idx].transpose(0, 1)
        kd = k[idx].repeat_interleave(groups, 1).transpose(0, 1)
        vd = v[idx].repeat_interleave(groups, 1).transpose(0, 1)
        pos = torch.arange(len(idx))
        allowed = pos[None, :] <= pos[:, None]
        if window is not None:
            allowed &= pos[:, None] - pos[None, :] < window
        scores = (qd @ kd.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
        out = out.index_copy(0, idx, (scores.softmax(-1) @ vd).transpose(0, 1))
    return out


def assert_same_attention(
    out: torch.Tensor,
    ref: torch.Tensor,
    leaves: list[torch.Tensor],
    rows: torch.Tensor | None = None,
    seed: int = 0,
) -> None:
    """Forward equal on ``rows`` (all if None) and grads of ``leaves`` equal under a random upstream grad
    that is zero outside ``rows``."""
    assert out.shape == ref.shape
    keep = torch.ones(out.shape[0], dtype=torch.bool) if rows is None else rows
    torch.testing.assert_close(out[keep], ref[keep], **TOL)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)) * keep[:, None, None]
    got = torch.autograd.grad(out, leaves, upstream, retain_graph=True, materialize_grads=True)
    want = torch.autograd.grad(ref, leaves, upstream, retain_graph=True, materialize_grads=True)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"grad of {n}: {m}")


def flat(x: torch.Tensor) -> torch.Tensor:
    """``[B, S, H, D]`` -> ``[B*S, H, D]``."""
    return x.reshape(-1, *x.shape[2:])


def window_kwargs(window: int | None, style: int = 0) -> dict[str, Any]:
    """Different spellings of the user-facing window."""
    if window is None:
        return [{}, {"window_size": (-1, 0)}, {"window_size": None}][style % 3]
    return [{"window_size": (window, 0)}, {"window_size": window}, {"window_size": [window, 0]}][style % 3]


# =====================================================================================
# runners: the public three-call sequence
# =====================================================================================


def run_backend(
    attn_impl: str, case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, **kw: Any
) -> torch.Tensor:
    _module, func = initialize_attn_module_and_func(
        attn_impl, case.heads, case.head_dim, case.v_dim, case.scale, num_gqa_groups=case.kv_heads
    )
    q2, k2, v2, attn_kwargs = preprocess_args_and_kwargs_for_attn(q, k, v, mask, attn_impl, **kw)
    return postprocess_output_for_attn(func(q2, k2, v2, **attn_kwargs), attn_impl)


def physical_stream(case: Case) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """THD over all ``B*S`` physical rows (no holes): cu_seqlens, cu_seqlens_padded (int32) and documents."""
    docs = case.documents(case.document_ids)
    lengths = torch.tensor([len(d) for d in docs])
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
    padded = torch.tensor([int(d[0]) for d in docs] + [case.ids.numel()], dtype=torch.int32)
    return cu, padded, docs


def gathered_stream(case: Case) -> tuple[torch.Tensor, torch.Tensor, int, list[torch.Tensor]]:
    """THD over the gathered eligible tokens: indices [T], cu_seqlens int32, max_seqlen, documents (stream rows)."""
    indices, cu, max_seqlen = case.flat_metadata()
    docs = [torch.arange(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:])]
    return indices, cu, max_seqlen, docs


# =====================================================================================
# equivalence to the per-document reference
# =====================================================================================


@PROPERTY
@given(case=cases(docs="multi"), style=st.integers(0, 2))
def test_sdpa_indexed_ids_equal_per_document_attention(case: Case, style: int) -> None:
    q, k, v = case.tensors()
    out = run_backend("sdpa", case, q, k, v, case.ids, **window_kwargs(case.window, style))
    ref = reference_attention(flat(q), flat(k), flat(v), case.documents(), case.window, case.scale)
    assert_same_attention(flat(out), ref, [q, k, v], seed=case.seed)  # excluded tokens included: zeros


@PROPERTY
@given(case=cases(), strategy=st.sampled_from(["auto", "segments", "dense"]))
def test_packed_sdpa_strategies_are_exact(case: Case, strategy: str) -> None:
    q, k, v = case.tensors()
    out = packed_sdpa(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), case.ids,
        window_left=case.window, scale=case.scale, strategy=strategy,
    ).transpose(1, 2)
    ref = reference_attention(flat(q), flat(k), flat(v), case.documents(), case.window, case.scale)
    assert_same_attention(flat(out), ref, [q, k, v], seed=case.seed)


@PROPERTY
@given(case=cases(docs="single", holes=False), style=st.integers(0, 2), as_bool=st.booleans())
def test_sdpa_padding_mask_equals_per_row_attention(case: Case, style: int, as_bool: bool) -> None:
    """Binary mask: AutoModel's causal & key mask; valid tokens equal the per-row reference."""
    q, k, v = case.tensors()
    mask = case.ids > 0 if as_bool else (case.ids > 0).long()
    out = run_backend("sdpa", case, q, k, v, mask, **window_kwargs(case.window, style))
    ref = reference_attention(flat(q), flat(k), flat(v), case.documents(), case.window, case.scale)
    assert_same_attention(flat(out), ref, [q, k, v], rows=mask.bool().reshape(-1))


@PROPERTY
@given(case=cases(padding=False, holes=False, docs="single"))
def test_sdpa_no_mask_is_causal(case: Case) -> None:
    q, k, v = case.tensors()
    out = run_backend("sdpa", case, q, k, v, None, **window_kwargs(case.window))
    ref = reference_attention(flat(q), flat(k), flat(v), case.documents(), case.window, case.scale)
    assert_same_attention(flat(out), ref, [q, k, v])


@PROPERTY
@given(case=cases(), physical=st.booleans())
def test_sdpa_thd_equals_per_document_attention(case: Case, physical: bool) -> None:
    q, k, v = case.tensors()
    if physical:  # all B*S rows, documents at cu_seqlens_padded offsets
        cu, padded, docs = physical_stream(case)
        qs, ks, vs = flat(q), flat(k), flat(v)
        kw: dict[str, Any] = {"cu_seqlens": cu, "cu_seqlens_padded": padded}
    else:  # gathered eligible tokens
        indices, cu, _, docs = gathered_stream(case)
        qs, ks, vs = flat(q)[indices], flat(k)[indices], flat(v)[indices]
        kw = {"cu_seqlens": cu}
    out = run_backend("sdpa", case, qs, ks, vs, None, **kw, **window_kwargs(case.window))
    assert out.shape == (qs.shape[0], case.heads, case.v_dim)
    ref = reference_attention(qs, ks, vs, docs, case.window, case.scale)
    assert_same_attention(out, ref, [q, k, v], seed=case.seed)


@PROPERTY
@given(case=cases(), style=st.integers(0, 2))
def test_fa4_packed_metadata_equals_per_document_attention(case: Case, style: int) -> None:
    q, k, v = case.tensors()
    indices, cu, max_seqlen = case.flat_metadata()
    with fake_fa4() as fake:
        out = run_backend(
            "fa4", case, q, k, v, case.ids, cu_seqlens=cu, packed_token_indices=indices, max_seqlen=max_seqlen,
            **window_kwargs(case.window, style),
        )
    assert [c["kind"] for c in fake.calls] == ["varlen"]
    # The kernel counts keys excluding the current token: left - 1.
    assert fake.calls[0]["window_size"] == ((None if case.window is None else case.window - 1), None)
    assert out.shape == (*case.ids.shape, case.heads, case.v_dim)
    ref = reference_attention(flat(q), flat(k), flat(v), case.documents(), case.window, case.scale)
    assert_same_attention(flat(out), ref, [q, k, v], seed=case.seed)


@PROPERTY
@given(case=cases(docs="single"), as_bool=st.booleans())
def test_fa4_binary_mask_is_unpadded_automatically(case: Case, as_bool: bool) -> None:
    q, k, v = case.tensors()
    mask = case.ids > 0 if as_bool else (case.ids > 0).to(torch.int32)
    with fake_fa4() as fake:
        out = run_backend("fa4", case, q, k, v, mask, **window_kwargs(case.window))
    assert [c["kind"] for c in fake.calls] == ["varlen"]
    ref = reference_attention(flat(q), flat(k), flat(v), case.documents(), case.window, case.scale)
    assert_same_attention(flat(out), ref, [q, k, v], seed=case.seed)


@PROPERTY
@given(case=cases(padding=False, holes=False, docs="single"))
def test_fa4_dense_without_mask(case: Case) -> None:
    q, k, v = case.tensors()
    with fake_fa4() as fake:
        out = run_backend("fa4", case, q, k, v, None, **window_kwargs(case.window))
    assert [c["kind"] for c in fake.calls] == ["dense"]
    ref = reference_attention(flat(q), flat(k), flat(v), case.documents(), case.window, case.scale)
    assert_same_attention(flat(out), ref, [q, k, v])


@PROPERTY
@given(case=cases(window=False), physical=st.booleans(), te_left=st.none() | st.integers(0, 25))
def test_te_thd_equals_per_document_attention(case: Case, physical: bool, te_left: int | None) -> None:
    """TE THD, optionally with cu_seqlens_padded; ``window_size`` is in TE distances (forwarded as is)."""
    q, k, v = case.tensors()
    if physical:
        cu, padded, docs = physical_stream(case)
        qs, ks, vs = flat(q), flat(k), flat(v)
        max_seqlen = max(len(d) for d in docs)
        kw: dict[str, Any] = {"cu_seqlens": cu, "cu_seqlens_padded": padded, "max_seqlen": max_seqlen}
    else:
        indices, cu, max_seqlen, docs = gathered_stream(case)
        qs, ks, vs = flat(q)[indices], flat(k)[indices], flat(v)[indices]
        kw = {"cu_seqlens": cu, "max_seqlen": max_seqlen}
    if te_left is not None:
        kw["window_size"] = (te_left, 0)
    with fake_te() as te:
        out = run_backend("te", case, qs, ks, vs, None, **kw)
    (module,) = te.instances
    assert module.calls[0]["qkv_format"] == "thd"
    # Set from the offsets (explicitly False when every document starts at its real offset), never left
    # to TE's auto-detection, which turns its FlashAttention backends off whenever padded offsets are passed.
    pads = physical and bool((padded[:-1] != cu[:-1]).any())
    assert module.calls[0]["pad_between_seqs"] is (pads if physical else None)
    out = out.reshape(qs.shape[0], case.heads, case.v_dim)
    # TE's (W, 0) shows W + 1 keys: the reference's window counts the current token.
    ref = reference_attention(qs, ks, vs, docs, None if te_left is None else te_left + 1, case.scale)
    assert_same_attention(out, ref, [q, k, v], seed=case.seed)


@PROPERTY
@given(case=cases(docs="single", holes=False), as_bool=st.booleans())
def test_te_padding_mask_equals_per_row_attention(case: Case, as_bool: bool) -> None:
    q, k, v = case.tensors()
    mask = case.ids > 0 if as_bool else (case.ids > 0).long()
    with fake_te():
        out = run_backend("te", case, q, k, v, mask)
    out = out.reshape(*case.ids.shape, case.heads, case.v_dim)
    ref = reference_attention(flat(q), flat(k), flat(v), case.documents(), None, case.scale)
    assert_same_attention(flat(out), ref, [q, k, v], seed=case.seed)


def test_worked_example_from_spec() -> None:
    """docs/contract.md §9: row 0 = docs of 3 and 2 then 3 pads; row 1 = docs of 4 and 4 with column 2 ineligible."""
    ids = torch.tensor([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 0, 1, 2, 2, 2, 2]])
    case = Case(ids.clamp_max(2), ids, heads=4, kv_heads=2, head_dim=8, v_dim=8, window=2, seed=3)
    indices, cu, max_seqlen = case.flat_metadata()
    assert indices.tolist() == [0, 1, 2, 3, 4, 8, 9, 11, 12, 13, 14, 15]
    assert cu.tolist() == [0, 3, 5, 8, 12] and max_seqlen == 4
    q, k, v = case.tensors()
    ref = reference_attention(flat(q), flat(k), flat(v), case.documents(), 2, case.scale)
    sdpa = run_backend("sdpa", case, q, k, v, ids, window_size=(2, 0))
    with fake_fa4():
        fa4 = run_backend("fa4", case, q, k, v, ids, cu_seqlens=cu, packed_token_indices=indices, max_seqlen=4,
                          window_size=(2, 0))
    torch.testing.assert_close(flat(sdpa), ref, **TOL)
    torch.testing.assert_close(flat(fa4), ref, **TOL)
    # Row 1, column 3 (after the hole) sees columns 1 and 3: the window counts document keys, not columns.
    assert torch.equal(sdpa[1, 2], torch.zeros_like(sdpa[1, 2]))


def test_batch_major_metadata_flattened_at_model_entry_drives_fa4() -> None:
    """Ours (zephon_loader.packing) or AutoModel's flatten gives the flat metadata FA4 consumes."""
    try:
        from zephon_loader.packing import flatten_packed_sequence_metadata
    except ImportError:
        try:
            from nemo_automodel.components.models.common.packing import flatten_packed_sequence_metadata
        except Exception as exc:  # noqa: BLE001
            pytest.skip(f"no flatten_packed_sequence_metadata available: {exc}")
    ids = torch.tensor([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 0, 1, 2, 2, 2, 2], [1, 2, 3, 3, 0, 0, 0, 0]])
    case = Case(ids, ids, heads=2, kv_heads=1, head_dim=8, v_dim=4, window=None, seed=5)
    batch_indices, batch_cu = case.batch_major_metadata()
    indices, cu = flatten_packed_sequence_metadata(batch_indices, batch_cu, batch_size=3, sequence_length=8)
    want_indices, want_cu, max_seqlen = case.flat_metadata()
    assert torch.equal(indices, want_indices) and torch.equal(cu, want_cu)
    q, k, v = case.tensors()
    with fake_fa4():
        out = run_backend("fa4", case, q, k, v, ids, cu_seqlens=cu, packed_token_indices=indices, max_seqlen=max_seqlen)
        with pytest.raises(ValueError, match="flatten_packed_sequence_metadata"):
            run_backend("fa4", case, q, k, v, ids, cu_seqlens=batch_cu, packed_token_indices=batch_indices,
                        max_seqlen=max_seqlen)
        with pytest.raises(ValueError, match="flatten_packed_sequence_metadata"):
            run_backend("fa4", case, q, k, v, ids, cu_seqlens=cu, packed_token_indices=batch_indices,
                        max_seqlen=max_seqlen)
    ref = reference_attention(flat(q), flat(k), flat(v), case.documents(), None, case.scale)
    assert_same_attention(flat(out), ref, [q, k, v])


# =====================================================================================
# the SDPA fast path
# =====================================================================================


def _random_ids(rows: int, seq: int, docs: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        cuts = torch.sort(torch.randperm(seq - 1, generator=g)[: docs - 1] + 1).values
        bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([seq])])
        out.append(torch.repeat_interleave(torch.arange(1, docs + 1), bounds.diff()))
    return torch.stack(out)


def test_auto_strategy_uses_segments_for_many_documents_and_is_exact() -> None:
    ids = _random_ids(2, 256, 16, seed=0)
    ids[1, -20:] = 0  # trailing padding
    case = Case(ids, ids, heads=4, kv_heads=2, head_dim=16, v_dim=16, window=None, seed=1)
    q, k, v = case.tensors()
    spy = mock.Mock(wraps=backends.sdpa._sdpa_segments)
    with mock.patch.object(backends.sdpa, "_sdpa_segments", spy):
        out = run_backend("sdpa", case, q, k, v, ids)
    assert spy.call_count == 1
    ref = reference_attention(flat(q), flat(k), flat(v), case.documents(), None, case.scale)
    assert_same_attention(flat(out), ref, [q, k, v])


def test_auto_strategy_falls_back_to_dense_when_buckets_would_cost_more() -> None:
    # Lengths 100 and 91 share a bucket padded to 100 (2 * 100^2); the extra
    # 9-token document makes the segment work exceed the dense B * S^2.
    ids = torch.tensor([[1] * 100, [1] * 91 + [2] * 9])
    case = Case(ids, ids, heads=2, kv_heads=2, head_dim=8, v_dim=8, window=None, seed=2)
    q, k, v = case.tensors()
    spy = mock.Mock(wraps=backends.sdpa._sdpa_segments)
    with mock.patch.object(backends.sdpa, "_sdpa_segments", spy):
        out = run_backend("sdpa", case, q, k, v, ids)
    assert spy.call_count == 0
    ref = reference_attention(flat(q), flat(k), flat(v), case.documents(), None, case.scale)
    assert_same_attention(flat(out), ref, [q, k, v])


def test_packed_sdpa_handles_unordered_ids_and_empty_batches() -> None:
    ids = torch.tensor([[2, 2, 1, 1, 2, 0, 1]])  # ids need not increase along the row
    case = Case(ids, ids, heads=2, kv_heads=1, head_dim=8, v_dim=8, window=None, seed=4)
    q, k, v = case.tensors()
    ref = reference_attention(flat(q), flat(k), flat(v), case.documents(), None, case.scale)
    for strategy in ("segments", "dense"):
        out = packed_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ids, scale=case.scale,
                          strategy=strategy).transpose(1, 2)
        torch.testing.assert_close(flat(out), ref, **TOL)
    empty = packed_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), torch.zeros_like(ids))
    assert torch.equal(empty, torch.zeros_like(empty))


# =====================================================================================
# pinned keyword names
# =====================================================================================


def test_pinned_kernel_keyword_names() -> None:
    assert FA4_VARLEN_KWARGS == {
        "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale", "causal",
        "window_size", "softcap", "learnable_sink",
    }
    assert FA4_DENSE_KWARGS == {"softmax_scale", "causal", "window_size", "softcap", "learnable_sink"}
    assert TE_INIT_KWARGS == {
        "num_attention_heads", "kv_channels", "attn_mask_type", "qkv_format", "softmax_scale", "num_gqa_groups",
    }
    assert TE_FORWARD_KWARGS == {
        "attention_mask", "qkv_format", "cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
        "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv", "attn_mask_type", "window_size",
        "pad_between_seqs",
    }
    assert SDPA_CALL_KWARGS >= {"attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"}
    # The fakes mirror the real signatures (names from FA4 4.0.0b36 / TE 2.20 sources).
    fake = FakeFA4()
    assert FA4_VARLEN_KWARGS <= set(inspect.signature(fake.flash_attn_varlen_func).parameters)
    assert FA4_DENSE_KWARGS <= set(inspect.signature(fake.flash_attn_func).parameters)
    assert TE_INIT_KWARGS <= set(inspect.signature(FakeDotProductAttention.__init__).parameters)
    assert TE_FORWARD_KWARGS <= set(inspect.signature(FakeDotProductAttention.forward).parameters)


def test_te_kwargs_emitted_are_pinned() -> None:
    q, k, v = (torch.randn(6, 2, 8) for _ in range(3))
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    bq, bk, bv = (torch.randn(2, 3, 2, 8) for _ in range(3))
    emitted = [
        preprocess_args_and_kwargs_for_attn(q, k, v, None, "te", cu_seqlens=cu, cu_seqlens_padded=cu, max_seqlen=4)[3],
        preprocess_args_and_kwargs_for_attn(q, k, v, None, "te", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                            cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu, max_seqlen_q=4,
                                            max_seqlen_kv=4)[3],
        preprocess_args_and_kwargs_for_attn(bq, bk, bv, torch.tensor([[1, 1, 0], [1, 1, 1]]), "te")[3],
        preprocess_args_and_kwargs_for_attn(bq, bk, bv, None, "te")[3],
    ]
    for kwargs in emitted:
        assert set(kwargs) <= TE_FORWARD_KWARGS
    with fake_te() as te:
        initialize_attn_module_and_func("te", 2, 8, 4, 0.5, num_gqa_groups=1, attention_dropout=0.1)
    (module,) = te.instances
    assert module.init_kwargs["kv_channels"] == (8, 4) and module.init_kwargs["attention_dropout"] == 0.1


def test_fa4_kwargs_passed_are_pinned() -> None:
    case = Case(torch.tensor([[1, 1, 2, 2]]), torch.tensor([[1, 1, 2, 2]]), 2, 1, 8, 8, None, 0)
    q, k, v = case.tensors()
    indices, cu, max_seqlen = case.flat_metadata()
    sink = torch.zeros(2)
    with fake_fa4() as fake:
        run_backend("fa4", case, q, k, v, None, softcap=30.0, learnable_sink=sink)
        run_backend("fa4", case, q, k, v, None, cu_seqlens=cu, packed_token_indices=indices, max_seqlen=max_seqlen,
                    softcap=30.0, learnable_sink=sink, window_size=(3, 0))
    dense, varlen = fake.calls
    assert dense["softcap"] == 30.0 and dense["learnable_sink"] is sink
    assert varlen["softcap"] == 30.0 and varlen["learnable_sink"] is sink and varlen["window_size"] == (2, None)
    assert varlen["max_seqlen_q"] == varlen["max_seqlen_k"] == 2 and varlen["softmax_scale"] == case.scale


# =====================================================================================
# compatibility with nemo-automodel 0.7.0
# =====================================================================================


@pytest.fixture(scope="module")
def automodel() -> Any:
    try:
        from nemo_automodel.components.attention import utils
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available here"
        pytest.skip(f"nemo_automodel.components.attention.utils (nemo-automodel 0.7.0) does not import: {exc!r}")
    return utils


def _assert_same_outputs(ours: tuple, theirs: tuple) -> None:
    for a, b in zip(ours[:3], theirs[:3]):
        assert a.shape == b.shape and torch.equal(a, b)
    assert set(ours[3]) == set(theirs[3]), (sorted(ours[3]), sorted(theirs[3]))
    for key, value in theirs[3].items():
        mine = ours[3][key]
        if isinstance(value, torch.Tensor):
            assert isinstance(mine, torch.Tensor) and mine.shape == value.shape and mine.dtype == value.dtype, key
            assert torch.equal(mine, value), key
        else:
            assert mine == value, key


def _compat_inputs() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    b, s, h, hkv, d = 2, 6, 4, 2, 8
    bshd = [torch.randn(b, s, n, d, generator=g) for n in (h, hkv, hkv)]
    thd = [torch.randn(10, n, d, generator=g) for n in (h, hkv, hkv)]
    return {"bshd": bshd, "thd": thd, "b": b, "s": s}


def _same_branch_cases() -> list[tuple[str, str, Any, dict[str, Any]]]:
    """(id, attn_impl, mask factory, kwargs) for branches where we match AutoModel exactly."""
    pad_int = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    cu = torch.tensor([0, 3, 7, 10], dtype=torch.int32)
    cu_padded = torch.tensor([0, 4, 8, 10], dtype=torch.int32)
    explicit = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    flat_indices = torch.tensor([0, 1, 2, 3, 6, 7, 8, 9, 10])
    flat_cu = torch.tensor([0, 4, 6, 9], dtype=torch.int32)
    return [
        ("sdpa-none", "sdpa", None, {}),
        ("sdpa-window", "sdpa", None, {"window_size": (3, 0)}),
        ("sdpa-window-scalar", "sdpa", None, {"window_size": 2}),
        ("sdpa-right-window", "sdpa", None, {"window_size": (-1, 2)}),
        ("sdpa-pad-int", "sdpa", pad_int, {}),
        ("sdpa-pad-bool-window", "sdpa", pad_int.bool(), {"window_size": (2, 0)}),
        ("sdpa-all-valid", "sdpa", torch.ones(2, 6, dtype=torch.long), {}),
        ("sdpa-explicit-bool", "sdpa", explicit, {}),
        ("sdpa-explicit-float", "sdpa", torch.zeros(2, 1, 6, 6).masked_fill(~explicit, float("-inf")), {}),
        ("fa4-none", "fa4", None, {}),
        ("fa4-window", "fa4", None, {"window_size": (4, 0)}),
        ("fa4-window-right", "fa4", None, {"window_size": (4, 2)}),
        ("fa4-softcap-sink", "fa4", None, {"softcap": 20.0, "learnable_sink": torch.ones(4)}),
        ("fa4-pad-int", "fa4", pad_int, {}),
        ("fa4-pad-bool-window", "fa4", pad_int.bool(), {"window_size": (3, 0)}),
        ("fa4-metadata", "fa4", None, {"cu_seqlens": flat_cu, "packed_token_indices": flat_indices, "max_seqlen": 4}),
        ("fa4-metadata-with-ids", "fa4", torch.tensor([[1, 1, 2, 2, 0, 0], [1, 1, 0, 2, 2, 2]]),
         {"cu_seqlens": torch.tensor([0, 2, 4, 6, 9], dtype=torch.int32),
          "packed_token_indices": torch.tensor([0, 1, 2, 3, 6, 7, 9, 10, 11]), "max_seqlen": 3}),
        ("fa4-cu-only", "fa4", None, {"cu_seqlens": torch.tensor([0, 6, 12], dtype=torch.int32), "max_seqlen": 6}),
        ("te-none", "te", None, {}),
        ("te-window", "te", None, {"window_size": (7, 0)}),
        ("te-pad-int", "te", pad_int, {}),
        ("te-pad-bool", "te", pad_int.bool(), {"window_size": (2, 0)}),
        ("te-thd", "te", None, {"cu_seqlens": cu, "max_seqlen": 4}),
        ("te-thd-padded", "te", None, {"cu_seqlens": cu, "cu_seqlens_padded": cu_padded, "max_seqlen": 4}),
        ("te-thd-q-kv", "te", None, {"cu_seqlens_q": cu, "cu_seqlens_kv": cu, "max_seqlen_q": 4, "max_seqlen_kv": 4}),
        ("te-thd-q-kv-padded", "te", None, {"cu_seqlens_q": cu, "cu_seqlens_kv": cu, "cu_seqlens_q_padded": cu_padded,
                                            "cu_seqlens_kv_padded": cu_padded}),
    ]


@pytest.mark.automodel
@pytest.mark.parametrize(("attn_impl", "mask", "kwargs"), [c[1:] for c in _same_branch_cases()],
                         ids=[c[0] for c in _same_branch_cases()])
def test_preprocess_matches_automodel(automodel: Any, attn_impl: str, mask: Any, kwargs: dict[str, Any]) -> None:
    inputs = _compat_inputs()
    thd = attn_impl == "te" and any(key.startswith("cu_seqlens") for key in kwargs)
    q, k, v = inputs["thd" if thd else "bshd"]
    ours = preprocess_args_and_kwargs_for_attn(q, k, v, mask, attn_impl, **kwargs)
    theirs = automodel.preprocess_args_and_kwargs_for_attn(q, k, v, mask, attn_impl, **kwargs)
    _assert_same_outputs(ours, theirs)


@pytest.mark.automodel
@pytest.mark.parametrize("case_id", ["sdpa-none", "sdpa-window", "sdpa-pad-int", "sdpa-pad-bool-window",
                                     "sdpa-explicit-bool", "sdpa-explicit-float"])
@pytest.mark.parametrize("num_gqa_groups", [None, 2])
def test_sdpa_callable_matches_automodel(automodel: Any, case_id: str, num_gqa_groups: int | None) -> None:
    (_, attn_impl, mask, kwargs), = [c for c in _same_branch_cases() if c[0] == case_id]
    q, k, v = _compat_inputs()["bshd"]
    if num_gqa_groups is None:  # plain MHA for the non-GQA call
        k, v = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    q2, k2, v2, attn_kwargs = preprocess_args_and_kwargs_for_attn(q, k, v, mask, "sdpa", **kwargs)
    _, ours = initialize_attn_module_and_func("sdpa", 4, 8, 8, 0.3, num_gqa_groups=num_gqa_groups)
    _, theirs = automodel.initialize_attn_module_and_func("sdpa", 4, 8, 8, 0.3, num_gqa_groups=num_gqa_groups)
    torch.testing.assert_close(
        postprocess_output_for_attn(ours(q2, k2, v2, **attn_kwargs), "sdpa"),
        automodel.postprocess_output_for_attn(theirs(q2, k2, v2, **attn_kwargs), "sdpa"),
        rtol=0, atol=0,
    )


@pytest.mark.automodel
def test_fa4_callable_matches_automodel(automodel: Any) -> None:
    """AutoModel's FA4 callable, driven by the same fake kernel, gives the same output as ours."""
    ids = torch.tensor([[1, 1, 2, 2, 0, 0], [1, 1, 0, 2, 2, 2]])
    case = Case(ids, ids, heads=4, kv_heads=2, head_dim=8, v_dim=8, window=3, seed=7)
    q, k, v = case.tensors()
    indices, cu, max_seqlen = case.flat_metadata()
    kwargs = {"cu_seqlens": cu, "packed_token_indices": indices, "max_seqlen": max_seqlen, "window_size": (3, 0)}
    with fake_fa4() as fake:
        out = run_backend("fa4", case, q, k, v, ids, **kwargs)
        fake_module = mock.Mock(
            flash_attn_func=fake.flash_attn_func, flash_attn_varlen_func=fake.flash_attn_varlen_func
        )
        with mock.patch.object(automodel, "safe_import", lambda name: (True, fake_module)):
            _, theirs = automodel.initialize_attn_module_and_func("fa4", 4, 8, 8, case.scale)
        q2, k2, v2, attn_kwargs = automodel.preprocess_args_and_kwargs_for_attn(q, k, v, ids, "fa4", **kwargs)
        torch.testing.assert_close(out, theirs(q2, k2, v2, **attn_kwargs), rtol=0, atol=0)


@pytest.mark.automodel
def test_difference_sdpa_indexed_ids_are_block_causal(automodel: Any) -> None:
    """AutoModel treats ids as a key mask (cross-document attention); ours is block-causal by id."""
    ids = torch.tensor([[1, 1, 1, 2, 2, 2, 0, 0]])
    case = Case(ids, ids, heads=2, kv_heads=2, head_dim=8, v_dim=8, window=None, seed=8)
    q, k, v = case.tensors()
    ref = reference_attention(flat(q), flat(k), flat(v), case.documents(), None, case.scale)
    ours = run_backend("sdpa", case, q, k, v, ids)
    _, func = automodel.initialize_attn_module_and_func("sdpa", 2, 8, 8, case.scale)
    q2, k2, v2, kw = automodel.preprocess_args_and_kwargs_for_attn(q, k, v, ids, "sdpa")
    theirs = automodel.postprocess_output_for_attn(func(q2, k2, v2, **kw), "sdpa")
    torch.testing.assert_close(flat(ours), ref, **TOL)
    assert not torch.allclose(flat(theirs)[3:6], ref[3:6], atol=1e-3)  # their document 2 sees document 1
    assert kw["attn_mask"][0, 0, 4, :3].all()


@pytest.mark.automodel
def test_difference_sdpa_zero_left_window_is_an_error(automodel: Any) -> None:
    q, k, v = _compat_inputs()["bshd"]
    *_, theirs = automodel.preprocess_args_and_kwargs_for_attn(q, k, v, None, "sdpa", window_size=(0, 0))
    assert not theirs["attn_mask"].any()  # AutoModel: nothing visible
    with pytest.raises(ValueError, match=r"window_size: got \(0, 0\); expected a left size >= 1"):
        preprocess_args_and_kwargs_for_attn(q, k, v, None, "sdpa", window_size=(0, 0))


@pytest.mark.automodel
def test_difference_sdpa_explicit_mask_kept_with_window(automodel: Any) -> None:
    q, k, v = _compat_inputs()["bshd"]
    explicit = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    explicit[..., 0] = False  # nobody may attend to key 0
    *_, ours = preprocess_args_and_kwargs_for_attn(q, k, v, explicit, "sdpa", window_size=(3, 0))
    *_, theirs = automodel.preprocess_args_and_kwargs_for_attn(q, k, v, explicit, "sdpa", window_size=(3, 0))
    assert theirs["attn_mask"][..., 1, 0].all()  # AutoModel dropped the explicit mask
    col = torch.arange(6)
    band = (col[None, :] <= col[:, None]) & (col[None, :] > col[:, None] - 3)
    assert torch.equal(ours["attn_mask"], explicit & band)


@pytest.mark.automodel
def test_difference_sdpa_thd_input(automodel: Any) -> None:
    """AutoModel's SDPA transposes THD's (tokens, heads) axes as if BSHD; ours attends per document."""
    q, k, v = _compat_inputs()["thd"]
    cu = torch.tensor([0, 3, 7, 10], dtype=torch.int32)
    theirs = automodel.preprocess_args_and_kwargs_for_attn(q, k, v, None, "sdpa", cu_seqlens=cu)
    assert theirs[0].shape == (10, 8, 4)  # [T, D, H]: not an attention layout
    q2, *_ = preprocess_args_and_kwargs_for_attn(q, k, v, None, "sdpa", cu_seqlens=cu)
    assert q2.shape == (4, 10, 8)  # [H, T, D]


@pytest.mark.automodel
@pytest.mark.parametrize(
    ("attn_impl", "mask", "kwargs", "message"),
    [
        ("te", None, {"cu_seqlens": torch.tensor([0, 4, 10], dtype=torch.int32)}, "max_seqlen: got None"),
        ("te", torch.tensor([[1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1]]), {}, "indexed document ids"),
        ("te", torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]), {}, "a valid token after padding"),
        ("fa4", None, {"packed_token_indices": torch.arange(12)},
         "packed_token_indices: got a tensor without cu_seqlens"),
        ("fa4", None, {"cu_seqlens": torch.tensor([0, 6, 12]), "max_seqlen": 6}, "cu_seqlens: got dtype torch.int64"),
    ],
)
def test_difference_layouts_refused_up_front(
    automodel: Any, attn_impl: str, mask: Any, kwargs: dict[str, Any], message: str
) -> None:
    """AutoModel passes these on (to a kernel that fails or misreads them); we raise a ValueError."""
    inputs = _compat_inputs()
    q, k, v = inputs["thd" if attn_impl == "te" and "cu_seqlens" in kwargs else "bshd"]
    automodel.preprocess_args_and_kwargs_for_attn(q, k, v, mask, attn_impl, **kwargs)  # accepted there
    with pytest.raises(ValueError, match=re.escape(message)):
        preprocess_args_and_kwargs_for_attn(q, k, v, mask, attn_impl, **kwargs)


@pytest.mark.automodel
@pytest.mark.parametrize("mask", [None, torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])], ids=["none", "pad"])
def test_difference_sdpa_gqa_inferred_from_shapes(automodel: Any, mask: torch.Tensor | None) -> None:
    """Without num_gqa_groups AutoModel's callable hands 4 q heads and 2 k heads to SDPA, which raises."""
    case = Case(torch.ones(2, 6, dtype=torch.long), torch.ones(2, 6, dtype=torch.long), 4, 2, 8, 8, None, 9)
    q, k, v = case.tensors()
    q2, k2, v2, kwargs = preprocess_args_and_kwargs_for_attn(q, k, v, mask, "sdpa")
    _, theirs = automodel.initialize_attn_module_and_func("sdpa", 4, 8, 8, case.scale)
    with pytest.raises(RuntimeError):
        theirs(q2, k2, v2, **kwargs)
    _, ours = initialize_attn_module_and_func("sdpa", 4, 8, 8, case.scale)
    out = postprocess_output_for_attn(ours(q2, k2, v2, **kwargs), "sdpa")
    rows = torch.ones(12, dtype=torch.bool) if mask is None else mask.bool().reshape(-1)
    ids = torch.ones(2, 6, dtype=torch.long) if mask is None else mask
    ref = reference_attention(flat(q), flat(k), flat(v), case.documents(ids), None, case.scale)
    assert_same_attention(flat(out), ref, [q, k, v], rows=rows)


@pytest.mark.automodel
def test_difference_none_metadata_is_absent(automodel: Any) -> None:
    q, k, v = _compat_inputs()["bshd"]
    *_, theirs = automodel.preprocess_args_and_kwargs_for_attn(q, k, v, None, "te", cu_seqlens=None)
    assert theirs["qkv_format"] == "thd" and theirs["cu_seqlens_q"] is None  # AutoModel: THD with no offsets
    *_, ours = preprocess_args_and_kwargs_for_attn(q, k, v, None, "te", cu_seqlens=None)
    assert ours == {"window_size": (-1, 0)}


# =====================================================================================
# bad inputs: one ValueError per refused layout
# =====================================================================================

B, S, H, HKV, D = 2, 4, 4, 2, 8


def _bshd(heads: int = H, kv: int = HKV, dv: int = D) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(B, S, heads, D), torch.randn(B, S, kv, D), torch.randn(B, S, kv, dv)


def _thd(tokens: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(tokens, H, D), torch.randn(tokens, HKV, D), torch.randn(tokens, HKV, D)


CU = torch.tensor([0, 2, 6], dtype=torch.int32)
IDS = torch.tensor([[1, 1, 2, 2], [1, 2, 0, 0]])
PAD = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])

BAD_INPUTS: list[tuple[str, str, Callable[[], tuple], dict[str, Any], str]] = [
    # (id, attn_impl, () -> (q, k, v, mask), kwargs, regex on the message)
    ("q-not-tensor", "sdpa", lambda: ([1.0], *_bshd()[1:], None), {}, r"q: got list; expected a torch.Tensor"),
    ("q-rank", "sdpa", lambda: (torch.randn(2, 3), *_bshd()[1:], None), {}, r"q: got shape \(2, 3\); expected BSHD"),
    ("k-rank", "fa4", lambda: (_bshd()[0], *_thd()[1:], None), {}, r"k/v: got shapes .*; expected rank 4"),
    ("k-batch", "sdpa", lambda: (_bshd()[0], torch.randn(3, S, HKV, D), torch.randn(3, S, HKV, D), None), {},
     r"k/v: got batch sizes 3/3; expected q's batch size 2"),
    ("v-leading", "te", lambda: (*_bshd()[:2], torch.randn(B, S + 1, HKV, D), None), {}, r"v: got shape"),
    ("k-head-dim", "sdpa", lambda: (_bshd()[0], torch.randn(B, S, HKV, 4), torch.randn(B, S, HKV, 4), None), {},
     r"k: got head_dim 4; expected q's head_dim 8"),
    ("gqa-divisor", "fa4", lambda: (*_bshd(heads=4, kv=3), None), {}, r"k: got 3 heads with q 4 heads"),
    ("mask-not-tensor", "sdpa", lambda: (*_bshd(), [[1]]), {}, r"attention_mask: got list; expected a torch.Tensor"),
    ("window-len", "sdpa", lambda: (*_bshd(), None), {"window_size": (1, 2, 3)}, r"window_size: got \(1, 2, 3\)"),
    ("window-type", "fa4", lambda: (*_bshd(), None), {"window_size": (1.5, 0)},
     r"window_size: .*expected ints or None"),
    ("window-bool", "sdpa", lambda: (*_bshd(), None), {"window_size": (True, 0)}, r"expected ints or None"),
    ("window-zero-sdpa", "sdpa", lambda: (*_bshd(), IDS), {"window_size": (0, 0)}, r"expected a left size >= 1"),
    ("window-zero-fa4", "fa4", lambda: (*_bshd(), None), {"window_size": 0}, r"expected a left size >= 1"),
    # sdpa masks
    ("sdpa-mask-1d", "sdpa", lambda: (*_bshd(), torch.ones(S)), {}, r"attention_mask: got shape \(4,\)"),
    ("sdpa-mask-3d", "sdpa", lambda: (*_bshd(), torch.ones(B, S, S)), {}, r"attention_mask: got shape \(2, 4, 4\)"),
    ("sdpa-mask-2d-shape", "sdpa", lambda: (*_bshd(), torch.ones(B, S - 1)), {},
     r"attention_mask: got shape \(2, 3\); expected \[batch=2, sequence>=4\]"),
    ("sdpa-mask-negative", "sdpa", lambda: (*_bshd(), -IDS), {}, r"attention_mask: got a negative value"),
    ("sdpa-mask-float", "sdpa", lambda: (*_bshd(), IDS.float()), {}, r"values other than 0/1"),
    ("sdpa-mask-complex", "sdpa", lambda: (*_bshd(), IDS.to(torch.complex64)), {}, r"dtype torch.complex64"),
    ("sdpa-ids-kv-cache", "sdpa", lambda: (torch.randn(B, 2, H, D), *_bshd()[1:], IDS), {},
     r"document ids of shape \(2, 4\) with q length 2 and k length 4"),
    ("sdpa-4d-shape", "sdpa", lambda: (*_bshd(), torch.ones(B, 1, S, S + 1, dtype=torch.bool)), {},
     r"expected an explicit mask broadcastable to \[2, 4, 4, 4\]"),
    ("sdpa-4d-int", "sdpa", lambda: (*_bshd(), torch.ones(B, 1, S, S, dtype=torch.long)), {},
     r"a 4D mask of dtype torch.int64"),
    ("sdpa-thd-mask", "sdpa", lambda: (*_thd(), PAD), {"cu_seqlens": CU},
     r"attention_mask: got shape \(2, 4\) with THD"),
    ("sdpa-thd-no-cu", "sdpa", lambda: (*_thd(), None), {}, r"cu_seqlens: got None with THD q"),
    ("sdpa-thd-k-tokens", "sdpa", lambda: (_thd()[0], *_thd(5)[1:], None), {"cu_seqlens": CU},
     r"k: got 5 tokens; expected q's 6 tokens"),
    ("sdpa-thd-cu-float", "sdpa", lambda: (*_thd(), None), {"cu_seqlens": CU.float()}, r"cu_seqlens: got dtype"),
    ("sdpa-thd-cu-2d", "sdpa", lambda: (*_thd(), None), {"cu_seqlens": CU[None]},
     r"cu_seqlens: got batch-major shape \(1, 3\).*flatten_packed_sequence_metadata"),
    ("sdpa-thd-cu-0d", "sdpa", lambda: (*_thd(), None), {"cu_seqlens": CU[0]}, r"cu_seqlens: got shape \(\)"),
    ("sdpa-thd-cu-list", "sdpa", lambda: (*_thd(), None), {"cu_seqlens": [0, 6]}, r"cu_seqlens: got list"),
    ("sdpa-thd-padded-shape", "sdpa", lambda: (*_thd(), None),
     {"cu_seqlens": CU, "cu_seqlens_padded": torch.tensor([0, 6], dtype=torch.int32)},
     r"cu_seqlens_padded: got shape \(2,\); expected cu_seqlens' shape \(3,\)"),
    # fa4
    ("fa4-thd", "fa4", lambda: (*_thd(), None), {"cu_seqlens": CU, "max_seqlen": 4},
     r"q: got THD shape \(6, 4, 8\); expected BSHD.*pre-packed THD is unsupported"),
    ("fa4-qkv-format", "fa4", lambda: (*_bshd(), None), {"qkv_format": "thd"}, r"qkv_format: got 'thd'"),
    ("fa4-cu-padded", "fa4", lambda: (*_bshd(), None), {"cu_seqlens_padded": CU}, r"cu_seqlens_padded: got a tensor"),
    ("fa4-4d-mask", "fa4", lambda: (*_bshd(), torch.ones(B, 1, S, S, dtype=torch.bool)),
     {"cu_seqlens": CU, "max_seqlen": 4}, r"attention_mask: got shape \(2, 1, 4, 4\); expected None or a \[batch"),
    ("fa4-indices-alone", "fa4", lambda: (*_bshd(), None), {"packed_token_indices": torch.arange(6)},
     r"packed_token_indices: got a tensor without cu_seqlens"),
    ("fa4-mask-shape", "fa4", lambda: (*_bshd(), torch.ones(B, S + 1)), {}, r"attention_mask: got shape \(2, 5\)"),
    ("fa4-mask-empty", "fa4", lambda: (*(torch.randn(B, 0, H, D), torch.randn(B, 0, HKV, D), torch.randn(B, 0, HKV, D)),
                                       torch.ones(B, 0)), {}, r"attention_mask: got an empty mask"),
    ("fa4-indexed-no-metadata", "fa4", lambda: (*_bshd(), IDS), {},
     r"indexed document ids without packed metadata.*flatten_packed_sequence_metadata"),
    ("fa4-no-valid-token", "fa4", lambda: (*_bshd(), torch.zeros(B, S, dtype=torch.bool)), {},
     r"attention_mask: got no valid token"),
    ("fa4-indices-2d", "fa4", lambda: (*_bshd(), None),
     {"cu_seqlens": CU, "packed_token_indices": torch.zeros(B, S, dtype=torch.long), "max_seqlen": 4},
     r"packed_token_indices: got shape \(2, 4\).*flatten_packed_sequence_metadata"),
    ("fa4-cu-2d", "fa4", lambda: (*_bshd(), None),
     {"cu_seqlens": torch.zeros(B, 3, dtype=torch.int32), "packed_token_indices": torch.arange(6), "max_seqlen": 4},
     r"cu_seqlens: got batch-major shape \(2, 3\).*flatten_packed_sequence_metadata"),
    ("fa4-indices-float", "fa4", lambda: (*_bshd(), None),
     {"cu_seqlens": CU, "packed_token_indices": torch.arange(6.0), "max_seqlen": 4},
     r"packed_token_indices: got dtype torch.float32"),
    ("fa4-indices-list", "fa4", lambda: (*_bshd(), None),
     {"cu_seqlens": CU, "packed_token_indices": [0, 1], "max_seqlen": 4}, r"packed_token_indices: got list"),
    ("fa4-no-max-seqlen", "fa4", lambda: (*_bshd(), None), {"cu_seqlens": CU, "packed_token_indices": torch.arange(6)},
     r"max_seqlen: got None with cu_seqlens"),
    ("fa4-max-seqlen-float", "fa4", lambda: (*_bshd(), None),
     {"cu_seqlens": CU, "packed_token_indices": torch.arange(6), "max_seqlen": 4.0}, r"max_seqlen: got float 4.0"),
    ("fa4-max-seqlen-bool", "fa4", lambda: (*_bshd(), None),
     {"cu_seqlens": CU, "packed_token_indices": torch.arange(6), "max_seqlen": True}, r"max_seqlen: got True"),
    ("fa4-k-length", "fa4", lambda: (torch.randn(B, S, H, D), torch.randn(B, S + 1, HKV, D),
                                     torch.randn(B, S + 1, HKV, D), None),
     {"cu_seqlens": CU, "max_seqlen": 4}, r"k: got shape \(2, 5, 2, 8\); expected q's \[batch, sequence\]"),
    ("fa4-physical-cu", "fa4", lambda: (*_bshd(), None), {"cu_seqlens_q": CU, "cu_seqlens_kv": CU},
     r"cu_seqlens_q/cu_seqlens_kv: got physical varlen offsets"),
    # te
    ("te-4d-mask", "te", lambda: (*_bshd(), torch.ones(B, 1, S, S, dtype=torch.bool)), {},
     r"attention_mask: got shape \(2, 1, 4, 4\); expected a 2D \[batch, sequence\] padding mask"),
    ("te-mask-thd", "te", lambda: (*_thd(), PAD), {}, r"attention_mask: got shape \(2, 4\) with q \(6, 4, 8\)"),
    ("te-mask-and-cu", "te", lambda: (*_bshd(), PAD), {"cu_seqlens": CU, "max_seqlen": 4},
     r"attention_mask: got a mask together with cu_seqlens"),
    ("te-indexed", "te", lambda: (*_bshd(), IDS), {},
     r"attention_mask: got indexed document ids.*THD q/k/v with cu_seqlens"),
    ("te-left-padded", "te", lambda: (*_bshd(), PAD.flip(1)), {}, r"got a valid token after padding"),
    ("te-cu-bshd", "te", lambda: (*_bshd(), None), {"cu_seqlens": CU, "max_seqlen": 4},
     r"q: got BSHD shape \(2, 4, 4, 8\) with cu_seqlens; expected THD"),
    ("te-cu-int64", "te", lambda: (*_thd(), None), {"cu_seqlens": CU.long(), "max_seqlen": 4},
     r"cu_seqlens: got dtype torch.int64; expected torch.int32"),
    ("te-cu-2d", "te", lambda: (*_thd(), None), {"cu_seqlens": CU[None], "max_seqlen": 4},
     r"cu_seqlens: got batch-major shape"),
    ("te-no-max-seqlen", "te", lambda: (*_thd(), None), {"cu_seqlens": CU}, r"max_seqlen: got None with cu_seqlens"),
    ("te-padded-int64", "te", lambda: (*_thd(), None), {"cu_seqlens": CU, "cu_seqlens_padded": CU.long(),
                                                       "max_seqlen": 4}, r"cu_seqlens_padded: got dtype torch.int64"),
    ("te-padded-shape", "te", lambda: (*_thd(), None),
     {"cu_seqlens": CU, "cu_seqlens_padded": CU[:2], "max_seqlen": 4}, r"cu_seqlens_padded: got shape \(2,\)"),
    ("te-only-cu-q", "te", lambda: (*_thd(), None), {"cu_seqlens_q": CU}, r"cu_seqlens_q/cu_seqlens_kv: got only one"),
    ("te-cu-q-bshd", "te", lambda: (*_bshd(), None), {"cu_seqlens_q": CU, "cu_seqlens_kv": CU},
     r"q: got BSHD shape \(2, 4, 4, 8\) with cu_seqlens_q"),
    ("te-cu-q-int64", "te", lambda: (*_thd(), None), {"cu_seqlens_q": CU.long(), "cu_seqlens_kv": CU},
     r"cu_seqlens_q: got dtype torch.int64"),
    ("te-max-seqlen-q-float", "te", lambda: (*_thd(), None), {"cu_seqlens_q": CU, "cu_seqlens_kv": CU,
                                                             "max_seqlen_q": 2.5}, r"max_seqlen_q: got float 2.5"),
    ("te-thd-no-cu", "te", lambda: (*_thd(), None), {}, r"cu_seqlens: got None with THD q"),
]


@pytest.mark.parametrize(("attn_impl", "make", "kwargs", "pattern"), [c[1:] for c in BAD_INPUTS],
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_raise_value_error(attn_impl: str, make: Callable, kwargs: dict[str, Any], pattern: str) -> None:
    q, k, v, mask = make()
    with pytest.raises(ValueError) as info:
        preprocess_args_and_kwargs_for_attn(q, k, v, mask, attn_impl, **kwargs)
    message = str(info.value)
    assert re.search(pattern, message), message
    assert message.startswith(f"attn_impl={attn_impl!r}: ") and "; expected " in message, message


def test_unknown_attn_impl() -> None:
    q, k, v = _bshd()
    for call in (
        lambda: preprocess_args_and_kwargs_for_attn(q, k, v, None, "flex"),
        lambda: postprocess_output_for_attn(q, "magi"),
        lambda: initialize_attn_module_and_func("eager", H, D, D, 0.3),
    ):
        with pytest.raises(ValueError, match=r"attn_impl: got '\w+'; expected one of \['sdpa', 'fa4', 'te'\]"):
            call()


def test_other_value_errors() -> None:
    q, k, v = (t.transpose(1, 2) for t in _bshd())
    with pytest.raises(ValueError, match=r"document ids: got shape \(2, 3\)"):
        packed_sdpa(q, k, v, IDS[:, :3])
    with pytest.raises(ValueError, match=r"strategy: got 'fast'"):
        packed_sdpa(q, k, v, IDS, strategy="fast")
    _, func = initialize_attn_module_and_func("sdpa", H, D, D, 0.3, num_gqa_groups=HKV)
    q2, k2, v2, kwargs = preprocess_args_and_kwargs_for_attn(*_bshd(), IDS, "sdpa")
    with pytest.raises(ValueError, match=r"attn_mask: got a mask together with packed document ids"):
        func(q2, k2, v2, **kwargs, attn_mask=torch.ones(S, S, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"qkv_format: got 'thd'; expected 'bshd'"):
        initialize_attn_module_and_func("fa4", H, D, D, 0.3, qkv_format="thd")
    with pytest.raises(ValueError, match=r"x: got shape \(2, 3\)"):
        postprocess_output_for_attn(torch.zeros(2, 3), "sdpa")


def test_type_errors_for_unknown_callable_kwargs() -> None:
    with pytest.raises(TypeError, match="Unsupported SDPA attention kwargs"):
        initialize_attn_module_and_func("sdpa", H, D, D, 0.3, attention_dropout=0.1)
    _, func = initialize_attn_module_and_func("sdpa", H, D, D, 0.3)
    with pytest.raises(TypeError, match="Unsupported SDPA attention kwargs"):
        func(*(t.transpose(1, 2) for t in _bshd(kv=H)), window=3)
    with pytest.raises(TypeError, match="Unsupported FA4 initialization kwargs"):
        initialize_attn_module_and_func("fa4", H, D, D, 0.3, attention_dropout=0.1)
    with fake_fa4():
        _, func = initialize_attn_module_and_func("fa4", H, D, D, 0.3)
    with pytest.raises(TypeError, match="Unsupported FA4 attention kwargs"):
        func(*_bshd(), cu_seqlens=CU)


# =====================================================================================
# lazy imports
# =====================================================================================


TE_INSTALL = "pip install --no-build-isolation 'zephon-loader[te]'"  # TE builds against the installed torch
FA4_INSTALL = "pip install 'zephon-loader[fa4]'"


@pytest.mark.parametrize(
    ("attn_impl", "error", "install"),
    [("te", RuntimeError("CUDA driver not found"), TE_INSTALL), ("fa4", FileNotFoundError("nvcc"), FA4_INSTALL),
     ("te", ImportError("no module"), TE_INSTALL), ("fa4", OSError("libcuda.so"), FA4_INSTALL)],
)
def test_import_failures_become_one_import_error(attn_impl: str, error: Exception, install: str) -> None:
    def failing_import(name: str) -> Any:
        raise error

    with mock.patch("importlib.import_module", failing_import):
        with pytest.raises(ImportError, match=re.escape(install)) as info:
            initialize_attn_module_and_func(attn_impl, H, D, D, 0.3)
    assert info.value.__cause__ is error and type(error).__name__ in str(info.value)


@pytest.mark.parametrize("attn_impl", ["te", "fa4"])
def test_import_of_module_without_the_entry_points(attn_impl: str) -> None:
    with mock.patch("importlib.import_module", lambda name: object()):
        with pytest.raises(ImportError, match=re.escape(f"zephon-loader[{attn_impl}]")):
            initialize_attn_module_and_func(attn_impl, H, D, D, 0.3)


def test_real_optional_imports_fail_cleanly_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the real kernels may import")
    for attn_impl in ("te", "fa4"):
        with pytest.raises(ImportError, match=re.escape(f"zephon-loader[{attn_impl}]'")):
            initialize_attn_module_and_func(attn_impl, H, D, D, 0.3)


# =====================================================================================
# no in-place modification, layouts of the outputs
# =====================================================================================


def _snapshot(values: dict[str, Any]) -> dict[str, Any]:
    return {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in values.items()}


def _assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, after[key]), key


@pytest.mark.parametrize(
    ("attn_impl", "layout", "mask", "kwargs"),
    [
        ("sdpa", "bshd", IDS, {"window_size": (2, 0)}),
        ("sdpa", "bshd", PAD, {"window_size": (2, 0)}),
        ("sdpa", "bshd", torch.ones(B, 1, S, S, dtype=torch.bool), {"window_size": (2, 0)}),
        ("sdpa", "thd", None, {"cu_seqlens": CU, "cu_seqlens_padded": CU}),
        ("fa4", "bshd", IDS, {"cu_seqlens": torch.tensor([0, 2, 4, 5, 6], dtype=torch.int32),
                              "packed_token_indices": torch.tensor([0, 1, 2, 3, 4, 5]), "max_seqlen": 2}),
        ("fa4", "bshd", PAD, {"window_size": (2, 0)}),
        ("te", "thd", None, {"cu_seqlens": CU, "cu_seqlens_padded": CU, "max_seqlen": 4}),
        ("te", "bshd", PAD, {}),
    ],
)
def test_callers_tensors_are_never_modified(attn_impl: str, layout: str, mask: Any, kwargs: dict[str, Any]) -> None:
    q, k, v = _bshd() if layout == "bshd" else _thd()
    inputs = {"q": q, "k": k, "v": v, "mask": mask, **kwargs}
    before = _snapshot(inputs)
    with fake_fa4(), fake_te():
        _, func = initialize_attn_module_and_func(attn_impl, H, D, D, 0.3, num_gqa_groups=HKV)
        q2, k2, v2, attn_kwargs = preprocess_args_and_kwargs_for_attn(q, k, v, mask, attn_impl, **kwargs)
        kwargs_before = _snapshot(attn_kwargs)
        out = postprocess_output_for_attn(func(q2, k2, v2, **attn_kwargs), attn_impl)
    _assert_unchanged(before, inputs)
    _assert_unchanged(kwargs_before, attn_kwargs)
    assert all(out.data_ptr() != t.data_ptr() for t in (q, k, v))


def test_postprocess_layouts() -> None:
    x = torch.randn(2, 3, 5, 4)
    assert torch.equal(postprocess_output_for_attn(x, "sdpa"), x.transpose(1, 2))
    assert postprocess_output_for_attn(x, "sdpa").is_contiguous()
    y = torch.randn(3, 7, 4)
    assert torch.equal(postprocess_output_for_attn(y, "sdpa"), y.transpose(0, 1))
    assert postprocess_output_for_attn(x, "fa4") is x and postprocess_output_for_attn(x, "te") is x
