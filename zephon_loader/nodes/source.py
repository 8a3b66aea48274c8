"""The torchdata source node over a Zephon pipeline.

* :class:`ZephonSource` is a ``torchdata.nodes.BaseNode`` that yields Zephon's
  ``SampleBatch`` objects. Its state is ``pipeline.checkpoint()`` and resuming
  is ``pipeline.restore(state)`` followed by ``iter(pipeline)``: exact and
  O(1), never the O(N) replay of ``IterableWrapper``.

The pipeline itself is built by :func:`zephon_loader.pipeline.text.build_pipeline`.

Do not put a ``torchdata.nodes.Prefetcher`` directly above a
:class:`ZephonSource`: a Prefetcher snapshots its source's state for every
item it pulls (``snapshot_frequency=1`` by default), which would call
``pipeline.checkpoint()`` per batch — a ~100 ms collective across ranks in a
multi-rank job. Zephon already prefetches internally (``prefetch_batches``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torchdata.nodes import BaseNode

from zephon_loader.errors import field_error as _err
from zephon_loader.zephon_compat import check_engine_state, close_engine, explained_window_warnings, worker_crash_info

__all__ = ["ZephonSource"]


# ----------------------------------------------------------------------------- torchdata node


def _restorable(state: Mapping[str, Any]) -> dict[str, Any]:
    """Copy of a checkpoint Zephon 0.2.0 can load after a JSON round trip.

    ``Engine.load_state_dict`` looks lanes up with
    ``lane_next_cid.get(str(lane)) or lane_next_cid.get(int(lane))``, so a lane
    whose next chunk id is 0 (no chunk drawn yet, e.g. a state taken before the
    first batch) is reported missing once JSON has turned the int keys into
    strings. The live state uses int keys; convert back to them.
    """
    state = dict(state)
    lane_next = state.get("lane_next_cid")
    if isinstance(lane_next, Mapping):
        fixed: dict[Any, Any] = {}
        for key, value in lane_next.items():
            try:
                fixed[int(key)] = value
            except (TypeError, ValueError):
                fixed[key] = value
        state["lane_next_cid"] = fixed
    return state


class ZephonSource(BaseNode):
    """torchdata node yielding a Zephon pipeline's ``SampleBatch`` objects.

    * ``reset(None)``: stops any running iteration and starts from scratch.
    * ``reset(state)``: ``pipeline.restore(state)`` then ``iter(pipeline)`` —
      Zephon resumes exactly after the last delivered batch.
    * ``get_state()``: ``{"zephon_checkpoint": pipeline.checkpoint()}`` (JSON-able). Called only
      when state is asked for (``state_dict()``), never per batch; in a
      multi-rank job it is a collective, so every rank must ask together.
    * ``close()``: stops Zephon's workers (closes the pipeline iterator, whose
      ``finally`` closes the engine). Idempotent; also on ``with`` exit.
    * Worker processes (``runner: process``) are contained
      (:mod:`zephon_loader.nodes.workers`): forked from a preloaded fork server,
      they ignore SIGINT and exit when this process dies; those still alive
      ``workers.WORKER_GRACE_S`` after ``close()`` or a new ``reset()`` began
      are SIGKILLed, and ``close()`` returns with none left.
    * ``cancel()``: from any thread, makes a ``next()`` blocked in Zephon
      return soon (for an owner that joins a reader thread before ``close()``).
    * Epochs: ``set_epoch(e)`` makes the next ``reset(None)`` start epoch
      ``e`` on the pipeline ``pipeline_for_epoch(e)`` returns (the same data
      and lanes with the epoch's shuffle seed; the old pipeline's workers are
      stopped first). The state carries the epoch, and ``reset(state)``
      rebuilds that epoch's pipeline before restoring Zephon's checkpoint.
      Without ``pipeline_for_epoch`` there is one epoch, 0.

    Workers start lazily, at the first ``next()``. The pipeline must not be
    iterated by anyone else while this node owns it.

    Do not place a ``torchdata.nodes.Prefetcher`` directly above this node: it
    snapshots ``state_dict()`` of its source for every item.
    """

    #: The key of :meth:`get_state` output holding ``pipeline.checkpoint()``.
    STATE_KEY = "zephon_checkpoint"
    #: The key of :meth:`get_state` output holding the epoch (absent in states of epoch 0).
    EPOCH_KEY = "epoch"

    def __init__(self, pipeline: Any, shards: Any = None, *,
                 pipeline_for_epoch: Callable[[int], Any] | None = None) -> None:
        super().__init__()
        #: ``records.ShardTable`` of the sources: names the shard and line of a record Zephon cannot parse.
        self._shards = shards
        self._pipeline_for_epoch = pipeline_for_epoch
        self._iterator: Iterator[Any] | None = None
        self._closed = False
        self._epoch = 0  # the epoch of self._pipeline
        self._next_epoch = 0  # the epoch reset(None) starts
        self._adopt(pipeline)

    def _adopt(self, pipeline: Any) -> None:
        import zephon

        if not isinstance(pipeline, zephon.Pipeline):
            raise TypeError(
                _err("pipeline", type(pipeline).__name__, "a zephon.Pipeline",
                     "Build it with zephon_loader.pipeline.text.build_pipeline(...).")
            )
        from zephon_loader.nodes.workers import contain_workers

        self._pipeline = pipeline
        #: The pipeline's ``mp_context``: registry of its worker processes, bounds their shutdown.
        self._workers = contain_workers(pipeline)

    @property
    def pipeline(self) -> Any:
        """The wrapped ``zephon.Pipeline`` (of the current epoch)."""
        return self._pipeline

    @property
    def epoch(self) -> int:
        """The epoch being read (or last read)."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at the next ``reset(None)``.

        Raises:
            ValueError: Not an int >= 0, or an epoch other than 0 without ``pipeline_for_epoch``.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(_err("epoch", epoch, "an int >= 0", "Pass the epoch number (0, 1, 2, ...)."))
        if epoch and self._pipeline_for_epoch is None:
            raise ValueError(_err("epoch", epoch, "0 (this source has one pipeline)",
                                  "Build the source with pipeline_for_epoch= to reshuffle per epoch."))
        self._next_epoch = epoch

    def _enter_epoch(self, epoch: int) -> None:
        if epoch == self._epoch:
            return
        if self._pipeline_for_epoch is None:
            raise ValueError(_err("initial_state.epoch", epoch, "0 (this source has one pipeline)",
                                  "Load the state into a loader built by the same builder."))
        self._workers.kill()  # _stop() ran: the old pipeline's iteration is over
        self._adopt(self._pipeline_for_epoch(epoch))
        self._epoch = epoch

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        if self._closed:
            raise RuntimeError("ZephonSource.reset: the source is closed; build a new pipeline and source.")
        super().reset(initial_state)
        self._stop()
        if initial_state is None:
            self._enter_epoch(self._next_epoch)
        else:
            if not isinstance(initial_state, Mapping):
                raise TypeError(
                    _err("initial_state", type(initial_state).__name__, "a dict from ZephonSource.get_state()",
                         "Pass the state saved by state_dict().")
                )
            checkpoint = self._checkpoint_of(initial_state)
            self._enter_epoch(self._epoch_of(initial_state))
            self._next_epoch = self._epoch
            self._pipeline.restore(_restorable(checkpoint))
        with explained_window_warnings():
            self._iterator = iter(self._pipeline)

    def next(self) -> Any:
        if self._closed:
            raise RuntimeError("ZephonSource.next: the source is closed.")
        if self._iterator is None:  # pragma: no cover - BaseNode calls reset first
            raise RuntimeError("ZephonSource.next: call reset() first.")
        try:
            return next(self._iterator)
        except json.JSONDecodeError as error:  # raised by Zephon's JSONL reader, without file or line
            if self._shards is None:
                raise
            raise self._shards.unparsable(error) from error
        except RuntimeError as error:
            # Zephon's process runner re-raises a worker's exception wrapped (``worker_crash_info``):
            # a bad record is a BadRecordError under every runner.
            info = worker_crash_info(error)
            if getattr(info, "exc_type", None) == "BadRecordError":
                from zephon_loader.errors import BadRecordError

                raise BadRecordError(str(info.message)) from error
            raise

    def get_state(self) -> dict[str, Any]:
        with explained_window_warnings():
            state = {self.STATE_KEY: self._pipeline.checkpoint()}
        if self._epoch:
            state[self.EPOCH_KEY] = self._epoch
        return state

    @classmethod
    def is_state(cls, state: Any) -> bool:
        """Whether ``state`` looks like :meth:`get_state` output (a tagged Zephon checkpoint)."""
        return isinstance(state, Mapping) and cls.STATE_KEY in state and set(state) <= {cls.STATE_KEY, cls.EPOCH_KEY}

    def _epoch_of(self, state: Mapping[str, Any]) -> int:
        epoch = state.get(self.EPOCH_KEY, 0)
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(_err("initial_state.epoch", epoch, "an int >= 0", "Pass the state saved by state_dict()."))
        return epoch

    def _checkpoint_of(self, state: Mapping[str, Any]) -> dict[str, Any]:
        checkpoint = state.get(self.STATE_KEY) if self.is_state(state) else None
        if not isinstance(checkpoint, Mapping):
            raise ValueError(
                _err("initial_state", sorted(map(str, state)),
                     f"{{{self.STATE_KEY!r}: <zephon checkpoint>, optional {self.EPOCH_KEY!r}: <int>}}",
                     "Pass the state saved by state_dict().")
            )
        return dict(checkpoint)

    def validate_state(self, state: Mapping[str, Any]) -> None:
        """Check a saved state against Zephon's checkpoint schema now, without starting anything.

        Raises:
            ValueError: Not a tagged checkpoint; Zephon's own error for a bad schema.
        """
        check_engine_state(_restorable(self._checkpoint_of(state)))

    def cancel(self) -> None:
        """From any thread: stop Zephon's engine so that a ``next()`` blocked in it returns soon.

        For an owner whose reader thread may wait inside :meth:`next` (a
        ``process`` runner's workers can take many seconds to start): cancel,
        join that thread, then :meth:`close` (the source is not meant to be
        read again before a ``reset()``). The ``next()`` in progress ends with
        ``StopIteration`` or Zephon's error; worker processes get the grace
        period. The engine is closed by
        :func:`~zephon_loader.zephon_compat.close_engine`, which does nothing
        before Zephon built it (early in the first ``next()``). Idempotent.
        """
        self._workers.shut_down()
        close_engine(self._pipeline)

    def close(self) -> None:
        """Stop Zephon's worker threads/processes; none is left when it returns. Safe to call more than once."""
        try:
            self._stop()
        finally:
            self._closed = True
            self._workers.kill()  # also after a cancel() whose iteration ended by itself

    def _stop(self) -> None:
        """End the running iteration: Zephon's own shutdown, its worker processes bounded by the grace period."""
        iterator, self._iterator = self._iterator, None
        if iterator is None:
            return
        self._workers.shut_down()  # Zephon joins worker after worker, up to 10 s each
        try:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
        finally:
            self._workers.kill()  # whatever Zephon left running (normally none)

    def __enter__(self) -> "ZephonSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
