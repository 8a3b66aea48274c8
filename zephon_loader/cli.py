"""``zephon-loader`` command line: ``run`` and ``inspect``.

    zephon-loader run [CONFIG] [--steps N]        # iterate and report (bundled default without CONFIG)
    zephon-loader inspect [CONFIG] --out FILE.png # draw the first batch
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from zephon_loader import fields as F
from zephon_loader.config import default_config_path
from zephon_loader.loader import ZephonLoader


def build_from_yaml(path: str | Path) -> ZephonLoader:
    """A single-process loader from a YAML file's ``dataloader`` node.

    Read by :func:`~zephon_loader.config.read_loader_config`, the same reader
    ``build_text_loader(path)`` uses: ``_target_`` optional, relative paths
    against the file's folder.
    """
    from zephon_loader.builders import build_text_loader

    return build_text_loader(path)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.'):7s} {list(value.shape)}"
    return f"{type(value).__name__:7s} {value!r}"


def _attention_ids(batch: dict[str, Any]) -> torch.Tensor | None:
    """Per-token attention ranges [B, S] from whichever yielded field carries them."""
    if F.PACKED_SEQ_IDS in batch:
        return batch[F.PACKED_SEQ_IDS]
    mask = batch.get(F.ATTENTION_MASK)
    if isinstance(mask, torch.Tensor) and mask.ndim == 2:
        return mask
    return None


def run(config: Path, steps: int | None, out=None) -> dict[str, Any]:
    """Iterate a loader and report throughput and packing statistics (printed to ``out``, default stdout)."""
    from tqdm import tqdm

    out = sys.stdout if out is None else out  # looked up per call, so redirect_stdout/capture work

    started = time.perf_counter()
    with build_from_yaml(config) as loader:
        built = time.perf_counter()
        batches = tokens = padding = supervised = positions = ranges = rows = 0
        first: dict[str, Any] | None = None
        for batch in tqdm(loader, total=steps, desc="batches", unit="batch", file=sys.stderr, leave=False):
            if first is None:
                first = batch
            pad = batch[F.PADDING_MASK]
            batches += 1
            rows += pad.shape[0]
            positions += pad.numel()
            padding += int(pad.sum())
            tokens += pad.numel() - int(pad.sum())
            supervised += int((batch[F.LABELS] != F.IGNORE_INDEX).sum())
            ids = _attention_ids(batch)
            ranges += int(ids.amax(dim=1).sum()) if ids is not None else pad.shape[0]
            if steps is not None and batches >= steps:
                break
        elapsed = time.perf_counter() - built
        stats = loader.stats()
        dropped = stats["dropped"]
    if first is None:
        counts = "; ".join(f"{reason}: {e['documents']} (first at {e['first']})" for reason, e in dropped.items())
        raise ValueError(
            f"{config}: the loader yielded no batch: every record was dropped ({counts or 'no drop recorded'}); "
            "fix the data, raise the limits, or use packing.algorithm: wrap for documents longer than a row"
        )
    report = {
        "config": str(config),
        "batches": batches,
        "build_s": round(built - started, 3),
        "iterate_s": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed) if elapsed > 0 else None,
        "padding_fraction": round(padding / positions, 4),
        "documents_per_row": round(ranges / rows, 2),
        "label_supervised_fraction": round(supervised / positions, 4),
        "fields": {name: _describe(value) for name, value in first.items()},
        "sources": stats["sources"],
        "dropped": dropped,
    }
    print(f"zephon-loader run  {config}", file=out)
    print(f"  batches                 {batches}  (built in {report['build_s']} s, iterated in {report['iterate_s']} s)", file=out)
    print(f"  tokens/s (non-padding)  {report['tokens_per_s']:,}", file=out)
    print(f"  padding fraction        {report['padding_fraction']:.4f}", file=out)
    print(f"  documents per row       {report['documents_per_row']:.2f}  (attention ranges)", file=out)
    print(f"  label-supervised frac.  {report['label_supervised_fraction']:.4f}", file=out)
    for name, entry in report["sources"].items():
        delivered = entry["delivered"]
        print(f"  source {name!r:17s} {delivered['documents']:,} documents, {delivered['tokens']:,} tokens delivered",
              file=out)
    if dropped:
        print("  dropped (loader.stats()):", file=out)
        for reason, entry in dropped.items():
            print(f"    {reason:22s} {entry['documents']:,} documents, {entry['tokens']:,} tokens; first at {entry['first']}",
                  file=out)
    else:
        print("  dropped                 nothing", file=out)
    print("  yielded fields:", file=out)
    for name, text in report["fields"].items():
        print(f"    {name:22s} {text}", file=out)
    return report


def inspect(config: Path, out_png: Path, row: int = 0) -> Path:
    """Draw the first batch: document ids, eligibility, padding, and one row's block mask."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from zephon_loader.finalize import block_causal_mask

    with build_from_yaml(config) as loader:
        try:
            batch = loader.preview()
        except RuntimeError as error:  # an empty stream is a configuration problem, not a crash
            raise ValueError(f"{config}: {error}; lower micro_batch_size or sequence_length, or add data") from error
    ids = batch[F.DOCUMENT_IDS]
    attention_ids = batch[F.ATTENTION_DOCUMENT_IDS]
    padding = batch[F.PADDING_MASK]
    ineligible = (attention_ids == 0) & ~padding
    row = min(max(row, 0), ids.shape[0] - 1)
    mask = block_causal_mask(attention_ids[row : row + 1])[0, 0]

    figure, axes = plt.subplots(2, 2, figsize=(13, 9))
    panels = [
        (axes[0, 0], ids, "document ids per row (0 = padding)", "tab20", None),
        (axes[0, 1], ineligible.int(), f"ineligible tokens: {int(ineligible.sum())}", "Reds", 1),
        (axes[1, 0], padding.int(), f"padding: {int(padding.sum())} tokens", "Greys", 1),
    ]
    for axis, values, title, cmap, top in panels:
        image = axis.imshow(
            values.numpy(), aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=top
        )
        axis.set_title(title)
        axis.set_xlabel("token")
        axis.set_ylabel("row")
        figure.colorbar(image, ax=axis)
    axis = axes[1, 1]
    axis.imshow(mask.numpy(), interpolation="nearest", cmap="Blues")
    axis.set_title(f"row {row}: block-causal mask (query × key, xdoc={loader.settings.xdoc})")
    axis.set_xlabel("key")
    axis.set_ylabel("query")
    figure.suptitle(f"{config.name}: B={ids.shape[0]}, S={ids.shape[1]}, contract={loader.settings.packed_mask_type}")
    figure.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_png, dpi=110)
    plt.close(figure)
    return out_png


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zephon-loader", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="iterate a loader and report throughput and packing statistics")
    run_parser.add_argument("config", nargs="?", type=Path, default=None, help="YAML (default: the bundled demo)")
    run_parser.add_argument("--steps", type=int, default=None, help="stop after N batches (default: one pass)")
    run_parser.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    inspect_parser = commands.add_parser("inspect", help="draw the first batch to a PNG")
    inspect_parser.add_argument("config", nargs="?", type=Path, default=None, help="YAML (default: the bundled demo)")
    inspect_parser.add_argument("--out", type=Path, required=True, help="PNG file to write")
    inspect_parser.add_argument("--row", type=int, default=0, help="row whose block mask is drawn")
    args = parser.parse_args(argv)
    config = args.config if args.config is not None else default_config_path()
    try:
        if args.command == "run":
            if args.steps is not None and args.steps <= 0:
                parser.error(f"--steps: got {args.steps}, expected a positive int")
            report = run(config, args.steps)
            if args.json is not None:
                args.json.write_text(json.dumps(report, indent=2))
        else:
            print(f"wrote {inspect(config, args.out, args.row)}")
    except (ValueError, TypeError, FileNotFoundError, ImportError) as error:
        print(f"zephon-loader: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
