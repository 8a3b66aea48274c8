"""A small Lightning run on a ZephonLoader, for tests/test_lightning.py (in process, or under torchrun for DDP).

Every ``training_step`` records ``(epoch, batch_idx, sha1 of input_ids)``; the
test compares an uninterrupted run with one stopped at a step and resumed
from Lightning's checkpoint (``ckpt_path``). Run as a script (``torchrun
--nproc_per_node 2 tests/lightning_worker.py OUT MODE ...``) it trains with
``strategy="ddp"`` on CPU (gloo) and writes each rank's record to
``OUT/rank{r}.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import yaml

from zephon_loader import build_text_loader
from zephon_loader import fields as F
from zephon_loader.config import default_config_path
from zephon_loader.lightning import ZephonLoaderCallback


def demo_config(**overrides: Any) -> dict[str, Any]:
    """The bundled demo as a mapping: short rows, so a pass holds a few dozen batches."""
    node = yaml.safe_load(default_config_path().read_text())["dataloader"]
    node.pop("_target_", None)
    node.update({"base_dir": str(default_config_path().parent), "sequence_length": 128, "micro_batch_size": 8,
                 "runtime": {"runner": "threads"}, **overrides})
    return node


def digest(batch: dict[str, Any]) -> str:
    return hashlib.sha1(batch[F.INPUT_IDS].numpy().tobytes()).hexdigest()[:16]


class TinyLM(pl.LightningModule):
    """An embedding and a linear head: enough for a loss, an optimizer step and a checkpoint."""

    def __init__(self, vocab: int = 512, build_loader: dict[str, Any] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, 8)
        self.head = torch.nn.Linear(8, vocab)
        self.trained: list[list[Any]] = []
        self.validated: list[str] = []
        self._build_loader = build_loader  # build in train_dataloader() (DDP: the process group exists there)

    def _loss(self, batch: dict[str, Any]) -> torch.Tensor:
        logits = self.head(self.embed(batch[F.INPUT_IDS].clamp(max=self.embed.num_embeddings - 1)))
        labels = batch[F.LABELS].clamp(max=self.embed.num_embeddings - 1)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.trained.append([self.current_epoch, batch_idx, digest(batch)])
        return self._loss(batch)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.validated.append(digest(batch))
        self.log("val_loss", self._loss(batch), batch_size=batch[F.INPUT_IDS].shape[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        if self._build_loader is None:
            raise RuntimeError("pass train_dataloaders= to fit, or build_loader= to the module")
        return build_text_loader(self._build_loader)


def trainer(out: Path, *, max_epochs: int, max_steps: int = -1, every: int | None = None, **kwargs: Any) -> pl.Trainer:
    callbacks: list[Any] = [ZephonLoaderCallback()]
    if every is not None:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=out, every_n_train_steps=every, save_top_k=-1,
                                                      filename="{step}"))
    return pl.Trainer(default_root_dir=out, max_epochs=max_epochs, max_steps=max_steps, accelerator="cpu",
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=every is not None, callbacks=callbacks, num_sanity_val_steps=0, **kwargs)


def main(argv: list[str]) -> int:
    """``OUT MODE STEPS [STOP_STEP|-] [passed]``: MODE ``full`` (uninterrupted), ``stop`` (checkpoint and stop at
    STOP_STEP) or ``resume`` (from OUT/ckpt/step=STOP_STEP.ckpt, on to STEPS); DDP over the torchrun processes.
    ``passed``: the loader is built before ``fit`` and passed to it (else in ``train_dataloader()``).

    The loader is endless (``passes: null``): data-parallel lanes hold different numbers of batches per pass,
    so several ranks train by steps.
    """
    out, mode, steps = Path(argv[0]), argv[1], int(argv[2])
    stop = int(argv[3]) if len(argv) > 3 and argv[3] != "-" else None
    passed_in = len(argv) > 4 and argv[4] == "passed"  # built here, before fit starts the process group
    epochs = len(argv) > 5 and argv[5] == "epochs"  # passes: 1 and max_epochs=STEPS: the ranks agree on pass ends
    if epochs:
        return by_epochs(out, mode, steps, stop, passed_in)
    config = demo_config(passes=None)
    module = TinyLM(build_loader=None if passed_in else config)
    loaders = {"train_dataloaders": build_text_loader(config)} if passed_in else {}
    kwargs: dict[str, Any] = {"strategy": "ddp", "devices": int(os.environ.get("WORLD_SIZE", "1"))}
    ckpt_dir = out / "ckpt"
    if mode == "stop":
        fit = trainer(ckpt_dir, max_epochs=1, max_steps=stop, every=stop, **kwargs)
        fit.fit(module, **loaders)
    elif mode == "resume":
        fit = trainer(ckpt_dir / "resumed", max_epochs=1, max_steps=steps, **kwargs)
        fit.fit(module, ckpt_path=str(ckpt_dir / f"step={stop}.ckpt"), **loaders)
    else:
        fit = trainer(out / "full", max_epochs=1, max_steps=steps, **kwargs)
        fit.fit(module, **loaders)
    (out / f"{mode}_rank{fit.global_rank}.json").write_text(json.dumps(module.trained))
    return 0


def by_epochs(out: Path, mode: str, epochs: int, stop: int | None, passed_in: bool) -> int:
    """As :func:`main`, by epochs: the default ``passes: 1``, ``max_epochs=epochs``; ``stop`` is a global step."""
    config = demo_config()
    module = TinyLM(build_loader=None if passed_in else config)
    loaders = {"train_dataloaders": build_text_loader(config)} if passed_in else {}
    kwargs: dict[str, Any] = {"strategy": "ddp", "devices": int(os.environ.get("WORLD_SIZE", "1"))}
    ckpt_dir = out / "ckpt-epochs"
    if mode == "stop":
        fit = trainer(ckpt_dir, max_epochs=epochs, max_steps=stop, every=stop, **kwargs)
        fit.fit(module, **loaders)
    elif mode == "resume":
        fit = trainer(ckpt_dir / "resumed", max_epochs=epochs, **kwargs)
        fit.fit(module, ckpt_path=str(ckpt_dir / f"step={stop}.ckpt"), **loaders)
    else:
        fit = trainer(out / "full-epochs", max_epochs=epochs, **kwargs)
        fit.fit(module, **loaders)
    (out / f"epochs_{mode}_rank{fit.global_rank}.json").write_text(json.dumps(module.trained))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
