"""CPU tests of what the real kernels need and do not check (issue 12, items 3-6).

* Device placement: the loader yields (pinned) CPU metadata; every tensor
  handed to a kernel must be on the query's device. q/k/v live on the
  ``meta`` device here, the metadata on CPU, and the fakes
  (``fake_kernels``, as strict as the real kernels) assert every tensor's
  device and record it.
* Windows reach every kernel as tuples (TE asserts on ``[-1, 0]``).
* Guards the kernels enforce deep inside, refused up front: FA4's SM90 GQA
  backward needs ``head_dim == head_dim_v``; its SM100/SM110 head-dim-256
  backward has no local window and no sink (the arch comes from
  ``FLASH_ATTENTION_ARCH``, which FA4 honours too); ``max_seqlen`` must cover
  the longest document; ``softcap``/``learnable_sink`` are well formed.
* TE's ``pad_between_seqs`` only when documents start at padded offsets.
* ``ZEPHON_LOADER_REQUIRE_KERNELS=1`` turns the GPU tests' skips into failures.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from zephon_loader.backends import (
    initialize_attn_module_and_func,
    postprocess_output_for_attn,
    preprocess_args_and_kwargs_for_attn,
)

from fake_kernels import fake_fa4, fake_te  # tests/fake_kernels.py

META = torch.device("meta")
B, S, H, HKV, D = 2, 6, 4, 2, 8
#: Row 0: documents of 2 and 3 tokens, then padding; row 1: one document of 4, a hole, one of 1.
IDS = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 2]])
INDICES = torch.tensor([0, 1, 2, 3, 4, 6, 7, 8, 9, 11])
CU = torch.tensor([0, 2, 5, 9, 10], dtype=torch.int32)
PAD = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
THD_CU = torch.tensor([0, 3, 7, 10], dtype=torch.int32)
THD_PADDED = torch.tensor([0, 4, 8, 12], dtype=torch.int32)


def bshd(device: torch.device | str = "cpu", heads: int = H, kv: int = HKV, dim: int = D, dv: int = D,
         grad: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(B, S, n, d, generator=g) for n, d in ((heads, dim), (kv, dim), (kv, dv))]
    return [t.to(device).requires_grad_(grad) for t in out]


def thd(device: torch.device | str = "cpu", tokens: int = 12) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(tokens, n, D, generator=g).to(device) for n in (H, HKV, HKV)]


def run(attn_impl: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, **kwargs: Any) -> torch.Tensor:
    _, func = initialize_attn_module_and_func(attn_impl, q.shape[-2], q.shape[-1], v.shape[-1], q.shape[-1] ** -0.5,
                                              num_gqa_groups=k.shape[-2])
    q2, k2, v2, attn_kwargs = preprocess_args_and_kwargs_for_attn(q, k, v, mask, attn_impl, **kwargs)
    return postprocess_output_for_attn(func(q2, k2, v2, **attn_kwargs), attn_impl)


# =====================================================================================
# device placement
# =====================================================================================


KERNEL_CASES: list[tuple[str, str, Callable[[torch.device | str], list[torch.Tensor]], Any, dict[str, Any]]] = [
    ("fa4-packed", "fa4", bshd, IDS, {"cu_seqlens": CU, "packed_token_indices": INDICES, "max_seqlen": 4,
                                      "learnable_sink": torch.zeros(H), "window_size": (3, 0)}),
    ("fa4-padding-mask", "fa4", bshd, PAD, {"softcap": 20.0}),
    ("fa4-dense-sink", "fa4", bshd, None, {"learnable_sink": torch.zeros(H)}),
    ("te-padding-mask", "te", bshd, PAD, {}),
    ("te-thd", "te", thd, None, {"cu_seqlens": THD_CU, "cu_seqlens_padded": THD_PADDED, "max_seqlen": 4}),
    ("te-thd-q-kv", "te", thd, None, {"cu_seqlens_q": THD_CU, "cu_seqlens_kv": THD_CU,
                                      "cu_seqlens_q_padded": THD_PADDED, "cu_seqlens_kv_padded": THD_PADDED,
                                      "max_seqlen_q": 4, "max_seqlen_kv": 4}),
]


@pytest.mark.parametrize(("attn_impl", "make", "mask", "kwargs"), [c[1:] for c in KERNEL_CASES],
                         ids=[c[0] for c in KERNEL_CASES])
def test_every_tensor_reaches_the_kernel_on_the_query_device(
    attn_impl: str, make: Callable, mask: Any, kwargs: dict[str, Any]
) -> None:
    """q/k/v on ``meta``, the loader's metadata on CPU: the kernel sees only ``meta`` tensors."""
    q, k, v = make(META)
    with fake_fa4() as fa4, fake_te() as te:
        _, func = initialize_attn_module_and_func(attn_impl, H, D, D, D**-0.5, num_gqa_groups=HKV)
        q2, k2, v2, attn_kwargs = preprocess_args_and_kwargs_for_attn(q, k, v, mask, attn_impl, **kwargs)
        out = postprocess_output_for_attn(func(q2, k2, v2, **attn_kwargs), attn_impl)
    tensors = {name: value for name, value in attn_kwargs.items() if isinstance(value, torch.Tensor)}
    assert tensors, "the case must hand the kernel at least one auxiliary tensor"
    assert {name: value.device for name, value in tensors.items()} == {name: META for name in tensors}
    calls = fa4.calls if attn_impl == "fa4" else te.instances[0].calls
    assert len(calls) == 1 and calls[0]["devices"] and set(calls[0]["devices"]) == {META}
    assert out.device == META
    expected = (*q.shape[:-1], D) if attn_impl == "fa4" else (*q.shape[:-2], H * D)
    assert out.shape == expected


