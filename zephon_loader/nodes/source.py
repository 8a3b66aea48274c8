"""The torchdata source node over a Zephon pipeline.

* :class:`ZephonSource` is a ``torchdata.nodes.BaseNode`` that yields Zephon's
  ``SampleBatch`` objects. Its state is Zephon's checkpoint and resuming is
  ``pipeline.restore(state)`` followed by ``iter(pipeline)``: exact and O(1),
  never the O(N) replay of ``IterableWrapper``.
* It reads a *chain* of epochs' pipelines: the current epoch's, after the
  batches earlier epochs left on this rank's lanes when the ranks agreed to
  end a pass early (:meth:`ZephonSource.carry_over`, see
  :mod:`zephon_loader.nodes.agreement`). Usually the chain is the current
  pipeline alone.

The pipeline itself is built by :func:`zephon_loader.pipeline.text.build_pipeline`.

Do not put a ``torchdata.nodes.Prefetcher`` directly above a
:class:`ZephonSource`: a Prefetcher snapshots its source's state for every
item it pulls (``snapshot_frequency=1`` by default), which would call
``pipeline.checkpoint()`` per batch — a ~100 ms collective across ranks in a
multi-rank job. Zephon already prefetches internally (``prefetch_batches``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torchdata.nodes import BaseNode

from zephon_loader.errors import described_error
from zephon_loader.errors import field_error as _err
from zephon_loader.zephon_compat import (
    check_engine_state,
    checkpoint_at,
    close_engine,
    explained_window_warnings,
    local_checkpoint,
    local_position,
    release_rounds,
    warn_taken_mid_window,
    worker_crash_info,
)

__all__ = ["PhasePlan", "Position", "ZephonSource", "lane_of"]


# ----------------------------------------------------------------------------- torchdata node


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


def lane_of(batch: Any) -> int:
    """The Zephon lane a ``SampleBatch`` was drawn from (Zephon batches within one lane).

    Raises:
        TypeError: ``batch`` carries no ``lane_ids`` (not a Zephon ``SampleBatch``).
        ValueError: Its rows come from several lanes.
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


class _Stream:
    """One epoch's pipeline as this rank reads it: its iterator and the batches it still drops after a restore."""

    def __init__(self, epoch: int, pipeline: Any, shards: Any, phase: int = 0) -> None:
        from zephon_loader.nodes.workers import contain_workers

        self.epoch = epoch
        self.phase = phase  # the mixture schedule's phase whose pipeline this is (0 without a schedule)
        self.pipeline = pipeline
        self.shards = shards
        #: The pipeline's ``mp_context``: registry of its worker processes, bounds their shutdown.
        self.workers = contain_workers(pipeline)
        self.iterator: Iterator[Any] | None = None
        self.skip: dict[int, int] = {}  # lane -> batches still to drop (delivered before the restored state)
        self.fresh = True  # nothing pulled since start(): Zephon's engine may not exist yet
        self.ended = False

    def start(self, checkpoint: Mapping[str, Any] | None, skip: Mapping[int, int]) -> None:
        """Restore ``checkpoint`` (``None``: the start of the epoch) and drop ``skip[lane]`` batches of each lane."""
        self.stop()
        self.skip = {int(lane): int(n) for lane, n in skip.items() if n}
        self.fresh, self.ended = True, False
        if checkpoint is not None:
            self.pipeline.restore(_restorable(checkpoint))
        with explained_window_warnings():
            self.iterator = iter(self.pipeline)

    def next(self) -> Any:
        if self.iterator is None or self.ended:
            raise StopIteration
        try:
            while True:
                # The first pull applies a restored checkpoint: Zephon's resume warning, explained.
                with explained_window_warnings() if self.fresh else contextlib.nullcontext():
                    batch = next(self.iterator)
                self.fresh = False
                if not self.skip:
                    return batch
                lane = lane_of(batch)
                if not self.skip.get(lane):
                    return batch
                self.skip[lane] -= 1  # delivered before the restored state was cut
                if not self.skip[lane]:
                    del self.skip[lane]
        except StopIteration:
            self.fresh, self.ended = False, True
            if self.skip:
                lane, left = next(iter(self.skip.items()))
                raise ValueError(
                    f"state_dict.skip: lane {lane} of epoch {self.epoch} ended with {left} of the batches the state "
                    "says it delivered after its checkpoint still to skip, expected at most the batches the lane "
                    "holds after it: the state was not made by ZephonLoader.state_dict() for this data (edited, "
                    "and its checksum recomputed); resume from an intact copy of the saved state") from None
            raise
        except Exception as error:
            better = self._explain(error)
            if better is None:
                raise
            raise better from error

    def _explain(self, error: Exception) -> Exception | None:
        """A clearer error for a failure of Zephon's (``None``: keep it): a shard changed since the build
        explains any read failure; a JSONL line Zephon's reader could not parse is located; a worker's bad
        record is a ``BadRecordError`` under every runner; a store of remote shards that cannot be reached
        is named (the URL, what it answered, what to check)."""
        try:
            changed = self.shards.changed_files() if self.shards is not None else None
        except ValueError as unreachable:  # a remote source's store: listing it again failed too
            return unreachable
        if changed:
            return ValueError(changed)
        if isinstance(error, json.JSONDecodeError) and self.shards is not None:
            return self.shards.unparsable(error)  # Zephon's message has neither file nor line
        # Zephon's process runner re-raises a worker's exception wrapped (``worker_crash_info``).
        info = worker_crash_info(error) if isinstance(error, RuntimeError) else None
        if getattr(info, "exc_type", None) == "BadRecordError":
            from zephon_loader.errors import BadRecordError

            return BadRecordError(str(info.message))
        return None

    def local(self) -> dict[str, Any]:
        """Zephon's local shard now (its engine built first if nothing was pulled since start())."""
        try:
            return local_position(self.pipeline, prime=self.fresh)
        except Exception as error:  # building the engine reads the shards' catalog
            better = self._explain(error)
            if better is None:
                raise
            raise better from error

    def stop(self) -> None:
        """End the running iteration: Zephon's own shutdown, its worker processes bounded by the grace period."""
        iterator, self.iterator = self.iterator, None
        if iterator is None:
            return
        self.workers.shut_down()  # Zephon joins worker after worker, up to 10 s each
        try:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
        finally:
            try:
                close_engine(self.pipeline)  # an engine built for a position and never iterated, too
                release_rounds(self.pipeline)  # now, while the rounds' store is up (not at exit)
            finally:
                self.workers.kill()  # whatever Zephon left running (normally none)


