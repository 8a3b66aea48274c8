"""Per-source loss: the mean next-token loss of each mixture source, from ``labels`` and ``source_ids``.

With ``return_source_ids: true`` every batch carries ``source_ids`` int64 ``[B, S]``: for each input token,
the index in ``sources`` of the record it came from (``-1`` at padding). ``labels[b, j]`` is the target
predicted from input token ``j`` (already shifted, ``-100`` = not trained), so the loss at ``(b, j)`` belongs
to ``source_ids[b, j]``. One ``cross_entropy(reduction="none")`` and two scatter-adds give every source's
loss sum and token count; their ratio is the source's mean loss, and the counts-weighted mean of the sources'
means is the batch's ordinary mean loss.

Run it (the bundled demo corpus, a tiny bigram model, CPU, a few seconds)::

    python examples/per_source_loss.py --steps 20
    python examples/per_source_loss.py --steps 3 --json   # one JSON line per step
    python examples/per_source_loss.py --config train.yaml   # your YAML (return_source_ids is turned on)

Lightning and Hugging Face Trainer: see the README section "Per-source loss" (a few lines in
``training_step`` / ``compute_loss`` calling :func:`per_source_loss`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as torch_functional

from zephon_loader import build_text_loader
from zephon_loader import fields as F
from zephon_loader.config import default_config_path


def per_source_loss(logits: torch.Tensor, labels: torch.Tensor, source_ids: torch.Tensor,
                    num_sources: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(mean loss, per-source loss sums [num_sources], per-source token counts [num_sources])`` of one batch.

    Args:
        logits: ``[B, S, V]`` (position ``j`` predicts ``labels[:, j]``).
        labels: int64 ``[B, S]``, ``-100`` where nothing is trained.
        source_ids: int64 ``[B, S]`` from the batch (``-1`` at padding, whose labels are ``-100``).
        num_sources: ``len(sources)``.

    The mean is over every trained token (what ``cross_entropy`` gives); a source's mean is
    ``sums[s] / counts[s]`` (undefined when ``counts[s] == 0``: the batch has no trained token of it).
    """
    losses = torch_functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
    trained = labels.flatten() != F.IGNORE_INDEX
    sources = source_ids.flatten()[trained]
    sums = torch.zeros(num_sources, dtype=losses.dtype, device=losses.device).index_add_(0, sources, losses[trained])
    counts = torch.bincount(sources, minlength=num_sources)
    return losses[trained].sum() / trained.sum().clamp_min(1), sums, counts


class Bigram(torch.nn.Module):
    """The smallest language model: the next token's logits from the current token alone."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.table = torch.nn.Embedding(vocab_size, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.table(input_ids)


def demo_config() -> dict[str, Any]:
    """The bundled demo (two sources: stories, notes) with ``return_source_ids: true``."""
    import yaml

    node = yaml.safe_load(default_config_path().read_text())["dataloader"]
    node.pop("_target_", None)
    node.update(base_dir=str(default_config_path().parent), return_source_ids=True, passes=None,
                runtime={"runner": "threads"})
    return node


def yaml_config(path: str) -> dict[str, Any]:
    """Your YAML's ``dataloader`` node with ``return_source_ids: true`` (paths relative to the file)."""
    import yaml

    node = yaml.safe_load(Path(path).read_text())["dataloader"]
    node.pop("_target_", None)
    node.update(base_dir=str(Path(path).resolve().parent), return_source_ids=True)
    return node


def train(steps: int, *, seed: int = 0, on_step: Any = None, config: str | None = None) -> list[dict[str, Any]]:
    """A plain training loop that logs each source's mean loss per step; returns one record per step.

    ``config``: a YAML file (default: the bundled demo)."""
    torch.manual_seed(seed)
    config = demo_config() if config is None else yaml_config(config)
    names = [source["name"] for source in config["sources"]]
    log = []
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(Path(config["base_dir"]) / config["tokenizer"]["path"])))
    with build_text_loader(config) as loader:
        model = Bigram(vocab)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step, batch in zip(range(steps), loader):
            logits = model(batch[F.INPUT_IDS])
            loss, sums, counts = per_source_loss(logits, batch[F.LABELS], batch[F.SOURCE_IDS], len(names))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            means = sums.detach() / counts.clamp_min(1)
            record = {"step": step, "loss": loss.item(),
                      "per_source": {name: means[k].item() for k, name in enumerate(names) if counts[k]},
                      "tokens": {name: int(counts[k]) for k, name in enumerate(names)}}
            log.append(record)
            if on_step is not None:
                on_step(record, batch, logits.detach())
    return log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", action="store_true", help="one JSON object per step")
    parser.add_argument("--config", default=None, help="your YAML file (default: the bundled demo)")
    args = parser.parse_args(argv)
    for record in train(args.steps, config=args.config):
        if args.json:
            print(json.dumps(record))
        else:
            sources = "  ".join(f"{name} {value:.3f} ({record['tokens'][name]} tok)"
                                for name, value in record["per_source"].items())
            print(f"step {record['step']:3d}  loss {record['loss']:.3f}  {sources}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
