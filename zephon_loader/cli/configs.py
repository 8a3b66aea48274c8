"""The loader a YAML file describes, for ``zephon-loader run`` and ``inspect``.

* :func:`is_image_config`: whether a YAML file (or a ``dataloader`` mapping) describes an image-text loader.
* :func:`config_and_builder` / :func:`build_from_yaml`: the config a file holds and the builder for its
  kind (:func:`~zephon_loader.build_image_loader` or :func:`~zephon_loader.build_text_loader`).
* :func:`no_batch_error`: the error of a loader that yielded nothing, with the config change that keeps
  each kind of dropped record.

Importing this module imports neither torch, Zephon nor numpy: each function imports what it needs.
"""

from __future__ import annotations

import sys

import argparse

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from zephon_loader.loader import ZephonLoader

__all__ = ["WRAP_HINT", "build_from_yaml", "config_and_builder", "is_image_config", "no_batch_error"]

#: The fix for documents longer than a row that first_fit/best_fit dropped.
WRAP_HINT = "use packing.algorithm: wrap to keep long documents (split across rows)"
#: Keys only an image-text ``dataloader`` section has.
_IMAGE_KEYS = ("processor", "records")


def is_image_config(config: str | Path | Mapping[str, Any]) -> bool:
    """Whether ``config`` (a YAML path or a ``dataloader`` mapping) is an image-text loader config.

    True when its ``_target_`` names :class:`~zephon_loader.config.ImageLoaderConfig`
    (or a subclass, like ``ZephonVLMDataloaderConfig``), or it has ``processor`` or ``records``.
    """
    from zephon_loader.config import LOADER_SECTION, ImageLoaderConfig, load_yaml, resolve_target
    from zephon_loader.config.reader import names_this_package

    node = load_yaml(Path(config)).get(LOADER_SECTION) if isinstance(config, (str, Path)) else config
    if not isinstance(node, Mapping):
        return False
    target = node.get("_target_")
    if names_this_package(target):  # nothing else is imported for a node
        try:
            built = resolve_target(target)
        except (ImportError, ValueError):
            return False  # the reader refuses it, naming the target
        return isinstance(built, type) and issubclass(built, ImageLoaderConfig)
    if isinstance(target, str):
        return False  # the reader refuses it, naming the target
    return any(key in node for key in _IMAGE_KEYS)


def config_path(text: str) -> Path:
    """A ``config`` argument as a path: ``pkg://NAME`` is ``NAME`` in the installed package's ``data/`` (the
    bundled demos: ``pkg://demo.yaml``, ``pkg://image_demo.yaml``, ...), anything else a file path."""
    from zephon_loader.config import PACKAGE_DATA_PREFIX
    from zephon_loader.config.schema import package_data_path

    if text.startswith(PACKAGE_DATA_PREFIX):
        try:
            return package_data_path(text, "config")
        except ValueError as error:  # argparse shows an ArgumentTypeError's own words
            raise argparse.ArgumentTypeError(str(error).removeprefix("config: ")) from None
    return Path(text)


def config_and_builder(config: Path) -> tuple[Any, Callable[[Any], Any]]:
    """The config a YAML file holds and the builder for it: the image-text loader's, or the text loader's.

    Read by :func:`~zephon_loader.config.read_loader_config`, the reader the
    builders use: ``_target_`` optional, relative paths against the file's folder.
    """
    from zephon_loader.config import ImageLoaderConfig, read_loader_config

    if is_image_config(config):
        from zephon_loader import build_image_loader

        return read_loader_config(config, ImageLoaderConfig), build_image_loader
    from zephon_loader import build_text_loader

    return read_loader_config(config), build_text_loader


def build_from_yaml(path: str | Path) -> ZephonLoader:
    """A single-process loader from a YAML file's ``dataloader`` node: image-text or text, by the node."""
    cfg, build = config_and_builder(Path(path))
    return build(cfg)


def no_batch_error(config: Path, dropped: dict[str, Any]) -> ValueError:
    """Why a loader yielded nothing, and the fix for each reason its records were dropped for.

    Args:
        config: The YAML file (named in the message).
        dropped: ``loader.stats()["dropped"]``: reason -> ``{"documents", "first", ...}``.
    """
    from zephon_loader.pipeline.records import LONGER_THAN_ROW

    counts = "; ".join(f"{reason}: {e['documents']:,} (first at {e['first']})" for reason, e in dropped.items())
    fixes = []
    if LONGER_THAN_ROW in dropped:
        fixes.append(f"{WRAP_HINT}, or raise sequence_length")
    if {"too_many_tokens", "too_many_bytes"} & set(dropped):
        fixes.append("raise or unset max_record_tokens / max_record_bytes")
    if set(dropped) - {LONGER_THAN_ROW, "too_many_tokens", "too_many_bytes"}:
        fixes.append("fix the records (or set on_bad_record: error to stop at the first one)")
    return ValueError(
        f"{config}: the loader yielded no batch: "
        + (f"every record was dropped ({counts}); " + "; ".join(fixes) if dropped
           else "the sources yielded no record and nothing was dropped; add data")
    )


def progress(message: str) -> None:
    """One line on stderr while a command works (its report goes to stdout)."""
    print(f"zephon-loader: {message}", file=sys.stderr, flush=True)
