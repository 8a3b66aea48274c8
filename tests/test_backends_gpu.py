"""Real kernels on CUDA against the per-document reference, in fp16/bf16 tolerance.

Every test is marked ``gpu`` and skipped (with the reason) where CUDA, or the
optional kernel package (``flash_attn.cute`` for FA4, ``transformer_engine.pytorch``
for TE), is missing. With ``ZEPHON_LOADER_REQUIRE_KERNELS=1`` every such skip
is a failure instead, so a GPU check cannot pass by skipping
(``scripts/gpu_check.sh`` sets it). Run with
``python -m pytest -rs tests/test_backends_gpu.py -m gpu``.

Metadata and masks are handed over as the loader yields them, on pinned CPU
memory (and, for one FA4 case, already on the GPU): the backends move them.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Any

import pytest
import torch

from zephon_loader.backends import (
    FA4_DENSE_KWARGS,
    FA4_VARLEN_KWARGS,
    TE_FORWARD_KWARGS,
    TE_INIT_KWARGS,
    initialize_attn_module_and_func,
    packed_sdpa,
    postprocess_output_for_attn,
    preprocess_args_and_kwargs_for_attn,
)

from fake_kernels import FakeDotProductAttention, FakeFA4  # tests/fake_kernels.py

pytestmark = pytest.mark.gpu

CUDA = torch.cuda.is_available()
#: Set to 1 (scripts/gpu_check.sh does) to turn every missing-CUDA / missing-kernel skip into a failure.
REQUIRE_KERNELS = os.environ.get("ZEPHON_LOADER_REQUIRE_KERNELS", "") == "1"


def _probe(module: str) -> tuple[Any, str]:
    """Import ``module`` if CUDA is present; return (module or None, skip reason)."""
    if not CUDA:
        return None, "needs a CUDA device"
    try:
        return importlib.import_module(module), ""
    except Exception as exc:  # noqa: BLE001 - TE raises RuntimeError, FA4 FileNotFoundError, ...
        return None, f"{module} is not usable here: {type(exc).__name__}: {exc}"


FA4, FA4_REASON = _probe("flash_attn.cute")
TE, TE_REASON = _probe("transformer_engine.pytorch")


def _gate(available: bool, reason: str) -> None:
    """Skip with ``reason``, or fail with it under ``ZEPHON_LOADER_REQUIRE_KERNELS=1``."""
    if available:
        return
    if REQUIRE_KERNELS:
        pytest.fail(f"ZEPHON_LOADER_REQUIRE_KERNELS=1 turns this skip into a failure: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture
def cuda_device() -> None:
    _gate(CUDA, "needs a CUDA device")


@pytest.fixture
def fa4_kernel() -> Any:
    _gate(FA4 is not None, FA4_REASON)
    return FA4


@pytest.fixture
def te_kernel() -> Any:
    _gate(TE is not None, TE_REASON)
    return TE


needs_cuda = pytest.mark.usefixtures("cuda_device")
needs_fa4 = pytest.mark.usefixtures("fa4_kernel")
needs_te = pytest.mark.usefixtures("te_kernel")

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
SCALE = HEAD_DIM**-0.5
#: Max error relative to the largest reference magnitude (outputs and grads).
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 1e-2}


def packed_ids(holes: bool = True) -> torch.Tensor:
    """``[2, 256]`` attention document ids: uneven documents, trailing padding and (optionally) eligibility holes."""
    lengths = [[37, 5, 90, 64, 40], [128, 1, 17, 70]]
    ids = torch.zeros(2, 256, dtype=torch.long)
    for b, row in enumerate(lengths):
        col = 0
        for d, n in enumerate(row):
            ids[b, col : col + n] = d + 1
            col += n
    if holes:
        ids[0, [3, 50, 51, 200]] = 0
        ids[1, [130, 131]] = 0
    return ids


def documents(ids: torch.Tensor) -> list[torch.Tensor]:
    seq = ids.shape[1]
    docs = []
    for b in range(ids.shape[0]):
        for d in sorted(set(ids[b].tolist()) - {0}):
            docs.append(b * seq + torch.nonzero(ids[b] == d).squeeze(1))
    return docs


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    docs: list[torch.Tensor],
    window: int | None,
    softcap: float | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-document fp32 softmax(q k^T) v, causal, window counting keys including the current one.

    q: ``[N, H, D]``, k/v: ``[N, Hkv, D]``; returns ``[N, H, D]`` with zeros outside documents.
    ``softcap`` caps the scaled scores (``c * tanh(s / c)``); ``sink`` ``[H]`` is one extra
    softmax logit per head with no value (FA4's ``learnable_sink``).
    """
    groups = q.shape[1] // k.shape[1]
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    for idx in docs:
        idx = idx.to(q.device)
        qd = q[idx].transpose(0, 1)
        kd = k[idx].repeat_interleave(groups, 1).transpose(0, 1)
        vd = v[idx].repeat_interleave(groups, 1).transpose(0, 1)
        pos = torch.arange(len(idx), device=q.device)
        allowed = pos[None, :] <= pos[:, None]
        if window is not None:
            allowed &= pos[:, None] - pos[None, :] < window
        scores = qd @ kd.transpose(-1, -2) * SCALE
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sink is None:
            probs = scores.softmax(-1)
        else:
            probs = torch.cat([scores, sink[:, None, None].expand(-1, len(idx), 1)], -1).softmax(-1)[..., :-1]
        out = out.index_copy(0, idx, (probs @ vd).transpose(0, 1))
    return out


