"""Accelerate run for tests/test_accelerate.py: ``prepare`` + ``save_state``/``load_state`` resume, per process.

``python accelerate_worker.py OUT`` (1 process) or under ``torchrun --nproc_per_node 2``: trains a tiny model
for 6 steps, saves the state, trains 6 more (the reference), then a fresh loader and model resume from the
saved folder and train 6 steps; ``OUT/rank{r}.json`` holds both lists of input hashes and whether ``prepare``
returned the loader itself.

``python accelerate_worker.py OUT rank-two`` (torchrun, 2 processes) and then ``OUT rank-one`` (1 process): the
loader with ``distributed.state_scope: rank`` (:func:`rank_scope`).
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


def row_digests(batch) -> list[str]:
    return [hashlib.sha1(row.cpu().numpy().tobytes()).hexdigest()[:16] for row in batch[F.INPUT_IDS]]


def steps(accelerator, model, optimizer, batches, n: int, rows: list[str] | None = None) -> list[str]:
    """``n`` training steps; returns each batch's digest (and adds each row's to ``rows``)."""
    seen = []
    for _ in range(n):
        batch = send_to_device(next(batches), accelerator.device)
        seen.append(digest(batch))
        if rows is not None:
            rows.extend(row_digests(batch))
        logits = model(batch[F.INPUT_IDS].clamp(max=511))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[F.LABELS].clamp(max=511).flatten(),
                                                 ignore_index=-100)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return seen


def build(accelerator, how: str = "hooks", **overrides):
    """``how``: ``hooks`` (checkpoint_loaders), ``register`` (Accelerate's register_for_checkpointing);
    ``overrides``: keys over the loader config."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(512, 8), torch.nn.Linear(8, 512))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = build_text_loader(demo_config(passes=None, **overrides))
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


#: The loader keys of :func:`rank_scope`: 4 lanes, each process's state holds its own.
RANK_SCOPE = {"distributed": {"canonical_replicas": 4, "state_scope": "rank"}}
#: rank_scope's two processes train HEAD steps, save_state, then REST more.
HEAD, REST = 6, 8


def rank_scope(out: Path, phase: str) -> int:
    """``distributed.state_scope: rank``. ``rank-two`` (2 processes): HEAD steps, ``save_state(OUT/rank_ckpt)``,
    REST steps (each row's hash in ``rows``, the run's whole stream); a new accelerator, model and loader resume
    from the folder and train REST steps (``resumed``); then a loader of that scope registered with
    ``register_for_checkpointing`` is iterated (``refused``: the error's text, or None). ``rank-one`` (1
    process): resume from ``OUT/rank_ckpt`` and train REST steps. Writes ``OUT/{phase}_rank{r}.json``."""
    folder = out / "rank_ckpt"
    accelerator = Accelerator(cpu=True)
    record: dict = {}
    if phase == "rank-two":
        model, optimizer, prepared, loader, _ = build(accelerator, **RANK_SCOPE)
        batches, rows = iter(prepared), []
        record["head"] = steps(accelerator, model, optimizer, batches, HEAD, rows)
        accelerator.save_state(str(folder))
        record["reference"] = steps(accelerator, model, optimizer, batches, REST, rows)
        record["rows"] = rows
        loader.close()
        accelerator.wait_for_everyone()  # every process's file is written before any reads them all
        saved = json.loads((folder / f"zephon_loader_0_rank{accelerator.process_index}.json").read_text())
        record["lanes"] = saved.get("lanes")
        record["files"] = sorted(p.name for p in folder.iterdir() if p.name.startswith("zephon_loader"))
        accelerator = Accelerator(cpu=True)
        model, optimizer, again, loader, _ = build(accelerator, **RANK_SCOPE)
        accelerator.load_state(str(folder))
        record["resumed"] = steps(accelerator, model, optimizer, iter(again), REST)
        loader.close()
        accelerator = Accelerator(cpu=True)
        model, optimizer, registered, loader, _ = build(accelerator, "register", **RANK_SCOPE)
        try:
            iter(registered)
            record["refused"] = None
        except ValueError as error:
            record["refused"] = str(error)
        loader.close()
    else:
        model, optimizer, prepared, loader, _ = build(accelerator, **RANK_SCOPE)
        accelerator.load_state(str(folder))
        record["rows"] = []
        record["resumed"] = steps(accelerator, model, optimizer, iter(prepared), REST, record["rows"])
        loader.close()
    (out / f"{phase}_rank{accelerator.process_index}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    if sys.argv[2:3] in (["rank-two"], ["rank-one"]):
        sys.exit(rank_scope(Path(sys.argv[1]), sys.argv[2]))
    sys.exit(main(Path(sys.argv[1]), *sys.argv[2:]))
