"""Zephon's worker processes, contained to the loader that started them.

Zephon 0.2.0's ``process`` runner (``runtime: {runner: process}``) starts one
daemonic ``multiprocessing`` process per operator instance — 4 for fetch,
tokenize and every ``map_transform``, 1 for ``pack_flat``, whatever the core
count (``max_workers`` only sizes buffers under Zephon's default
``worker_allocation``) — through ``RuntimeOptions.mp_context`` (``spawn``).
Measured on 2 cores, three of its behaviours break a training job. This module
contains them without changing Zephon: :class:`~zephon_loader.source.ZephonSource`
installs a :class:`WorkerContext` as its pipeline's ``mp_context``
(:func:`contain_workers`).

* **Orphans.** A SIGKILLed trainer runs no cleanup, and Zephon's workers wait
  on their task queue forever (13 of them plus ``multiprocessing``'s resource
  tracker). A contained worker runs a thread that waits on
  ``multiprocessing``'s parent sentinel (a pipe that reads EOF once the parent
  process is gone) and then exits at once; the resource tracker follows when
  the last of them is gone. Linux's ``PR_SET_PDEATHSIG`` does not fit: it fires
  when the *thread* that started the child exits, and Zephon starts workers
  from short-lived threads (and restarts crashed ones from its watchdog
  thread), so it would kill healthy workers.
* **Ctrl-C.** A terminal sends SIGINT to the whole foreground process group.
  Contained workers ignore it, so the training process alone decides
  (``KeyboardInterrupt`` in its loop, then ``close()``).
* **Slow shutdown.** Zephon stops its workers one operator after the other,
  waiting up to 10 s for each worker (after up to 5 s draining an operator
  whose batches were in flight), and a Python process holding torch takes
  seconds to exit on a busy machine. ``close()`` took 10-17 s, and an operator
  error (a bad record) reached the training loop only after that shutdown,
  which Zephon runs before it re-raises. When a shutdown begins — ``close()``
  (:meth:`WorkerContext.shut_down`), or, within a Zephon stage, the first
  worker that exits on its own (Zephon documents that a worker exits by itself
  only on its stop command or after its operator raised, both once the stage
  is ending) — the workers alive then get :data:`WORKER_GRACE_S` to exit and
  are SIGKILLed after it. Nothing is lost: a Zephon worker holds nothing a
  checkpoint needs (checkpoints are taken in the training process) and Zephon
  discards the batches in flight at a shutdown.

The grace-period kill is Linux only (pidfds give a worker's exit status
without reaping the child Zephon will ``join``, and signal it without the risk
of a reused pid); elsewhere workers still ignore SIGINT and exit with their
parent, and :meth:`WorkerContext.kill` ends whatever Zephon left running.
Processes started through the context that are not Zephon stage workers
(Zephon's token-estimation pool, its ``mtp_mode`` engine process) are
contained the same way but only ever killed by :meth:`WorkerContext.kill`.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import select
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing import context as mp_context
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = ["WORKER_GRACE_S", "WorkerContext", "contain_workers"]

#: Seconds the workers alive when a shutdown begins get to exit before SIGKILL.
WORKER_GRACE_S = 1.0
#: Seconds :meth:`WorkerContext.kill` waits for killed workers to be gone.
KILL_WAIT_S = 5.0
#: Exit status of a worker whose parent process died (nobody reads it).
_ORPHANED_EXIT = 1
#: Attribute of a process object holding ``(context, zephon stage or None)``; kept out of its pickle.
_CONTAINED = "_zephon_loader_contained"

_HAVE_PIDFD = hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal") and hasattr(os, "P_PIDFD")


# ----------------------------------------------------------------------------- in the worker


def _contain_this_process() -> None:
    """In a worker, before its target runs: ignore SIGINT, exit as soon as the parent process is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    sentinel = parent.sentinel if parent is not None else None
    if sentinel is not None:
        threading.Thread(
            target=_exit_with_parent, args=(sentinel,), name="zephon_loader-parent-watch", daemon=True
        ).start()


