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

import copy
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torchdata.nodes import BaseNode

from zephon_loader.errors import field_error as _err
from zephon_loader.zephon_compat import (
    check_engine_state,
    checkpoint_at,
    close_engine,
    explained_window_warnings,
    local_position,
    worker_crash_info,
)

__all__ = ["Position", "ZephonSource"]


# ----------------------------------------------------------------------------- torchdata node


def _lane_of(batch: Any) -> int:
    from zephon_loader.nodes.readahead import lane_of

    return lane_of(batch)


def _owned_lanes(pipeline: Any) -> frozenset[int]:
    from zephon_loader.nodes.lanes import Lanes

    return Lanes(pipeline).owned_lanes()


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


class Position:
    """One rank's position in a :class:`ZephonSource`, taken without a collective (:meth:`ZephonSource.position`).

    Attributes:
        epoch: The epoch of the pipeline it was taken on.
        pipeline: That ``zephon.Pipeline``.
        local: Zephon's local shard of the checkpoint at that instant
            (:func:`~zephon_loader.zephon_compat.local_position`), or ``None``
            at the point of the last ``reset()``, before anything was pulled.
        restored: At that reset point, the state it restored (checkpoint
            ``None``: the start of the epoch), every lane's skips included.
        skip: Lane -> batches this rank still had to drop after that instant (a resumed state's skips).
    """

    __slots__ = ("epoch", "pipeline", "local", "restored", "skip")

    def __init__(self, epoch: int, pipeline: Any, local: dict[str, Any] | None,
                 restored: dict[str, Any] | None, skip: dict[int, int]) -> None:
        self.epoch = epoch
        self.pipeline = pipeline
        self.local = local
        self.restored = restored
        self.skip = skip


