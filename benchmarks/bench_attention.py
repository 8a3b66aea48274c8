"""Packed SDPA on CPU: dense block-causal mask versus the exact per-document fast path.

Both sides run the public three-call sequence of ``zephon_loader.backends``
(``preprocess_args_and_kwargs_for_attn`` -> the ``sdpa`` callable ->
``postprocess_output_for_attn``) on the same packed batch:

* **dense**: the ``block_causal`` representation, a precomputed bool
  ``[B, 1, S, S]`` mask (what the loader yields; building it is not timed),
  consumed by one masked SDPA call;
* **fast**: the ``document_ids`` representation, int64 ``[B, S]`` ids, for which
  the ``sdpa`` callable batches documents of similar length into one causal
  SDPA call per length bucket (``zephon_loader.backends.packed_sdpa``).

Documents have random lengths (uniform random cut points, fixed seed). The
script checks that both outputs agree, then prints the median time of each,
forward and forward+backward, and the dense/fast ratio. Single-threaded.

Usage: ``python benchmarks/bench_attention.py [--docs 4 16] [--repeats 7]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import median_seconds  # noqa: E402

from zephon_loader.backends import (  # noqa: E402
    initialize_attn_module_and_func,
    postprocess_output_for_attn,
    preprocess_args_and_kwargs_for_attn,
)
from zephon_loader.finalize.final_map import block_causal_mask  # noqa: E402  (what the loader yields)


def document_ids(rows: int, seq: int, docs: int, seed: int) -> torch.Tensor:
    """int64 ``[rows, seq]`` 1-based document ids, ``docs`` documents per row at random cut points."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        cuts = torch.sort(torch.randperm(seq - 1, generator=g)[: docs - 1] + 1).values
        bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([seq])])
        out.append(torch.repeat_interleave(torch.arange(1, docs + 1), torch.diff(bounds)))
    return torch.stack(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--docs", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    b, s, h, d = args.batch, args.seq, args.heads, args.head_dim
    _, attn_func = initialize_attn_module_and_func("sdpa", h, d, d, d**-0.5, num_gqa_groups=h)
    g = torch.Generator().manual_seed(args.seed)
    q, k, v = (torch.randn(b, s, h, d, generator=g) for _ in range(3))
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, B={b} S={s} H={h} D={d}, "
          f"fp32, median of {args.repeats}")
    print(f"{'docs/row':>8} {'pass':>9} {'dense ms':>10} {'fast ms':>10} {'ratio':>7}   max|diff|  doc lengths (row 0)")

    for docs in args.docs:
        ids = document_ids(b, s, docs, args.seed + docs)
        mask = block_causal_mask(ids)

        def forward(attention_mask: torch.Tensor, grad: bool = False) -> torch.Tensor:
            leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
            q2, k2, v2, kwargs = preprocess_args_and_kwargs_for_attn(*leaves, attention_mask, "sdpa")
            out = postprocess_output_for_attn(attn_func(q2, k2, v2, **kwargs), "sdpa")
            if grad:
                out.sum().backward()
            return out

        diff = (forward(mask) - forward(ids)).abs().max().item()
        lengths = torch.unique_consecutive(ids[0], return_counts=True)[1].tolist()
        for label, grad in (("fwd", False), ("fwd+bwd", True)):
            dense = median_seconds(lambda: forward(mask, grad), args.repeats)
            fast = median_seconds(lambda: forward(ids, grad), args.repeats)
            print(f"{docs:>8} {label:>9} {dense * 1e3:>10.1f} {fast * 1e3:>10.1f} {dense / fast:>6.1f}x"
                  f"   {diff:.1e}  {lengths if label == 'fwd' else ''}")


if __name__ == "__main__":
    main()
