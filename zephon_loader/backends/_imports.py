"""Lazy imports of the optional kernel packages (TE, FA4), with one ImportError saying what to install."""

from __future__ import annotations

import importlib
from types import ModuleType


def import_optional(module: str, attn_impl: str, package: str, install: str) -> ModuleType:
    """Import an optional kernel module, turning any failure into one ImportError.

    Broad on purpose: without CUDA, TE raises ``RuntimeError`` at import and
    ``flash_attn.cute`` can raise ``FileNotFoundError`` (no nvcc) or cutlass errors.

    Args:
        module: the module to import (``"flash_attn.cute"``).
        attn_impl / package: the backend and the package, for the message.
        install: the command that installs it (named in the message).
    """
    try:
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - see docstring
        raise ImportError(
            f"attn_impl={attn_impl!r} needs {package} ({module}) with a working CUDA setup, but importing it "
            f"failed with {type(exc).__name__}: {exc}. Install it after a CUDA build of torch with: {install} "
            "(README.md, 'Install on a GPU machine')"
        ) from exc
