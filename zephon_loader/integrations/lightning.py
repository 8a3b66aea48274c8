"""PyTorch Lightning: exact mid-epoch resume with Lightning's own checkpoints (optional extra ``lightning``).

A :class:`~zephon_loader.loader.ZephonLoader` is not a ``DataLoader``, so
``trainer.fit(module, train_dataloaders=loader, val_dataloaders=val_loader)``
takes it as it is (no worker checks, no sampler injection under DDP: Zephon's
lanes already shard the data per rank), and Lightning saves its
``state_dict()`` in every checkpoint (``loops.fit_loop.state_dict.combined_loader``)
and loads it on ``ckpt_path`` resume.

Lightning's fetcher pulls one batch ahead of ``training_step`` on a loader
without ``len()``, so the state it saves would already count the batch the
step has not trained: a resumed run would start one batch late. The
:class:`ZephonLoaderCallback` tells each training loader how many batches
of the epoch reached ``training_step`` (:meth:`ZephonLoader.set_consumed
<zephon_loader.loader.ZephonLoader.set_consumed>`), so the saved state
describes exactly those::

    trainer = lightning.Trainer(..., callbacks=[ZephonLoaderCallback()])
    trainer.fit(module, train_dataloaders=loader)                  # or ckpt_path=... to resume

Under DDP launched by ``torchrun`` the loader may be built before ``fit``
(the builder takes torchrun's ``RANK``/``WORLD_SIZE``); with Lightning's own
launcher build it where the process group exists (in
``LightningModule.train_dataloader()`` or a ``LightningDataModule``), or pass
``dp_rank``/``dp_world_size``: a loader built before refuses to run under
several ranks.
"""

from __future__ import annotations

from typing import Any, Iterator

try:
    import lightning.pytorch as pl
except ImportError as error:  # pragma: no cover - the extra is missing
    raise ImportError(
        f"zephon_loader.lightning needs PyTorch Lightning ({error}); install it with "
        "`pip install 'zephon-loader[lightning]'` (or `pip install lightning`)"
    ) from error

from zephon_loader.loader import ZephonLoader

__all__ = ["ZephonLoaderCallback", "zephon_loaders"]


class ZephonLoaderCallback(pl.Callback):
    """Keeps the training loaders' states at the batch ``training_step`` reached (see the module docstring).

    At every training batch it calls ``loader.set_consumed(batch_idx + 1)`` on
    each :class:`~zephon_loader.loader.ZephonLoader` among the trainer's
    training dataloaders: the batches of the epoch trained so far, this one
    included, whatever the fetcher pulled beyond it.
    """

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        for loader in zephon_loaders(trainer.train_dataloader):
            loader.set_consumed(batch_idx + 1)


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