def _exit_with_parent(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(_ORPHANED_EXIT)


class _ContainedProcess:
    """Mixin for a ``multiprocessing`` process class: contained in the child, registered in the parent."""

    def start(self) -> None:
        super().start()  # type: ignore[misc]
        contained = self.__dict__.get(_CONTAINED)
        if contained is not None:
            contained[0]._started(self, contained[1])

    def run(self) -> None:
        _contain_this_process()
        super().run()  # type: ignore[misc]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop(_CONTAINED, None)  # the registry stays in the parent
        return state


class _SpawnWorker(_ContainedProcess, mp_context.SpawnProcess):
    pass


_PROCESS_CLASSES: dict[str, type[BaseProcess]] = {"spawn": _SpawnWorker}
if hasattr(mp_context, "ForkServerProcess"):

    class _ForkServerWorker(_ContainedProcess, mp_context.ForkServerProcess):
        pass

    class _ForkWorker(_ContainedProcess, mp_context.ForkProcess):
        pass

    _PROCESS_CLASSES.update(forkserver=_ForkServerWorker, fork=_ForkWorker)


# ----------------------------------------------------------------------------- in the parent


def _zephon_stage(args: Any) -> int | None:
    """The stage of a Zephon 0.2.0 process-runner worker: its one argument is a config with ``stage_index``."""
    if not isinstance(args, tuple) or len(args) != 1:
        return None
    stage = getattr(args[0], "stage_index", None)
    return stage if isinstance(stage, int) and not isinstance(stage, bool) else None


@dataclass(eq=False)
class _Worker:
    process: BaseProcess
    #: Zephon stage index, ``None`` for processes that are not Zephon stage workers.
    stage: int | None
    #: Linux pidfd (exit status without reaping, signals without pid reuse); ``None`` elsewhere.
    pidfd: int | None
    #: ``time.monotonic()`` at which it is SIGKILLed if still alive; ``None`` while no shutdown covers it.
    kill_at: float | None = None
    killed: bool = False


class WorkerContext(mp_context.BaseContext):
    """A ``multiprocessing`` context for Zephon's ``RuntimeOptions.mp_context`` whose processes are contained.

    Same start method and primitives as ``multiprocessing.get_context(start_method)``.
    Its processes ignore SIGINT and exit with their parent; the context keeps
    them in a registry for :meth:`shut_down` (grace period, then SIGKILL) and
    :meth:`kill`, and on Linux a watch thread (alive only while processes are)
    applies the grace period and notices the first worker of a Zephon stage
    that exits on its own. See the module docstring for why.

    Picklable (Zephon's ``mtp_mode`` sends its options to a subprocess): a copy
    has the same start method and grace period and an empty registry.

    Args:
        start_method: ``"spawn"`` (Zephon's default), ``"forkserver"`` or ``"fork"``.
        grace_s: Seconds the workers alive at a shutdown get before SIGKILL.
    """

    def __init__(self, start_method: str = "spawn", grace_s: float = WORKER_GRACE_S) -> None:
        if start_method not in _PROCESS_CLASSES:
            raise ValueError(
                f"mp_context: got start method {start_method!r}, expected one of {sorted(_PROCESS_CLASSES)}. "
                "Pass Zephon an mp_context with one of these start methods."
            )
        multiprocessing.get_context(start_method)  # raises where the method is unavailable
        if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not grace_s >= 0:
            raise ValueError(f"grace_s: got {grace_s!r}, expected seconds >= 0. Pass e.g. grace_s=1.0.")
        self._name = start_method
        self._process_class = _PROCESS_CLASSES[start_method]
        self._grace_s = float(grace_s)
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._watch: threading.Thread | None = None
        self._wake_w: int | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._name, self._grace_s))

    def Process(self, *args: Any, **kwargs: Any) -> BaseProcess:  # noqa: N802 - multiprocessing's name
        """A process of this context's start method, contained (it is registered when it starts)."""
        process = self._process_class(*args, **kwargs)
        setattr(process, _CONTAINED, (self, _zephon_stage(kwargs.get("args"))))  # Zephon passes keywords
        return process

    # -- registry --------------------------------------------------------------------

    def _started(self, process: BaseProcess, stage: int | None) -> None:
        pidfd = os.pidfd_open(process.pid) if _HAVE_PIDFD else None  # the child is not reaped before start() returns
        with self._lock:
            # Note every exit first, whether or not the watch thread saw it yet: a stage
            # shutdown then covers only the workers of the run that is ending, never
            # those of the next run (Zephon starts those after joining the old ones).
            for worker in [w for w in self._workers if not _alive(w)]:
                self._exited_locked(worker)
            self._workers.append(_Worker(process, stage, pidfd))
            if pidfd is not None:
                self._ensure_watch_locked()

    def live_pids(self) -> list[int]:
        """Pids of the registered processes not yet seen exiting (Linux: exact; elsewhere: alive now)."""
        with self._lock:
            return [w.process.pid for w in self._workers if _alive(w)]  # type: ignore[misc]

    def shut_down(self) -> None:
        """A shutdown begins: the processes alive now are SIGKILLed if still alive :attr:`grace_s` from now.

        Returns at once; the watch thread applies the deadline (Linux). Call
        before asking Zephon to stop, so a slow Zephon shutdown is bounded.
        """
        with self._lock:
            self._doom_locked(stage=None)
            self._wake_locked()

    def kill(self, wait_s: float = KILL_WAIT_S) -> list[int]:
        """SIGKILL every registered process still alive now and wait (up to ``wait_s``) until they are gone.

        Returns:
            The pids that were signalled (empty when Zephon had stopped them all).
        """
        with self._lock:
            victims = [w for w in self._workers if _alive(w)]
            for worker in victims:
                _kill(worker)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with self._lock:  # the watch thread closes the pidfd of a process it forgets
                if not any(w in self._workers and _alive(w) for w in victims):
                    break
            time.sleep(0.01)
        return [w.process.pid for w in victims]  # type: ignore[misc]

    def close(self) -> None:
        """:meth:`kill` what is left, then join the watch thread (a context can still start processes later)."""
        self.kill()
        with self._lock:
            watch = self._watch
            self._wake_locked()
        if watch is not None:
            watch.join(KILL_WAIT_S)

    # -- grace period (Linux) ----------------------------------------------------------

    def _doom_locked(self, stage: int | None) -> None:
        """Give the live processes (of ``stage``, or all) a kill deadline, unless they already have one."""
        kill_at = time.monotonic() + self._grace_s
        for worker in self._workers:
            if worker.kill_at is None and (stage is None or worker.stage == stage):
                worker.kill_at = kill_at

    def _wake_locked(self) -> None:
        if self._wake_w is not None:
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:  # wakes already pending
                pass

    def _ensure_watch_locked(self) -> None:
        if self._watch is not None:
            self._wake_locked()
            return
        wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # written under the lock: never block there
        self._watch = threading.Thread(target=self._watch_loop, args=(wake_r,), name="zephon_loader-workers", daemon=True)
        self._watch.start()

    def _watch_loop(self, wake_r: int) -> None:
        """Until no registered process is left: note exits, start stage shutdowns, apply kill deadlines."""
        while True:
            with self._lock:
                if not self._workers:
                    os.close(wake_r)
                    os.close(self._wake_w)  # type: ignore[arg-type]
                    self._watch = self._wake_w = None
                    return
                by_fd = {w.pidfd: w for w in self._workers}
                deadlines = [w.kill_at for w in self._workers if w.kill_at is not None and not w.killed]
            poller = select.poll()  # not select.select: a trainer may hold more than FD_SETSIZE descriptors
            for fd in (*by_fd, wake_r):
                poller.register(fd, select.POLLIN)
            timeout_ms = None if not deadlines else max(0.0, (min(deadlines) - time.monotonic()) * 1000.0)
            ready = poller.poll(timeout_ms)
            now = time.monotonic()
            with self._lock:
                for fd, _ in ready:
                    if fd == wake_r:
                        os.read(wake_r, 4096)
                    elif by_fd[fd] in self._workers:  # else _started noted it first
                        self._exited_locked(by_fd[fd])
                for worker in self._workers:
                    if worker.kill_at is not None and worker.kill_at <= now and not worker.killed:
                        _kill(worker)

    def _exited_locked(self, worker: _Worker) -> None:
        """Forget an exited process; one that exited on its own starts the shutdown of its Zephon stage."""
        on_its_own = not worker.killed and _exited_on_its_own(worker)
        self._workers.remove(worker)
        if worker.pidfd is not None:
            os.close(worker.pidfd)
        if on_its_own and worker.stage is not None:
            self._doom_locked(stage=worker.stage)