class Position:
    """One rank's position in a :class:`ZephonSource`, taken without a collective (:meth:`ZephonSource.position`).

    Attributes:
        streams: Per pipeline of the chain, in order: ``(stream, local shard, skip)``, the shard of
            :func:`~zephon_loader.zephon_compat.local_position` and the batches per lane it still had to drop.
        carry: The carry the epoch began with (what a restart of the pass reads first).
    """

    __slots__ = ("streams", "carry", "phase", "phase_batches")

    def __init__(self, streams: list[tuple[_Stream, dict[str, Any], dict[int, int]]], carry: list[dict[str, Any]],
                 phase: int = 0, phase_batches: dict[int, int] | None = None):
        self.streams = streams
        self.carry = carry
        #: The schedule's phase and, per lane this rank owns, the batches delivered in it (none without a schedule).
        self.phase = phase
        self.phase_batches = dict(phase_batches or {})


_FROM_STATE_DICT = "Pass the state saved by state_dict()."


def checked_epoch(value: Any, where: str) -> int:
    """A state's ``epoch``: an int >= 0 (the loader state and a source's ``initial_state`` check it here)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(_err(where, value, "an int >= 0 (the epoch the state was saved in)", _FROM_STATE_DICT))
    return value


def checked_skip(value: Any, where: str, lanes: int | None = None) -> dict[str, int]:
    """A state's ``skip``: ``{"<lane>": batches >= 0}`` delivered after its checkpoint, lanes below ``lanes``
    when given; returned with string lanes."""
    expected = "{'<lane>': int >= 0} (batches of each lane delivered after the checkpoint)"
    if not isinstance(value, Mapping):
        raise ValueError(described_error(where, type(value).__name__, expected, _FROM_STATE_DICT))
    for lane, count in value.items():
        if not (str(lane).isdigit() and (lanes is None or int(lane) < lanes)):
            raise ValueError(described_error(where, f"lane {lane!r}", "a lane id" + (
                f" in [0, {lanes})" if lanes else ""), _FROM_STATE_DICT))
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(_err(f"{where}[{lane!r}]", count, "an int >= 0", _FROM_STATE_DICT))
    return {str(lane): int(n) for lane, n in value.items()}


def checked_link(link: Any, where: str) -> dict[str, Any]:
    """One entry of a state's ``carried`` or ``carry``: exactly ``{"epoch", "zephon_checkpoint", "skip"}``, the
    checkpoint a dict or ``None`` (its schema is :meth:`ZephonSource.validate_state`'s to check)."""
    keys = {ZephonSource.EPOCH_KEY, ZephonSource.STATE_KEY, ZephonSource.SKIP_KEY}
    if not isinstance(link, Mapping) or set(link) != keys:
        seen = f"keys {sorted(map(str, link))}" if isinstance(link, Mapping) else type(link).__name__
        raise ValueError(described_error(where, seen, "{'epoch': int, 'zephon_checkpoint': ..., 'skip': {...}}",
                                         _FROM_STATE_DICT))
    checkpoint = link[ZephonSource.STATE_KEY]
    if checkpoint is not None and not isinstance(checkpoint, Mapping):
        raise ValueError(described_error(f"{where}.zephon_checkpoint", type(checkpoint).__name__,
                                         "a Zephon checkpoint (dict) or None", _FROM_STATE_DICT))
    return {ZephonSource.EPOCH_KEY: checked_epoch(link[ZephonSource.EPOCH_KEY], f"{where}.epoch"),
            ZephonSource.STATE_KEY: checkpoint,
            ZephonSource.SKIP_KEY: checked_skip(link[ZephonSource.SKIP_KEY], f"{where}.skip")}


class PhasePlan:
    """A mixture schedule as the source reads it: each phase its own pipeline, ending after a batch count per lane.

    Args:
        pipeline_for_phase: Phase index -> its ``zephon.Pipeline`` (the same data and lanes, the phase's weights
            and seed, its own aggregation run id); phase 0's is the one the source is built with.
        lengths: Batches of each lane per phase, in order; ``None`` for the last (it never ends).
    """

    def __init__(self, pipeline_for_phase: Callable[[int], Any], lengths: list[int | None]) -> None:
        if not lengths or lengths[-1] is not None or any(n is None or n <= 0 for n in lengths[:-1]):
            raise ValueError(f"phases: got lengths {lengths!r}, expected ints > 0 then None (the last phase)")
        self.pipeline_for_phase = pipeline_for_phase
        self.lengths = list(lengths)

    def length(self, phase: int) -> int | None:
        return self.lengths[phase] if phase < len(self.lengths) else None


class ZephonSource(BaseNode):
    """torchdata node yielding a Zephon pipeline's ``SampleBatch`` objects.

    * ``reset(None)``: stops any running iteration and starts from scratch
      (the epoch chosen by ``set_epoch``, after the batches carried into it).
    * ``reset(state)``: restores every pipeline of the state's chain, then
      ``iter(pipeline)`` — Zephon resumes exactly after the last delivered batch.
    * ``get_state()``: the state of :meth:`position` now (JSON-able). Called
      only when state is asked for (``state_dict()``), never per batch; in a
      multi-rank job it is a collective (one Zephon round per pipeline of the
      chain), so every rank must ask together.
    * ``position()``: this rank's position now, without a collective
      (Zephon's local shards, a few ms); ``state_at(position, skip)`` turns one
      taken earlier into the state of that instant plus ``skip[(epoch,
      lane)]`` more batches (the collective). The state says, per lane, how
      many batches after Zephon's checkpoint were already delivered
      (``"skip"``); ``reset(state)`` restores the checkpoint and drops that
      many batches of each lane it owns before yielding (a lane's batches
      follow from its position alone, at any DP size). A read-ahead keeps a
      position now and then, so a state can be cut before what it pulled.
    * ``carry_over(position, skip, drop)``: the ranks agreed to end the pass
      here while some still had batches: the next ``reset(None)`` (the next
      epoch) reads what is left of them first. A collective.
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

    State (``get_state``)::

        {"zephon_checkpoint": {...} | None, "skip"?: {"<lane>": n}, "epoch"?: e,   # the current pipeline
         "carried"?: [{"epoch": k, "zephon_checkpoint": ..., "skip": ...}, ...],    # earlier ones still read
         "carry"?: [...]}                                                           # what the epoch began with
    """

    #: The key of :meth:`get_state` output holding Zephon's checkpoint of the current pipeline.
    STATE_KEY = "zephon_checkpoint"
    #: The key of :meth:`get_state` output holding the epoch (absent in states of epoch 0).
    EPOCH_KEY = "epoch"
    #: The key of :meth:`get_state` output holding ``{"<lane>": batches delivered after the checkpoint}``
    #: (absent: none).
    SKIP_KEY = "skip"
    #: Earlier epochs' pipelines still being read (absent: none).
    CARRIED_KEY = "carried"
    #: The carry the epoch began with (absent: none).
    CARRY_KEY = "carry"
    #: The key this node's part of a state round travels under.
    ROUND_KEY = "zephon_loader.source"
    #: The mixture schedule's phase of the current pipeline (absent: 0, or no schedule).
    PHASE_KEY = "phase"
    #: ``{"<lane>": batches of that lane delivered in the current phase}`` (every lane; absent: no schedule).
    PHASE_BATCHES_KEY = "phase_batches"

    def __init__(self, pipeline: Any, shards: Any = None, *,
                 pipeline_for_epoch: Callable[[int], Any] | None = None, phases: PhasePlan | None = None) -> None:
        super().__init__()
        import zephon

        if not isinstance(pipeline, zephon.Pipeline):
            raise TypeError(
                _err("pipeline", type(pipeline).__name__, "a zephon.Pipeline",
                     "Build it with zephon_loader.pipeline.text.build_pipeline(...).")
            )
        #: ``records.ShardTable`` of the sources: names the shard and line of a record Zephon cannot parse.
        self._shards = shards
        self._pipeline_for_epoch = pipeline_for_epoch
        self._closed = False
        self._next_epoch = 0  # the epoch reset(None) starts
        self._streams = [_Stream(0, pipeline, shards)]  # the chain; the last is the current epoch's
        self._reading = 0  # index of the stream being read
        self._carry: list[dict[str, Any]] = []  # what the current epoch began with (a restart reads it again)
        self._pending_carry: list[dict[str, Any]] | None = None  # carry_over(): for the next reset(None)
        self._warned_pinned = False  # the warning of a pinned epoch's dropped carry, once
        self._owned = _owned_lanes(pipeline)
        if phases is not None and pipeline_for_epoch is not None:
            raise ValueError("phases: a mixture schedule reads one endless stream; expected no pipeline_for_epoch")
        self._phases = phases
        self._phase0 = pipeline if phases is not None else None  # phase 0's pipeline, reused by a restart
        self._wanted_phase = 0  # the phase _build_chain starts
        self._phase_batches: dict[int, int] = {}  # lane -> batches delivered in the current phase (owned lanes)
        self._retired: _Stream | None = None  # the previous phase's stream: a state may still be cut in it
        self._merged_phase_batches: dict[str, int] = {}  # of the last state round

    # -- mixture schedule ---------------------------------------------------------------

    @property
    def phase(self) -> int:
        """The mixture schedule's phase being read (0 without a schedule)."""
        return self._streams[-1].phase

    @property
    def phase_batches(self) -> dict[int, int]:
        """Lane -> batches delivered in the current phase, for the lanes this rank owns ({} without a schedule)."""
        return dict(self._phase_batches)

    def _phase_done(self) -> bool:
        """Every lane this rank owns delivered the current phase's batches (the next batch is the next phase's)."""
        if self._phases is None:
            return False
        length = self._phases.length(self.phase)
        return length is not None and all(self._phase_batches.get(lane, 0) >= length for lane in self._owned)

    @property
    def anchor_due(self) -> bool:
        """A read-ahead takes a new position before the next pull: the next batch begins a phase (its anchor must
        be in that phase's pipeline)."""
        return self._phase_done()

    def _next_phase(self) -> None:
        """Switch to the next phase's pipeline, from its start. The old one stops (its workers go) but is kept
        for a state cut before batches a read-ahead already pulled past the boundary."""
        old = self._streams[-1]
        old.stop()
        if self._retired is not None:
            self._retired.workers.kill()
        self._retired = old
        phase = old.phase + 1
        stream = _Stream(old.epoch, self._phases.pipeline_for_phase(phase), self._shards, phase)  # type: ignore[union-attr]
        stream.start(None, {})
        self._streams, self._reading, self._phase_batches = [stream], 0, {}

    def _check_phase_steps(self, phase: int, batches: Mapping[int, int]) -> None:
        """Refuse a resume whose ranks would reach the phase's end at different steps (a state cut at one lane
        count and loaded where one rank reads lanes that stand at different counts): their state rounds would
        then meet in different phases' pipelines."""
        assert self._phases is not None
        length = self._phases.length(phase)
        if length is None:
            return
        from zephon_loader.nodes.lanes import lane_mapping
        from zephon_loader.zephon_compat import runtime_options

        left = {group: sum(length - batches.get(lane, 0) for lane in lanes)
                for group, lanes in lane_mapping(runtime_options(self.pipeline)).items()}
        if len(set(left.values())) > 1:
            raise ValueError(
                f"initial_state.{self.PHASE_BATCHES_KEY}: the lanes stand at {dict(sorted(batches.items()))} batches of "
                f"phase {phase} (of {length}), so these ranks would reach its end after {left} more batches: at "
                "different steps. Resume at the data-parallel size the state was saved at, or a smaller one (each "
                "rank reading more lanes), or from a state saved at a step where every lane stood at the same count")


    @property
    def pipeline(self) -> Any:
        """The wrapped ``zephon.Pipeline`` (of the current epoch)."""
        return self._streams[-1].pipeline

    @property
    def epoch(self) -> int:
        """The epoch being read (or last read)."""
        return self._streams[-1].epoch

    @property
    def chain_epochs(self) -> list[int]:
        """The epochs of the pipelines this rank reads, in order (the current one last)."""
        return [stream.epoch for stream in self._streams]

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

    def _stream_for(self, epoch: int, held: list[_Stream]) -> _Stream:
        """The stream of ``epoch``: one held already (its pipeline reused), else a new pipeline."""
        phase = self._wanted_phase
        for stream in held:
            if stream.epoch == epoch and stream.phase == phase:
                held.remove(stream)
                return stream
        if self._phases is not None:
            if phase == 0 and self._phase0 is not None:
                return _Stream(epoch, self._phase0, self._shards, 0)
            return _Stream(epoch, self._phases.pipeline_for_phase(phase), self._shards, phase)
        if epoch and self._pipeline_for_epoch is None:
            raise ValueError(_err("initial_state.epoch", epoch, "0 (this source has one pipeline)",
                                  "Load the state into a loader built by the same builder."))
        pipeline = self._pipeline_for_epoch(epoch) if self._pipeline_for_epoch is not None else held.pop().pipeline
        return _Stream(epoch, pipeline, self._shards)

    def _build_chain(self, links: list[tuple[int, Mapping[str, Any] | None, Mapping[str, int]]]) -> None:
        """Stop everything, then start one stream per ``(epoch, checkpoint, skip)`` in order."""
        held = list(self._streams)
        if self._retired is not None:  # the previous phase's (stopped): reusable for its phase
            held.append(self._retired)
            self._retired = None
        for stream in held:
            stream.stop()
        chain = [self._stream_for(epoch, held) for epoch, _, _ in links]
        for stream in held:  # pipelines no longer read: their workers go
            stream.workers.kill()
        for stream, (_, checkpoint, skip) in zip(chain, links):
            stream.start(checkpoint, {int(lane): n for lane, n in skip.items() if int(lane) in self._owned})
        self._streams, self._reading = chain, 0

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        if self._closed:
            raise RuntimeError("ZephonSource.reset: the source is closed; build a new pipeline and source.")
        super().reset(initial_state)
        if initial_state is None:
            if self._pending_carry is not None:  # a new pass after an agreed end
                self._carry, self._pending_carry = self._pending_carry, None
            elif self._next_epoch != self.epoch:  # another epoch, nothing carried into it
                self._carry = []
            # A pass of epoch e from its beginning reads all of e again: what an earlier pass of e left is in it
            # (set_epoch(e) pinned before every pass: the chain stays one pipeline, its epochs unique).
            kept = [link for link in self._carry if link[self.EPOCH_KEY] != self._next_epoch]
            if len(kept) != len(self._carry) and not self._warned_pinned:
                self._warned_pinned = True
                warnings.warn(
                    f"zephon_loader: epoch {self._next_epoch} starts again from its beginning (set_epoch chose the "
                    "epoch the previous pass read): what the data-parallel ranks had left of that earlier pass is "
                    "not carried into this one (it would be read twice), so ranks whose lanes hold more batches "
                    "than the shortest rank's never reach their later ones in such passes. Let the epoch advance "
                    "(do not set the same epoch again), or set distributed.even_passes: false",
                    RuntimeWarning, stacklevel=2)
            self._carry = kept
            links = [(link[self.EPOCH_KEY], link[self.STATE_KEY], link.get(self.SKIP_KEY) or {})
                     for link in self._carry]
            self._wanted_phase, self._phase_batches = 0, {}
            self._build_chain(links + [(self._next_epoch, None, {})])
            return
        if not isinstance(initial_state, Mapping):
            raise TypeError(
                _err("initial_state", type(initial_state).__name__, "a dict from ZephonSource.get_state()",
                     "Pass the state saved by state_dict().")
            )
        checkpoint = self._checkpoint_of(initial_state)
        epoch = self._epoch_of(initial_state)
        carried = [checked_link(link, f"initial_state.carried[{i}]")
                   for i, link in enumerate(initial_state.get(self.CARRIED_KEY) or [])]
        self._carry = [checked_link(link, f"initial_state.carry[{i}]")
                       for i, link in enumerate(initial_state.get(self.CARRY_KEY) or [])]
        self._pending_carry = None
        self._next_epoch = epoch
        phase, batches = self._phase_of(initial_state)
        if self._phases is not None:
            self._check_phase_steps(phase, batches)
        self._wanted_phase = phase
        self._phase_batches = {lane: n for lane, n in batches.items() if lane in self._owned}
        links = [(link[self.EPOCH_KEY], link[self.STATE_KEY], link[self.SKIP_KEY]) for link in carried]
        self._build_chain(links + [(epoch, checkpoint, self._skip_of(initial_state))])

    def set_carry(self, carry: list[Mapping[str, Any]]) -> None:
        """What the next ``reset(None)`` reads first (a loaded state's ``carry`` of an ended pass)."""
        self._pending_carry = [checked_link(link, f"carry[{i}]") for i, link in enumerate(carry)]

    def next(self) -> Any:
        if self._closed:
            raise RuntimeError("ZephonSource.next: the source is closed.")
        if self._phases is None:
            return self._next_of_chain()
        while True:
            if self._phase_done():
                self._next_phase()
            batch = self._next_of_chain()
            lane = lane_of(batch)
            length = self._phases.length(self.phase)
            if length is not None and self._phase_batches.get(lane, 0) >= length:
                continue  # this lane ended the phase; another of this rank's lanes has not yet (dropped)
            self._phase_batches[lane] = self._phase_batches.get(lane, 0) + 1
            return batch

    def _next_of_chain(self) -> Any:
        while self._reading < len(self._streams):
            try:
                return self._streams[self._reading].next()
            except StopIteration:
                if self._reading == len(self._streams) - 1:
                    raise
                self._reading += 1  # an earlier epoch's batches are behind: the next pipeline
        raise StopIteration

    def batch_key(self, batch: Any) -> tuple[int, int]:
        """``(epoch, lane)`` of the batch :meth:`next` just returned (what a state's ``skip`` counts by)."""
        return self._streams[min(self._reading, len(self._streams) - 1)].epoch, lane_of(batch)

    def get_state(self) -> dict[str, Any]:
        return self.state_at(self.position())[0]

    @property
    def skipping(self) -> dict[int, int]:
        """Lane -> batches this rank still drops after the restored state (empty once they are behind it)."""
        return {lane: n for stream in self._streams for lane, n in stream.skip.items()}

    def position(self) -> Position:
        """This rank's position now, without a collective: after the batches pulled so far, before the next.

        Safe between pulls (the owner serializes them); costs Zephon's local
        shard per pipeline of the chain (a few ms for 8 lanes), and builds
        Zephon's engine of a pipeline nothing was pulled from yet.
        """
        if self._phase_done():  # the next batch is the next phase's: the position is at its start
            self._next_phase()
        return Position([(stream, stream.local(), dict(stream.skip)) for stream in self._streams],
                        copy.deepcopy(self._carry), self.phase, self._phase_batches)

    def state_at(self, position: Position, skip: Mapping[tuple[int, int], int] | None = None,
                 extra: tuple[str, Any, Callable[[list[Any]], Any]] | None = None,
                 local: bool = False) -> tuple[dict[str, Any], Any]:
        """The state of ``position`` plus ``skip[(epoch, lane)]`` batches delivered after it, and ``extra``
        merged across ranks in the round of the current pipeline. A collective: one Zephon round per
        pipeline of the chain (``local``: none, and the state holds this rank's lanes only).

        Args:
            position: From :meth:`position` on this source, in the current pass.
            skip: ``(epoch, lane)`` -> batches delivered after ``position`` (this rank's lanes).
            extra: ``(key, value, merge)`` as :func:`~zephon_loader.zephon_compat.checkpoint_at` takes it.
            local: This rank's lanes, without a round (``merge`` sees this rank's value alone).

        Returns:
            ``(state, merged extra or None)``; the state as the class docstring shows.
        """
        links, merged_extra = self._links_at(position, skip, extra, local=local)
        *carried, current = links
        state: dict[str, Any] = {self.STATE_KEY: current[self.STATE_KEY]}
        if current[self.SKIP_KEY]:
            state[self.SKIP_KEY] = current[self.SKIP_KEY]
        if current[self.EPOCH_KEY]:
            state[self.EPOCH_KEY] = current[self.EPOCH_KEY]
        if carried:
            state[self.CARRIED_KEY] = carried
        if position.carry:
            state[self.CARRY_KEY] = position.carry
        if self._phases is not None:
            state[self.PHASE_KEY] = position.phase
            state[self.PHASE_BATCHES_KEY] = self._merged_phase_batches
        return state, merged_extra

    def carry_over(self, position: Position, skip: Mapping[tuple[int, int], int], drop: set[int]) -> list[dict]:
        """The ranks ended the pass at ``position`` (plus ``skip``) while some had batches left: the next
        ``reset(None)`` reads what is left first. A collective (one round per pipeline of the chain).

        Args:
            drop: Indexes of chain pipelines no rank has anything left of (they are not carried).

        Returns:
            The carry (also what a state of the ended pass records).
        """
        links, _ = self._links_at(position, skip, None, quiet=True)
        self._pending_carry = [link for index, link in enumerate(links) if index not in drop]
        return copy.deepcopy(self._pending_carry)

    def clear_carry(self) -> None:
        """The pass ended with nothing left on any rank: the next pass carries nothing in."""
        self._pending_carry = []

    @property
    def pending_carry(self) -> list[dict[str, Any]]:
        """What the next ``reset(None)`` reads first (after :meth:`carry_over`), else ``[]``."""
        return copy.deepcopy(self._pending_carry or [])

    def _links_at(self, position: Position, skip: Mapping[tuple[int, int], int] | None,
                  extra: tuple[str, Any, Callable[[list[Any]], Any]] | None,
                  quiet: bool = False, local: bool = False) -> tuple[list[dict[str, Any]], Any]:
        """Zephon's checkpoint of each pipeline of the chain at ``position`` (one collective round each).

        ``quiet``: a position the loader keeps for itself (the carry): no mid-window warning.
        ``local``: this rank's lanes only, no round (:func:`~zephon_loader.zephon_compat.local_checkpoint`).
        """
        merged_extra = None
        links = []
        last = len(position.streams) - 1
        for index, (stream, shard, pending) in enumerate(position.streams):
            mine = dict(pending)
            for (epoch, lane), count in (skip or {}).items():
                if epoch == stream.epoch:
                    mine[int(lane)] = mine.get(int(lane), 0) + int(count)
            with_extra = extra if index == last else None
            value = {"skip": {str(lane): n for lane, n in sorted(mine.items()) if n},
                     "extra": with_extra[1] if with_extra is not None else None}
            if index == last and self._phases is not None:
                # Batches of each lane in the phase at this instant: at the position, plus those after it (the
                # read-ahead anchors anew at a phase's start, so they are all of the position's phase).
                counted = dict(position.phase_batches)
                for (epoch, lane), count in (skip or {}).items():
                    if epoch == stream.epoch:
                        counted[int(lane)] = counted.get(int(lane), 0) + int(count)
                value["phase_batches"] = {str(lane): n for lane, n in sorted(counted.items())
                                          if int(lane) in self._owned}

            def merge(values: list[Any], with_extra: Any = with_extra) -> dict[str, Any]:
                present = [v for v in values if v]
                merged_skip: dict[str, int] = {}
                for v in present:  # each lane is one DP group's; its model-parallel peers agree
                    for lane, n in v["skip"].items():
                        merged_skip.setdefault(lane, n)
                merged_phase: dict[str, int] = {}
                for v in present:
                    for lane, n in (v.get("phase_batches") or {}).items():
                        merged_phase.setdefault(lane, n)
                return {"skip": merged_skip, "phase_batches": merged_phase,
                        "extra": with_extra[2]([v["extra"] for v in present]) if with_extra is not None else None}

            if local:
                checkpoint, merged = local_checkpoint(stream.pipeline, shard), merge([value])
            else:
                # Whether the lanes were out of step is judged here (Zephon's own warning sees the anchor only).
                with explained_window_warnings(taken=False):
                    checkpoint, merged = checkpoint_at(stream.pipeline, shard, extra=(self.ROUND_KEY, value, merge))
                if index == last and not quiet:
                    warn_taken_mid_window((checkpoint, merged["skip"]), int(checkpoint["world"]["canonical_replicas"]))
            if index == last:
                merged_extra = merged["extra"]
                self._merged_phase_batches = {lane: int(n) for lane, n in sorted(
                    (merged.get("phase_batches") or {}).items(), key=lambda item: int(item[0]))}
            links.append({self.EPOCH_KEY: stream.epoch, self.STATE_KEY: checkpoint,
                          self.SKIP_KEY: {lane: int(n) for lane, n in sorted(merged["skip"].items(),
                                                                               key=lambda item: int(item[0]))}})
        return links, merged_extra

    @classmethod
    def is_state(cls, state: Any) -> bool:
        """Whether ``state`` looks like :meth:`get_state` output (a tagged Zephon checkpoint)."""
        return (isinstance(state, Mapping) and cls.STATE_KEY in state
                and set(state) <= {cls.STATE_KEY, cls.EPOCH_KEY, cls.SKIP_KEY, cls.CARRIED_KEY, cls.CARRY_KEY,
                                   cls.PHASE_KEY, cls.PHASE_BATCHES_KEY})

    def _epoch_of(self, state: Mapping[str, Any], where: str = "initial_state") -> int:
        return checked_epoch(state.get(self.EPOCH_KEY, 0), f"{where}.{self.EPOCH_KEY}")

    def _phase_of(self, state: Mapping[str, Any], where: str = "initial_state") -> tuple[int, dict[int, int]]:
        """``(phase, {lane: batches in it})`` of a state: ``(0, {})`` without a schedule's keys.

        Raises:
            ValueError: A malformed phase, or a phase the schedule does not have.
        """
        phase = state.get(self.PHASE_KEY, 0)
        if isinstance(phase, bool) or not isinstance(phase, int) or phase < 0:
            raise ValueError(_err(f"{where}.{self.PHASE_KEY}", phase, "an int >= 0 (the schedule's phase the state "
                                  "was saved in)", _FROM_STATE_DICT))
        batches = checked_skip(state.get(self.PHASE_BATCHES_KEY) or {}, f"{where}.{self.PHASE_BATCHES_KEY}")
        if (phase or batches) and self._phases is None:
            raise ValueError(_err(f"{where}.{self.PHASE_KEY}", phase, "no phase (this loader has no mixture schedule)",
                                  "Load the state into a loader built with the schedule it was saved with."))
        if self._phases is not None and phase >= len(self._phases.lengths):
            raise ValueError(_err(f"{where}.{self.PHASE_KEY}", phase,
                                  f"a phase of this schedule (0 to {len(self._phases.lengths) - 1})", _FROM_STATE_DICT))
        return phase, {int(lane): n for lane, n in batches.items()}

    def _skip_of(self, state: Mapping[str, Any], where: str = "initial_state") -> dict[str, int]:
        return checked_skip(state.get(self.SKIP_KEY) or {}, f"{where}.{self.SKIP_KEY}")

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
        """Check a saved state's Zephon checkpoints (the current one and any carried) against Zephon's schema,
        without starting anything.

        Raises:
            ValueError: Not a tagged checkpoint; Zephon's own error for a bad schema.
        """
        checkpoints = [self._checkpoint_of(state)]
        for key in (self.CARRIED_KEY, self.CARRY_KEY):
            checkpoints += [checked_link(link, f"{key}[{i}]")[self.STATE_KEY]
                            for i, link in enumerate(state.get(key) or [])]
        for checkpoint in checkpoints:
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
        for stream in self._streams:
            stream.workers.shut_down()
            close_engine(stream.pipeline)

    def close(self) -> None:
        """Stop Zephon's worker threads/processes; none is left when it returns. Safe to call more than once."""
        streams = self._streams + ([self._retired] if self._retired is not None else [])
        try:
            for stream in streams:
                stream.stop()
        finally:
            self._closed = True
            for stream in streams:
                stream.workers.kill()  # also after a cancel() whose iteration ended by itself

    def __enter__(self) -> "ZephonSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