@pytest.mark.parametrize(
    ("mask", "kwargs"),
    [(IDS, {}), (PAD, {"window_size": (2, 0)}), (torch.ones(B, 1, S, S, dtype=torch.bool), {}), (None, {})],
    ids=["indexed-ids", "padding-mask", "explicit-mask", "none"],
)
def test_sdpa_keywords_are_on_the_query_device(mask: Any, kwargs: dict[str, Any]) -> None:
    _, _, _, attn_kwargs = preprocess_args_and_kwargs_for_attn(*bshd(META), mask, "sdpa", **kwargs)
    assert all(value.device == META for value in attn_kwargs.values() if isinstance(value, torch.Tensor))
    _, _, _, thd_kwargs = preprocess_args_and_kwargs_for_attn(
        *thd(META), None, "sdpa", cu_seqlens=THD_CU, cu_seqlens_padded=THD_PADDED
    )
    assert [value.device for value in thd_kwargs.values() if isinstance(value, torch.Tensor)] == [META]


def test_metadata_already_on_the_query_device_is_passed_through() -> None:
    """No copy when nothing moves: the kernel gets the caller's offsets themselves (never modified)."""
    q, k, v = bshd()
    _, _, _, attn_kwargs = preprocess_args_and_kwargs_for_attn(
        q, k, v, IDS, "fa4", cu_seqlens=CU, packed_token_indices=INDICES, max_seqlen=4
    )
    assert attn_kwargs["cu_seqlens_q"] is CU and attn_kwargs["packed_token_indices"] is INDICES


# =====================================================================================
# windows as tuples
# =====================================================================================


@pytest.mark.parametrize("window", [[-1, 0], [5, 0], (np.int64(5), np.int32(0)), torch.tensor([5, 0]).tolist()])
def test_te_window_lists_become_tuples_before_the_kernel(window: Any) -> None:
    """TE's ``check_set_window_size`` compares with tuple literals: ``[-1, 0]`` fails its assert."""
    q, k, v = thd()
    with fake_te() as te:
        out = run("te", q, k, v, None, cu_seqlens=THD_CU, max_seqlen=4, window_size=window)
    (module,) = te.instances
    sent = module.calls[0]["window_arg"]
    assert type(sent) is tuple and all(type(bound) is int for bound in sent) and sent == tuple(int(x) for x in window)
    assert out.shape == (q.shape[0], H * D)


def test_te_init_window_list_becomes_a_tuple() -> None:
    with fake_te() as te:
        initialize_attn_module_and_func("te", H, D, D, D**-0.5, num_gqa_groups=HKV, window_size=[-1, 0])
    (module,) = te.instances
    assert module.init_kwargs["window_size"] == (-1, 0) and type(module.init_kwargs["window_size"]) is tuple