def _alive(worker: _Worker) -> bool:
    """Not yet exited (never reaps: Zephon joins its own children)."""
    if worker.pidfd is not None:
        poller = select.poll()  # a pidfd reads as ready once the process exited
        poller.register(worker.pidfd, select.POLLIN)
        return not poller.poll(0)
    try:
        return not multiprocessing.connection.wait([worker.process.sentinel], 0)
    except ValueError:  # closed by its owner: it was joined
        return False


def _exited_on_its_own(worker: _Worker) -> bool:
    """Whether an exited process ended by exiting (any status) rather than by a signal (Linux; else ``False``)."""
    if worker.pidfd is None:
        return False
    try:
        info = os.waitid(os.P_PIDFD, worker.pidfd, os.WEXITED | os.WNOWAIT | os.WNOHANG)  # type: ignore[attr-defined]
    except ChildProcessError:
        # Reaped already (Zephon joined it), or not our child (a fork server's): unknown.
        # Never ask its Process object from this thread: a fork-server Popen reads the
        # status from a socket that Zephon's join reads too.
        return False
    return info is not None and info.si_code == os.CLD_EXITED


def _kill(worker: _Worker) -> None:
    worker.killed = True
    if worker.pidfd is not None:
        try:
            signal.pidfd_send_signal(worker.pidfd, signal.SIGKILL)  # type: ignore[attr-defined]
        except ProcessLookupError:
            pass
    else:
        worker.process.kill()