def leaves(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(low-precision BSHD leaves, fp32 leaves with the same values)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    low = []
    for heads in (HEADS, KV_HEADS, KV_HEADS):
        low.append(torch.randn(*shape, heads, HEAD_DIM, generator=g, device="cuda").to(dtype).requires_grad_())
    return low, [t.detach().float().requires_grad_() for t in low]


def assert_close_to_reference(
    out: torch.Tensor, ref: torch.Tensor, low: list[torch.Tensor], high: list[torch.Tensor], dtype: torch.dtype
) -> None:
    """Forward and grads (under one random upstream grad) within ``TOLERANCE[dtype]`` of the fp32 reference."""
    tol = TOLERANCE[dtype]

    def check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
        err = (got.float() - want).abs().max().item() / max(want.abs().max().item(), 1e-6)
        assert err < tol, f"{what}: relative max error {err:.2e} >= {tol:.0e}"

    check(out, ref, "output")
    upstream = torch.randn(ref.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    got = torch.autograd.grad(out, low, upstream.to(dtype), materialize_grads=True)
    want = torch.autograd.grad(ref, high, upstream, materialize_grads=True)
    for name, a, b in zip(("q", "k", "v", "learnable_sink"), got, want):
        check(a, b, f"grad of {name}")


def run(attn_impl: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, **kwargs: Any) -> torch.Tensor:
    _, func = initialize_attn_module_and_func(attn_impl, HEADS, HEAD_DIM, HEAD_DIM, SCALE, num_gqa_groups=KV_HEADS)
    q2, k2, v2, attn_kwargs = preprocess_args_and_kwargs_for_attn(q, k, v, mask, attn_impl, **kwargs)
    return postprocess_output_for_attn(func(q2, k2, v2, **attn_kwargs), attn_impl)


def flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, *x.shape[2:])


def flat_metadata(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Gathered-token metadata as the loader yields it: int64 indices ``[T]``, int32 cu_seqlens, pinned CPU."""
    docs = documents(ids)
    lengths = torch.tensor([len(d) for d in docs])
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
    return torch.cat(docs).pin_memory(), cu.pin_memory(), int(lengths.max())


DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
WINDOWS = [pytest.param(None, id="full"), pytest.param(48, id="window48")]


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_sdpa_cuda_indexed_ids(dtype: torch.dtype, window: int | None) -> None:
    ids = packed_ids()
    low, high = leaves(tuple(ids.shape), dtype, seed=1)
    kw = {} if window is None else {"window_size": (window, 0)}
    out = run("sdpa", *low, ids.cuda(), **kw)
    ref = reference_attention(*(flat(t) for t in high), documents(ids), window)
    assert_close_to_reference(flat(out), ref, low, high, dtype)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strategy", ["segments", "dense"])
def test_sdpa_cuda_packed_strategies(dtype: torch.dtype, strategy: str) -> None:
    """Both exact strategies on the CUDA kernels, excluded tokens (fully masked rows) included."""
    ids = packed_ids()
    low, high = leaves(tuple(ids.shape), dtype, seed=6)
    out = packed_sdpa(*(t.transpose(1, 2) for t in low), ids.cuda(), window_left=48, scale=SCALE, strategy=strategy)
    out = out.transpose(1, 2)
    assert torch.isfinite(out).all()
    ref = reference_attention(*(flat(t) for t in high), documents(ids), 48)
    assert_close_to_reference(flat(out), ref, low, high, dtype)


@needs_fa4
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("metadata_on", ["pinned_cpu", "cuda"])
def test_fa4_real_kernel_packed_metadata(dtype: torch.dtype, window: int | None, metadata_on: str) -> None:
    ids = packed_ids()
    low, high = leaves(tuple(ids.shape), dtype, seed=2)
    indices, cu, max_seqlen = flat_metadata(ids)
    mask = ids.pin_memory()
    if metadata_on == "cuda":
        indices, cu, mask = indices.cuda(), cu.cuda(), mask.cuda()
    kw = {} if window is None else {"window_size": (window, 0)}
    out = run("fa4", *low, mask, cu_seqlens=cu, packed_token_indices=indices, max_seqlen=max_seqlen, **kw)
    ref = reference_attention(*(flat(t) for t in high), documents(ids), window)
    assert_close_to_reference(flat(out), ref, low, high, dtype)


@needs_fa4
@pytest.mark.parametrize("dtype", DTYPES)
def test_fa4_real_kernel_padding_mask(dtype: torch.dtype) -> None:
    mask = torch.ones(2, 256, dtype=torch.bool)
    mask[0, 200:] = False
    low, high = leaves(tuple(mask.shape), dtype, seed=3)
    out = run("fa4", *low, mask.pin_memory())
    ref = reference_attention(*(flat(t) for t in high), documents(mask.long()), None)
    assert_close_to_reference(flat(out), ref, low, high, dtype)


@needs_fa4
@pytest.mark.parametrize("window", WINDOWS)
def test_fa4_real_kernel_dense(window: int | None) -> None:
    """No mask and no metadata: FA4's dense ``flash_attn_func`` (bf16)."""
    low, high = leaves((2, 256), torch.bfloat16, seed=7)
    kw = {} if window is None else {"window_size": [window, 0]}  # a YAML/JSON list
    out = run("fa4", *low, None, **kw)
    ref = reference_attention(*(flat(t) for t in high), documents(torch.ones(2, 256, dtype=torch.long)), window)
    assert_close_to_reference(flat(out), ref, low, high, torch.bfloat16)


@needs_fa4
def test_fa4_real_kernel_softcap() -> None:
    """``softcap`` on the varlen kernel (bf16), small enough to change the scores."""
    ids = packed_ids()
    low, high = leaves(tuple(ids.shape), torch.bfloat16, seed=8)
    indices, cu, max_seqlen = flat_metadata(ids)
    out = run("fa4", *low, ids.pin_memory(), cu_seqlens=cu, packed_token_indices=indices, max_seqlen=max_seqlen,
              softcap=2.0)
    ref = reference_attention(*(flat(t) for t in high), documents(ids), None, softcap=2.0)
    assert_close_to_reference(flat(out), ref, low, high, torch.bfloat16)


@needs_fa4
def test_fa4_real_kernel_learnable_sink() -> None:
    """``learnable_sink`` ``[H]`` (fp32) on the dense kernel (bf16), its gradient included."""
    low, high = leaves((2, 256), torch.bfloat16, seed=9)
    g = torch.Generator(device="cuda").manual_seed(10)
    sink = torch.randn(HEADS, generator=g, device="cuda").requires_grad_()
    sink_high = sink.detach().clone().requires_grad_()
    out = run("fa4", *low, None, learnable_sink=sink)
    ref = reference_attention(*(flat(t) for t in high), documents(torch.ones(2, 256, dtype=torch.long)), None,
                              sink=sink_high)
    assert_close_to_reference(flat(out), ref, [*low, sink], [*high, sink_high], torch.bfloat16)


@needs_te
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("physical", [pytest.param(False, id="gathered"), pytest.param(True, id="cu_seqlens_padded")])
@pytest.mark.parametrize("te_left", [pytest.param(None, id="full"), pytest.param(31, id="te_window31")])
def test_te_real_kernel_thd(dtype: torch.dtype, physical: bool, te_left: int | None) -> None:
    # Physical THD (all B*S rows, documents at padded offsets) cannot hold eligibility holes.
    ids = packed_ids(holes=not physical)
    docs = documents(ids)
    lengths = torch.tensor([len(d) for d in docs])
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32).pin_memory()
    low, high = leaves(tuple(ids.shape), dtype, seed=4)
    kw: dict[str, Any] = {"cu_seqlens": cu, "max_seqlen": int(lengths.max())}
    if te_left is not None:
        kw["window_size"] = (te_left, 0)  # TE distances: W + 1 visible keys
    if physical:
        padded = torch.tensor([int(d[0]) for d in docs] + [ids.numel()], dtype=torch.int32)
        kw["cu_seqlens_padded"] = padded.pin_memory()
        streams_low, streams_high, stream_docs = [flat(t) for t in low], [flat(t) for t in high], docs
    else:
        index = torch.cat(docs).cuda()
        streams_low = [flat(t)[index] for t in low]
        streams_high = [flat(t)[index] for t in high]
        bounds = cu.tolist()
        stream_docs = [torch.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    out = run("te", *streams_low, None, **kw).reshape(streams_low[0].shape[0], HEADS, HEAD_DIM)
    ref = reference_attention(*streams_high, stream_docs, None if te_left is None else te_left + 1)
    if physical:  # TE leaves rows between padded documents unspecified unless zero-filled; compare document rows
        rows = torch.zeros(out.shape[0], dtype=torch.bool, device="cuda")
        rows[torch.cat(docs).cuda()] = True
        out = torch.where(rows[:, None, None], out, 0)
    assert_close_to_reference(out, ref, low, high, dtype)


@needs_te
@pytest.mark.parametrize("dtype", DTYPES)
def test_te_real_kernel_cu_seqlens_q_kv(dtype: torch.dtype) -> None:
    """TE's own ``cu_seqlens_q``/``cu_seqlens_kv`` (+ ``max_seqlen_q``/``_kv``), a list window (TE distances)."""
    ids = packed_ids()
    docs = documents(ids)
    lengths = torch.tensor([len(d) for d in docs])
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(torch.int32)
    low, high = leaves(tuple(ids.shape), dtype, seed=11)
    index = torch.cat(docs).cuda()
    streams_low = [flat(t)[index] for t in low]
    streams_high = [flat(t)[index] for t in high]
    longest = int(lengths.max())
    out = run("te", *streams_low, None, cu_seqlens_q=cu.pin_memory(), cu_seqlens_kv=cu.pin_memory(),
              max_seqlen_q=longest, max_seqlen_kv=longest, window_size=[31, 0])
    bounds = cu.tolist()
    stream_docs = [torch.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    ref = reference_attention(*streams_high, stream_docs, 32)
    assert_close_to_reference(out.reshape(-1, HEADS, HEAD_DIM), ref, low, high, dtype)


@needs_te
@pytest.mark.parametrize("dtype", DTYPES)
def test_te_real_kernel_padding_mask(dtype: torch.dtype) -> None:
    mask = torch.ones(2, 256, dtype=torch.long)
    mask[1, 180:] = 0
    low, high = leaves(tuple(mask.shape), dtype, seed=5)
    out = run("te", *low, mask.pin_memory()).reshape(2, 256, HEADS, HEAD_DIM)
    ref = reference_attention(*(flat(t) for t in high), documents(mask), None)
    rows = mask.bool().reshape(-1).cuda()
    assert_close_to_reference(torch.where(rows[:, None, None], flat(out), 0), ref, low, high, dtype)


@needs_te
@pytest.mark.parametrize("dtype", DTYPES)
def test_te_real_kernel_causal_without_mask(dtype: torch.dtype) -> None:
    """BSHD without a mask: the module's own ``causal`` mask type."""
    low, high = leaves((2, 256), dtype, seed=12)
    out = run("te", *low, None).reshape(2, 256, HEADS, HEAD_DIM)
    ref = reference_attention(*(flat(t) for t in high), documents(torch.ones(2, 256, dtype=torch.long)), None)
    assert_close_to_reference(flat(out), ref, low, high, dtype)


def _parameters(function: Any) -> list[tuple[str, Any]]:
    return [(name, p.default) for name, p in inspect.signature(function).parameters.items()]


@needs_fa4
def test_real_fa4_signatures_contain_pinned_keywords() -> None:
    assert FA4_VARLEN_KWARGS <= set(inspect.signature(FA4.flash_attn_varlen_func).parameters)
    assert FA4_DENSE_KWARGS <= set(inspect.signature(FA4.flash_attn_func).parameters)


@needs_fa4
def test_real_fa4_signatures_equal_the_fakes() -> None:
    """The CPU fakes take exactly the installed kernels' parameters, in order, with the same defaults."""
    fake = FakeFA4()
    assert _parameters(fake.flash_attn_varlen_func) == _parameters(FA4.flash_attn_varlen_func)
    assert _parameters(fake.flash_attn_func) == _parameters(FA4.flash_attn_func)


@needs_te
def test_real_te_signatures_contain_pinned_keywords() -> None:
    assert TE_INIT_KWARGS <= set(inspect.signature(TE.DotProductAttention.__init__).parameters)
    assert TE_FORWARD_KWARGS <= set(inspect.signature(TE.DotProductAttention.forward).parameters)


@needs_te
def test_real_te_signatures_equal_the_fakes() -> None:
    assert _parameters(FakeDotProductAttention.__init__) == _parameters(TE.DotProductAttention.__init__)
    assert _parameters(FakeDotProductAttention.forward) == _parameters(TE.DotProductAttention.forward)
