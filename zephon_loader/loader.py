"""ZephonLoader: the iterable a training loop (or an AutoModel recipe) holds.

The ``torchdata.nodes`` graph, one direction::

    ZephonSource ─► ReadAhead(collate ─► final map ─► pin memory?) ─► iterator

* ``ZephonSource``: Zephon's ``SampleBatch`` es; state = ``pipeline.checkpoint()``,
  taken only in ``state_dict()``.
* :class:`~zephon_loader.nodes.readahead.ReadAhead`: ``collate``
  (``SampleBatch.to_training`` + document ids), then the final map
  (:class:`~zephon_loader.finalize.final_map.FinalMap`: finalize, the recipe's
  ``collate_wrapper``, pinning when CUDA is available); ``read_ahead``
  batches ahead in a background thread, or inline when ``read_ahead`` is 0.
* The state is the loader's own, the same whatever ``read_ahead`` is and on
  every rank: a :class:`~zephon_loader.state.LoaderState` (its ``to_dict()``
  is what :meth:`ZephonLoader.state_dict` returns), Zephon's checkpoint cut
  before the read-ahead plus per-lane accounting; no batch travels in it.
"""

from __future__ import annotations

import copy
import importlib
import os
import re
import sys
import threading
import warnings
import weakref
from collections import deque
from typing import Any, Callable, Iterator, Mapping

import torch

from zephon_loader import fields as F
from zephon_loader.attention import adapt_model_inputs, join_subdocuments
from zephon_loader.finalize.final_map import FinalizeSettings, FinalMap
from zephon_loader.nodes.agreement import PassAgreement, loader_identity
from zephon_loader.nodes.lanes import Lanes
from zephon_loader.nodes.readahead import ReadAhead
from zephon_loader.nodes.source import ZephonSource
from zephon_loader.pipeline.provenance import describe_rows, raw_provenance
from zephon_loader.state import STATE_FORMAT, LoaderState, lane_ranges, merge_states
from zephon_loader.zephon_compat import warn_resuming_mid_window
from zephon_loader.stats import LoaderStats, batch_source_counts

__all__ = ["STATE_FORMAT", "EpochHook", "ImageLoader", "ZephonLoader"]

#: The key the per-lane accounting travels under in the round of Zephon's checkpoint.
STATS_ROUND_KEY = "zephon_loader.stats"


