"""Exact read-ahead over a Zephon source: collate and finalize batches ahead, restorable in any topology.

:class:`ReadAhead` is the one ``torchdata.nodes`` node between the Zephon
source and the consumer. It pulls Zephon ``SampleBatch`` es, collates them and
applies the final map, either inline in the consumer's thread (``depth=0``) or
up to ``depth`` batches ahead in one background thread.

Why a batch pulled ahead needs a state of its own: Zephon counts a batch as
delivered when its iterator yields it, so once read-ahead has pulled it,
``pipeline.checkpoint()`` will never produce it again. Exactness therefore
needs the batches pulled but not yet delivered inside the state. They are kept
*collated* (before the final map, which is re-applied on resume) and *tagged
with their Zephon lane* (``SampleBatch.lane_ids``; Zephon batches within one
lane), so that after an elastic resume each batch can go to whichever rank owns
its lane now (see :mod:`zephon_loader.nodes.handoff`):

``state = {"source": <ZephonSource state>, "buffered": [{"lane": int, "batch": <encode_batch>}, ...]}``

The state is the same whatever ``depth`` is (``depth`` is a performance knob,
not part of the stream): resuming restores the source and delivers the
buffered batches first, so a state taken after the consumer saw ``k`` batches
resumes at batch ``k + 1``. The source's state is asked for only when the
node's state is (never per batch: ``pipeline.checkpoint()`` is a cross-rank
collective; torchdata's ``Prefetcher`` would call it for every item).
Buffered batches are plain lists (JSON- and pickle-safe); at most ``depth`` of
them per rank, plus, in a state taken as of ``lag`` batches back
(:meth:`ReadAhead.get_state`), the last ``lag <= retain`` delivered ones in front.
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


def lane_of(batch: Any) -> int:
    """The Zephon lane a ``SampleBatch`` was drawn from (Zephon batches within one lane).

    Raises:
        TypeError: ``batch`` carries no ``lane_ids`` (not a Zephon ``SampleBatch``).
        ValueError: Its rows come from several lanes (no single rank owns it after a topology change).
    """
    lanes = getattr(batch, "lane_ids", None)
    if not lanes:
        raise TypeError(
            f"read-ahead: got {type(batch).__name__} without lane_ids; expected a zephon SampleBatch "
            "(the source must be a ZephonSource over pack_flat(...).batch(B))"
        )
    distinct = set(lanes)
    if len(distinct) != 1:
        raise ValueError(
            f"read-ahead: a batch mixes Zephon lanes {sorted(distinct)}; expected one lane per batch "
            "(batch after the lane split, as build_pipeline does)"
        )
    return int(lanes[0])


class _End:
    """Marks the end of the source in the buffer."""


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Pending:
    """A pulled batch: its ``lane``, ``raw`` (collated, what the state stores) and, once computed, ``ready``."""

    __slots__ = ("lane", "raw", "ready", "done")

    def __init__(self, lane: int, raw: Any) -> None:
        self.lane = lane
        self.raw = raw
        self.ready: Any = None
        self.done = False


class ReadAhead(BaseNode):
    """Deliver a Zephon source's batches collated and finalized, up to ``depth`` ahead of the consumer.

    Args:
        source: A node yielding Zephon ``SampleBatch`` es, one lane each
            (:class:`~zephon_loader.nodes.source.ZephonSource`).
        depth: Batches prepared ahead in one background thread (``>= 1``), or
            ``0``: pull, collate and transform inline in the consumer's thread.
        collate: ``SampleBatch -> mapping of tensors`` (what the state stores);
            ``None`` keeps the ``SampleBatch`` (then the state cannot encode it).
        transform: Pure function of a collated batch (the final map, pinning),
            given a shallow copy of it; re-applied to restored batches.
        retain: Delivered batches kept (collated), newest last, so that a
            state can be taken as of up to ``retain`` batches back
            (``get_state(lag=...)``): for consumers that pull ahead of what
            they trained (Lightning's fetcher pulls one batch ahead).

    State (:meth:`get_state` / :meth:`reset`): ``{"source": <source state>,
    "buffered": [{"lane": int, "batch": <encode_batch>}, ...]}`` in delivery
    order, the same for every ``depth``. ``reset(state)`` delivers every
    buffered batch it is given before the source's next one; the caller picks
    the lanes it owns (:class:`~zephon_loader.loader.ZephonLoader` does).

    Threads: the source is touched only under one lock, by the background
    thread (pull + collate + transform + buffer, as one step) or by the
    consumer (``depth=0``), and by :meth:`get_state`, which therefore sees
    every pulled batch either in the source's state or in the buffer, never
    in between; it is safe from any thread. One consumer at a time.
    Exceptions from the source, collate or transform re-raise in the
    consumer, in order.
    """

    SOURCE_KEY = "source"
    BUFFERED_KEY = "buffered"
    LANE_KEY = "lane"
    BATCH_KEY = "batch"

    def __init__(
        self,
        source: BaseNode,
        depth: int,
        transform: Callable[[Any], Any] | None = None,
        *,
        collate: Callable[[Any], Any] | None = None,
        retain: int = 0,
    ) -> None:
        super().__init__()
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"read_ahead depth: got {depth!r}, expected an int >= 0 (0 = inline)")
        if isinstance(retain, bool) or not isinstance(retain, int) or retain < 0:
            raise ValueError(f"retain: got {retain!r}, expected an int >= 0")
        self.source = source
        self.depth = depth
        self.collate = collate
        self.transform = transform
        self._buffer: deque[Any] = deque()
        self.retain = retain
        self._recent: deque[_Pending] = deque(maxlen=retain)  # delivered, newest last
        self._space = threading.Condition()
        self._source_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._closed = False  # close() until the next reset(): next() raises

    @property
    def buffered(self) -> int:
        """Batches pulled from the source and not yet delivered (restored ones included)."""
        with self._space:
            return sum(isinstance(item, _Pending) for item in self._buffer)

    def in_reader_thread(self) -> bool:
        """Whether the caller runs in this node's background thread (it must not join itself)."""
        return self._thread is not None and threading.current_thread() is self._thread

    # -- lifecycle --------------------------------------------------------------------
    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._shutdown()
        self._closed = False
        restored: list[_Pending] = []
        source_state = None
        if initial_state is not None:
            source_state, restored = self._parse_state(initial_state)
        with self._source_lock:
            self.source.reset(source_state)
            with self._space:
                self._buffer = deque(restored)
                self._recent.clear()
                self._stop = False
        if self.depth:
            self._thread = threading.Thread(target=self._fill, name="zephon-loader-read-ahead", daemon=True)
            self._thread.start()

    def _parse_state(self, state: Mapping[str, Any]) -> tuple[Any, list[_Pending]]:
        for key in (self.SOURCE_KEY, self.BUFFERED_KEY):
            if key not in state:
                raise ValueError(
                    f"read-ahead state: missing {key!r} (keys seen: {sorted(map(str, state))}); "
                    "expected ReadAhead.get_state() output"
                )
        restored = []
        for index, entry in enumerate(state[self.BUFFERED_KEY]):
            where = f"read-ahead state: buffered[{index}]"
            if not isinstance(entry, Mapping) or set(entry) != {self.LANE_KEY, self.BATCH_KEY}:
                raise ValueError(f"{where}: got {entry!r:.120}, expected {{'lane': int, 'batch': <encoded batch>}}")
            lane = entry[self.LANE_KEY]
            if isinstance(lane, bool) or not isinstance(lane, int) or lane < 0:
                raise ValueError(f"{where}.lane: got {lane!r}, expected a Zephon lane id (int >= 0)")
            batch = entry[self.BATCH_KEY]
            if not isinstance(batch, Mapping):
                raise ValueError(f"{where}.batch: got {type(batch).__name__}, expected an encoded batch (dict)")
            restored.append(_Pending(lane, decode_batch(batch)))
        return state[self.SOURCE_KEY], restored

    def close(self) -> None:
        """Stop the background thread (the source is left to its owner). Idempotent."""
        self._shutdown()
        self._closed = True

    def _shutdown(self) -> None:
        thread = self._thread
        if thread is None:
            return
        with self._space:
            self._stop = True
            self._space.notify_all()
        if thread is not threading.current_thread():
            thread.join()
        self._thread = None

    # -- producing (background thread, or the consumer when depth == 0) -----------------
    def _pull(self) -> _Pending | _End | _Failure:
        """Next batch from the source, collated and transformed. Call with the source lock held."""
        try:
            raw = next(self.source)
        except StopIteration:
            return _End()
        except BaseException as error:  # re-raised in the consumer
            return _Failure(error)
        try:
            item = _Pending(lane_of(raw), self.collate(raw) if self.collate is not None else raw)
        except BaseException as error:
            return _Failure(error)
        if self.depth:
            self._prepare(item)
        return item

    def _fill(self) -> None:
        while True:
            with self._space:
                while len(self._buffer) >= self.depth and not self._stop:
                    self._space.wait()
                if self._stop:
                    return
            # Pull, transform and buffer under the source lock: get_state() then
            # never sees a batch that is neither in the source's state nor buffered.
            with self._source_lock:
                if self._stop:
                    return
                item = self._pull()
                with self._space:
                    self._buffer.append(item)
                    self._space.notify_all()
            if isinstance(item, (_End, _Failure)):
                return

    def _prepare(self, item: _Pending) -> None:
        """Apply the transform once, to a shallow copy (the state keeps ``raw`` as collated)."""
        if item.done:
            return
        try:
            item.ready = self.transform(dict(item.raw)) if self.transform is not None else item.raw
        except BaseException as error:  # re-raised in the consumer, in order
            item.ready = _Failure(error)
        item.done = True

    # -- consumer side ----------------------------------------------------------------
    def next(self) -> Any:
        if self._closed:
            raise RuntimeError("ReadAhead: next() after close(); batches read ahead are not delivered. "
                               "reset() starts a new pass")
        item = self._take()
        if isinstance(item, _End):
            raise StopIteration
        if isinstance(item, _Failure):
            raise item.error
        self._prepare(item)
        if isinstance(item.ready, _Failure):
            raise item.ready.error
        return item.ready

    def _take(self) -> Any:
        """The next item; a batch leaves the buffer and joins the retained ones in one step (under ``_space``),
        so :meth:`get_state` sees it in exactly one of them."""
        with self._space:
            if not self.depth:
                if self._buffer:  # restored batches come before the source's next one
                    return self._delivered(self._buffer.popleft())
            else:
                while not self._buffer:
                    if self._thread is None or not self._thread.is_alive():
                        return _End()  # stopped (close) or ended without a marker
                    self._space.wait(timeout=0.1)
                item = self._buffer[0]
                if isinstance(item, _End):
                    return item  # stays buffered: the node is exhausted until reset
                self._buffer.popleft()
                self._space.notify_all()
                return self._delivered(item)
        with self._source_lock:  # depth 0: the consumer pulls
            item = self._pull()
            with self._space:
                return self._delivered(item)

    def _delivered(self, item: Any) -> Any:
        if self.retain and isinstance(item, _Pending):
            self._recent.append(item)
        return item

    def get_state(self, lag: int = 0) -> dict[str, Any]:
        """The state; with ``lag``, as of ``lag`` delivered batches back (they lead ``buffered``, to be delivered
        again), ``0 <= lag <= retain``."""
        if isinstance(lag, bool) or not isinstance(lag, int) or not 0 <= lag <= len(self._recent):
            raise ValueError(f"lag: got {lag!r}, expected an int in [0, {len(self._recent)}] (the delivered batches "
                             f"this node keeps: retain={self.retain})")
        # Holding the source lock parks the producer between pulls, so the source's
        # state and the buffer describe the same instant.
        with self._source_lock:
            with self._space:
                rewound = list(self._recent)[len(self._recent) - lag:] if lag else []
                pending = [(item.lane, item.raw) for item in rewound + list(self._buffer) if isinstance(item, _Pending)]
            source_state = self.source.state_dict()
        return {
            self.SOURCE_KEY: source_state,
            self.BUFFERED_KEY: [{self.LANE_KEY: lane, self.BATCH_KEY: encode_batch(raw)} for lane, raw in pending],
        }
