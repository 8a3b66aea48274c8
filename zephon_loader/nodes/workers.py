"""Zephon's worker processes: started fast, contained to the loader that started them.

Zephon 0.2.0's ``process`` runner (``runtime: {runner: process}``) starts one
daemonic ``multiprocessing`` process per operator instance (4 for fetch and
tokenize, whatever the core count: ``max_workers`` only sizes buffers under
Zephon's default ``worker_allocation``) through ``RuntimeOptions.mp_context``,
by default ``spawn``. :class:`~zephon_loader.nodes.source.ZephonSource` installs a
:class:`WorkerContext` as its pipeline's ``mp_context`` (:func:`contain_workers`),
which changes four things (measured on 2 shared cores; reproduce with
``benchmarks/bench_process_runner.py``):

* **Start method.** Under ``spawn`` every worker is a fresh interpreter that
  imports Zephon and torch again (about 1.6 CPU-seconds each, 11 workers): the
  first batch comes after 10 s on idle cores, 17-55 s on busy ones. A pipeline
  left on Zephon's default uses
  :data:`DEFAULT_START_METHOD` (``forkserver``) with :data:`FORKSERVER_PRELOAD`:
  the fork server imports those modules once and forks every worker from
  itself, ready in about 0.1 s (first batch after 3.5-5 s). A forked worker also
  ends with ``os._exit`` after ``multiprocessing``'s own cleanup (it flushes
  the worker's queues), instead of tearing down an interpreter that holds
  torch, so Zephon's own shutdown is fast too. As under ``spawn``, a worker
  gets the parent's working directory, ``sys.path`` and environment variables
  as they are when it starts; what a module read at import (torch reads
  ``OMP_NUM_THREADS``) is what it was when the fork server started, with the
  first ``process``-runner loader. An explicit start method (a ``mp_context``
  string or another context) is kept; pass ``"spawn"`` to keep spawn.
* **Orphans.** A SIGKILLed trainer runs no cleanup, and Zephon's workers wait
  on their task queue forever (14 processes left behind). A contained worker
  runs a thread that waits on ``multiprocessing``'s parent sentinel (a pipe
  that reads EOF once the parent process is gone) and exits at once; the fork
  server and the resource tracker exit by themselves when the trainer is gone.
  Linux's ``PR_SET_PDEATHSIG`` does not fit: it fires when the *thread* that
  started the child exits, and Zephon starts workers from short-lived threads
  (and restarts crashed ones from its watchdog thread), so it would kill
  healthy workers.
* **Ctrl-C.** A terminal sends SIGINT to the whole foreground process group.
  Contained workers ignore it, so the training process alone decides
  (``KeyboardInterrupt`` in its loop, then ``close()``).
* **Slow shutdown.** Zephon stops its workers one operator after the other,
  waiting up to 10 s for each worker, after up to 5 s draining the batches in
  flight (uncontained, ``close()`` takes 5 s on idle cores, 10-17 s on busy
  ones, 32 s with a worker stuck in an operator; contained, 1.4-2.5 s). When a
  shutdown begins (:meth:`WorkerContext.shut_down`, called by ``ZephonSource``
  before it asks Zephon to stop) the workers alive then get
  :data:`WORKER_GRACE_S` and are SIGKILLed after it, and a pipeline with a
  ``process`` stage is closed with Zephon's ``shutdown_mode="hard"`` (0.5 s
  waits). Nothing is lost: a Zephon
  worker holds nothing a checkpoint needs (checkpoints are taken in the
  training process) and Zephon discards the batches in flight at a shutdown.

Not contained (Zephon's runner, whatever the start method): an operator's
error (a bad record) reaches the training loop about 10 s after it happened,
because before re-raising Zephon joins the failed operator's pump thread (5 s
timeout) and drains its in-flight batches (5 s timeout); the workers
themselves are gone in milliseconds. ``close()`` afterwards is immediate.

On Linux the registry holds pidfds (signals cannot reach a reused pid);
elsewhere it uses the process objects. Processes started through the context
that are not Zephon stage workers (Zephon's token-estimation pool, its
``mtp_mode`` engine process) are contained the same way.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import context as mp_context
from multiprocessing.process import BaseProcess
from typing import Any

from zephon_loader.zephon_compat import runtime_options

__all__ = [
    "DEFAULT_START_METHOD",
    "FORKSERVER_PRELOAD",
    "KILL_WAIT_S",
    "MAIN_GUARD_ADVICE",
    "WORKER_GRACE_S",
    "WorkerContext",
    "contain_workers",
]

#: Seconds the workers alive when a shutdown begins get to exit before SIGKILL.
WORKER_GRACE_S = 1.0
#: Seconds :meth:`WorkerContext.kill` waits for killed workers to be gone.
KILL_WAIT_S = 5.0
#: Modules the fork server imports once for all the workers it forks: the trainer's main module
#: (what ``spawn`` imports in every worker) and :mod:`zephon_loader.nodes.worker_preload`.
FORKSERVER_PRELOAD = ("__main__", "zephon_loader.nodes.worker_preload")
#: Start method for a pipeline left on Zephon's default ``spawn`` context.
DEFAULT_START_METHOD = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
#: Exit status of a worker whose parent process died (nobody reads it).
_ORPHANED_EXIT = 1
#: Attribute of a process object holding its :class:`WorkerContext`; kept out of its pickle.
_CONTEXT_ATTR = "_zephon_loader_context"
#: Attribute of a fork-server process object carrying the parent's environment at ``start()``.
_ENVIRON_ATTR = "_zephon_loader_environ"
#: Attribute of a process object holding the write end of the pipe its ``run()`` says it began on.
_RUNNING_ATTR = "_zephon_loader_running"
#: The README's advice for scripts that use the process runner (its configuration table, ``runtime.runner``).
MAIN_GUARD_ADVICE = 'scripts need an `if __name__ == "__main__"` guard (README, `runtime.runner`: `process`).'

_HAVE_PIDFD = hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")


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
        if self._start_method == "forkserver":  # type: ignore[attr-defined]
            # The fork server's environment is the parent's when the server started; a spawned
            # worker would get the parent's environment of now. Carry that to the worker.
            setattr(self, _ENVIRON_ATTR, dict(os.environ))
        running, running_w = multiprocessing.connection.Pipe(duplex=False)
        setattr(self, _RUNNING_ATTR, running_w)  # the child sends on it as its run() begins
        try:
            super().start()  # type: ignore[misc]
        finally:
            self.__dict__.pop(_RUNNING_ATTR, None)
            running_w.close()  # the child has its own copy by now
        context = self.__dict__.get(_CONTEXT_ATTR)
        if context is not None:
            context._started(self)
        with running:
            _wait_until_running(self, running)

    def run(self) -> None:
        environ = self.__dict__.pop(_ENVIRON_ATTR, None)
        if environ is not None:
            os.environ.clear()
            os.environ.update(environ)
        _contain_this_process()
        running = self.__dict__.pop(_RUNNING_ATTR, None)
        if running is not None:
            with running:
                running.send_bytes(b"running")
        super().run()  # type: ignore[misc]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop(_CONTEXT_ATTR, None)  # the registry stays in the parent
        return state


def _wait_until_running(process: BaseProcess, running: multiprocessing.connection.Connection) -> None:
    """In the parent, after ``start()``: return once ``process`` began its ``run()``, or raise if it exited first.

    Under ``spawn`` and ``forkserver`` a new worker first re-runs the main module's top-level code (as
    ``__mp_main__``), then unpickles its task. A worker that exits there never tells Zephon anything, and the
    training loop would wait for its batches forever (a script without the ``__main__`` guard: every worker
    re-runs the training script and fails). A worker SIGKILLed meanwhile (a shutdown began) is left to Zephon.
    """
    multiprocessing.connection.wait([running, process.sentinel])
    try:
        if running.poll(0) and running.recv_bytes():  # poll() is also true at EOF (the child closed it unsent)
            return
    except EOFError:
        pass
    process.join(KILL_WAIT_S)  # exited: its sentinel is ready, the status is there
    code = process.exitcode
    if code == -signal.SIGKILL:
        return
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    method = process._start_method  # type: ignore[attr-defined]
    if main is not None and method in ("spawn", "forkserver"):
        where = (f"a new worker first re-runs the main module {main} (the {method!r} start method runs its "
                 "top-level code again in every worker, as '__mp_main__'), then unpickles its task, and one of these "
                 "failed")
    else:
        where = "it failed to unpickle its task"
    raise RuntimeError(
        f"runtime.runner 'process': worker process {process.pid} exited with status {code} before it began its "
        f"work: {where}; its error is printed above. Expected: {MAIN_GUARD_ADVICE} Fix: build and iterate the loader "
        "in a function called under `if __name__ == \"__main__\":` (the training script runs again in every "
        "worker otherwise), or set `runtime: {runner: threads}`."
    )


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


@dataclass(eq=False)
class _Worker:
    process: BaseProcess
    #: Linux pidfd (signals cannot reach a reused pid); ``None`` elsewhere.
    pidfd: int | None


def _alive(worker: _Worker) -> bool:
    """Not yet exited. Never reaps: Zephon joins its own children."""
    if worker.pidfd is not None:
        poller = select.poll()  # a pidfd reads as ready once the process exited; poll has no FD_SETSIZE limit
        poller.register(worker.pidfd, select.POLLIN)
        return not poller.poll(0)
    try:
        return not multiprocessing.connection.wait([worker.process.sentinel], 0)
    except ValueError:  # closed by its owner after it was joined
        return False


def _kill(worker: _Worker) -> None:
    if worker.pidfd is not None:
        try:
            signal.pidfd_send_signal(worker.pidfd, signal.SIGKILL)  # type: ignore[attr-defined]
        except ProcessLookupError:
            pass
    else:
        worker.process.kill()


def _preload_fork_server() -> None:
    """Put :data:`FORKSERVER_PRELOAD` first in the fork server's preload list (before it starts; kept after).

    First: :mod:`~zephon_loader.nodes.worker_preload` makes the fork server exit with its parent while it
    imports the modules after it, too.
    """
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    current = list(getattr(server, "_preload_modules", None) or [])
    multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD) + [m for m in current if m not in FORKSERVER_PRELOAD])


class WorkerContext(mp_context.BaseContext):
    """A ``multiprocessing`` context for Zephon's ``RuntimeOptions.mp_context`` whose processes are contained.

    Same start method and primitives as ``multiprocessing.get_context(start_method)``.
    Its processes ignore SIGINT and exit with their parent; the context keeps
    the started ones in a registry for :meth:`shut_down` (grace period, then
    SIGKILL) and :meth:`kill`. With ``forkserver`` the fork server preloads
    :data:`FORKSERVER_PRELOAD` (set when the first process starts; a server
    already running keeps its list). See the module docstring for why.

    Picklable (Zephon's ``mtp_mode`` sends its options to a subprocess): a copy
    has the same start method and grace period and an empty registry.

    Args:
        start_method: ``"forkserver"``, ``"spawn"`` or ``"fork"``.
        grace_s: Seconds the processes alive at :meth:`shut_down` get before SIGKILL.
    """

    def __init__(self, start_method: str = DEFAULT_START_METHOD, grace_s: float = WORKER_GRACE_S) -> None:
        if start_method not in _PROCESS_CLASSES:
            raise ValueError(
                f"mp_context: got start method {start_method!r}, expected one of {sorted(_PROCESS_CLASSES)}. "
                "Give Zephon an mp_context with one of these start methods."
            )
        multiprocessing.get_context(start_method)  # raises where the method is unavailable
        if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not grace_s >= 0:
            raise ValueError(f"grace_s: got {grace_s!r}, expected seconds >= 0. Pass e.g. grace_s=1.0.")
        self._name = start_method
        self._process_class = _PROCESS_CLASSES[start_method]
        self._grace_s = float(grace_s)
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._preloaded = False
        #: The thread waiting out the current grace period, and the event that ends it early.
        self._reaper: tuple[threading.Thread, threading.Event] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._name, self._grace_s))

    @property
    def grace_s(self) -> float:
        """Seconds the processes alive at :meth:`shut_down` get before SIGKILL."""
        return self._grace_s

    def Process(self, *args: Any, **kwargs: Any) -> BaseProcess:  # noqa: N802 - multiprocessing's name
        """A process of this context's start method, contained; registered when it starts.

        Raises:
            RuntimeError: Called in a worker that is still re-running the main module (a script without the
                ``__main__`` guard builds and iterates a ``process``-runner loader at its top level).
        """
        if getattr(multiprocessing.current_process(), "_inheriting", False):  # multiprocessing's own flag
            raise RuntimeError(
                "runtime.runner 'process': a worker process is starting Zephon workers of its own while it re-runs "
                f"the main module {getattr(sys.modules.get('__mp_main__'), '__file__', None) or '(unknown)'} "
                f"(as '__mp_main__'). Expected: {MAIN_GUARD_ADVICE} Fix: build and iterate the loader in a function "
                "called under `if __name__ == \"__main__\":`."
            )
        if self._name == "forkserver" and not self._preloaded:
            _preload_fork_server()
            self._preloaded = True
        process = self._process_class(*args, **kwargs)
        setattr(process, _CONTEXT_ATTR, self)
        return process

    def _started(self, process: BaseProcess) -> None:
        pidfd = None
        if _HAVE_PIDFD:
            try:
                pidfd = os.pidfd_open(process.pid)  # not reaped before start() returns
            except OSError:  # a kernel without pidfds (before 5.3)
                pass
        with self._lock:
            self._prune_locked()
            self._workers.append(_Worker(process, pidfd))

    def _prune_locked(self) -> None:
        """Forget the processes that exited."""
        alive = []
        for worker in self._workers:
            if _alive(worker):
                alive.append(worker)
            elif worker.pidfd is not None:
                os.close(worker.pidfd)
        self._workers = alive

    def live_pids(self) -> list[int]:
        """Pids of the registered processes that have not exited."""
        with self._lock:
            return [w.process.pid for w in self._workers if _alive(w)]  # type: ignore[misc]

    def shut_down(self) -> None:
        """A shutdown begins: the processes alive now are SIGKILLed if still alive :attr:`grace_s` from now.

        Returns at once (a daemon thread waits out the grace period); call it
        before asking Zephon to stop, and :meth:`kill` once Zephon returned. A
        call while an earlier grace period runs changes nothing.
        """
        with self._lock:
            victims = [w for w in self._workers if _alive(w)]
            if not victims or self._reaper is not None:
                return
            stop = threading.Event()
            reaper = threading.Thread(
                target=self._reap, args=(victims, stop), name="zephon_loader-worker-grace", daemon=True
            )
            reaper.start()
            self._reaper = (reaper, stop)

    def _reap(self, victims: list[_Worker], stop: threading.Event) -> None:
        if stop.wait(self._grace_s):
            return
        with self._lock:  # pidfds are closed under this lock
            for worker in victims:
                if worker in self._workers and _alive(worker):
                    _kill(worker)

    def kill(self, wait_s: float = KILL_WAIT_S) -> list[int]:
        """End the grace period; SIGKILL every registered process still alive and wait (up to ``wait_s``) for them.

        Returns:
            The pids that were signalled (empty when Zephon had stopped them all).
        """
        with self._lock:
            reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper[1].set()
            reaper[0].join()  # outside the lock: the reaper takes it
        with self._lock:
            self._prune_locked()
            victims = list(self._workers)
            for worker in victims:
                _kill(worker)
        deadline = time.monotonic() + wait_s
        while victims and time.monotonic() < deadline:
            with self._lock:
                self._prune_locked()
                if not self._workers:
                    break
            time.sleep(0.01)
        return [w.process.pid for w in victims]  # type: ignore[misc]


def contain_workers(pipeline: Any) -> WorkerContext:
    """Make ``pipeline`` start its processes through a new :class:`WorkerContext`; returns the context.

    The start method is the pipeline's ``RuntimeOptions.mp_context`` (a method
    name or a context), or :data:`DEFAULT_START_METHOD` when it is Zephon's
    default ``spawn`` context (pass the string ``"spawn"`` to keep spawn).
    When a stage runs on the ``process`` runner it also sets Zephon's
    ``shutdown_mode="hard"``: a closed engine then waits 0.5 s instead of 5 s
    for the batches in flight (which it discards either way) and 0.5 s instead
    of 10 s per worker. Thread runners keep ``"graceful"``: under ``"hard"``
    Zephon leaves their threads running after ``close()``. The options are
    read with :func:`~zephon_loader.zephon_compat.runtime_options`. Call
    before the pipeline is first iterated: Zephon reads ``mp_context`` when it
    builds its engine.
    """
    options = runtime_options(pipeline)
    current = getattr(options, "mp_context", None)
    if current is None or current is multiprocessing.get_context("spawn"):  # Zephon's default object
        method = DEFAULT_START_METHOD
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
