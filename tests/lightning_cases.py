"""Lightning checkpoints as users get them by default, for tests/test_lightning_defaults.py.

Each run trains ``lightning_worker.TinyLM`` on the demo at S=256, B=8 (59
batches a pass at one process) and records ``(epoch, batch_idx, sha1 of
input_ids)`` per ``training_step``. A case is a run stopped by its own
checkpoint (Lightning's default ``ModelCheckpoint``, ``save_on_train_epoch_end``,
``every_n_train_steps`` landing on a pass's last batch, ...) and a run resumed
from that checkpoint (``ckpt_path``); "exact" means the two runs' steps are
the uninterrupted run's, step for step, by epoch and batch hash.

As a script (``python lightning_cases.py OUT PHASE DEVICES JSON``) it runs one
fit with Lightning's own DDP launcher (``strategy="ddp"``, CPU, gloo): the
launcher starts the other ranks by running this script again; each rank
builds its loaders in ``train_dataloader()``/``val_dataloader()`` and writes
``OUT/PHASE_rank{r}.json``.
"""

from __future__ import annotations

import glob
import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

import lightning_worker as W
from zephon_loader import build_text_loader
from zephon_loader.lightning import ZephonLoaderCallback

SEQUENCE_LENGTH = 256


def train_config(**overrides: Any) -> dict[str, Any]:
    return W.demo_config(sequence_length=SEQUENCE_LENGTH, **overrides)


def val_config() -> dict[str, Any]:
    return W.demo_config(sequence_length=SEQUENCE_LENGTH, shuffle=False, mixture="once")


class Module(W.TinyLM):
    """TinyLM whose loaders are built where the process group exists (Lightning's DDP launcher)."""

    def __init__(self, val: bool, loader: dict[str, Any] | None = None) -> None:
        super().__init__(build_loader=train_config(**(loader or {})))
        self._val = val

    def val_dataloader(self) -> Any:
        return build_text_loader(val_config()) if self._val else []


def fit(out: Path, *, max_epochs: int, ckpt: str | None = None, callback: bool = True, val: bool = False,
        checkpoint: dict[str, Any] | None = None, devices: int = 1, loader: dict[str, Any] | None = None,
        **kwargs: Any) -> tuple[list[list], int]:
    """One fit; returns the steps it trained and the trainer's global rank.

    ``checkpoint``: ``ModelCheckpoint`` arguments (``{}``: Lightning's default one, after validation at every
    epoch's end); ``None``: no checkpoint. ``callback=False``: the user's callbacks do not name
    ``ZephonLoaderCallback``. ``loader``: keys over the training loader's config.
    """
    callbacks: list[Any] = [ZephonLoaderCallback()] if callback else []
    if checkpoint is not None:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=out, save_top_k=-1, **checkpoint))
    if devices > 1:
        kwargs.update(strategy="ddp", devices=devices)
    trainer = pl.Trainer(default_root_dir=out, max_epochs=max_epochs, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=checkpoint is not None, callbacks=callbacks, num_sanity_val_steps=0,
                         **kwargs)
    module = Module(val, loader)
    trainer.fit(module, ckpt_path=ckpt)
    return module.trained, trainer.global_rank


def only_checkpoint(folder: Path, pattern: str) -> str:
    found = sorted(glob.glob(str(folder / pattern)))
    if len(found) != 1:
        raise AssertionError(f"{folder}: expected one checkpoint {pattern}, found {found}")
    return found[0]


def main(argv: list[str]) -> int:
    out, phase, devices, options = Path(argv[0]), argv[1], int(argv[2]), json.loads(argv[3])
    trained, rank = fit(out / phase, devices=devices, **options)
    (out / f"{phase}_rank{rank}.json").write_text(json.dumps(trained))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
