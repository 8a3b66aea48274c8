"""What the fork server imports once for all the Zephon workers it forks (``workers.FORKSERVER_PRELOAD``).

Every worker imports Zephon (and torch with it) and this package (its
operators); Zephon's tokenize operators load tokenizers with transformers. A
transformers that fails to import is left to the worker that needs it, which
raises the real error: the fork server stops at the first exception other than
``ImportError`` in a preloaded module, and every later worker start would then
fail with an ``EOFError`` that names nothing.

Imported by the fork server itself (``multiprocessing.forkserver.main``, first
in its preload list), it also makes the server leave promptly once the
training process is gone (SIGTERM from a scheduler, SIGKILL, or a normal exit):

* **While it preloads** (seconds, tens of seconds on a busy machine: torch),
  the server cannot see its parent die; it would finish importing and only
  then exit. A thread started before the imports ends it (``os._exit``) as
  soon as its parent process is gone; it is stopped and joined before the
  server's first fork (``os.register_at_fork``), so no worker is forked from
  a process with a second thread.
* **At its exit** (its parent and every worker gone), the server tears down
  an interpreter that holds torch: about 1 s on idle cores, more than 5 s on
  busy ones, during which it and the resource tracker waiting on it are
  still there. The server holds nothing to save: an ``atexit`` hook (moved
  last at the first fork, so it runs before the hooks of the modules
  preloaded after this one) flushes its standard streams and ends it with
  ``os._exit`` (status 1 after an unhandled exception, else 0). Forked workers never run it: they end with
  ``os._exit`` after ``multiprocessing``'s own cleanup.

In any other process (a test importing every module, a ``spawn`` worker)
importing this module only imports Zephon, this package and transformers.
"""

import atexit
import multiprocessing.forkserver
import os
import sys
import threading


def _in_fork_server() -> bool:
    """Whether this import runs inside ``multiprocessing.forkserver.main`` (the fork server's preload)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is multiprocessing.forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


def _exit_with_parent(parent: int, stop: threading.Event) -> None:
    while not stop.wait(0.05):
        if os.getppid() != parent:  # reparented: the training process is gone
            os._exit(0)


def _before_fork(watch: threading.Thread, stop: threading.Event) -> None:
    """Stop the watch (joined: the child gets one thread); move :func:`_exit_now` last (it then runs first)."""
    if stop.is_set():
        return
    stop.set()
    if watch.is_alive() and watch is not threading.current_thread():
        watch.join()
    atexit.unregister(_exit_now)
    atexit.register(_exit_now)  # after the hooks of every preloaded module: atexit runs them last first


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # a closed or broken stream: nothing more to write
            pass
    failed = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)  # set by an unhandled exception
    os._exit(1 if failed is not None else 0)


if _in_fork_server():
    _stop = threading.Event()
    _watch = threading.Thread(
        target=_exit_with_parent, args=(os.getppid(), _stop), name="zephon_loader-fork-server-watch", daemon=True
    )
    _watch.start()
    os.register_at_fork(before=lambda: _before_fork(_watch, _stop))
    atexit.register(_exit_now)

import zephon  # noqa: E402,F401
import zephon_loader  # noqa: E402,F401

try:
    import transformers  # noqa: F401
except Exception:  # raised again, with its cause, in the worker that needs it
    pass