@pytest.mark.parametrize(
    ("window", "pattern"),
    [(3, r"window_size: got 3; expected a \(left, right\) pair of ints"),
     ((1.5, 0), r"window_size: got \(1\.5, 0\)"),
     ((True, 0), r"window_size: got \(True, 0\)"),
     ((None, 0), r"window_size: got \(None, 0\); expected a \(left, right\) pair of ints \(-1 = unbounded\)"),
     ([1, 2, 3], r"window_size: got \[1, 2, 3\]")],
)
def test_te_malformed_windows_are_refused(window: Any, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        preprocess_args_and_kwargs_for_attn(*thd(), None, "te", cu_seqlens=THD_CU, max_seqlen=4, window_size=window)
    with pytest.raises(ValueError, match=pattern), fake_te():
        initialize_attn_module_and_func("te", H, D, D, D**-0.5, window_size=window)


def test_fa4_callable_takes_a_window_list_as_a_tuple() -> None:
    q, k, v = bshd()
    with fake_fa4() as fa4:
        _, func = initialize_attn_module_and_func("fa4", H, D, D, D**-0.5)
        func(q, k, v, window_size=[np.int64(2), None])
        with pytest.raises(ValueError, match=r"window_size: got \(2\.0, None\); expected a \(left, right\) pair"):
            func(q, k, v, window_size=(2.0, None))
    assert fa4.calls[0]["window_size"] == (2, None) and type(fa4.calls[0]["window_size"]) is tuple
    assert type(fa4.calls[0]["window_size"][0]) is int


def test_fa4_preprocess_window_list_becomes_a_tuple() -> None:
    _, _, _, attn_kwargs = preprocess_args_and_kwargs_for_attn(*bshd(), None, "fa4", window_size=[3, 0])
    assert attn_kwargs["window_size"] == (2, None) and type(attn_kwargs["window_size"]) is tuple


# =====================================================================================
# guards the kernels enforce (FA4 backward limits)
# =====================================================================================


@pytest.fixture
def arch(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Select FA4's kernel family the way FA4 itself allows it: ``FLASH_ATTENTION_ARCH``."""
    monkeypatch.delenv("FLASH_ATTENTION_HD256_GENERIC_BWD", raising=False)
    return lambda value: monkeypatch.setenv("FLASH_ATTENTION_ARCH", value)


def test_fa4_sm90_gqa_backward_needs_equal_head_dims(arch: Callable[[str], None]) -> None:
    arch("sm_90a")
    q, k, v = bshd(heads=4, kv=2, dim=16, dv=8, grad=True)
    with fake_fa4(), pytest.raises(ValueError) as info:
        run("fa4", q, k, v, PAD)
    message = str(info.value)
    assert message.startswith("attn_impl='fa4': v: got head_dim 8 with q/k head_dim 16 and GQA (4 query heads over 2 "
                              "KV heads) on SM90; expected head_dim_v == head_dim"), message
    assert "attn_impl='sdpa' or 'te'" in message


@pytest.mark.parametrize(
    ("arch_value", "heads", "kv", "dim", "dv", "grad"),
    [("sm_90a", 4, 2, 16, 8, False),  # forward only
     ("sm_90a", 4, 4, 16, 8, True),  # MHA: no GQA backward path
     ("sm_90a", 4, 2, 16, 16, True),  # equal head dims
     ("sm_100a", 4, 2, 16, 8, True)],  # not SM90
)
def test_fa4_sm90_guard_is_scoped(arch: Callable[[str], None], arch_value: str, heads: int, kv: int, dim: int,
                                  dv: int, grad: bool) -> None:
    arch(arch_value)
    q, k, v = bshd(heads=heads, kv=kv, dim=dim, dv=dv, grad=grad)
    with fake_fa4():
        out = run("fa4", q, k, v, PAD)
    if grad:
        out.sum().backward()  # the fake raises where the real backward kernel would assert
    assert out.shape == (B, S, heads, dv)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [({"window_size": (8, 0)}, "window_size"), ({"window_size": 1}, "window_size"),
     ({"learnable_sink": torch.zeros(2)}, "learnable_sink")],
)
def test_fa4_hd256_sm100_backward_limits(arch: Callable[[str], None], kwargs: dict[str, Any], argument: str) -> None:
    arch("100")
    q, k, v = bshd(heads=2, kv=2, dim=256, dv=256, grad=True)
    with fake_fa4(), pytest.raises(ValueError) as info:
        run("fa4", q, k, v, None, **kwargs)
    message = str(info.value)
    assert message.startswith(f"attn_impl='fa4': {argument}: got "), message
    assert "with head_dim 256 and gradients on SM100" in message and "dedicated head-dim-256 SM100/SM110 backward" in message


@pytest.mark.parametrize(
    ("arch_value", "kwargs", "grad", "generic"),
    [("100", {"window_size": (8, 0)}, False, False),  # the forward has local attention
     ("100", {"window_size": (-1, 4)}, True, False),  # right-only window: causal, not local
     ("100", {}, True, False),  # no window
     ("110", {"window_size": (8, 0)}, True, True),  # FA4's generic SM100 backward
     ("sm_90a", {"window_size": (8, 0), "learnable_sink": torch.zeros(2)}, True, False)],  # not SM100/SM110
)
def test_fa4_hd256_guard_is_scoped(monkeypatch: pytest.MonkeyPatch, arch: Callable[[str], None], arch_value: str,
                                   kwargs: dict[str, Any], grad: bool, generic: bool) -> None:
    arch(arch_value)
    if generic:
        monkeypatch.setenv("FLASH_ATTENTION_HD256_GENERIC_BWD", "1")
    q, k, v = bshd(heads=2, kv=2, dim=256, dv=256, grad=grad)
    with fake_fa4():
        out = run("fa4", q, k, v, None, **kwargs)
    if grad:
        out.sum().backward()
    assert out.shape == (B, S, 2, 256)


def test_fa4_backward_guards_need_no_arch_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``FLASH_ATTENTION_ARCH`` a CPU tensor names no kernel family: nothing is refused."""
    monkeypatch.delenv("FLASH_ATTENTION_ARCH", raising=False)
    q, k, v = bshd(heads=4, kv=2, dim=16, dv=8, grad=True)
    with fake_fa4():
        run("fa4", q, k, v, PAD).sum().backward()


def test_fa4_malformed_arch_override_is_named(arch: Callable[[str], None]) -> None:
    arch("hopper")
    with fake_fa4(), pytest.raises(ValueError, match=r"FLASH_ATTENTION_ARCH: got 'hopper'; expected an arch"):
        run("fa4", *bshd(grad=True), PAD)


# =====================================================================================
# max_seqlen, softcap, learnable_sink
# =====================================================================================


BAD_ARGUMENTS: list[tuple[str, str, Callable[[], list[torch.Tensor]], Any, dict[str, Any], str]] = [
    ("fa4-max-seqlen-short", "fa4", bshd, IDS, {"cu_seqlens": CU, "packed_token_indices": INDICES, "max_seqlen": 3},
     r"max_seqlen: got 3; expected at least the longest document in cu_seqlens \(4 tokens\)\. The kernels do not "
     r"check it"),
    ("te-max-seqlen-short", "te", thd, None, {"cu_seqlens": THD_CU, "max_seqlen": 3},
     r"max_seqlen: got 3; expected at least the longest document in cu_seqlens \(4 tokens\)"),
    ("te-max-seqlen-q-short", "te", thd, None, {"cu_seqlens_q": THD_CU, "cu_seqlens_kv": THD_CU, "max_seqlen_q": 2},
     r"max_seqlen_q: got 2; expected at least the longest document in cu_seqlens_q \(4 tokens\)"),
    ("te-max-seqlen-kv-short", "te", thd, None, {"cu_seqlens_q": THD_CU, "cu_seqlens_kv": THD_CU,
                                                 "max_seqlen_kv": 3},
     r"max_seqlen_kv: got 3; expected at least the longest document in cu_seqlens_kv \(4 tokens\)"),
    ("te-q-padded-shape", "te", thd, None, {"cu_seqlens_q": THD_CU, "cu_seqlens_kv": THD_CU,
                                            "cu_seqlens_q_padded": THD_PADDED[:2]},
     r"cu_seqlens_q_padded: got shape \(2,\); expected cu_seqlens_q' shape \(4,\)"),
    ("fa4-softcap-negative", "fa4", bshd, None, {"softcap": -1.0}, r"softcap: got -1\.0; expected a finite number >= 0"),
    ("fa4-softcap-nan", "fa4", bshd, None, {"softcap": float("nan")}, r"softcap: got nan"),
    ("fa4-softcap-bool", "fa4", bshd, None, {"softcap": True}, r"softcap: got True"),
    ("fa4-sink-shape", "fa4", bshd, None, {"learnable_sink": torch.zeros(HKV)},
     r"learnable_sink: got torch\.float32 tensor of shape \(2,\); expected a \[heads=4\] float16/bfloat16/float32"),
    ("fa4-sink-dtype", "fa4", bshd, None, {"learnable_sink": torch.zeros(H, dtype=torch.long)},
     r"learnable_sink: got torch\.int64 tensor"),
    ("fa4-sink-list", "fa4", bshd, None, {"learnable_sink": [0.0] * H}, r"learnable_sink: got list"),
]


@pytest.mark.parametrize(("attn_impl", "make", "mask", "kwargs", "pattern"), [c[1:] for c in BAD_ARGUMENTS],
                         ids=[c[0] for c in BAD_ARGUMENTS])
def test_arguments_the_kernels_trust_are_checked(
    attn_impl: str, make: Callable, mask: Any, kwargs: dict[str, Any], pattern: str
) -> None:
    with pytest.raises(ValueError) as info:
        preprocess_args_and_kwargs_for_attn(*make(), mask, attn_impl, **kwargs)
    message = str(info.value)
    assert re.search(pattern, message), message
    assert message.startswith(f"attn_impl={attn_impl!r}: ") and "; expected " in message, message


def test_a_longer_max_seqlen_is_accepted() -> None:
    _, _, _, fa4_kwargs = preprocess_args_and_kwargs_for_attn(
        *bshd(), IDS, "fa4", cu_seqlens=CU, packed_token_indices=INDICES, max_seqlen=S
    )
    _, _, _, te_kwargs = preprocess_args_and_kwargs_for_attn(*thd(), None, "te", cu_seqlens=THD_CU, max_seqlen=12)
    assert fa4_kwargs["max_seqlen_q"] == S and te_kwargs["max_seqlen_kv"] == 12


# =====================================================================================
# TE pad_between_seqs
# =====================================================================================


@pytest.mark.parametrize(
    ("padded", "pads"),
    [(THD_CU.clone(), False),  # same offsets, another tensor (TE's auto-detection would say True)
     (torch.tensor([0, 3, 7, 12], dtype=torch.int32), False),  # tail padding after the last document only
     (THD_PADDED, True),  # documents start at padded offsets
     (torch.tensor([0, 3, 8, 12], dtype=torch.int32), True)],  # one gap is enough
    ids=["equal", "tail-only", "between", "one-gap"],
)
def test_te_pad_between_seqs_only_when_documents_move(padded: torch.Tensor, pads: bool) -> None:
    q, k, v = thd()
    for kwargs in ({"cu_seqlens": THD_CU, "cu_seqlens_padded": padded, "max_seqlen": 4},
                   {"cu_seqlens_q": THD_CU, "cu_seqlens_kv": THD_CU, "cu_seqlens_q_padded": padded,
                    "cu_seqlens_kv_padded": padded}):
        _, _, _, attn_kwargs = preprocess_args_and_kwargs_for_attn(q, k, v, None, "te", **kwargs)
        assert attn_kwargs["pad_between_seqs"] is pads
        assert torch.equal(attn_kwargs["cu_seqlens_q_padded"], padded)  # forwarded either way, never dropped


def test_te_pad_between_seqs_absent_without_padded_offsets() -> None:
    _, _, _, attn_kwargs = preprocess_args_and_kwargs_for_attn(*thd(), None, "te", cu_seqlens=THD_CU, max_seqlen=4)
    assert "pad_between_seqs" not in attn_kwargs and "cu_seqlens_q_padded" not in attn_kwargs


# =====================================================================================
# the GPU check cannot pass by skipping
# =====================================================================================


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: the GPU tests would not skip here")
@pytest.mark.parametrize("require", ["", "1"])
def test_require_kernels_turns_gpu_skips_into_failures(require: str, tmp_path: Any) -> None:
    """``ZEPHON_LOADER_REQUIRE_KERNELS=1`` (set by scripts/gpu_check.sh): no CUDA is a failure, not a skip."""
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "ZEPHON_LOADER_REQUIRE_KERNELS": require}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--rootdir={tests.parent}",
         str(tests / "test_backends_gpu.py"), "-k", "real_fa4_signatures_equal or te_real_kernel_causal"],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300, check=False,
    )
    output = done.stdout + done.stderr
    if require:
        assert done.returncode == 1 and "3 errors" in output, output[-2000:]
        assert "ZEPHON_LOADER_REQUIRE_KERNELS=1 turns this skip into a failure: needs a CUDA device" in output
    else:
        assert done.returncode == 0 and "3 skipped" in output, output[-2000:]
