"""A training-like loop over a ``runner: process`` loader, for ``test_process_runner`` and its benchmark.

    python tests/process_trainer.py CONFIG.json

``CONFIG.json`` holds the ``dataloader`` mapping given to
:func:`zephon_loader.build_text_loader`; the fork server also preloads the
modules named in ``$PROCESS_TRAINER_PRELOAD`` (:data:`PRELOAD_ENV`). Passes
repeat until interrupted. It
prints, one line each, flushed:

* ``first <s>``: seconds from start to the first batch;
* ``step <k>``: after each batch;
* on ``KeyboardInterrupt`` (the caller sends SIGINT): ``interrupted <k>`` (the
  loop's step) and ``alive <n>``: worker processes still alive (they must have
  ignored the SIGINT); then, once the ``with`` block closed the loader,
  ``closed <s>`` (seconds from the SIGINT to the end of ``close()``) and
  ``left <n>``: worker processes still alive; exit status 0.

Worker processes are the processes of this one's session other than itself
and the ``multiprocessing`` helpers it started (fork server, resource tracker),
which exit when it does. :class:`TrainerProcess` runs it in a new session, so
that its processes, and only they, share its session id. :class:`StallFrom`
is a transform that makes a worker stick in an operator,
:func:`exit_zero_if_environ` a process target. Module level stays
import-light: the fork server imports ``__main__`` and workers import
:class:`StallFrom` from here.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any


#: Environment variable: comma-separated modules the fork server preloads too (``set_forkserver_preload``).
PRELOAD_ENV = "PROCESS_TRAINER_PRELOAD"


def session_processes(session: int) -> list[tuple[int, int, str]]:
    """``(pid, ppid, command line)`` of the live (not zombie) processes of session ``session`` (Linux ``/proc``)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{name}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile
            continue
        # After the command: state, ppid, pgrp, session, ...
        if fields[0] != b"Z" and int(fields[3]) == session:
            found.append((int(name), int(fields[1]), command))
    return found


def worker_pids(trainer: int, session: int) -> list[int]:
    """Live processes of ``session`` other than ``trainer`` and the multiprocessing helpers it started."""
    return [
        pid
        for pid, ppid, command in session_processes(session)
        if pid != trainer and not (ppid == trainer and ("resource_tracker" in command or "forkserver" in command))
    ]


def loader_config(data: Path, tokenizer: Path) -> dict[str, Any]:
    """A small ``runner: process`` loader over one JSONL source folder and a local tokenizer folder."""
    return {
        "sources": [{"name": "web", "path": str(data), "weight": 1.0}],
        "tokenizer": {"path": str(tokenizer)},
        "sequence_length": 32,
        "micro_batch_size": 2,
        "packing": {"algorithm": "wrap"},
        "runtime": {"runner": "process"},
    }


class StallFrom:
    """Map transform: passes records ``doc0`` .. ``doc{first - 1}`` through, sleeps ``seconds`` on later ones."""

    def __init__(self, first: int, seconds: float = 120.0) -> None:
        self.first = first
        self.seconds = seconds

    def __call__(self, payload: Any) -> Any:
        if int(payload["text"].split()[0][len("doc") :]) >= self.first:
            time.sleep(self.seconds)
        return payload


def exit_zero_if_environ(name: str, value: str) -> None:
    """Process target: exit status 0 if environment variable ``name`` is ``value`` in the process, else 3."""
    sys.exit(0 if os.environ.get(name) == value else 3)


class TrainerProcess:
    """This script on ``config`` in its own session; its output lines are read by a thread.

    Args:
        config: The ``dataloader`` mapping.
        folder: Where the config file is written.
        env: Environment variables to set in it (e.g. ``TMPDIR``, :data:`PRELOAD_ENV`).
    """

    def __init__(self, config: dict[str, Any], folder: Path, env: dict[str, str] | None = None) -> None:
        path = Path(folder) / "process_trainer_config.json"
        path.write_text(json.dumps(config))
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **(env or {}))
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True, env=env,
        )
        self.seen: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self._lines.put(line.rstrip("\n"))

    def wait_for(self, prefix: str, timeout: float = 300.0) -> str:
        """The next output line starting with ``prefix``; ``AssertionError`` with the output so far after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {prefix!r} line within {timeout} s; output:\n" + "\n".join(self.seen)) from None
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def workers(self) -> list[int]:
        return worker_pids(self.proc.pid, self.proc.pid)

    def session_left_after(self, seconds: float) -> list[tuple[int, int, str]]:
        """Processes of its session still alive once they are all gone or ``seconds`` passed."""
        deadline = time.monotonic() + seconds
        while (left := session_processes(self.proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left

    def kill_session(self) -> None:
        """SIGKILL whatever is left of its session and reap it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def main(config_path: str) -> int:
    start = time.monotonic()
    interrupted_at = [0.0]

    def on_sigint(signum: int, frame: object) -> None:
        interrupted_at[0] = time.monotonic()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    if os.environ.get(PRELOAD_ENV):
        import multiprocessing

        multiprocessing.set_forkserver_preload(os.environ[PRELOAD_ENV].split(","))
    from zephon_loader import build_text_loader

    with open(config_path) as handle:
        config = json.load(handle)
    me, session = os.getpid(), os.getsid(0)
    step = 0
    try:
        with build_text_loader(config) as loader:
            try:
                while True:
                    for _ in loader:
                        step += 1
                        if step == 1:
                            print(f"first {time.monotonic() - start:.2f}", flush=True)
                        print(f"step {step}", flush=True)
                        time.sleep(0.02)
            except KeyboardInterrupt:
                print(f"interrupted {step}", flush=True)
                print(f"alive {len(worker_pids(me, session))}", flush=True)
                raise
    except KeyboardInterrupt:
        print(f"closed {time.monotonic() - interrupted_at[0]:.2f}", flush=True)
        print(f"left {len(worker_pids(me, session))}", flush=True)
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
