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

``accelerator.register_for_checkpointing(loader)`` works too (Accelerate
saves the main process's state, which resumes any process: every rank's
state is the job's). What the loader checks when it is iterated under an
``Accelerator`` (found in the calling frames):

* ``DataLoaderConfiguration(split_batches=True)`` or ``dispatch_batches=True``
  is refused: Accelerate applies them to its own ``DataLoader`` s only, so
  each process would still read ``micro_batch_size`` rows of its own lane.
* A loader neither hooked nor registered gets one warning: ``save_state``
  would not save its position, and ``load_state`` would restart it.
* A loader built for another number of data-parallel ranks than the
  Accelerator's processes (torchrun's ``WORLD_SIZE`` while a CPU
  ``Accelerator()`` runs one process) is refused.
* ``accelerator.skip_first_batches(loader, n)`` is refused with the fix
  (``AttributeError`` naming it): the loader resumes itself; skipping again
  would skip twice.
"""

from __future__ import annotations

import json
import sys
import warnings
import weakref
from pathlib import Path
from typing import Any

from zephon_loader.loader import ZephonLoader
from zephon_loader.state import write_json_atomically

__all__ = ["STATE_FILE", "check_under_accelerator", "checkpoint_loaders"]

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
    _check_batch_settings(accelerator)
    checkpointed.update(loaders)

    def path(folder: str, index: int) -> Path:
        return Path(folder) / STATE_FILE.format(index=index, rank=accelerator.process_index)

    def save(models: Any, weights: Any, output_dir: str) -> None:
        for index, loader in enumerate(loaders):  # every process takes part: state_dict() may be a collective
            write_json_atomically(path(output_dir, index), loader.state_dict())

    def load(models: Any, input_dir: str) -> None:
        for index, loader in enumerate(loaders):
            if loader.state_scope == "rank":  # each process saved its lanes: every process's file, at any size
                files = sorted(Path(input_dir).glob(STATE_FILE.format(index=index, rank="*")))
                if files:
                    loader.load_state_dict([json.loads(f.read_text()) for f in files])
                    continue
            file = path(input_dir, index)
            if not file.is_file():
                raise FileNotFoundError(
                    f"{file}: no state of loader {index} for process {accelerator.process_index}; expected the file "
                    "accelerator.save_state wrote with checkpoint_loaders(...) registered (resume with as many "
                    "loaders, and a folder saved with the hooks)"
                )
            loader.load_state_dict(json.loads(file.read_text()))

    return [accelerator.register_save_state_pre_hook(save), accelerator.register_load_state_pre_hook(load)]



#: Loaders whose position something saves and restores (checkpoint_loaders, ZephonTrainer): not warned about.
checkpointed: "weakref.WeakSet[ZephonLoader]" = weakref.WeakSet()
#: Loaders already warned about (once each).
_warned: "weakref.WeakSet[ZephonLoader]" = weakref.WeakSet()
#: How far up the stack ``check_under_accelerator`` looks for the user's ``Accelerator``.
_STACK_DEPTH = 12


def check_under_accelerator(loader: ZephonLoader) -> None:
    """Called by ``iter(loader)`` when ``accelerate`` is imported: the checks of the module docstring.

    The ``Accelerator`` is found among the local variables (or a ``self``'s
    ``accelerator`` attribute) of the frames that called ``iter()``; none
    found, nothing is checked.

    Raises:
        ValueError: ``split_batches`` or ``dispatch_batches`` set on that accelerator.
    """
    accelerator = _calling_accelerator(sys._getframe(2))
    if accelerator is None:
        return
    _check_batch_settings(accelerator)
    _check_processes(accelerator, loader)
    registered = any(obj is loader for obj in getattr(accelerator, "_custom_objects", []))
    if registered and loader.state_scope == "rank" and loader.dp_world_size > 1:
        raise ValueError(
            "distributed.state_scope: got 'rank' for a loader registered with accelerator.register_for_checkpointing, "
            "expected 'job' there: Accelerate saves registered objects on the main process only, so the state "
            "would hold that process's lanes and the others could not resume. Use checkpoint_loaders(accelerator, "
            "loader) (one file per process), or distributed.state_scope: job"
        )
    if loader in checkpointed or loader in _warned or any(obj is loader for obj in getattr(accelerator, "_custom_objects", [])):
        return
    _warned.add(loader)
    warnings.warn(
        "zephon_loader: this ZephonLoader is iterated under an accelerate.Accelerator that does not checkpoint it: "
        "accelerator.save_state() will not save its position, and load_state() will leave it at the start of "
        "the stream (its batches would repeat). Call zephon_loader.accelerate.checkpoint_loaders(accelerator, "
        "loader) once after prepare()",
        RuntimeWarning, stacklevel=4,
    )


def _check_processes(accelerator: Any, loader: ZephonLoader) -> None:
    """The loader's data-parallel ranks must be the accelerator's processes (or divide them: model-parallel peers
    read the same lanes)."""
    processes = getattr(accelerator, "num_processes", None)
    ranks = loader.dp_world_size
    if isinstance(processes, int) and processes > 0 and processes % ranks:
        raise ValueError(
            f"ZephonLoader dp_world_size: got {ranks}, expected a divisor of the Accelerator's {processes} "
            f"process(es): the loader deals the data to {ranks} ranks (torchrun's WORLD_SIZE, or dp_world_size=), "
            "so the processes would each train a model of their own on part of the data. Under torchrun on a "
            "CPU machine make the Accelerator use the processes (Accelerator(cpu=True), or ACCELERATE_USE_CPU=1); "
            "or build the loader for the processes the Accelerator runs"
        )


def _check_batch_settings(accelerator: Any) -> None:
    for name in ("split_batches", "dispatch_batches"):
        if getattr(accelerator, name, None) is True:
            raise ValueError(
                f"accelerate {name}: got True, expected False or unset with a ZephonLoader; Accelerate applies it "
                "to its own DataLoaders only, so every process would still read micro_batch_size rows of its own "
                "Zephon lane (the global batch would not be what you configured). Set the loader's "
                "micro_batch_size to the rows each process should get, and leave "
                f"DataLoaderConfiguration({name}=...) unset"
            )


def _calling_accelerator(frame: Any) -> Any:
    """The first ``accelerate.Accelerator`` among the callers' local variables (or ``self.accelerator``)."""
    from accelerate import Accelerator

    for _ in range(_STACK_DEPTH):
        if frame is None:
            return None
        for value in list(frame.f_locals.values()):
            if isinstance(value, Accelerator):
                return value
            nested = getattr(value, "accelerator", None) if not isinstance(value, type) else None
            if isinstance(nested, Accelerator):
                return nested
        frame = frame.f_back
    return None
