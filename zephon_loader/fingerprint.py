"""The configuration fingerprint a saved state carries: what must match for a resume to be exact.

``ZephonLoader.load_state_dict`` refuses a state whose fingerprint differs from
the loader's, naming the differing keys. It covers everything that changes the
batch stream:

* each source's **shard list**: per shard file (in Zephon's order) its name,
  size in bytes and a SHA-256 of its first and last 64 KiB. Content, not
  paths or mtimes: a run may resume where the data is mounted elsewhere or
  was copied (which changes mtimes), but a different folder, an added,
  removed, truncated or rewritten shard is refused. (An edit in the middle of
  a large shard that keeps its size is not detected: that would need hashing
  every byte on every start.)
* the **tokenizer's identity**: a SHA-256 over the names and contents of the
  files in its folder;
* the packing, sequence, seed, mixture and label settings, the effective
  ``canonical_replicas`` (Zephon's lane count) and the bad-record policy.

Not covered, on purpose: ``read_ahead``, the runtime (runner, workers) and the
DP world size — they do not change the stream, and a state moves between them.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["shard_list_fingerprint", "tokenizer_fingerprint"]

_EDGE_BYTES = 64 * 1024


def shard_list_fingerprint(folder: str | os.PathLike[str], files: tuple[str, ...]) -> list[list[object]]:
    """``[[file name, size, sha256(first + last 64 KiB)[:16]], ...]`` for ``files`` in ``folder``."""
    out: list[list[object]] = []
    for name in files:
        path = Path(folder) / name
        size = path.stat().st_size
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            digest.update(handle.read(_EDGE_BYTES))
            if size > _EDGE_BYTES:
                handle.seek(max(_EDGE_BYTES, size - _EDGE_BYTES))
                digest.update(handle.read(_EDGE_BYTES))
        out.append([name, size, digest.hexdigest()[:16]])
    return out


def tokenizer_fingerprint(folder: str | os.PathLike[str] | None) -> str | None:
    """SHA-256 (hex, 16 chars) of the names and contents of the files in a tokenizer folder; ``None`` for none."""
    if folder is None:
        return None
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(folder).iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:16]