class ZephonSource(BaseNode):
    """torchdata node yielding a Zephon pipeline's ``SampleBatch`` objects.

    * ``reset(None)``: stops any running iteration and starts from scratch.
    * ``reset(state)``: ``pipeline.restore(state)`` then ``iter(pipeline)`` —
      Zephon resumes exactly after the last delivered batch.
    * ``get_state()``: ``{"zephon_checkpoint": <checkpoint>}`` (JSON-able), the
      checkpoint of :meth:`position` now (``None``: the start of the epoch,
      nothing pulled since). Called only when state is asked for
      (``state_dict()``), never per batch; in a multi-rank job it is a
      collective, so every rank must ask together.
    * ``position()``: this rank's position now, without a collective
      (Zephon's local shard, a few ms); ``state_at(position, skip)`` turns one
      taken earlier into the state of that instant plus ``skip[lane]`` more
      batches of each lane (the collective). The state then says, per lane,
      how many batches after Zephon's checkpoint were already delivered
      (``"skip"``); ``reset(state)`` restores the checkpoint and drops that
      many batches of each lane it owns before yielding (a lane's batches
      follow from its position alone, at any DP size). A read-ahead keeps a
      position now and then, so a state can be cut before what it pulled.
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
    #: The key of :meth:`get_state` output holding ``{"<lane>": batches delivered after the checkpoint}``
    #: (absent: none).
    SKIP_KEY = "skip"
    #: The key this node's part of a state round travels under.
    ROUND_KEY = "zephon_loader.source"

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
        self._fresh = True  # nothing pulled since the last reset(): the position is the reset point
        self._restored: dict[str, Any] | None = None  # the state the last reset() restored (None: start)
        self._skip: dict[int, int] = {}  # lane -> batches still to drop (delivered before the restored state)
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
        self._fresh, self._restored, self._skip = True, None, {}
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
            skip = self._skip_of(initial_state)
            self._restored = {self.STATE_KEY: checkpoint, self.SKIP_KEY: skip}
            owned = _owned_lanes(self._pipeline)
            self._skip = {int(lane): count for lane, count in skip.items() if int(lane) in owned and count}
            if checkpoint is not None:  # None: the start of the epoch
                self._pipeline.restore(_restorable(checkpoint))
        with explained_window_warnings():
            self._iterator = iter(self._pipeline)

    def next(self) -> Any:
        if self._closed:
            raise RuntimeError("ZephonSource.next: the source is closed.")
        if self._iterator is None:  # pragma: no cover - BaseNode calls reset first
            raise RuntimeError("ZephonSource.next: call reset() first.")
        try:
            while True:
                batch = next(self._iterator)
                self._fresh = False
                if not self._skip:
                    return batch
                lane = _lane_of(batch)
                if not self._skip.get(lane):
                    return batch
                self._skip[lane] -= 1  # delivered before the restored state was cut
                if not self._skip[lane]:
                    del self._skip[lane]
        except StopIteration:
            self._fresh = False
            raise
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
        return self.state_at(self.position())[0]

    @property
    def skipping(self) -> dict[int, int]:
        """Lane -> batches this rank still drops after the restored state (empty once they are behind it)."""
        return dict(self._skip)

    def position(self) -> Position:
        """This rank's position now, without a collective: after the batches pulled so far, before the next.

        Safe between pulls (the owner serializes them); costs a copy of
        Zephon's local shard (a few kB per lane).
        """
        local = None if self._fresh else local_position(self._pipeline)
        return Position(self._epoch, self._pipeline, local, None if local is not None else self._restored,
                        dict(self._skip))

    def state_at(self, position: Position, skip: Mapping[int, int] | None = None,
                 extra: tuple[str, Any, Callable[[list[Any]], Any]] | None = None) -> tuple[dict[str, Any], Any]:
        """The state of ``position`` plus ``skip[lane]`` batches delivered after it, and ``extra`` merged
        across ranks in the same round. A collective.

        At a reset point (``position.local`` is ``None``) with nothing
        delivered since, nothing is exchanged: every rank stands at the same
        restored state (or the start), and ``extra`` merges this rank's value alone.

        Args:
            position: From :meth:`position` on this source, in the current epoch.
            skip: Lane -> batches of that lane delivered after ``position`` (this rank's lanes).
            extra: ``(key, value, merge)`` as :func:`~zephon_loader.zephon_compat.checkpoint_at` takes it.

        Returns:
            ``({"zephon_checkpoint": <checkpoint or None>, "skip"?: {"<lane>": n}, "epoch"?: e},
            merged extra or None)``.
        """
        mine = dict(position.skip)
        for lane, count in (skip or {}).items():
            mine[int(lane)] = mine.get(int(lane), 0) + int(count)
        value = {"skip": {str(lane): n for lane, n in sorted(mine.items()) if n},
                 "extra": extra[1] if extra is not None else None}

        def merge(values: list[Any]) -> dict[str, Any]:
            present = [v for v in values if v]
            merged_skip: dict[str, int] = {}
            for v in present:  # each lane is one DP group's; its model-parallel peers agree
                for lane, n in v["skip"].items():
                    merged_skip.setdefault(lane, n)
            return {"skip": merged_skip,
                    "extra": extra[2]([v["extra"] for v in present]) if extra is not None else None}

        if position.local is None and not skip:
            restored = copy.deepcopy(position.restored) or {self.STATE_KEY: None, self.SKIP_KEY: {}}
            checkpoint, merged_skip = restored[self.STATE_KEY], restored[self.SKIP_KEY]
            merged_extra = extra[2]([extra[1]]) if extra is not None else None
        else:
            local = position.local
            if local is None:  # a reset point with deliveries since: Zephon's shard of the restored state
                raise RuntimeError("ZephonSource.state_at: a position at a reset point carries no deliveries")
            with explained_window_warnings():
                checkpoint, merged = checkpoint_at(position.pipeline, local, extra=(self.ROUND_KEY, value, merge))
            merged_skip, merged_extra = merged["skip"], merged["extra"]
        state: dict[str, Any] = {self.STATE_KEY: checkpoint}
        if merged_skip:
            state[self.SKIP_KEY] = {str(lane): int(n) for lane, n in sorted(merged_skip.items(), key=lambda i: int(i[0]))}
        if position.epoch:
            state[self.EPOCH_KEY] = position.epoch
        return state, merged_extra

    @classmethod
    def is_state(cls, state: Any) -> bool:
        """Whether ``state`` looks like :meth:`get_state` output (a tagged Zephon checkpoint)."""
        return (isinstance(state, Mapping) and cls.STATE_KEY in state
                and set(state) <= {cls.STATE_KEY, cls.EPOCH_KEY, cls.SKIP_KEY})

    def _epoch_of(self, state: Mapping[str, Any]) -> int:
        epoch = state.get(self.EPOCH_KEY, 0)
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(_err("initial_state.epoch", epoch, "an int >= 0", "Pass the state saved by state_dict()."))
        return epoch

    def _skip_of(self, state: Mapping[str, Any]) -> dict[str, int]:
        skip = state.get(self.SKIP_KEY) or {}
        if not isinstance(skip, Mapping) or not all(
                str(lane).isdigit() and isinstance(n, int) and not isinstance(n, bool) and n >= 0
                for lane, n in skip.items()):
            raise ValueError(_err("initial_state.skip", skip, "{'<lane>': int >= 0}",
                                  "Pass the state saved by state_dict()."))
        return {str(lane): int(n) for lane, n in skip.items()}

    def _checkpoint_of(self, state: Mapping[str, Any]) -> dict[str, Any] | None:
        checkpoint = state.get(self.STATE_KEY) if self.is_state(state) else None
        if checkpoint is None and self.is_state(state):
            return None  # the start of the epoch
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
        checkpoint = self._checkpoint_of(state)
        if checkpoint is not None:
            check_engine_state(_restorable(checkpoint))

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
