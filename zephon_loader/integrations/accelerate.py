"""Hugging Face Accelerate: ``prepare`` passes the loader through, ``save_state``/``load_state`` keep its position.

``accelerator.prepare(model, optimizer, loader)`` returns a
:class:`~zephon_loader.loader.ZephonLoader` unchanged: Accelerate re-wraps
and re-shards only ``torch.utils.data.DataLoader`` instances, and Zephon's
lanes already give each process its own data (build the loader after the
process group exists, e.g. after ``Accelerator()``). The loader yields CPU
tensors (pinned when CUDA is available): move a batch with
``accelerate.utils.send_to_device(batch, accelerator.device)``.

Accelerate saves objects registered with ``register_for_checkpointing`` on
the main process only; a loader's position is per process (its lanes, its
read-ahead, its counts). :func:`checkpoint_loaders` hooks the loaders into
``save_state``/``load_state`` with one file per loader and process, written
atomically (a full disk leaves the previous file whole)::

    accelerator = Accelerator()
    loader = build_text_loader("train.yaml")               # lanes from the process group
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    checkpoint_loaders(accelerator, loader)
    ...
    accelerator.save_state("ckpt/step_100")                # model, optimizer, RNG, and each loader
    accelerator.load_state("ckpt/step_100")                # in a new run: the next batch is batch 101
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from zephon_loader.loader import ZephonLoader
from zephon_loader.state import write_json_atomically

__all__ = ["STATE_FILE", "checkpoint_loaders"]

#: File of loader ``index``'s state for process ``rank`` inside a ``save_state`` folder.
STATE_FILE = "zephon_loader_{index}_rank{rank}.json"


def checkpoint_loaders(accelerator: Any, *loaders: ZephonLoader) -> list[Any]:
    """Save and load ``loaders`` with ``accelerator.save_state``/``load_state``, one file per loader and process.

    Returns:
        The two hook handles (``handle.remove()`` undoes the registration).

    Raises:
        TypeError: Something other than a :class:`~zephon_loader.loader.ZephonLoader`.
        FileNotFoundError: At ``load_state``, a folder without this process's loader file (saved without these
            hooks, or by fewer processes).
    """
    if not loaders:
        raise TypeError("checkpoint_loaders: got no loader, expected one or more ZephonLoader objects")
    for index, loader in enumerate(loaders):
        if not isinstance(loader, ZephonLoader):
            raise TypeError(f"checkpoint_loaders: loader {index} is {type(loader).__name__}, expected a ZephonLoader "
                            "(Accelerate checkpoints its own DataLoaders itself)")

    def path(folder: str, index: int) -> Path:
        return Path(folder) / STATE_FILE.format(index=index, rank=accelerator.process_index)

    def save(models: Any, weights: Any, output_dir: str) -> None:
        for index, loader in enumerate(loaders):  # every process takes part: state_dict() may be a collective
            write_json_atomically(path(output_dir, index), loader.state_dict())

    def load(models: Any, input_dir: str) -> None:
        for index, loader in enumerate(loaders):
            file = path(input_dir, index)
            if not file.is_file():
                raise FileNotFoundError(
                    f"{file}: no state of loader {index} for process {accelerator.process_index}; expected the file "
                    "accelerator.save_state wrote with checkpoint_loaders(...) registered (resume with as many "
                    "loaders, and a folder saved with the hooks)"
                )
            loader.load_state_dict(json.loads(file.read_text()))

    return [accelerator.register_save_state_pre_hook(save), accelerator.register_load_state_pre_hook(load)]