class ZephonLoader:
    """Iterate packed, finalized batches; save and restore the exact position.

    Built by :func:`~zephon_loader.build.build_text_loader` (or the AutoModel
    config's ``build``). A stateful iterable like torchdata's ``StatefulDataLoader``
    (``__iter__``, ``state_dict()``, ``load_state_dict()``), but not a
    ``torch.utils.data.DataLoader``: trainers that rebuild or re-shard a
    ``DataLoader`` (Lightning, Accelerate) pass it through as it is, and Zephon's
    lanes stay the data-parallel sharding. ``len()`` raises ``TypeError``: the
    number of packed batches of a pass is not known before it is read (train
    by steps, or by passes). ``batch_size`` is the micro-batch size ``B``.

    * ``for batch in loader``: dicts of CPU tensors (pinned when CUDA is
      available) with AutoModel's names (``docs/contract.md``, section 7).
      A new ``iter()`` starts a new pass from the beginning (or from the
      state ``load_state_dict`` gave) and invalidates the previous iterator:
      advancing that one raises ``RuntimeError`` instead of silently moving
      the new pass.
    * Epochs: an epoch is one pass as the config's ``mixture`` defines it
      (``repeat``: every source at least once, lighter ones repeating;
      ``once``: every record exactly once), in an order derived from
      ``(seed, epoch)`` (the same on every run, rank and DP size). A pass
      that follows an exhausted one starts the next epoch; ``set_epoch(e)``
      (AutoModel's step scheduler calls it through ``loader.sampler``) chooses
      the epoch of the next ``iter()`` instead. A pass restarted before its
      end restarts the same epoch. The state records the epoch, and whether
      its pass had ended: such a state resumes at the start of the next epoch.
      With several ranks in a process group and a finite ``passes``, every
      rank's pass ends at the same batch (the shortest rank's count;
      :mod:`zephon_loader.nodes.agreement`): what the others had left comes
      first in the next epoch, and the state records it.
    * ``state_dict()``: JSON- and pickle-safe dict (AutoModel's
      ``weights_only`` load accepts it). Taken after the training loop
      consumed ``k`` batches, a loader that ``load_state_dict``-s it yields
      batch ``k + 1`` next, whatever ``read_ahead`` either loader has (a
      performance knob, not part of the stream). Safe from any thread at any
      time, ``next()`` and ``iter()`` included: a call that overlaps a
      ``next()`` reflects that batch either as delivered (that ``next()``
      returns it) or as not (a resume yields it again), never half. Before
      the first ``iter()`` it is the start of the stream; after
      ``load_state_dict`` and before ``iter()`` it is the loaded state.
    * In multi-rank runs ``state_dict()`` is a collective (one round of
      Zephon's checkpoint, which also merges the per-lane accounting): every
      DP rank must call it at the same step, and every rank gets the same
      state. Its size does not grow with the number of ranks: it holds no
      batch. Elastic resume at another DP size (``canonical_replicas``
      divisible by both) is exact with read-ahead on: the state is Zephon's
      checkpoint as of the batches the training loop took, so Zephon
      re-produces the ones read ahead, on whichever rank owns their lane now
      (within the window open at the state Zephon may permute the order; no
      row is lost or repeated). Any rank's state resumes any rank.
    * ``load_state_dict(state)``: checked now (format, configuration
      fingerprint, Zephon's schema and lane count, the accounting); applied
      at the next ``iter()``; a live iterator becomes stale (advancing it
      raises ``RuntimeError``). Its cost does not depend on the number of
      ranks. ``save_state(path)`` / ``load_state(path)``: the same through a
      file written atomically.
    * ``close()`` / ``with``: stops the read-ahead thread and Zephon's
      workers, then runs ``on_close``. A loader dropped without ``close()``
      does the same when it is garbage-collected (``weakref.finalize``).

    State layout: :class:`~zephon_loader.state.LoaderState` (format
    :data:`~zephon_loader.state.STATE_FORMAT`).

    Args:
        source: The Zephon source node (owned: closed with the loader).
        collate_fn: ``zephon SampleBatch -> TrainingBatch``.
        settings: Final-map settings (contract already validated).
        read_ahead: Batches prepared ahead in a background thread (0 = inline).
        collate_wrapper: Optional recipe wrapper applied to each finalized batch.
        fingerprint: JSON-able description of everything that fixes the batch
            stream; a state saved under another fingerprint is refused.
        shard_digests: The fingerprint's ``shards`` while their digests are
            still being computed (:class:`~zephon_loader.pipeline.digests.PendingShards`;
            ``None``: ``fingerprint`` is complete). Their hashing starts after
            the first batch is delivered; :attr:`fingerprint`, ``state_dict``
            and ``load_state_dict`` wait for it. The loader does not close it.
        pin_memory: Pin yielded tensors; ``None`` = when CUDA is available.
        on_close: Called once after the workers stopped, by :meth:`close` or
            when the loader is collected (e.g. removes a tokenizer folder the
            builder saved); it must not refer to the loader.
        stats: What was delivered and dropped, per source (:meth:`stats`);
            its counts travel in the state. ``None``: no accounting.
        single_rank_by_default: The builder took one rank because no process
            group existed yet; ``iter()`` refuses to run under several ranks.

    AutoModel 0.7.0's recipes save per DP rank only what passes an
    ``isinstance(..., StatefulDataLoader)`` check: the recipe slots
    (:mod:`zephon_loader.integrations.recipe`) build a subclass that also is one.

    Consumers that pull ahead of what they trained (Lightning's fetcher pulls
    one batch ahead) report what they consumed with :meth:`set_consumed`; the
    state then describes exactly that many batches of the pass.
    """

    def __init__(
        self,
        source: ZephonSource,
        collate_fn: Callable[[Any], dict[str, Any]],
        settings: FinalizeSettings,
        *,
        read_ahead: int = 0,
        collate_wrapper: Callable | None = None,
        fingerprint: Mapping[str, Any] | None = None,
        shard_digests: Any = None,
        pin_memory: bool | None = None,
        on_close: Callable[[], None] | None = None,
        stats: LoaderStats | None = None,
        single_rank_by_default: bool = False,
        even_passes: bool = False,
        state_scope: str = "job",
    ) -> None:
        if isinstance(read_ahead, bool) or not isinstance(read_ahead, int) or read_ahead < 0:
            raise ValueError(f"read_ahead: got {read_ahead!r}, expected an int >= 0")
        if state_scope not in ("job", "rank"):
            raise ValueError(f"state_scope: got {state_scope!r}, expected 'job' or 'rank'")
        #: ``"rank"``: :meth:`state_dict` holds this rank's lanes, without a collective (``distributed.state_scope``).
        self.state_scope = state_scope
        self.settings = settings
        self._fingerprint = dict(fingerprint or {})
        self._shard_digests = shard_digests  # the fingerprint's shard digests, until they are known
        self._source = source
        self._collate_fn = collate_fn
        self._stats = stats
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        final_map = FinalMap(settings, collate_wrapper, pin_memory=bool(pin_memory))
        self._read_ahead = ReadAhead(source, read_ahead, final_map, collate=_TracedCollate(collate_fn),
                                     retain=self.RETAINED_BATCHES)
        #: The last yielded batches' provenance: ``(weakref to the batch's first tensor, raw, step, epoch, lane)``.
        self._traced: deque[tuple[Any, Any, int, int, int]] = deque(maxlen=self.TRACED_BATCHES)
        self._lanes = Lanes(source.pipeline)
        if stats is not None:  # a rank reports the lanes it owns (all of them, after an elastic resume too)
            stats.owned_lanes = self._lanes.owned_lanes()
        # Lock order: _consume_lock -> _state_lock -> (ReadAhead's own locks).
        self._consume_lock = threading.RLock()  # one next() at a time; iter()/preview()/close() wait for it
        self._next_guard = threading.Lock()  # guards _next_thread
        self._next_thread: int | None = None  # the thread inside next(): another one entering is refused
        self._state_lock = threading.RLock()  # state_dict / load_state_dict / iter() / close()
        self._generation = 0  # bumped by iter() and preview(): older iterators are stale
        self._started = False  # the node has been reset for a pass
        self._pending: LoaderState | None = None  # loaded state, applied at the next iter()
        self._exhausted = False  # the last pass ended: the next iter() starts the next epoch
        self._epoch_chosen = False  # set_epoch() was called since: it decides the next epoch
        self._consumed: int | None = None  # set_consumed(): batches of this pass the consumer has taken
        self._pass_base = 0  # batches of the pass counted when it started (a resumed pass: those before the state)
        self._pass_delivered = 0  # batches next() returned since the pass started
        self._pass_resumed = False  # the pass continues a loaded state's
        self._pass_carry: list[dict[str, Any]] | None = None  # what the pass began with after an ended pass
        self._consumed_at = 0  # the batches delivered when set_consumed() was last called
        self._single_rank_by_default = single_rank_by_default
        self._even_passes = even_passes
        self._agreement: PassAgreement | None = None  # made at the first iter() in a multi-rank process group
        self._pass_over = False  # the ranks agreed to end this pass: next() raises StopIteration
        # Everything the finalizer touches is passed in: it must not keep the loader alive.
        self._finalizer = weakref.finalize(self, _release, self._read_ahead, source, on_close)

    #: Delivered batches kept (collated) so that a state can be taken as of that many batches back.
    RETAINED_BATCHES = 1
    #: Yielded batches whose provenance :meth:`provenance` can still tell (the newest last).
    TRACED_BATCHES = 8

    def __len__(self) -> int:
        raise TypeError(
            "ZephonLoader has no len(): the number of packed batches is not known before iterating. Train by "
            "steps or by passes; with transformers' Trainer use zephon_loader.hf.ZephonTrainer(train_loader="
            "loader, ...) instead of Trainer(train_dataset=loader) (the Trainer would batch the batches again)"
        )

    @property
    def dataset(self) -> Any:
        """Absent: Zephon reads and deals the records. The ``AttributeError`` names what a caller should do."""
        raise AttributeError(
            "ZephonLoader has no dataset: Zephon reads, packs and deals the records, so there is no dataset to "
            "rebuild a DataLoader from. If this comes from accelerate's skip_first_batches (or a Trainer's "
            "resume that calls it): the loader resumes itself from its state (zephon_loader.accelerate."
            "checkpoint_loaders, or zephon_loader.hf.ZephonTrainer): drop that call, skipping again would skip "
            "batches twice. If it comes from transformers' Trainer: use zephon_loader.hf.ZephonTrainer"
            "(train_loader=loader, ...)"
        )

    @property
    def fingerprint(self) -> dict[str, Any]:
        """What fixes the batch stream (:mod:`zephon_loader.fingerprint`); a state saved under another is refused.

        Its ``shards`` carry each shard's SHA-256: a build that did not find them (cache, manifest) hashes
        them in the background after the first batch, and this waits for them (:meth:`setting` does not).
        """
        pending = self._shard_digests
        if pending is not None:
            self._fingerprint["shards"] = pending.result()
            self._shard_digests = None
        return self._fingerprint

    @fingerprint.setter
    def fingerprint(self, value: Mapping[str, Any]) -> None:
        self._fingerprint, self._shard_digests = dict(value), None

    def setting(self, key: str, default: Any = None) -> Any:
        """One fingerprint key's value without waiting for the shard digests (``shards``: names and sizes
        until they are known), e.g. ``setting("micro_batch_size")``."""
        return self._fingerprint.get(key, default)

    def _await_digests(self) -> None:
        """Complete the fingerprint's shard digests (waiting for the hashing) without holding the state lock, so
        that ``next()`` in another thread goes on meanwhile."""
        if self._shard_digests is not None and self._finalizer.alive:
            self.fingerprint  # noqa: B018 - the property completes it

    def _identity_fingerprint(self) -> dict[str, Any]:
        """The fingerprint with each shard as ``[name, size]``: the same on every rank whether its digests are
        known yet or not (what names the loader to the other ranks)."""
        shards = self._fingerprint.get("shards")
        if not isinstance(shards, Mapping):
            return self._fingerprint
        return {**self._fingerprint, "shards": {source: [entry[:2] for entry in entries]
                                                for source, entries in shards.items()}}

    def __repr__(self) -> str:
        fp = self._fingerprint
        sources = [name for name, _ in fp.get("sources", [])]
        state = "closed" if not self._finalizer.alive else f"epoch {self._source.epoch}"
        return (f"{type(self).__name__}(sources={sources}, sequence_length={fp.get('sequence_length')}, "
                f"micro_batch_size={fp.get('micro_batch_size')}, contract={fp.get('contract')}, "
                f"dp_rank={self.dp_rank}/{self.dp_world_size}, read_ahead={self._read_ahead.depth}, {state})")

    @property
    def batch_size(self) -> int | None:
        """The micro-batch size ``B``: rows of every yielded batch."""
        value = self._fingerprint.get("micro_batch_size")
        return value if isinstance(value, int) else None

    # -- iteration ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        _trainer_hooks(self)  # Lightning / Accelerate: what they need of the loader (see _trainer_hooks)
        with self._consume_lock, self._state_lock:
            self._check_open()
            self._check_ranks()
            pending, self._pending = self._pending, None
            if self._even_passes and self._agreement is None:
                self._agreement = PassAgreement.for_job(loader_identity(self._identity_fingerprint()),
                                                        self.batch_size)
                if self._agreement is not None:  # a rank promises the batches it holds: hold a window of them
                    self._read_ahead.hold = max(self._read_ahead.depth, PassAgreement.WINDOW)
            self._generation += 1
            # A new pass after an ended one carries in what the ranks had left (an ended loaded state's carry, or
            # the agreement's): kept so that set_epoch() before the first batch can restart the pass with it.
            after_end = pending.pass_ended if pending is not None else self._exhausted
            carry = pending.carry if pending is not None else None
            self._pass_carry = (carry if carry is not None else self._source.pending_carry) if after_end else None
            self._start_pass(pending)
            return _Pass(self, self._generation)

    def _start_pass(self, pending: LoaderState | None) -> None:
        """Position the source for a pass: resume inside ``pending``'s pass, or start an epoch from its beginning.

        After an ended pass (this loader's, or the loaded state's) the next epoch, unless ``set_epoch`` chose
        one. Called with both locks held.
        """
        resume = pending is not None and not pending.pass_ended
        if self._stats is not None and resume:  # deliveries count per pass
            self._stats.load_state_dict(pending.stats)
        elif self._stats is not None:
            self._stats.reset()
        self._pass_over = False
        self._started = False
        if not resume:
            ended_epoch = pending.epoch if pending is not None else self._source.epoch
            if (pending is not None or self._exhausted) and not self._epoch_chosen:
                self._source.set_epoch(ended_epoch + 1)
            if self._pass_carry is not None:  # an ended pass: what the ranks had left comes first
                self._source.set_carry(self._pass_carry)
            self._read_ahead.reset(None)
        else:
            self._read_ahead.reset({ReadAhead.SOURCE_KEY: self._source_state(pending)})
        if self._agreement is not None:  # where the pass begins, checked against the other ranks
            step = self._stats.steps if self._stats is not None else -1
            self._agreement.begin_pass(fresh=not resume, epoch=self._source.epoch, step=step)
        self._exhausted = self._epoch_chosen = False
        self._consumed = None
        self._pass_resumed = resume
        self._pass_base = self._stats.batches if self._stats is not None else 0
        self._pass_delivered = 0
        self._started = True

    def _next(self, generation: int) -> dict[str, Any]:
        me = threading.get_ident()
        with self._next_guard:
            inside = self._next_thread
            if inside is not None and inside != me:
                raise RuntimeError(
                    f"ZephonLoader: next() called from thread {threading.current_thread().name!r} while another "
                    f"thread (id {inside}) is inside next() of the same loader; expected one consumer at a time: "
                    "each batch would go to whichever thread asked first, so neither sees the stream in order. "
                    "Consume a loader from one thread (hand batches on through a queue), or build one loader "
                    "per consumer (each its own data-parallel rank)"
                )
            self._next_thread = me
        try:
            return self._next_batch(generation)
        finally:
            with self._next_guard:
                self._next_thread = None

    def _next_batch(self, generation: int) -> dict[str, Any]:
        with self._consume_lock:
            self._check_open()
            if generation != self._generation:
                raise RuntimeError(
                    f"ZephonLoader: this iterator is stale (pass {generation}; pass {self._generation} is current): "
                    "a later iter(loader), preview() or load_state_dict() restarted the stream; advance the "
                    "newest iterator, or call iter(loader) once per pass (after load_state_dict: iter(loader) "
                    "resumes the loaded state)"
                )
            if self._pass_over:
                raise StopIteration
            if self._agreement is not None:
                self._agree()
            try:
                batch = next(self._read_ahead)
            except StopIteration:
                self._exhausted = True
                raise
            self._pass_delivered += 1
            digests = self._shard_digests
            if digests is not None:  # the first batch is out: hash what the fingerprint lacks (once)
                digests.start()
            counts = batch.pop(F.SOURCE_COUNTS, None)
            epoch, lane = self._read_ahead.last_key or (self._source.epoch, -1)
            if self._stats is not None and counts is not None:
                self._stats.add_delivered(counts, carried=epoch != self._source.epoch)
            step = self._stats.steps - 1 if self._stats is not None else self._pass_delivered - 1
            raw = self._read_ahead.last_raw
            tensor = _first_tensor(batch)
            if tensor is not None:
                self._traced.append((weakref.ref(tensor), getattr(raw, "provenance", None), step, epoch, lane))
            return batch

    def _agree(self) -> None:
        """Before a batch: unless every rank promised it already, ask every rank whether it has one (and how
        many it holds read ahead: the next exchange waits that many batches); end the pass for all when one
        has none.

        What the others had left is carried into the next pass (a collective, at the same batch on every rank).
        """
        assert self._agreement is not None
        window = self._agreement.WINDOW
        if self._agreement.granted(lambda: self._read_ahead.ahead(window)[1]):  # every rank promised it
            return
        key, held = self._read_ahead.ahead(window)
        chain = self._source.chain_epochs
        reading = chain.index(key[0]) if isinstance(key, tuple) and key[0] in chain else (
            len(chain) - 1 if key is not None else len(chain))
        promise = 0 if key is None else max(1, min(held, window))  # a failure next: one (next() raises it)
        every, some, drained = self._agreement.exchange(promise, [i < reading for i in range(len(chain))])
        if every:
            return
        with self._state_lock:
            if some:  # someone has batches left: they come first in the next epoch
                anchor, skip, _ = self._read_ahead.position(0)
                self._source.carry_over(anchor, skip, {i for i, done in enumerate(drained) if done})
            else:
                self._source.clear_carry()
            self._pass_over = True
            self._exhausted = True
        raise StopIteration

    @property
    def sampler(self) -> "EpochHook":
        """Where AutoModel's ``StepScheduler.set_epoch`` looks (``dataloader.sampler.set_epoch``): it reaches
        :meth:`set_epoch`. There is no sampler otherwise (Zephon orders and deals the records)."""
        return EpochHook(self)

    @property
    def batch_sampler(self) -> None:
        """``None``: Zephon forms the batches (trainers that look for a ``DataLoader``'s batch sampler find none)."""
        return None

    @property
    def dp_rank(self) -> int:
        """This loader's data-parallel rank (its Zephon lanes)."""
        return self._lanes.data_parallel[0]

    @property
    def dp_world_size(self) -> int:
        """The data-parallel size the loader was built for."""
        return self._lanes.data_parallel[1]

    @property
    def epoch(self) -> int:
        """The epoch being read (or last read); see :meth:`set_epoch`."""
        return self._source.epoch

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` at the next ``iter()`` (AutoModel's and the HF Trainer's hook).

        Each epoch reads every source once in an order derived from ``(seed,
        epoch)``: the same on every run, rank and data-parallel size. A state
        loaded with :meth:`load_state_dict` takes precedence (it carries its
        own epoch). Does not disturb a pass that has yielded a batch; a pass
        that ``iter()`` started but that has yielded nothing yet (trainers
        call ``iter()`` first, then ``set_epoch``) restarts as epoch
        ``epoch`` from its beginning, keeping what an ended pass carried in.

        Raises:
            ValueError: Not an int >= 0.
        """
        with self._consume_lock, self._state_lock:
            self._check_open()
            self._source.set_epoch(epoch)
            self._epoch_chosen = True
            if (self._started and not self._pass_delivered and not self._exhausted and not self._pass_over
                    and epoch != self._source.epoch):
                self._start_pass(None)  # the iterator iter() returned stays valid: it reads the new start

    def stats(self) -> dict[str, Any]:
        """What this loader delivered and dropped, per source and reason (:meth:`LoaderStats.snapshot`).

        Delivered counts are exact at the last yielded batch and continue
        across ``state_dict``/``load_state_dict``; drops count records Zephon's
        workers have read (bad records under ``on_bad_record: skip``, records
        longer than a row under ``first_fit``/``best_fit``). In multi-rank runs,
        each rank reports the Zephon lanes it owns; the ranks' reports add up
        to the job's, also after an elastic resume at another DP size.
        """
        with self._state_lock:
            if self._stats is None:
                raise RuntimeError("ZephonLoader.stats: this loader was built without accounting (stats=None)")
            return self._stats.snapshot()

    @property
    def yielded_fields(self) -> tuple[str, ...]:
        """Names every yielded batch carries (see :mod:`zephon_loader.fields`)."""
        return self.settings.yielded_fields

    @property
    def pipeline(self) -> Any:
        """The underlying ``zephon.Pipeline``."""
        return self._source.pipeline

    def preview(self) -> dict[str, Any]:
        """The first batch of a fresh pass, as the final map sees it after adapt (and xdoc).

        Internal names (``document_ids``, ``attention_document_ids``,
        ``attention_eligibility`` when configured, ...) for inspection tools.
        It restarts the Zephon source, so a live iterator becomes stale (it
        raises ``RuntimeError`` when advanced); the next ``iter()`` starts
        the pass it would have started anyway (the current epoch from its
        beginning, or the next epoch after a finished pass), or from a state
        loaded before.

        Raises:
            RuntimeError: The stream is empty.
        """
        with self._consume_lock, self._state_lock:
            self._check_open()
            self._generation += 1
            self._started = False
            self._read_ahead.close()  # park the reader: the source is used from this thread now
            self._source.reset(None)
            try:
                raw = next(self._source)
            except StopIteration as error:
                raise RuntimeError("preview: the Zephon pipeline yielded no batch") from error
            batch = dict(self._collate_fn(raw))
            batch.pop(F.SOURCE_COUNTS, None)  # accounting of delivered batches, not part of a preview
            adapt_model_inputs(batch, batch.get(F.ATTENTION_ELIGIBILITY))
            if self.settings.xdoc:
                join_subdocuments(batch)
            self._source.reset(None)
            return batch

    # -- provenance and skipping ---------------------------------------------------------
    def provenance(self, batch: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Which documents each row of a yielded batch holds (``None``: the batch ``next()`` returned last).

        Returns ``{"step", "epoch", "lane", "rank", "world", "rows": [[piece, ...], ...]}``, one list per row
        (in row order; a row of padding only has none), each piece ``{"source", "shard" (file or URL), "line" (JSONL, 1-based) or "row"
        (Parquet and other formats, 0-based), "record" (Zephon's index in the shard), "start", "end"
        (columns of ``input_ids``, end exclusive), "tokens", "ends_document"}``
        (:func:`~zephon_loader.pipeline.provenance.describe_rows`). ``step``: this rank's step of the pass
        (0-based; skipped steps count). Costs nothing per batch: the loader keeps references to what Zephon
        already carries, and the lines are looked up (once per shard) only here.

        Raises:
            ValueError: ``batch`` is not one of the last :attr:`TRACED_BATCHES` batches this loader yielded.
        """
        with self._state_lock:
            wanted = _first_tensor(batch) if batch is not None else None
            for ref, raw, step, epoch, lane in reversed(self._traced):
                if batch is None or (wanted is not None and ref() is wanted):
                    if raw is None:
                        raise ValueError("provenance: this batch's collate kept no provenance")
                    return {"step": step, "epoch": epoch, "lane": lane, "rank": self.dp_rank,
                            "world": self.dp_world_size, "rows": self._rows_of(raw)}
        raise ValueError(
            "provenance: " + ("no batch was yielded yet" if batch is None else
                              f"got a batch that is not one of the last {self.TRACED_BATCHES} this loader yielded")
            + "; call provenance(batch) soon after next() returned it, or loader.provenance_of_steps(first, last) "
            "(zephon-loader show) for any step")

    def provenance_of_steps(self, first: int, last: int | None = None) -> list[dict[str, Any]]:
        """The provenance (as :meth:`provenance`) of steps ``first .. last`` of the pass, without training.

        Call it before iterating: on a fresh loader (steps count from the start of the pass), or after
        :meth:`load_state_dict` (it reads from the state's position, never from the start of the run: the
        steps before the state are not read again; ``first`` must be at or after the state's step). It reads
        and packs the batches from there to ``last`` (no collate, no final map) and leaves the loader where it
        was: the next ``iter()`` starts (or resumes) as it would have. Not a collective: one rank's steps.

        Raises:
            ValueError: Bad steps, a step before the state's, a pass that ends before ``last``, a state of an
                ended pass or without accounting.
            RuntimeError: The loader has begun a pass (its position is no longer a state it can read from).
        """
        last = first if last is None else last
        if any(isinstance(x, bool) or not isinstance(x, int) for x in (first, last)) or not 0 <= first <= last:
            raise ValueError(f"provenance_of_steps: got steps {first!r}..{last!r}, expected ints 0 <= first <= last")
        with self._consume_lock, self._state_lock:
            self._check_open()
            pending = self._pending
            if pending is None and self._started:
                raise RuntimeError(
                    "provenance_of_steps: this loader has begun a pass; call it on a fresh loader or after "
                    "load_state_dict (or use provenance(batch) for the batches it yields)")
            step = 0
            skipped: list[dict[str, int]] = []
            if pending is not None:
                step, skipped = self._steps_of(pending, "provenance_of_steps")
            if first < step:
                raise ValueError(
                    f"provenance_of_steps: step {first} comes before the state's step {step} (the state resumes "
                    f"there), expected steps >= {step}; pass an earlier state, or none to read from the start of "
                    "the pass")
            self._park()
            self._source.reset(self._source_state(pending) if pending is not None else None)
            found = []
            while step <= last:
                try:
                    raw = next(self._source)
                except StopIteration:
                    raise ValueError(f"provenance_of_steps: this rank's pass ends after step {step - 1}, expected "
                                     f"steps up to {last}") from None
                if step >= first:
                    epoch, lane = self._source.batch_key(raw)
                    found.append({"step": step, "epoch": epoch, "lane": lane, "rank": self.dp_rank,
                                  "world": self.dp_world_size, "skipped_steps": copy.deepcopy(skipped),
                                  "rows": self._rows_of(raw_provenance(raw))})
                step += 1
            return found

    def skip_batches(self, n: int) -> None:
        """Skip the next ``n`` steps: every rank resumes ``n`` of its batches later (a loss spike's range).

        Call it after :meth:`load_state_dict` (or on a fresh loader, or between passes of a live one: then
        from :meth:`state_dict`, a collective) and before ``iter()``. On each rank it reads and packs its next
        ``n`` batches (Zephon's work for them; no collate, no final map, nothing before them read again),
        then takes the state there (a collective: every rank calls it with the same ``n``). Nothing else of
        the stream changes: the batches after them are the ones an uninterrupted run yields there. They are
        counted in :meth:`stats` (``skipped_batches``, ``sources[name]["skipped"]``, ``skipped_steps``) and
        recorded in the state (:meth:`state_dict` returns it until ``iter()``), so a later resume and
        :meth:`provenance_of_steps` (``zephon-loader show``) know them. ``n`` steps are ``n`` batches on each
        rank of this DP size (at another DP size than the state was saved at: that size's steps).

        Raises:
            ValueError: ``n`` not an int >= 1; a state whose pass ended; a rank whose pass ends before ``n``
                batches (the loader is left as it was).
            RuntimeError: The loader has no accounting (``stats=None``): it could not record the skip.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"skip_batches: got {n!r}, expected an int >= 1 (the steps to skip)")
        with self._consume_lock, self._state_lock:
            self._check_open()
            if self._stats is None:
                raise RuntimeError("skip_batches: this loader was built without accounting (stats=None), so it "
                                   "could not record the skip in its state; build it with accounting")
            pending = self._pending
            if pending is None and self._started:  # a live loader: from where the training loop is
                pending = self._loaded(self.state_dict())
            if pending is not None:
                self._steps_of(pending, "skip_batches")  # refuses an ended pass
            self._park()
            if pending is not None:
                self._stats.load_state_dict(pending.stats)
                self._source.reset(self._source_state(pending))
            else:
                self._stats.reset()
                self._source.reset(None)
            from_step, pulled = self._stats.steps, 0
            while pulled < n:
                try:
                    raw = next(self._source)
                except StopIteration:
                    break
                self._stats.add_skipped(self._source.batch_key(raw)[1], batch_source_counts(raw))
                pulled += 1
            self._stats.record_skip(from_step, pulled)
            value = {"stats": self._stats.round_value(), "pulled": pulled}
            # Nothing was pulled ahead: the position now is the one before the next batch (a resume of the state
            # does not read the skipped batches again).
            source_state, merged = self._source.state_at(self._source.position(), None,
                                                         (STATS_ROUND_KEY, value, _merge_skip_round))
            if min(merged["pulled"]) < n:
                if pending is not None:
                    self._stats.load_state_dict(pending.stats)
                else:
                    self._stats.reset()
                raise ValueError(
                    f"skip_batches: got {n}, expected at most the batches left in the pass: a rank's pass ended "
                    f"after {min(merged['pulled'])} (ranks read {merged['pulled']}); the loader is left at the "
                    "state it had; skip fewer, or start the next epoch")
            self._pending = self._state_of(source_state, merged["stats"], pass_ended=False, carry=None)

    def _steps_of(self, pending: LoaderState, what: str) -> tuple[int, list[dict[str, int]]]:
        """The step a loaded state resumes at and the ranges it skipped (from its accounting)."""
        if pending.pass_ended:
            raise ValueError(f"{what}: the loaded state's pass (epoch {pending.epoch}) ended, expected a state "
                             "inside a pass; iterate into the next epoch, then take a state there")
        if pending.stats is None:
            raise ValueError(f"{what}: the loaded state carries no accounting (saved by a loader built with "
                             "stats=None), so its step is not known; use a state saved with accounting")
        return LoaderStats.steps_of(pending.stats)

    def _loaded(self, state: Mapping[str, Any]) -> LoaderState:
        return LoaderState.from_dict(
            state, fingerprint=self.fingerprint, canonical_replicas=self._lanes.canonical_replicas,
            check_checkpoint=lambda checkpoint: self._source.validate_state({ZephonSource.STATE_KEY: checkpoint}),
            stats=self._stats)

    def _park(self) -> None:
        """Stop the read-ahead and make live iterators stale: the source is used from this thread now; the next
        ``iter()`` starts or resumes the pass anew."""
        self._generation += 1
        self._started = False
        self._read_ahead.close()

    def _rows_of(self, raw: Any) -> list[list[dict[str, Any]]]:
        """:func:`describe_rows` of a batch, padded with empty rows to ``B`` (Zephon's short last batch of a
        flush: collate fills the missing rows with padding, which holds no piece)."""
        rows = describe_rows(raw, self._source._shards, int(self.fingerprint["sequence_length"]))
        return rows + [[] for _ in range(max(0, (self.batch_size or 0) - len(rows)))]

    @staticmethod
    def _source_state(pending: LoaderState) -> dict[str, Any]:
        """What :meth:`ZephonSource.reset` takes to resume ``pending``."""
        source_state = {ZephonSource.STATE_KEY: pending.zephon_checkpoint, ZephonSource.SKIP_KEY: pending.skip,
                        ZephonSource.CARRIED_KEY: pending.carried, ZephonSource.CARRY_KEY: pending.carry}
        if pending.epoch:
            source_state[ZephonSource.EPOCH_KEY] = pending.epoch
        if pending.phase is not None:
            source_state[ZephonSource.PHASE_KEY] = pending.phase["index"]
            source_state[ZephonSource.PHASE_BATCHES_KEY] = pending.phase["batches"]
        return source_state

    # -- state --------------------------------------------------------------------------
    def set_consumed(self, count: int) -> None:
        """Say that the training loop has taken ``count`` batches of the current pass (a trainer hook).

        A consumer that pulls batches ahead of the step (Lightning's fetcher
        pulls one) calls this with the batches it trained, before a state is
        taken: :meth:`state_dict` then describes the stream after exactly
        ``count`` batches, and the ones pulled beyond it are delivered again on
        resume. Without it the state counts every batch ``next()`` returned.
        It holds until the next ``iter()``.

        Raises:
            ValueError: ``count`` is not between the batches delivered minus
                :attr:`RETAINED_BATCHES` and the batches delivered.
            RuntimeError: The loader has no accounting (``stats=None``) to count deliveries.
        """
        with self._state_lock:
            self._check_open()
            if self._stats is None:
                raise RuntimeError("ZephonLoader.set_consumed: this loader was built without accounting (stats=None), "
                                   "so it does not count its deliveries")
            delivered = self._stats.batches
            low = max(0, delivered - self.RETAINED_BATCHES)
            if isinstance(count, bool) or not isinstance(count, int) or not low <= count <= delivered:
                raise ValueError(
                    f"set_consumed: got {count!r}, expected an int in [{low}, {delivered}]: this pass delivered "
                    f"{delivered} batches and the loader keeps the last {self.RETAINED_BATCHES} to hand back; a "
                    "consumer may be at most that many batches behind next()"
                )
            self._consumed = count
            self._consumed_at = delivered

    def note_consumed(self, count: int = 1) -> None:
        """Say that the training loop has taken ``count`` more batches of the current pass (a trainer hook).

        :meth:`set_consumed` counted from where the pass started: 0 for a new
        pass, the batches before the state for a resumed one. Lightning's
        :class:`~zephon_loader.integrations.lightning.ZephonLoaderCallback`
        calls it at every training batch (Lightning's own ``batch_idx`` does
        not restart after a resume at an epoch's last batch).

        Raises:
            ValueError, RuntimeError: As :meth:`set_consumed`.
        """
        with self._state_lock:
            self.set_consumed((self._consumed if self._consumed is not None else self._pass_base) + count)

    def state_dict(self) -> dict[str, Any]:
        """The exact position of the training loop: :meth:`LoaderState.to_dict <zephon_loader.state.LoaderState.to_dict>`.

        After :meth:`set_consumed`, the position after that many batches of the pass. Its fingerprint carries
        every shard's SHA-256: digests still being hashed in the background are waited for (a long wait is
        logged once, naming ``zephon-loader index``, which makes them known at build).

        ``distributed.state_scope: job`` (default): every lane, the same on every rank; a collective (every
        rank calls it at the same step). ``rank``: the lanes this rank owns (``lanes``), no collective: each
        rank saves its own (docs/distributed.md, "Per-rank state").
        """
        self._await_digests()
        with self._state_lock:
            self._check_open()
            if self._pending is not None:
                return copy.deepcopy(self._scoped(self._pending).to_dict())
            lag = 0
            if self._started:
                lag = self._consumer_lag()
                anchor, skip, handed_back = self._read_ahead.position(lag)
            else:  # start of the stream (no pass yet, or preview() restarted it)
                anchor, skip, handed_back = self._source.position(), {}, []
            extra = None
            if self._stats is not None:
                counts = [raw.get(F.SOURCE_COUNTS) for raw in handed_back]
                extra = (STATS_ROUND_KEY, self._stats.round_value([c for c in counts if c]), LoaderStats.merge)
            source_state, stats = self._source.state_at(anchor, skip, extra, local=self.state_scope == "rank")
            pass_ended = self._exhausted and lag == 0
            # An ended pass records what the next one reads first; a pass in progress what it began with.
            return self._scoped(self._state_of(source_state, stats, pass_ended=pass_ended,
                                               carry=self._source.pending_carry if pass_ended else None)).to_dict()

    def _scoped(self, state: LoaderState) -> LoaderState:
        """``state`` as :meth:`state_dict` returns it: cut to this rank's lanes with ``state_scope: rank``."""
        return state.for_lanes(self._lanes.owned_lanes()) if self.state_scope == "rank" else state

    def _state_of(self, source_state: Mapping[str, Any], stats: Any, *, pass_ended: bool,
                  carry: list[dict[str, Any]] | None) -> LoaderState:
        """The :class:`LoaderState` of a source state (``ZephonSource.state_at``) and merged accounting."""
        fingerprint = copy.deepcopy(self.fingerprint)
        phase = None
        if ZephonSource.PHASE_KEY in source_state:  # a mixture schedule: its phases up to the current one
            index = int(source_state[ZephonSource.PHASE_KEY])
            phase = {"index": index, "batches": source_state.get(ZephonSource.PHASE_BATCHES_KEY, {})}
            fingerprint["schedule"] = fingerprint["schedule"][:index + 1]
        return LoaderState(
            fingerprint=fingerprint,
            epoch=int(source_state.get(ZephonSource.EPOCH_KEY, 0)),
            pass_ended=pass_ended,
            zephon_checkpoint=source_state[ZephonSource.STATE_KEY],
            skip=source_state.get(ZephonSource.SKIP_KEY, {}),
            carried=source_state.get(ZephonSource.CARRIED_KEY, []),
            carry=carry if carry is not None else source_state.get(ZephonSource.CARRY_KEY, []),
            stats=stats,
            phase=phase,
        )

    def _consumer_lag(self) -> int:
        """Batches delivered beyond the last :meth:`set_consumed` count (0 without one); a count given before
        batches that were delivered since is stale: warned (the state rewinds to it), or refused when the loader
        cannot hand back that many."""
        if self._consumed is None or self._stats is None:
            return 0
        delivered = self._stats.batches
        lag, since = delivered - self._consumed, delivered - self._consumed_at
        if not since:
            return lag
        stale = (f"state_dict: the last set_consumed({self._consumed}) came {since} batch(es) ago ({delivered} "
                 "delivered now)")
        fix = ("call set_consumed(<batches trained this pass>) after every batch or just before state_dict(), as "
               "ZephonLoaderCallback does")
        if lag > self.RETAINED_BATCHES:
            raise ValueError(f"{stale}, expected a count at most {self.RETAINED_BATCHES} behind the batches "
                             f"delivered (the loader keeps only that many to hand back); {fix}")
        warnings.warn(f"{stale}: the state resumes after batch {self._consumed}, so the {lag} delivered after it "
                      f"come again on resume; if they were trained, {fix}", RuntimeWarning, stacklevel=3)
        return lag

    def load_state_dict(self, state_dict: Mapping[str, Any] | list[Mapping[str, Any]]) -> None:
        """Resume from :meth:`state_dict` output at the next ``iter()``.

        Any ``read_ahead`` and, within ``canonical_replicas``, any DP size may
        have saved it. The shard digests are compared whole: digests this
        build did not find (cache, manifest) are hashed first, and waited for.

        Per-rank states (``distributed.state_scope: rank``): this rank's own
        state at the same DP size; at another DP size a list of every old
        rank's state (a rank keeps the lanes it owns now). A state of every lane
        (``job``) loads into either scope.

        Raises:
            TypeError: Not a mapping (or a list of them).
            ValueError: Empty, another or a retired format, a different
                configuration (the differing keys are named), a corrupt Zephon
                checkpoint or one with another lane count, malformed
                accounting, states of different steps, or states that miss a
                lane this rank needs (named, with the fix). Never a silent fresh start.
        """
        self._await_digests()
        with self._state_lock:
            self._check_open()
            lanes = self._lanes.canonical_replicas
            if isinstance(state_dict, (list, tuple)):
                if not state_dict:
                    raise ValueError("load_state_dict: got an empty list, expected the state of every rank "
                                     "(distributed.state_scope: rank) or one state")
                loaded = []
                for index, state in enumerate(state_dict):
                    try:
                        loaded.append(self._loaded(state))
                    except (TypeError, ValueError) as error:
                        raise type(error)(f"states[{index}]: {error}") from error
            else:
                loaded = [self._loaded(state_dict)]
            given = set().union(*(s.held_lanes(lanes) for s in loaded))
            owned = self._lanes.owned_lanes()
            needed = owned if self.state_scope == "rank" else frozenset(range(lanes))
            if needed - given:
                raise self._missing_lanes(given, needed - given, loaded)
            cuts = [(s.zephon_checkpoint, s.skip) for s in loaded if s.zephon_checkpoint is not None]
            if self.state_scope == "rank":  # keep only the lanes this rank owns (O(lanes / ranks) held)
                loaded = [s.for_lanes(s.held_lanes(lanes) & owned) for s in loaded]
            pending = merge_states(loaded, lanes) if len(loaded) > 1 else loaded[0]
            # Resumed at another size with its lanes out of step where it was cut: said once, in both scopes.
            warn_resuming_mid_window(cuts, lanes, self._lanes.data_parallel[1])
            self._pending = self._scoped(pending)
            self._generation += 1  # a live iterator would go on with the old stream: it is stale now

    def _missing_lanes(self, given: set[int], missing: set[int], loaded: list[LoaderState]) -> ValueError:
        """The error for loaded states that lack lanes this loader needs, with the likely fix."""
        lanes = self._lanes.canonical_replicas
        dp_rank, dp_size = self._lanes.data_parallel
        sizes = {(s.zephon_checkpoint or {}).get("world", {}).get("world_size") for s in loaded} - {None}
        seen = (f"load_state_dict: the state{'s' if len(loaded) > 1 else ''} hold{'' if len(loaded) > 1 else 's'} "
                f"lanes {lane_ranges(given)} of {lanes}")
        every = ("pass every rank's state: loader.load_state_dict([state of rank 0, rank 1, ...]) or "
                 "loader.load_state('<folder>/loader-*.pt')")
        same_size = sizes == {dp_size}
        saved_at = " or ".join(str(size) for size in sorted(sizes)) + " rank(s)" if sizes else "another size"
        if self.state_scope == "job":
            return ValueError(
                f"{seen}, expected every lane (distributed.state_scope is 'job'); missing {lane_ranges(missing)}. "
                f"They were saved with distributed.state_scope: rank (a state per rank, its own lanes) at "
                f"{saved_at}: "
                + ("set distributed.state_scope: rank in this configuration to resume each rank from its own "
                   f"state, or {every}" if same_size else every))
        return ValueError(
            f"{seen}, expected also {lane_ranges(missing)} (the lanes dp_rank {dp_rank} of {dp_size} owns). "
            + (f"They were saved at this data-parallel size: load dp_rank {dp_rank}'s own state on this rank, "
               f"or {every}" if same_size and len(loaded) == 1 else
               f"Per-rank states (distributed.state_scope: rank) saved at {saved_at} resume at another size from "
               f"every rank's state: {every}"))

    def save_state(self, path: str | Any) -> None:
        """:meth:`state_dict` written to ``path`` atomically (a temporary file, fsync, rename).

        JSON when the name ends in ``.json``, else ``torch.save`` (it loads
        with ``torch.load(path, weights_only=True)``). A full disk or a signal
        mid-write leaves the previous file at ``path`` whole. ``{dp_rank}`` in
        ``path`` is this rank's DP rank (``"ckpt/loader-{dp_rank}.pt"``).
        ``state_scope: job``: a collective like ``state_dict()``, every rank's
        state the same (one path on a shared disk, or one per rank);
        ``rank``: each rank saves its own lanes (put ``{dp_rank}`` in the path).

        Raises:
            ValueError: ``state_scope: rank`` on several ranks and a path with neither ``{dp_rank}`` nor
                this rank's number in its file name (each rank's file would replace the others').
        """
        from zephon_loader.state import save_state_file

        dp_rank, dp_size = self._lanes.data_parallel
        text = str(path)
        own = "{dp_rank}" in text or re.search(rf"(?<!\d){dp_rank}(?!\d)", os.path.basename(text))
        if not own and self.state_scope == "rank" and dp_size > 1:
            raise ValueError(f"save_state: got {text!r} at {dp_size} data-parallel ranks with "
                             "distributed.state_scope: rank, expected a path of this rank's own, with {dp_rank} "
                             f"in it (e.g. 'ckpt/loader-{{dp_rank}}.pt') or this rank's number ({dp_rank}) in its "
                             "file name: each rank saves its own lanes, and one path would keep only the last rank's")
        save_state_file(text.replace("{dp_rank}", str(dp_rank)) if "{dp_rank}" in text else path, self.state_dict())

    def load_state(self, path: str | Any) -> None:
        """:meth:`load_state_dict` of the file :meth:`save_state` wrote, or of several: a list of paths, or a
        pattern with ``*`` or ``{dp_rank}`` (``"ckpt/loader-*.pt"``, ``"ckpt/loader-{dp_rank}.pt"``: every
        rank's file of a per-rank state, which resumes at any DP size).

        Raises:
            FileNotFoundError: No file at ``path`` (a pattern: none matches).
            ValueError: An unreadable file (naming it), or a state ``load_state_dict`` refuses.
        """
        from zephon_loader.state import read_state_file, state_paths

        paths = [str(p) for p in path] if isinstance(path, (list, tuple)) else state_paths(path)
        if paths is None:
            self.load_state_dict(read_state_file(path))
            return
        if not paths:
            raise FileNotFoundError(f"load_state: no file matches {str(path).replace('{dp_rank}', '*')!r}; expected "
                                    "the files save_state wrote")
        try:
            self.load_state_dict([read_state_file(p) for p in paths])
        except ValueError as error:  # states[i] is a file here: name it
            named = re.sub(r"states\[(\d+)\]", lambda m: f"states[{m[1]}] ({paths[int(m[1])]})", str(error))
            raise ValueError(named) from error

    # -- shutdown -----------------------------------------------------------------------
    def close(self) -> None:
        """Stop the read-ahead thread and Zephon's workers, then run ``on_close``. Idempotent."""
        with self._consume_lock, self._state_lock:
            self._finalizer()

    def __enter__(self) -> "ZephonLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _check_ranks(self) -> None:
        if not self._single_rank_by_default:
            return
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise RuntimeError(
                f"ZephonLoader: built as the only data-parallel rank (no process group existed yet), but it is "
                f"iterated in a process group of {dist.get_world_size()} ranks: every rank would read the same "
                "data. Build the loader after the process group is initialized (Lightning: in "
                "LightningModule.train_dataloader() or a LightningDataModule; torchrun: after "
                "init_process_group), or pass dp_rank/dp_world_size (dp_rank=0, dp_world_size=1 to read "
                "everything on every rank)"
            )

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("ZephonLoader is closed; build a new loader")


class ImageLoader(ZephonLoader):
    """A :class:`~zephon_loader.loader.ZephonLoader` of image-text batches that knows its processor."""

    def __init__(self, *args: Any, processor: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._processor = processor

    @property
    def processor(self) -> Any:
        """The record processor this loader runs (e.g. a :class:`~zephon_loader.processors.Qwen2VLRecordProcessor`)."""
        return self._processor

    @property
    def yielded_fields(self) -> tuple[str, ...]:
        """Names every yielded batch carries; ``pixel_values``/``image_grid_thw`` come only with an image.

        Under the ``hf`` contract no flash kwargs: a Hugging Face VLM hands its kwargs to its vision tower too.
        """
        names = self.settings.yielded_fields
        if self.settings.packed_mask_type == "position_ids":
            names = tuple(name for name in names if name not in F.FLASH_KWARGS)
        return names + F.IMAGE_ALWAYS


class EpochHook:
    """``loader.sampler``: forwards ``set_epoch`` to its loader (the hook training loops call on samplers)."""

    def __init__(self, loader: ZephonLoader) -> None:
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        """:meth:`ZephonLoader.set_epoch`."""
        self._loader.set_epoch(epoch)


class _Pass(Iterator[dict[str, Any]]):
    """One pass over a :class:`ZephonLoader`; stale once a later ``iter()`` (or ``preview()``) restarted it."""

    def __init__(self, loader: ZephonLoader, generation: int) -> None:
        self._loader = loader
        self._generation = generation

    def __iter__(self) -> "_Pass":
        return self

    def __next__(self) -> dict[str, Any]:
        return self._loader._next(self._generation)


class _Collated(dict):
    """A collated batch (what the read-ahead keeps of a pulled batch) that also holds, as an attribute, its
    rows' raw provenance: the final map gets a plain ``dict`` copy, so it never reaches a yielded batch."""

    provenance: Any = None


class _TracedCollate:
    """The loader's collate plus references to what Zephon's batch carries of each row's records
    (:func:`~zephon_loader.pipeline.provenance.raw_provenance`: no copy, no work;
    :meth:`ZephonLoader.provenance` reads them only when asked)."""

    def __init__(self, collate_fn: Callable[[Any], dict[str, Any]]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, sample_batch: Any) -> dict[str, Any]:
        out = _Collated(self.collate_fn(sample_batch))
        out.provenance = raw_provenance(sample_batch)
        return out


def _first_tensor(batch: Any) -> Any:
    """A yielded batch's first tensor: what identifies it (tensors are weak-referenceable, dicts are not)."""
    if isinstance(batch, Mapping):
        for value in batch.values():
            if isinstance(value, torch.Tensor):
                return value
    return None


def _merge_skip_round(values: list[Any]) -> dict[str, Any]:
    """Every rank's ``{"stats": round value, "pulled": batches}`` of a skip -> merged accounting, every count."""
    present = [value for value in values if value]
    return {"stats": LoaderStats.merge([value["stats"] for value in present]),
            "pulled": [int(value["pulled"]) for value in present]}


def _release(read_ahead: ReadAhead, source: ZephonSource, on_close: Callable[[], None] | None) -> None:
    """Close what a loader owns; run by ``close()`` or when the loader is collected.

    Garbage collection can run it in any thread, the read-ahead thread
    included; that thread cannot join itself (nor close the Zephon iterator it
    may be inside), so there the work moves to a new thread.
    """
    if read_ahead.in_reader_thread():
        threading.Thread(
            target=_release, args=(read_ahead, source, on_close), name="zephon-loader-release", daemon=True
        ).start()
        return
    try:
        read_ahead.close()
        source.close()
    finally:
        if on_close is not None:
            on_close()


#: Trainer integrations the loader calls at ``iter()`` once the trainer's package is imported (by the user's
#: program): trainer module -> (integration module, function). Loaded by name: the integrations import the loader,
#: the loader never imports them.
TRAINER_HOOKS = {
    "lightning.pytorch": ("zephon_loader.integrations.lightning", "attach_to_trainer"),
    "accelerate": ("zephon_loader.integrations.accelerate", "check_under_accelerator"),
}


def _trainer_hooks(loader: ZephonLoader) -> None:
    """At ``iter()``: what a trainer already imported in this process needs of the loader.

    Lightning: its fetcher pulls a batch ahead, so its training loaders need
    :class:`~zephon_loader.integrations.lightning.ZephonLoaderCallback` (added
    to the trainer when missing). Accelerate: refuse settings the loader cannot
    honour, warn when ``save_state`` would not save the loader. Neither is
    imported unless the user's program already imported the trainer.
    """
    for trainer, (module, function) in TRAINER_HOOKS.items():
        if trainer in sys.modules:
            getattr(importlib.import_module(module), function)(loader)
