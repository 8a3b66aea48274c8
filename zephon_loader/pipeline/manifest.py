"""``zephon-loader index FOLDER``: hash a source folder's shards once and write their digest manifest.

The manifest (:data:`~zephon_loader.pipeline.digests.MANIFEST_NAME`, beside Zephon's ``index.json``) holds each
file's SHA-256 with the size, mtime and ctime it had when hashed; a build on any machine takes the digests of
unchanged files from it (:func:`zephon_loader.pipeline.digests.lookup`) instead of reading the corpus. This
module lists the folder as a build would (``formats``, ``shards``), so it sits above both.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zephon_loader.pipeline import formats, object_store, shards
from zephon_loader.pipeline.digests import _MANIFEST_FORMAT, _MANIFEST_VERSION, MANIFEST_NAME, _identity, \
    _what_changed, file_sha256
from zephon_loader.state import write_json_atomically

__all__ = ["build_manifest"]


def build_manifest(folder: str | os.PathLike[str], progress: Callable[[str, int], None] | None = None
                   ) -> tuple[Path, int, int]:
    """Hash every file a build of ``folder`` would fingerprint and write the manifest into it.

    The files are listed as a build lists them (JSONL/Parquet shards; every data file of a LitData, Lance
    or Vortex folder). Each is stat'ed before and after it is hashed: one that changed meanwhile stops the
    command (nothing is written).

    Args:
        folder: A local source folder (object storage needs none: its ETags identify the objects).
        progress: Called with each file name and its size after it was hashed.

    Returns:
        ``(manifest path, files, bytes hashed)``.

    Raises:
        ValueError: Not a folder a source reads, a URL, a file changed while hashed, or a folder that
            cannot be written (naming what to do).
    """
    shown = os.fspath(folder)
    where = f"zephon-loader index {shown}"
    if object_store.is_url(shown):
        raise ValueError(f"{where}: got a URL, expected a local folder: objects on storage are identified by "
                         "their ETags, listed at each build without reading a byte, so they need no manifest")
    real = Path(os.path.realpath(folder))
    if formats.owns(shown, real, None):
        _, files, _ = formats.list_files(where, shown, real, None)
    else:
        files, _ = shards.list_shards(where, shown, real)
    entries: dict[str, list[Any]] = {}
    total = 0
    for name in files:
        path = real / name
        before = _identity(path)
        digest = file_sha256(path)
        after = _identity(path)
        if after != before:
            raise ValueError(f"{where}: {_what_changed(os.fspath(path), before, after)} while it was hashed; "
                             "run the command again when nothing writes to the shards")
        entries[name] = [before[0], before[1], before[2], digest]
        total += before[0]
        if progress is not None:
            progress(name, before[0])
    manifest = real / MANIFEST_NAME
    data = {"format": _MANIFEST_FORMAT, "version": _MANIFEST_VERSION,
            "note": "SHA-256 of each file with the size, mtime_ns and ctime_ns it had when hashed; written by "
                    "zephon-loader index; a file changed since is hashed again by the loader (run the command "
                    "again after changing shards)",
            "files": entries}
    try:
        write_json_atomically(manifest, data)
    except OSError as error:
        raise ValueError(f"{where}: cannot write {manifest} ({error}); run it as a user who may write into the "
                         "folder (the one who built Zephon's index.json), or leave the folder without one: the "
                         "loader then hashes the shards in the background on each new machine") from None
    return manifest, len(entries), total
