"""The training-like process that ``crash_harness`` SIGKILLs: consume batches, log each one, checkpoint every N.

    python tests/crash_worker.py --config CFG.json --state STATE.pt --log CONSUMED.log --save-every N

* ``--config``: JSON file holding the ``dataloader`` mapping given to
  :func:`zephon_loader.build_text_loader`.
* ``--state``: the checkpoint ``{"step": k, "loader": loader.state_dict()}``,
  written with ``torch.save`` to a temporary file, fsync'd, then
  ``os.replace``-d over this path (and the folder fsync'd), so a kill at any
  instant leaves either the previous checkpoint or the new one, never a torn
  file. If it exists at start, the loader resumes from it.
* ``--log``: one fixed-width line per consumed batch, ``f"{step:08d} {digest}\\n"``
  (:data:`LINE_BYTES` bytes, see :func:`batch_digest`), appended and fsync'd
  before the step counts as done, so after a kill the log holds every step
  up to the last one logged plus at most one torn line. The resuming side
  (the harness) truncates it to ``step * LINE_BYTES`` bytes first; this
  worker refuses to start on a log of any other length.

Exit status 0 once the stream ended. Module level stays import-light: Zephon's
``process`` runner spawns workers that re-import ``__main__``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: Hex digits of a batch digest (sha256).
DIGEST_CHARS = 64
#: Bytes of one log line: 8-digit step, space, digest, newline.
LINE_BYTES = 8 + 1 + DIGEST_CHARS + 1


def batch_digest(batch: Mapping[str, Any]) -> str:
    """sha256 over every field of a yielded batch, in name order: name, dtype, shape and bytes of tensors.

    Two batches have the same digest only if every tensor (``input_ids``,
    ``labels``, ``position_ids``, masks, ...) is identical in dtype, shape and
    values, and every non-tensor field has the same ``repr``.
    """
    import torch

    digest = hashlib.sha256()
    for name in sorted(batch):
        value = batch[name]
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def log_line(step: int, digest: str) -> bytes:
    """The fixed-width log record of consumed batch ``step`` (1-based)."""
    line = f"{step:08d} {digest}\n".encode()
    if len(line) != LINE_BYTES:
        raise ValueError(f"log line: step {step} or digest {digest!r} does not fit {LINE_BYTES} bytes")
    return line


def temporary_path(path: Path) -> Path:
    """Where :func:`save_atomically` writes before the rename (present after a kill mid-save)."""
    return path.with_name(path.name + ".tmp")


def save_atomically(payload: Any, path: Path) -> None:
    """``torch.save`` to ``path`` so that a kill at any instant leaves the old file or the new one."""
    import torch

    tmp = temporary_path(path)
    with tmp.open("wb") as handle:
        torch.save(payload, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """The checkpoint at ``path`` (``{"step", "loader"}``), or ``None`` when none was saved yet."""
    import torch

    if not path.exists():
        return None
    return torch.load(path, weights_only=False)


def run(config: Mapping[str, Any], state_path: Path, log_path: Path, save_every: int, step_seconds: float) -> int:
    """Consume the loader to its end from the checkpoint (if any); returns the number of steps taken now."""
    from zephon_loader import build_text_loader

    checkpoint = load_checkpoint(state_path)
    step = 0 if checkpoint is None else int(checkpoint["step"])
    size = log_path.stat().st_size if log_path.exists() else 0
    if size != step * LINE_BYTES:
        raise RuntimeError(
            f"{log_path}: holds {size} bytes, expected {step * LINE_BYTES} (= {step} steps x {LINE_BYTES} bytes, "
            f"the step of {state_path}); truncate the log to the checkpoint's step before resuming"
        )
    taken = 0
    with build_text_loader(dict(config)) as loader, log_path.open("ab", buffering=0) as log:
        if checkpoint is not None:
            loader.load_state_dict(checkpoint["loader"])
        for batch in loader:
            step += 1
            taken += 1
            log.write(log_line(step, batch_digest(batch)))
            os.fsync(log.fileno())
            if step_seconds:
                time.sleep(step_seconds)  # the "training step"
            if step % save_every == 0:
                save_atomically({"step": step, "loader": loader.state_dict()}, state_path)
    return taken


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="JSON file with the dataloader mapping")
    parser.add_argument("--state", type=Path, required=True, help="checkpoint path (resumed from when it exists)")
    parser.add_argument("--log", type=Path, required=True, help="consumed-batch log (fixed-width lines)")
    parser.add_argument("--save-every", type=int, required=True, help="checkpoint every N steps")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (simulated compute)")
    args = parser.parse_args()
    if args.save_every < 1:
        parser.error(f"--save-every: got {args.save_every}, expected an int >= 1")
    run(json.loads(args.config.read_text()), args.state, args.log, args.save_every, args.step_seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
