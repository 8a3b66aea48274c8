"""Run a test's ranks as spawned processes and wait for them, failing on a hang or a crash.

Each rank process writes its result (JSON) to a file of its own, or its
traceback to a ``.error`` file beside it; :func:`run_ranks` waits for every
process until one shared deadline (a hang fails the test and kills them), then
asserts each exited 0, showing the traceback it wrote.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pytest


def free_port() -> int:
    """A TCP port free on loopback now (for a rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(target: Callable[..., Any], arguments: Sequence[tuple], errors: Sequence[Path], *,
              bound_s: float, what: str = "") -> None:
    """``target(*args)`` in a spawned process per entry of ``arguments``; ``errors[i]``: where process ``i``
    writes its traceback. ``bound_s``: a generous bound on the whole run (a busy 2-core machine)."""
    context = mp.get_context("spawn")
    processes = [context.Process(target=target, args=args) for args in arguments]
    for process in processes:
        process.start()
    deadline = time.monotonic() + bound_s
    try:
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        hung = [index for index, process in enumerate(processes) if process.is_alive()]
        if hung:
            pytest.fail(f"{what}: process(es) {hung} still running after {bound_s} s (a hang)")
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(30)
    for index, (process, error) in enumerate(zip(processes, errors)):
        assert process.exitcode == 0, error.read_text() if error.exists() else f"{what} process {index}: exit {process.exitcode}"


@contextlib.contextmanager
def error_file(path: Path) -> Iterator[None]:
    """In a rank process: write the traceback of whatever escapes the block to ``path`` (what :func:`run_ranks`
    shows when that process fails), then let it propagate."""
    try:
        yield
    except BaseException:
        path.write_text(traceback.format_exc())
        raise
