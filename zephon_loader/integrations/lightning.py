"""PyTorch Lightning: exact resume from every checkpoint Lightning writes (optional extra ``lightning``).

A :class:`~zephon_loader.loader.ZephonLoader` is not a ``DataLoader``, so
``trainer.fit(module, train_dataloaders=loader, val_dataloaders=val_loader)``
takes it as it is (no worker checks, no sampler injection under DDP: Zephon's
lanes already shard the data per rank), and Lightning saves its
``state_dict()`` in every checkpoint (``loops.fit_loop.state_dict.combined_loader``).

Two things of Lightning's own would change the data on resume; the
:class:`ZephonLoaderCallback` corrects both, and a training loader adds it to
the trainer by itself when the user did not (at its first ``iter()``):

* **The fetcher pulls one batch ahead** of ``training_step`` on a loader
  without ``len()``, so the state it saves would count a batch not yet
  trained (a resume one batch late). The callback tells each training loader
  at every training batch that one more reached ``training_step``
  (:meth:`ZephonLoader.note_consumed
  <zephon_loader.loader.ZephonLoader.note_consumed>`): the saved state
  describes exactly the trained batches.
* **At an epoch's end Lightning does not restore the loaders** (its default
  ``ModelCheckpoint``, ``save_on_train_epoch_end``, the last batch of an
  epoch or of ``limit_train_batches``): it calls ``iter()`` on the loader as
  built, and ``set_epoch`` only after its fetcher pulled a batch. At
  ``on_train_start`` the callback loads the state Lightning skipped (when its
  pass had ended: what the ranks had left comes first), and when a loader's
  pass is not the epoch Lightning trains next, restarts it there
  (``set_epoch``, then a new ``iter()`` of Lightning's fetcher); again at each
  ``on_train_epoch_start`` (a loader rebuilt by
  ``reload_dataloaders_every_n_epochs`` starts at its epoch 0).

::

    trainer = lightning.Trainer(..., callbacks=[ZephonLoaderCallback()])  # optional: added when missing
    trainer.fit(module, train_dataloaders=loader)                  # or ckpt_path=... to resume

Under DDP launched by ``torchrun`` the loader may be built before ``fit``
(the builder takes torchrun's ``RANK``/``WORLD_SIZE``); with Lightning's own
launcher build it where the process group exists (in
``LightningModule.train_dataloader()`` or a ``LightningDataModule``), or pass
``dp_rank``/``dp_world_size``: a loader built before refuses to run under
several ranks.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Iterator

try:
    import lightning.pytorch as pl
    from lightning.pytorch.loops.fit_loop import _FitLoop
    from lightning.pytorch.utilities.combined_loader import CombinedLoader
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError(
        f"zephon_loader.lightning needs PyTorch Lightning ({error}); install it with "
        "`pip install 'zephon-loader[lightning]'` (or `pip install lightning`)"
    ) from error

from zephon_loader.loader import ZephonLoader

__all__ = ["ZephonLoaderCallback", "attach_to_trainer", "zephon_loaders"]

logger = logging.getLogger(__name__)

#: How far up the stack ``attach_to_trainer`` looks for Lightning's fit loop (it calls ``iter()`` a few frames up).
_STACK_DEPTH = 40


class ZephonLoaderCallback(pl.Callback):
    """Keeps the training loaders on the batches and the epoch Lightning trains (see the module docstring)."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        align_with_trainer(trainer)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        # A loader Lightning rebuilt for this epoch (reload_dataloaders_every_n_epochs) started at its epoch 0.
        align_with_trainer(trainer)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        for loader in zephon_loaders(trainer.train_dataloader):
            loader.note_consumed()


def align_with_trainer(trainer: Any) -> None:
    """Before the first training batch: each training loader reads the epoch ``trainer.current_epoch``.

    Lightning restores loader states only when it resumes inside an epoch
    (``fit_loop.restarting``); at an epoch's end it leaves them in
    ``fit_loop._combined_loader_states_to_load``, and its fetcher has already
    pulled a batch of the pass the loader started by itself. A skipped state
    whose pass ended is loaded (its carry comes first in the next epoch); then
    a loader whose pass is another epoch than Lightning's restarts there, and
    Lightning's fetcher takes a new iterator (dropping the batch it pulled).
    """
    fit_loop = trainer.fit_loop
    loaders = list(zephon_loaders(trainer.train_dataloader))
    if not loaders:
        return
    restart = False
    skipped = getattr(fit_loop, "_combined_loader_states_to_load", None) or []
    if skipped:
        stateful = [dl for dl in CombinedLoader(trainer.train_dataloader).flattened
                    if callable(getattr(dl, "state_dict", None)) and callable(getattr(dl, "load_state_dict", None))]
        if len(stateful) == len(skipped):
            for loader, state in zip(stateful, skipped):
                if isinstance(loader, ZephonLoader) and isinstance(state, dict) and state.get("pass_ended"):
                    loader.load_state_dict(state)
                    restart = True
        fit_loop._combined_loader_states_to_load = []  # applied (or not this loader's to apply): never again
    epoch = trainer.current_epoch
    for loader in loaders:
        if restart or loader.epoch != epoch:
            loader.set_epoch(epoch)
            restart = True
    fetcher = getattr(fit_loop, "_data_fetcher", None)
    if restart and fetcher is not None:
        iter(fetcher)  # a new iterator of every training loader: the pass set above, the pulled batch dropped


def attach_to_trainer(loader: ZephonLoader) -> None:
    """Called by ``iter(loader)``: when Lightning's fit loop is iterating it as a training loader and the
    trainer has no :class:`ZephonLoaderCallback`, add one (the resume would otherwise be one batch late, or
    replay an epoch)."""
    frame = sys._getframe(1)
    for _ in range(_STACK_DEPTH):
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        if isinstance(owner, _FitLoop):
            trainer = owner.trainer
            if loader.state_scope == "rank" and trainer.world_size > 1:
                raise ValueError(
                    f"distributed.state_scope: got 'rank' under a Lightning Trainer of {trainer.world_size} "
                    "processes, expected 'job': Lightning writes its checkpoint on rank 0 only, so the loader state "
                    "in it would hold rank 0's lanes and the other ranks could not resume. Leave "
                    "distributed.state_scope at its default, 'job'"
                )
            if any(isinstance(callback, ZephonLoaderCallback) for callback in trainer.callbacks):
                return
            if any(item is loader for item in zephon_loaders(trainer.train_dataloader)):
                trainer.callbacks.append(ZephonLoaderCallback())
                logger.info("zephon_loader: added ZephonLoaderCallback to the Lightning trainer: it keeps the "
                            "loader's saved state at the trained batches and epoch")
            return
        frame = frame.f_back


def zephon_loaders(dataloaders: Any) -> Iterator[ZephonLoader]:
    """The :class:`~zephon_loader.loader.ZephonLoader` objects in Lightning's dataloaders (one, a list, a mapping
    or a ``CombinedLoader``)."""
    if isinstance(dataloaders, ZephonLoader):
        yield dataloaders
        return
    flattened = getattr(dataloaders, "flattened", None)  # lightning's CombinedLoader
    if flattened is not None:
        dataloaders = flattened
    elif isinstance(dataloaders, dict):
        dataloaders = list(dataloaders.values())
    if isinstance(dataloaders, (list, tuple)):
        for item in dataloaders:
            yield from zephon_loaders(item)
