"""Accelerate run for tests/test_accelerate.py: ``prepare`` + ``save_state``/``load_state`` resume, per process.

``python accelerate_worker.py OUT`` (1 process) or under ``torchrun --nproc_per_node 2``: trains a tiny model
for 6 steps, saves the state, trains 6 more (the reference), then a fresh loader and model resume from the
saved folder and train 6 steps; ``OUT/rank{r}.json`` holds both lists of input hashes and whether ``prepare``
returned the loader itself.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device

from zephon_loader import build_text_loader
from zephon_loader import fields as F
from zephon_loader.accelerate import checkpoint_loaders
from lightning_worker import demo_config


def digest(batch) -> str:
    return hashlib.sha1(batch[F.INPUT_IDS].cpu().numpy().tobytes()).hexdigest()[:16]


def steps(accelerator, model, optimizer, batches, n: int) -> list[str]:
    seen = []
    for _ in range(n):
        batch = send_to_device(next(batches), accelerator.device)
        seen.append(digest(batch))
        logits = model(batch[F.INPUT_IDS].clamp(max=511))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[F.LABELS].clamp(max=511).flatten(),
                                                 ignore_index=-100)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return seen


def build(accelerator, how: str = "hooks"):
    """``how``: ``hooks`` (checkpoint_loaders), ``register`` (Accelerate's register_for_checkpointing)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(512, 8), torch.nn.Linear(8, 512))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = build_text_loader(demo_config(passes=None))
    prepared = accelerator.prepare(model, optimizer, loader)
    if how == "register":
        accelerator.register_for_checkpointing(prepared[2])
        handles = None
    else:
        handles = checkpoint_loaders(accelerator, prepared[2])
    return (*prepared, loader, handles)


def main(out: Path, how: str = "hooks") -> int:
    accelerator = Accelerator(cpu=True)
    model, optimizer, prepared, loader, _ = build(accelerator, how)
    batches = iter(prepared)
    head = steps(accelerator, model, optimizer, batches, 6)
    accelerator.save_state(str(out / "ckpt"))
    reference = steps(accelerator, model, optimizer, batches, 6)
    loader.close()
    accelerator = Accelerator(cpu=True)  # the resumed run: a new accelerator, model, optimizer and loader
    model, optimizer, again, loader2, _ = build(accelerator, how)
    accelerator.load_state(str(out / "ckpt"))
    resumed = steps(accelerator, model, optimizer, iter(again), 6)
    loader2.close()
    record = {"head": head, "reference": reference, "resumed": resumed, "same_object": prepared is loader,
              "files": sorted(p.name for p in (out / "ckpt").iterdir()
                              if p.name.startswith(("zephon_loader", "custom_checkpoint")))}
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), *sys.argv[2:]))
