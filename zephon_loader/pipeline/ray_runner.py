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
cores this process may use, without dashboard, and shuts it down when the last
loader that uses it closes.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["INSTALL_HINT", "RayLease", "acquire", "require_ray", "tokenize_placement"]

#: What to install for ``runtime.runner: ray``.
INSTALL_HINT = "pip install 'zephon-loader[ray]'"

_lock = threading.Lock()
#: Loaders holding the local instance this package started (0: none started, or it was shut down).
_holders = 0
#: Which started instance the holders hold (a lease of an instance shut down by someone else counts for none).
_generation = 0


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

    def release(self) -> None:
        global _holders
        with _lock:
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

    The local instance: ``ray.init(address="local", num_cpus=<this process's cores>, include_dashboard=False)``
    (``address="local"`` never joins a cluster found through ``RAY_ADDRESS`` or ``ray start``: connect to one
    with ``ray.init(address=...)`` before building the loader).

    Raises:
        ImportError: ``ray`` is not installed (see :func:`require_ray`).
    """
    global _holders, _generation
    from zephon_loader.config.schema import available_cores

    ray = require_ray()
    with _lock:
        if _holders > 0 and ray.is_initialized():
            _holders += 1
            return RayLease(started=True)
        if ray.is_initialized():
            return RayLease(started=False)
        ray.init(address="local", num_cpus=available_cores(), include_dashboard=False)
        _holders, _generation = 1, _generation + 1
        return RayLease(started=True)
