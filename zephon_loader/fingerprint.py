"""The configuration fingerprint a saved state carries: what must match for a resume to be exact.

``ZephonLoader.load_state_dict`` refuses a state whose fingerprint differs from
the loader's, naming the differing keys. It covers everything that changes the
batch stream:

* each source's **shard list**: per shard file (in Zephon's order) its name,
  size in bytes and the SHA-256 of all its bytes (:mod:`zephon_loader.pipeline.digests`:
  taken at build from the machine's cache or the folder's ``zephon-loader index``
  manifest by the file's identity, else hashed in the background after the first
  batch; ``state_dict()`` and ``load_state_dict()`` wait for them, so every saved
  state carries them and every resume compares them). Content,
  not paths or mtimes: a run may resume where the data is mounted elsewhere or
  was copied, but a different folder, an added, removed, truncated or
  rewritten shard — also an edit in the middle that keeps the size — is refused;
  the message names the changed shards (:func:`describe_difference`). A shard on object storage
  is identified by its size and ETag instead (listed, not downloaded): a state saved on a local copy
  is refused on the same shards in a bucket, and the other way, with a message that says so.
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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["describe_difference", "tokenizer_fingerprint"]


def describe_difference(key: str, saved: Any, now: Any) -> str:
    """One fingerprint key's difference, short: ``shards`` names the changed shards of each source (first
    three, then a count), another key shows both values (cut at 200 characters)."""
    if key == "shards" and isinstance(saved, Mapping) and isinstance(now, Mapping):
        parts = []
        for source in sorted(set(saved) | set(now), key=str):
            before, after = _by_name(saved.get(source)), _by_name(now.get(source))
            if before == after:
                continue
            if before is None or after is None:
                parts.append(f"source {source!r} {'added' if before is None else 'removed'}")
                continue
            if _identified_by(before) != _identified_by(after):
                parts.append(f"source {source!r}: the state identifies its shards by {_identified_by(before)}, "
                             f"this loader by {_identified_by(after)}; a state resumes only on shards in the same "
                             "kind of place (local files by their bytes, objects by their ETags)")
                continue
            changes = [f"{name} {'added' if name not in before else 'removed' if name not in after else 'changed'}"
                       for name in sorted(set(before) | set(after)) if before.get(name) != after.get(name)]
            more = f", and {len(changes) - 3} more of {len(after)}" if len(changes) > 3 else ""
            parts.append(f"source {source!r}: {', '.join(changes[:3])}{more}")
        return "shards: " + "; ".join(parts)
    if key == "schedule" and isinstance(saved, list) and isinstance(now, list):
        return _schedule_difference(saved, now)
    if key == "flush_window" and saved is None:
        return (f"flush_window: this loader flushes every {now} records per lane (the default window, shortened so "
                "a resume re-reads less), the state was saved with Zephon's unshortened cadence (the default before "
                "it); set flush_every_records: 0 to resume it")
    return f"{key}: saved {_cut(saved)}, now {_cut(now)}"


def _schedule_difference(saved: list[Any], now: list[Any]) -> str:
    """The first phase of a mixture schedule that changed, named: the state holds the phases up to the one it was
    saved in (past ones and the current one); those may not change, later ones may."""
    current = len(saved) - 1
    for index, before in enumerate(saved):
        after = now[index] if index < len(now) else None
        if before != after:
            which = "the current phase" if index == current else "a past phase"
            return (f"mixture.schedule[{index}] ({which}: the state was saved in phase {current}) saved {_cut(before)}, "
                    f"now {_cut(after) if after is not None else 'absent'}; a phase that has begun cannot change "
                    f"(only phases after {current} may)")
    return f"schedule: saved {_cut(saved)}, now {_cut(now)}"


def _by_name(shards: Any) -> dict[str, Any] | None:
    if not isinstance(shards, list):
        return None
    return {str(entry[0]): entry[1:] for entry in shards if isinstance(entry, list) and entry}


def _identified_by(shards: Mapping[str, Any]) -> str:
    """How a source's fingerprint entries identify its shards: a remote object's entry ends with ``"etag"``."""
    remote = any(isinstance(v, list) and v[-1:] == ["etag"] for v in shards.values())
    return "ETag (object storage)" if remote else "SHA-256 (local files)"


def _cut(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "...]"


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
