"""Exact read-ahead: a ``torchdata.nodes`` node that pulls batches in a background thread.

torchdata's ``Prefetcher`` snapshots its source's state for every item, which
for a Zephon source means a ``pipeline.checkpoint()`` per batch (a cross-rank
collective in multi-rank runs). :class:`ReadAhead` instead asks its source
for state only when its own state is asked for, and stays exact by carrying
the batches it has pulled but not yet delivered inside that state:

``state = {"source": <source state after the last pull>, "buffered": [<encoded batch>, ...]}``

Resuming restores the source and delivers the buffered batches first, so a
``state_dict()`` taken after the consumer saw ``k`` batches resumes at batch
``k + 1`` whatever the read-ahead depth. The buffered batches are encoded as
plain lists (JSON- and pickle-safe); at most ``depth`` of them.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Mapping

import torch
from torchdata.nodes import BaseNode

_TENSOR_TAG = "__tensor__"


def encode_batch(batch: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON-safe copy of a batch of tensors and plain values.

    Tensors become ``{"__tensor__": dtype, "shape": [...], "data": [...]}``.

    Raises:
        TypeError: A value that is neither a tensor nor a JSON scalar/list.
    """
    out: dict[str, Any] = {}
    for name, value in batch.items():
        if isinstance(value, torch.Tensor):
            out[name] = {
                _TENSOR_TAG: str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape),
                "data": value.reshape(-1).tolist(),
            }
        elif value is None or isinstance(value, (bool, int, float, str, list)):
            out[name] = value
        else:
            raise TypeError(
                f"read-ahead state: field {name!r} holds {type(value).__name__}; expected a tensor or a JSON value"
            )
    return out


def decode_batch(encoded: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`encode_batch`.

    Raises:
        ValueError: A malformed tensor entry (unknown dtype, data not matching shape).
    """
    out: dict[str, Any] = {}
    for name, value in encoded.items():
        if isinstance(value, Mapping) and _TENSOR_TAG in value:
            dtype = getattr(torch, str(value[_TENSOR_TAG]), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"read-ahead state: field {name!r} has unknown dtype {value[_TENSOR_TAG]!r}")
            try:
                out[name] = torch.tensor(value["data"], dtype=dtype).reshape(value["shape"])
            except (RuntimeError, KeyError, TypeError) as error:
                raise ValueError(f"read-ahead state: field {name!r} is malformed ({error})") from error
        else:
            out[name] = value
    return out


class _End:
    """Marks the end of the source in the buffer."""


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Pending:
    """A pulled item: ``raw`` (what the state stores) and, once computed, ``ready`` (what is yielded)."""

    __slots__ = ("raw", "ready", "done")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.ready: Any = None
        self.done = False


class ReadAhead(BaseNode):
    """Pull up to ``depth`` items from ``source`` ahead of the consumer, in one thread.

    Args:
        source: A node yielding mappings of tensors (collated batches).
        depth: Items kept ready (>= 1).
        transform: Pure function applied to each item in the background thread
            (the final map); the state stores items *before* it, so it is
            re-applied to restored items.

    The source is only ever touched by the background thread, or by
    :meth:`get_state` while that thread is parked, so it needs no locking of
    its own. Exceptions from the source re-raise in the consumer, in order.
    """

    SOURCE_KEY = "source"
    BUFFERED_KEY = "buffered"
    EXHAUSTED_KEY = "exhausted"

    def __init__(self, source: BaseNode, depth: int, transform: Callable[[Any], Any] | None = None) -> None:
        super().__init__()
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"read_ahead depth: got {depth!r}, expected an int >= 1")
        self.source = source
        self.depth = depth
        self.transform = transform
        self._buffer: deque[Any] = deque()
        self._space = threading.Condition()
        self._source_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = False

    # -- lifecycle --------------------------------------------------------------------
    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._shutdown()
        self._buffer = deque()
        ended = False
        if initial_state is None:
            self.source.reset(None)
        else:
            for key in (self.SOURCE_KEY, self.BUFFERED_KEY):
                if key not in initial_state:
                    raise ValueError(
                        f"read-ahead state: missing {key!r} (keys seen: {sorted(initial_state)}); "
                        "expected a state_dict() of this loader"
                    )
            self.source.reset(initial_state[self.SOURCE_KEY])
            self._buffer.extend(_Pending(decode_batch(item)) for item in initial_state[self.BUFFERED_KEY])
            ended = bool(initial_state.get(self.EXHAUSTED_KEY, False))
            if ended:
                self._buffer.append(_End())
        self._stop = False
        if not ended:
            self._thread = threading.Thread(target=self._fill, name="zephon-loader-read-ahead", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the background thread (the source is left to its owner)."""
        self._shutdown()

    def _shutdown(self) -> None:
        thread = self._thread
        if thread is None:
            return
        with self._space:
            self._stop = True
            self._space.notify_all()
        thread.join()
        self._thread = None

    # -- background thread ------------------------------------------------------------
    def _fill(self) -> None:
        while True:
            with self._space:
                while len(self._buffer) >= self.depth and not self._stop:
                    self._space.wait()
                if self._stop:
                    return
            # Pull, transform and buffer under the source lock: get_state() then
            # never sees an item that is neither in the source's state nor buffered.
            with self._source_lock:
                if self._stop:
                    return
                try:
                    item: Any = _Pending(next(self.source))
                except StopIteration:
                    item = _End()
                except BaseException as error:  # re-raised in the consumer
                    item = _Failure(error)
                if isinstance(item, _Pending):
                    self._prepare(item)
                with self._space:
                    self._buffer.append(item)
                    self._space.notify_all()
            if isinstance(item, (_End, _Failure)):
                return

    def _prepare(self, item: _Pending) -> None:
        """Apply the transform once (restored items are prepared by the consumer)."""
        if item.done:
            return
        try:
            item.ready = self.transform(item.raw) if self.transform is not None else item.raw
        except BaseException as error:  # re-raised in the consumer, in order
            item.ready = _Failure(error)
        item.done = True

    # -- consumer side ----------------------------------------------------------------
    def next(self) -> Any:
        with self._space:
            while not self._buffer:
                if self._thread is None or not self._thread.is_alive():
                    if not self._buffer:
                        raise StopIteration
                self._space.wait(timeout=0.1)
            item = self._buffer[0]
            if isinstance(item, _End):
                raise StopIteration  # stays buffered: the node is exhausted until reset
            self._buffer.popleft()
            self._space.notify_all()
        if isinstance(item, _Failure):
            raise item.error
        self._prepare(item)
        if isinstance(item.ready, _Failure):
            raise item.ready.error
        return item.ready

    def get_state(self) -> dict[str, Any]:
        # Holding the source lock parks the thread between pulls, so the source's
        # state and the buffer describe the same instant.
        with self._source_lock:
            with self._space:
                pending = [item.raw for item in self._buffer if isinstance(item, _Pending)]
                exhausted = any(isinstance(item, _End) for item in self._buffer)
            return {
                self.SOURCE_KEY: self.source.state_dict(),
                self.BUFFERED_KEY: [encode_batch(item) for item in pending],
                self.EXHAUSTED_KEY: exhausted,
            }
