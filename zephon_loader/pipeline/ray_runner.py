"""``runtime.runner: ray``: the tokenize stage on Zephon's experimental Ray runner, the rest on threads.

Zephon 0.2 runs a stage whose operators are placed ``"remote"`` on its
``RemoteStageRunner`` (``zephon/_internal/runners/ray/``): one group of Ray
actors per operator (``parallelism`` actors each, 0 CPUs reserved), fed by
pump threads in the trainer's process, results reordered deterministically.
The loader places only ``tokenize`` / ``tokenize_chat`` there (Zephon's
planner cuts a stage at each placement change); reading, the record checks,
packing and batching stay on the trainer's threads, so:

* the batches are those of ``runner: threads``, bit for bit, and resume is exact
  (Zephon's checkpoint is taken in the trainer: the actors hold no position);
* a bad record is refused or logged where it is under threads (the checks and
  the drop log are in the trainer's process, the shard files read there);
* the text tokenizer reaches the actors inside the pickled operator
  (:class:`~zephon_loader.tokenizing.SharedTokenizer`); in chat mode Zephon
  loads the tokenizer folder on each actor, so on a cluster of several machines
  that folder must be readable at the same path on every node.

Ray itself (:func:`acquire`): a loader uses the Ray instance of its process
when ``ray.is_initialized()`` (the caller's, e.g. ``ray.init(address=...)``,
never shut down by the loader); otherwise it starts a local one, sized to the
cores this process may use, without dashboard, bound to 127.0.0.1 (nothing
listens on the machine's network interfaces), and shuts it down when the last
loader that uses it closes.

Exit (:func:`_close_at_exit`): Ray shuts its instance down from an ``atexit``
hook it registers at ``import ray``; a loader still open then (a script that
ends by Ctrl-C without ``close()``) closed its actors after it, from its own
finalizer, and Ray's automatic ``ray.init()`` in those calls started a second
local instance (~20 s, "Can't find actor", rc 1). The loaders that use Ray
are now closed by one of ``threading``'s exit callbacks, which run before
``atexit``'s hooks and before the thread pools stop, while their instance is
up; automatic ``init`` stays off from then on. And
``ray.init`` replaces the process's SIGTERM handler with one that raises
``SystemExit`` wherever the main thread is (exit status 15, Ray's C++ stack,
at times an abort in teardown): the handler the process had before is put
back, so SIGTERM ends it as it would without Ray; where that is the default
action, the local instance is shut down first (Ray's agents outlive a driver
killed outright) and the process then dies by SIGTERM (status 143).
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import threading
from typing import Any, Callable, Iterator

__all__ = ["INSTALL_HINT", "RayLease", "acquire", "require_ray", "tokenize_placement"]

#: What to install for ``runtime.runner: ray``.
INSTALL_HINT = "pip install 'zephon-loader[ray]'"

_lock = threading.Lock()
#: Loaders holding the local instance this package started (0: none started, or it was shut down).
_holders = 0
#: Which started instance the holders hold (a lease of an instance shut down by someone else counts for none).
_generation = 0
#: Per live lease: what closes its loader (``close_first``), run at exit before Ray's own shutdown.
_closers: dict[int, Callable[[], Any]] = {}
_exit_hook = False  # _close_at_exit is registered (after ``import ray``: it runs before Ray's hook)


def tokenize_placement(config: Any) -> str:
    """Zephon's placement of the tokenize operator: ``"remote"`` under ``runtime.runner: ray``, else ``"auto"``."""
    return "remote" if config.runtime.runner == "ray" else "auto"


def require_ray() -> Any:
    """The ``ray`` module, after checking Zephon's Ray runner imports with it.

    Raises:
        ImportError: One line naming the key and ``pip install 'zephon-loader[ray]'``.
    """
    try:
        import ray

        from zephon_loader.zephon_compat import import_ray_runner

        import_ray_runner()
    except ImportError as error:
        raise ImportError(
            f"dataloader.runtime.runner: got 'ray', but {error.name or 'ray'!r} cannot be imported ({error}); "
            f"install it with {INSTALL_HINT} (or set runtime.runner: threads)"
        ) from None
    return ray