def contain_workers(pipeline: Any) -> WorkerContext:
    """Make ``pipeline`` start its processes through a new :class:`WorkerContext`; returns the context.

    Keeps the pipeline's start method (``RuntimeOptions.mp_context``: a context,
    a method name, or Zephon's default ``spawn``). When a stage runs on the
    ``process`` runner it also sets Zephon's ``shutdown_mode="hard"``: a closed
    engine then waits 0.5 s instead of 5 s for the batches in flight (which it
    discards either way) and 0.5 s instead of 10 s per worker; its workers hold
    nothing that needs a graceful stop (module docstring). Thread runners keep
    ``"graceful"``: under ``"hard"`` Zephon leaves their threads running after
    ``close()``. Zephon 0.2.0 has no public getter for its options, so they are
    read from ``pipeline._options``. Call before the pipeline is first
    iterated: Zephon reads ``mp_context`` when it builds its engine.
    """
    options = getattr(pipeline, "_options", None)
    current = getattr(options, "mp_context", None)
    if current is None:
        method = "spawn"
    elif isinstance(current, str):
        method = current
    else:
        method = current.get_start_method()
    context = WorkerContext(method)
    runners = {getattr(options, "runner", None), *getattr(options, "per_stage_runner", {}).values()}
    if "process" in runners:
        pipeline.options(mp_context=context, shutdown_mode="hard")
    else:
        pipeline.options(mp_context=context)
    return context
