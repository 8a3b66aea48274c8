"""Exact read-ahead over a Zephon source: collate and finalize batches ahead; the state is cut before them.

:class:`ReadAhead` is the one ``torchdata.nodes`` node between the Zephon
source and the consumer. It pulls Zephon ``SampleBatch`` es, collates them and
applies the final map, either inline in the consumer's thread (``depth=0``) or
up to ``depth`` batches ahead in one background thread.

Why the state needs care: Zephon counts a batch as delivered when its iterator
yields it, so once read-ahead has pulled a batch, ``pipeline.checkpoint()``
now would never produce it again. Instead of carrying the pulled batches in
the state, the node takes now and then an *anchor*: the source's
:meth:`~zephon_loader.nodes.source.ZephonSource.position` just before a pull
(Zephon's local shard, no collective; a few ms, so at most every
``ANCHOR_COST_RATIO`` times its own cost in wall time: 0.2% at most). Each
pulled batch remembers its anchor and, per lane, how many batches were pulled
between the anchor and itself. A state is cut before the first batch not yet
delivered: its anchor's checkpoint plus, per lane, those batches (delivered
already: a resume drops them again, :class:`~zephon_loader.nodes.source.ZephonSource`
``"skip"``). Resuming restores Zephon at the anchor, drops the delivered ones
and produces the rest again, at any data-parallel size (a lane's batches
follow from its position alone; nothing of the loader's is tied to a rank).
A resume re-reads at most the batches of one anchor interval.

The state is therefore the same whatever ``depth`` is (``depth`` is a
performance knob, not part of the stream), holds no batch, and a state taken
after the consumer saw ``k`` batches resumes at batch ``k + 1``. The source's
state is asked for only when the node's state is (never per batch:
``pipeline.checkpoint()`` is a cross-rank collective; torchdata's
``Prefetcher`` would call it for every item). With ``retain``, the last
delivered batches keep their positions too, so a state can be cut as of
``lag <= retain`` batches back (consumers that pull ahead of what they trained).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable

from torchdata.nodes import BaseNode

from zephon_loader.nodes.source import lane_of


class _End:
    """Marks the end of the source in the buffer."""


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Pending:
    """A pulled batch: its ``key`` (``(epoch, lane)``), its ``anchor`` (a source position before it) and
    ``skip`` (key -> batches pulled between the anchor and it), ``raw`` (collated) and, once computed, ``ready``."""

    __slots__ = ("key", "anchor", "skip", "raw", "ready", "done")

    def __init__(self, key: Any, anchor: Any, skip: dict[Any, int], raw: Any) -> None:
        self.key = key
        self.anchor = anchor
        self.skip = skip
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

    State (:meth:`get_state` / :meth:`reset`): ``{"source": <source state>}``,
    the source's state before the first undelivered batch, the same for every
    ``depth``; :meth:`position` is the same point without the collective (the
    caller turns it into a state, e.g. with accounting in the same round).

    Threads: the source is touched only under one lock, by the background
    thread (position + pull + collate + transform + buffer, as one step) or by
    the consumer (``depth=0``), and by :meth:`position`, which therefore sees
    every pulled batch either not yet pulled or buffered with its position,
    never in between; it is safe from any thread. One consumer at a time.
    Exceptions from the source, collate or transform re-raise in the
    consumer, in order.
    """

    SOURCE_KEY = "source"
    #: An anchor is taken once the wall time since the last one is this many times what the last one cost.
    ANCHOR_COST_RATIO = 500
    #: ... or after this many pulls, whichever comes first (bounds what a resume re-reads).
    ANCHOR_MAX_PULLS = 256

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
        self._pulled = False  # the source was pulled since the last reset()
        #: ``(epoch, lane)`` of the batch the last ``next()`` returned (consumer side).
        self.last_key: Any = None
        #: What ``collate`` made of the batch the last ``next()`` returned (consumer side).
        self.last_raw: Any = None
        self._anchor: Any = None  # the latest anchor (source position before a pull), None before the first
        self._since: dict[Any, int] = {}  # key -> batches pulled since the anchor
        self._anchor_due = 0.0  # monotonic time after which the next pull takes a new anchor
        self._anchor_pulls = 0  # pulls since the anchor
        self._closed = False  # close() until the next reset(): next() raises
        #: Batches the background thread keeps pulled ahead: ``max(depth, hold)``. The pass agreement raises
        #: it (:attr:`~zephon_loader.nodes.agreement.PassAgreement.WINDOW`) so that a rank can promise as
        #: many batches as it holds and skip the exchanges for them.
        self.hold = depth

    @property
    def buffered(self) -> int:
        """Batches pulled from the source and not yet delivered."""
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
        source_state = None
        if initial_state is not None:
            if self.SOURCE_KEY not in initial_state:
                raise ValueError(
                    f"read-ahead state: missing {self.SOURCE_KEY!r} (keys seen: {sorted(map(str, initial_state))}); "
                    "expected ReadAhead.get_state() output"
                )
            source_state = initial_state[self.SOURCE_KEY]
        with self._source_lock:
            self.source.reset(source_state)
            with self._space:
                self._buffer = deque()
                self._recent.clear()
                self._stop = False
                self._pulled = False
                self._anchor, self._since, self._anchor_due, self._anchor_pulls = None, {}, 0.0, 0
        if self.depth:
            self._thread = threading.Thread(target=self._fill, name="zephon-loader-read-ahead", daemon=True)
            self._thread.start()

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
        self._maybe_anchor()
        try:
            raw = next(self.source)
        except StopIteration:
            return _End()
        except BaseException as error:  # re-raised in the consumer
            return _Failure(error)
        finally:
            self._pulled = True
        try:
            batch_key = getattr(self.source, "batch_key", None)
            key = batch_key(raw) if batch_key is not None else (0, lane_of(raw))
            item = _Pending(key, self._anchor, dict(self._since), self.collate(raw) if self.collate is not None else raw)
        except BaseException as error:
            return _Failure(error)
        self._since[key] = self._since.get(key, 0) + 1
        self._anchor_pulls += 1
        if self.depth:
            self._prepare(item)
        return item

    def _fill(self) -> None:
        while True:
            with self._space:
                while len(self._buffer) >= max(self.depth, self.hold) and not self._stop:
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
        self.last_key = item.key
        self.last_raw = item.raw
        return item.ready

    def _take(self) -> Any:
        """The next item; a batch leaves the buffer and joins the retained ones in one step (under ``_space``),
        so :meth:`get_state` sees it in exactly one of them."""
        with self._space:
            if not self.depth:
                if self._buffer:  # a batch peek() pulled comes before the source's next one
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

    def peek(self) -> Any:
        """Wait for the next item without delivering it: its ``(epoch, lane)`` key, ``None`` at the end, or
        ``"failure"`` (the next ``next()`` raises it). Inline (``depth=0``) this pulls the batch."""
        with self._space:
            if self.depth:
                while not self._buffer and self._thread is not None and self._thread.is_alive():
                    self._space.wait(timeout=0.1)
                item = self._buffer[0] if self._buffer else _End()
            elif self._buffer:
                item = self._buffer[0]
            else:
                item = None
        if item is None:  # inline: pull it now, into the buffer the next next() takes from
            with self._source_lock:
                item = self._pull()
                with self._space:
                    self._buffer.append(item)
        if isinstance(item, _Pending):
            return item.key
        return None if isinstance(item, _End) else "failure"

    def ahead(self, limit: int) -> tuple[Any, int]:
        """Wait for the next item as :meth:`peek` does; inline (``depth=0``) pull up to ``limit`` batches now.

        Returns:
            ``(peek's answer, batches pulled and not delivered at the front: how many the consumer can
            certainly take)``; 0 at the end, and before a failure.
        """
        key = self.peek()
        if not self.depth and key is not None and key != "failure":
            with self._space:
                count = self._leading()
            while count < limit:
                with self._source_lock:
                    item = self._pull()
                    with self._space:
                        self._buffer.append(item)
                if not isinstance(item, _Pending):
                    break
                count += 1
        return key, self.pending()

    def pending(self) -> int:
        """Batches pulled and not delivered, before any end or failure: the ones ``next()`` will certainly
        return. Does not wait."""
        with self._space:
            return self._leading()

    def _leading(self) -> int:
        count = 0
        for item in self._buffer:
            if not isinstance(item, _Pending):
                break
            count += 1
        return count

    def _delivered(self, item: Any) -> Any:
        if self.retain and isinstance(item, _Pending):
            self._recent.append(item)
        return item

    def _position(self) -> Any:
        position = getattr(self.source, "position", None)
        return position() if position is not None else None

    def _maybe_anchor(self) -> None:
        """Before a pull (source lock held): a new anchor when one is due.

        The first pull of a pass anchors at the reset point (free); the second
        takes a real one, so that every later batch's anchor carries Zephon's
        shard (a state cut after deliveries needs one for its round).
        """
        if self._anchor is not None and self._anchor_pulls < self.ANCHOR_MAX_PULLS and (
                time.monotonic() < self._anchor_due) and not getattr(self.source, "anchor_due", False):
            return  # (a source's anchor_due: the next batch begins a mixture schedule's phase, anchored in it)
        started = time.perf_counter()
        self._anchor = self._position()
        cost = time.perf_counter() - started
        first = self._anchor_pulls == 0 and not self._since
        self._since, self._anchor_pulls = {}, 0
        self._anchor_due = 0.0 if first else time.monotonic() + self.ANCHOR_COST_RATIO * cost

    def position(self, lag: int = 0) -> tuple[Any, list[Any]]:
        """Where a state is cut: ``(anchor, skip, handed_back)``.

        ``anchor`` is a source position at or before the first batch not
        delivered, ``skip`` (lane -> batches) the batches delivered since it,
        ``handed_back`` the collated batches given back by ``lag``. With
        ``lag`` (``0 <= lag <= retain``), as of ``lag`` delivered batches back:
        those are handed back (newest last) and a resume delivers them again.
        With a background reader that has not pulled yet since the last
        :meth:`reset`, waits for its first pull, so that every rank of a job
        cuts its state at a pulled position or none does.
        """
        if isinstance(lag, bool) or not isinstance(lag, int) or not 0 <= lag <= len(self._recent):
            raise ValueError(f"lag: got {lag!r}, expected an int in [0, {len(self._recent)}] (the delivered batches "
                             f"this node keeps: retain={self.retain})")
        with self._space:
            while self.depth and not self._pulled and self._thread is not None and self._thread.is_alive():
                self._space.wait(timeout=0.1)
        # Holding the source lock parks the producer between pulls: the buffer and the source agree.
        with self._source_lock:
            with self._space:
                rewound = list(self._recent)[len(self._recent) - lag:] if lag else []
                pending = [item for item in rewound + list(self._buffer) if isinstance(item, _Pending)]
                if pending:
                    return pending[0].anchor, dict(pending[0].skip), [item.raw for item in rewound]
            return self._position(), {}, []

    def get_state(self, lag: int = 0) -> dict[str, Any]:
        """``{"source": <the source's state at position(lag)>}``; a collective for a multi-rank source."""
        anchor, skip, _ = self.position(lag)
        return {self.SOURCE_KEY: self.source.state_at(anchor, skip)[0]}
