"""torchrun worker: AutoModel 0.7.0's own CLI entry point on CPU, recording every batch the recipe consumes.

Run as ``torchrun --nproc-per-node N tests/recipe/recipe_worker.py CONFIG.yaml [--key.sub=value ...]``:
``nemo_automodel.cli.app.main`` reads the YAML's ``recipe:`` line, sees it runs inside torchrun and runs
that recipe in this process, exactly as ``torchrun -m nemo_automodel.cli.app CONFIG.yaml`` does.

Before that, this module patches AutoModel's CPU gaps (CUDA-only calls it makes unconditionally:
:data:`CPU_GAPS`, :data:`CUDA_DEVICE_MODULES`) -- here, never in the package -- and wraps the recipe's ``_forward_backward_step`` to
append each batch it receives to ``$ZEPHON_RECIPE_RECORD/rank<R>.jsonl``:
``{"train": bool, "step": int, "input_ids": [[...]], "labels": [[...]], "position_ids": [[...]]}``
(``step`` is the step scheduler's 0-based optimizer step; validation batches carry the step they ran after).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import types
from pathlib import Path

import torch

RECORD_ENV = "ZEPHON_RECIPE_RECORD"


#: torch.cuda calls AutoModel 0.7.0's LLM recipe makes without checking for CUDA that raise on a CPU-only
#: torch, and their stand-ins.
CPU_GAPS = {
    "reset_peak_memory_stats": lambda *args, **kwargs: None,  # TrainFinetuneRecipe.setup, first line
}

#: AutoModel modules that place the model on ``torch.device("cuda", torch.cuda.current_device())``
#: unconditionally (``NeMoAutoModelForCausalLM.from_config`` / ``_build_model``); they get a ``torch``
#: whose CUDA device is the CPU (see :class:`_CpuTorch`).
CUDA_DEVICE_MODULES = ("nemo_automodel._transformers.auto_model",)


class _DeviceType(type):
    """``torch.device`` for those modules: a ``cuda`` device is the CPU; ``isinstance`` checks are torch's."""

    def __call__(cls, *args, **kwargs):
        kind = args[0] if args else kwargs.get("type")
        if isinstance(kind, str) and kind.startswith("cuda"):
            return torch.device("cpu")
        return torch.device(*args, **kwargs)

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, torch.device)


class _CpuDevice(metaclass=_DeviceType):
    pass


class _CpuCuda:
    """``torch.cuda`` for those modules: the current device is the CPU; the rest is torch's."""

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """The ``torch`` module, with :class:`_CpuDevice` and :class:`_CpuCuda` in place of ``device`` and ``cuda``."""

    device = _CpuDevice
    cuda = _CpuCuda()

    def __getattr__(self, name: str):
        return getattr(torch, name)


def patch_cpu_gaps() -> list[str]:
    """Patch AutoModel's CUDA-only calls when there is no CUDA; returns what was patched."""
    if torch.cuda.is_available():
        return []
    patched = []
    for name, value in CPU_GAPS.items():
        setattr(torch.cuda, name, value)
        patched.append(f"torch.cuda.{name}")
    for module_name in CUDA_DEVICE_MODULES:
        module = importlib.import_module(module_name)
        module.torch = _CpuTorch("torch")
        patched.append(f"{module_name}.torch")
    return patched


def _record_batches(directory: Path) -> None:
    from nemo_automodel.recipes.llm.train_ft import TrainFinetuneRecipeForNextTokenPrediction as Recipe

    rank = int(os.environ.get("RANK", "0"))
    path = directory / f"rank{rank}.jsonl"
    original = Recipe._forward_backward_step

    def recording(self, idx, batch, *args, is_train: bool = True, **kwargs):
        entry = {"train": bool(is_train), "step": int(self.step_scheduler.step)}
        for name in ("input_ids", "labels", "position_ids"):
            entry[name] = batch[name].tolist()
        with path.open("a") as handle:
            handle.write(json.dumps(entry) + "\n")
        return original(self, idx, batch, *args, is_train=is_train, **kwargs)

    Recipe._forward_backward_step = recording


def main() -> int:
    patch_cpu_gaps()
    record = os.environ.get(RECORD_ENV)
    if record:
        Path(record).mkdir(parents=True, exist_ok=True)
        _record_batches(Path(record))
    from nemo_automodel.cli.app import main as automodel_main

    sys.argv = ["automodel", *sys.argv[1:]]
    return automodel_main() or 0


if __name__ == "__main__":
    sys.exit(main())