class RayLease:
    """A loader's hold on the Ray instance; :meth:`release` once, when the loader closes (idempotent).

    Attributes:
        started: The loader started the instance (it shuts it down with the last holder), rather than the caller.
    """

    def __init__(self, started: bool) -> None:
        self.started = started
        self._generation = _generation
        self._held = True

    def close_first(self, close: Callable[[], Any]) -> None:
        """At interpreter exit, call ``close`` (the loader's idempotent finalizer) before Ray shuts down."""
        with _lock:
            if self._held:
                _closers[id(self)] = close

    def release(self) -> None:
        global _holders
        with _lock:
            _closers.pop(id(self), None)
            if not self._held:
                return
            self._held = False
            if not self.started or self._generation != _generation:
                return
            _holders -= 1
            if _holders > 0:
                return
            import ray

            if ray.is_initialized():
                ray.shutdown()


def acquire() -> RayLease:
    """Ray for a loader: the process's instance if one is initialized, else a local one this package starts.

    The local instance: ``ray.init(address="local", num_cpus=<this process's cores>, include_dashboard=False,
    _node_ip_address="127.0.0.1")``
    (``address="local"`` never joins a cluster found through ``RAY_ADDRESS`` or ``ray start``: connect to one
    with ``ray.init(address=...)`` before building the loader).

    Raises:
        ImportError: ``ray`` is not installed (see :func:`require_ray`).
    """
    global _holders, _generation
    from zephon_loader.config.schema import available_cores

    global _exit_hook
    ray = require_ray()
    with _lock:
        if not _exit_hook:  # runs before Ray's shutdown (atexit, registered at ``import ray``)
            _register_exit_hook()
            _exit_hook = True
        if _holders > 0 and ray.is_initialized():
            _holders += 1
            return RayLease(started=True)
        if ray.is_initialized():
            return RayLease(started=False)
        main = threading.current_thread() is threading.main_thread()
        sigterm = signal.getsignal(signal.SIGTERM) if main else None
        try:
            with _on_loopback():
                ray.init(address="local", num_cpus=available_cores(), include_dashboard=False,
                         _node_ip_address=LOCALHOST)
        finally:
            if sigterm is not None:  # ray.init's handler raises SystemExit(15) in the middle of anything
                signal.signal(signal.SIGTERM, _shutdown_and_die if sigterm == signal.SIG_DFL else sigterm)
        _holders, _generation = 1, _generation + 1
        return RayLease(started=True)


def _shutdown_and_die(signum: int, frame: Any) -> None:
    """SIGTERM while this package's local Ray runs (the process had the default action): shut Ray down (its
    agents outlive a driver killed outright), then die by SIGTERM as the default action would (status 143).
    Nothing else of the process runs (no ``atexit``, as under the default action); a second SIGTERM, or 10 s,
    ends it at once."""
    import os

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    watchdog = threading.Timer(10.0, os.kill, (os.getpid(), signal.SIGTERM))
    watchdog.daemon = True
    watchdog.start()
    try:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    finally:
        os.kill(os.getpid(), signal.SIGTERM)


#: The address the local instance binds to.
LOCALHOST = "127.0.0.1"


@contextlib.contextmanager
def _on_loopback() -> Iterator[None]:
    """While a local instance starts: its node address is 127.0.0.1, and every Ray process listens there only.

    ``ray.init`` turns a ``_node_ip_address`` of 127.0.0.1 into the machine's address ("remotely
    reachable") unless Ray's multi-node support is off (``ray_constants.ENABLE_RAY_CLUSTER``, as on macOS):
    it is off for the ``init`` (the node's processes take the address as an argument), then restored.
    """
    try:
        from ray._private import ray_constants
    except ImportError:  # another Ray layout: _node_ip_address alone
        yield
        return
    saved = getattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def _register_exit_hook() -> None:
    """:func:`_close_at_exit` at interpreter exit, before the thread pools stop and ``atexit`` runs.

    ``threading``'s exit callbacks run first, newest first: before ``concurrent.futures`` stops accepting
    work (Zephon's thread runner submits to its pools while it closes) and before any ``atexit`` hook.
    """
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(_close_at_exit)
            return
    except RuntimeError:  # the interpreter is already shutting down
        return
    atexit.register(_close_at_exit)


def _close_at_exit() -> None:
    """At interpreter exit, before Ray's own shutdown: close the loaders still holding Ray, then keep Ray
    from starting an instance again for a late call (its automatic ``ray.init()``)."""
    with _lock:
        closers = list(_closers.values())
    for close in closers:
        try:
            close()
        except Exception:  # noqa: BLE001 - exiting: one loader's failure must not keep the others open
            pass
    try:
        from ray._private import auto_init_hook

        auto_init_hook.enable_auto_connect = False
    except Exception:  # noqa: BLE001 - another Ray layout: nothing to turn off
        pass
