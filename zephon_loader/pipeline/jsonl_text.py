"""JSONL shards read so that a line with bytes that are not UTF-8 is a bad record, not a crash.

Zephon 0.2.0 decodes JSONL shards strictly (``open(..., encoding="utf-8")``):
one undecodable byte anywhere in a shard raises ``UnicodeDecodeError`` from its
count scan at build (``_count_records``) and from every read of that shard,
with no shard or line named and whatever ``on_bad_record`` says.

:func:`install` makes Zephon's JSONL count scan and shard reader decode with
``errors="surrogateescape"``: valid UTF-8 decodes exactly as before (same
lines, same counts, same text), and each undecodable byte ``0xNN`` becomes the
lone surrogate ``U+DCNN`` inside the parsed string. The record checks then see
it like a JSON-escaped lone surrogate (``"\\ud800"``): text that cannot be
encoded as UTF-8 (:data:`~zephon_loader.pipeline.records.REASONS`
``not_utf8``), refused with its source, shard file and line, or left out and
counted under ``on_bad_record: skip``.

Installed when :mod:`zephon_loader.pipeline.records` is imported, so also in
Zephon's worker processes (they import it to unpickle the record checks).
Zephon's module comes from ``zephon_compat.jsonl_reader_module()`` (the one
module that names Zephon's private modules); without it, or with a Zephon
whose JSONL module does not look like 0.2.0's, nothing is changed.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, BinaryIO

__all__ = ["DECODE_ERRORS", "LenientPath", "install", "installed"]

#: How JSONL shards are decoded once :func:`install` ran.
DECODE_ERRORS = "surrogateescape"

_INSTALLED_FLAG = "_zephon_loader_surrogateescape"


def _count_records(stream: BinaryIO) -> int:
    """Zephon's ``_count_records`` (non-blank lines), decoding undecodable bytes as surrogates."""
    text = io.TextIOWrapper(stream, encoding="utf-8", errors=DECODE_ERRORS)
    try:
        return sum(1 for line in text if not line.isspace())
    finally:
        text.detach()  # leave ``stream`` open for the caller


class LenientPath(type(Path())):  # type: ignore[misc]
    """A path whose text-mode ``open()`` decodes with :data:`DECODE_ERRORS` unless told otherwise.

    Zephon's ``JsonlShard`` reads its file only through ``self._path.open("r", encoding="utf-8")``: given
    this path, its own ``__getitem__``, ``__len__`` and ``getsamples`` read undecodable bytes as surrogates.
    """

    def open(self, mode: str = "r", buffering: int = -1, encoding: str | None = None,  # noqa: A003
             errors: str | None = None, newline: str | None = None) -> Any:
        if "b" not in mode and errors is None:
            errors = DECODE_ERRORS
        return super().open(mode, buffering, encoding, errors, newline)


def _shard_class(base: type) -> type:
    """A subclass of Zephon's ``JsonlShard`` reading its file through a :class:`LenientPath` (its logic unchanged)."""

    class JsonlShard(base):  # type: ignore[misc, valid-type]
        def __init__(self, path: Any, *, length: int | None = None) -> None:
            super().__init__(LenientPath(path), length=length)

    JsonlShard.__qualname__ = JsonlShard.__name__ = base.__name__
    JsonlShard.__module__ = __name__
    return JsonlShard


def _zephon_jsonl() -> Any:
    """Zephon's JSONL format module, through :mod:`zephon_loader.zephon_compat` (the one module that reads
    Zephon's private names); ``None`` when the compat layer does not offer it."""
    from zephon_loader import zephon_compat

    reader = getattr(zephon_compat, "jsonl_reader_module", None)
    if reader is None:
        return None
    try:
        return reader()
    except ImportError:  # pragma: no cover - another Zephon layout
        return None


def installed() -> bool:
    """Whether Zephon's JSONL reader decodes with :data:`DECODE_ERRORS` in this process."""
    jsonl = _zephon_jsonl()
    return bool(getattr(jsonl, _INSTALLED_FLAG, False))


def install() -> bool:
    """Make Zephon's JSONL count scan and shard reader decode with :data:`DECODE_ERRORS` (idempotent).

    Returns:
        Whether it is installed (``False``: no ``zephon_compat.jsonl_reader_module``, or this Zephon's JSONL
        module is not the 0.2.0 layout; left alone).
    """
    jsonl = _zephon_jsonl()
    if jsonl is None:
        return False
    if getattr(jsonl, _INSTALLED_FLAG, False):
        return True
    base = getattr(jsonl, "JsonlShard", None)
    if not (callable(getattr(jsonl, "_count_records", None)) and isinstance(base, type)
            and all(hasattr(base, name) for name in ("getsamples", "__getitem__", "__len__", "__init__"))):
        return False  # pragma: no cover - another Zephon layout
    shard = _shard_class(base)
    globals()["JsonlShard"] = shard  # picklable by reference: zephon_loader.pipeline.jsonl_text.JsonlShard
    jsonl._count_records = _count_records
    jsonl.JsonlShard = shard  # JsonlFormat.open_shard looks the name up at each call
    setattr(jsonl, _INSTALLED_FLAG, True)
    return True
