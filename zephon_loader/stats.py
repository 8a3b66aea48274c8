"""Accounting: what the loader delivered and what it dropped, per source and reason.

* **Delivered** documents and tokens are counted from Zephon's own per-row
  provenance (``SampleMeta.component_sample_counts`` — a document split by
  ``wrap`` counts once, on its closing piece — and
  ``component_token_counts``: the packed tokens, ``S + 1`` per full row),
  when a batch reaches the training loop: batches
  read ahead but not yet yielded are not counted, and the counts travel in the
  loader's state, so a resumed run continues them exactly.
* **Label-only** tokens: Zephon packs rows of ``S + 1`` tokens and
  ``to_training`` shifts them, so the last token of a row without padding
  reaches the model only as the label of the token before it; the next-token
  pair it starts (it, then the next row's first token) is trained by nobody.
  They are delivered (counted in ``tokens``) and counted again, per lane, as
  ``label_only_tokens``: a pass's input tokens (``~padding_mask``) are
  ``tokens - label_only_tokens``, one per full row (``1 / (S + 1)`` of the
  tokens; ``tests/test_token_accounting.py``).
* Counts are kept **per Zephon lane** (a batch comes from one lane), and a
  rank reports the lanes it owns. A state carries every lane's counts (merged
  across ranks in the round of Zephon's checkpoint), so after an elastic
  resume at another DP size each rank continues the lanes it owns now: the
  ranks' reports still add up to what was delivered.
* **Dropped** records come from the :class:`~zephon_loader.pipeline.provenance.DropLog`
  the record operators append to (skipped bad records by reason; records longer
  than a row under ``first_fit``/``best_fit``). Each is keyed by its position in
  the stream (Zephon's cursor), so a record read again (after a resume, or in
  a new pass from the beginning) counts once. They count when Zephon's workers
  first read them, which may run a few batches ahead of delivery; at the end
  of a pass they are exact.

:func:`batch_source_counts` runs in ``collate`` on every batch (a few dict
reads per row, no tensor work); :class:`LoaderStats` lives in the loader.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from zephon_loader import fields as F
from zephon_loader.nodes.source import lane_of
from zephon_loader.pipeline.records import LONGER_THAN_ROW, REASONS
from zephon_loader.pipeline.provenance import DropLog

__all__ = ["CountingCollate", "LoaderStats", "batch_source_counts"]


def batch_source_counts(sample_batch: Any) -> list[list[int]]:
    """``[[component_id, documents, tokens], ...]`` of one Zephon ``SampleBatch`` (JSON-safe, sorted by id).

    ``documents``: records whose last piece is in these rows; ``tokens``: real
    (non-pad) tokens, as Zephon's packer attributes them to components.
    """
    documents: dict[int, int] = {}
    tokens: dict[int, int] = {}
    for record in sample_batch.records:  # per batch, on the loader's path: ints are made once, at the end
        meta = record.meta
        for cid, count in meta.component_sample_counts.items():
            documents[cid] = documents.get(cid, 0) + count
        if meta.component_token_counts:
            for cid, count in meta.component_token_counts.items():
                tokens[cid] = tokens.get(cid, 0) + count
    return [[int(cid), int(documents.get(cid, 0)), int(tokens.get(cid, 0))]
            for cid in sorted(documents.keys() | tokens.keys())]


class CountingCollate:
    """``collate`` plus ``[lane, batch_source_counts(batch), label_only, cp_padding]`` under
    ``fields.SOURCE_COUNTS`` (picklable).

    ``label_only``: the batch's packed tokens that are no input token (the last token of each full row).
    ``cp_padding``: the batch's context-parallel padding tokens (``contract.cp_size > 1``; Zephon's packer
    counts them in the sources' tokens, as they are part of the padded records).
    """

    def __init__(self, collate_fn: Any, phase_of: Any = None) -> None:
        self.collate_fn = collate_fn
        #: With a mixture schedule: the source's current phase, read when a batch is collated (right after the
        #: source returned it, before it can switch): a fifth element of ``SOURCE_COUNTS``.
        self.phase_of = phase_of

    def __call__(self, sample_batch: Any) -> dict[str, Any]:
        out = self.collate_fn(sample_batch)
        counts = batch_source_counts(sample_batch)
        packed = sum(tokens for _cid, _documents, tokens in counts)
        padding = out.get(F.PADDING_MASK)
        label_only = packed - int(padding.numel() - int(padding.sum())) if padding is not None else 0
        cp = out.get(F.CP_PADDING)
        cp_padding = int(cp.sum()) if cp is not None else 0
        out[F.SOURCE_COUNTS] = [lane_of(sample_batch), counts, max(0, label_only), cp_padding]
        if self.phase_of is not None:
            out[F.SOURCE_COUNTS].append(int(self.phase_of()))
        return out


class LoaderStats:
    """Delivered and dropped documents/tokens per source, kept per Zephon lane (see the module docstring).

    Args:
        source_names: Zephon component id -> source name (the mixture's dataset order).
        drop_log: The file the record operators append drop events to.
        reasons: Drop reason -> meaning, reported with the drops (default: the text checks'
            :data:`~zephon_loader.pipeline.records.REASONS` and ``longer_than_row``).
        owned_lanes: The lanes this rank reads (what :meth:`snapshot` adds up); ``None``: every lane.

    State (:meth:`state_dict`): ``{"lanes": {"<lane>": {"batches": int, "carried": int, "label_only": int,
    "delivered": {source: [documents, tokens]}}}, "drops": [event, ...]}`` (``carried``: batches of
    this pass left over from an earlier one; ``label_only``: see the module docstring, 0 when a state
    saved before it existed is loaded).
    """

    STATE_KEYS = ("lanes", "drops")

    def __init__(self, source_names: Sequence[str], drop_log: DropLog,
                 reasons: Mapping[str, str] | None = None, owned_lanes: Iterable[int] | None = None) -> None:
        self.source_names = list(source_names)
        self.drop_log = drop_log
        self.reasons = dict(reasons) if reasons is not None else {
            **REASONS, LONGER_THAN_ROW: "longer than a row: first_fit/best_fit cannot split it"}
        self.owned_lanes = frozenset(owned_lanes) if owned_lanes is not None else None
        #: lane -> {"batches": int, "delivered": {source: [documents, tokens]}}
        self._lanes: dict[int, dict[str, Any]] = {}
        #: Drop events by cursor key (merged from the log and from a loaded state).
        self._drops: dict[str, dict[str, Any]] = {}
        #: This rank's steps of the pass: batches delivered plus batches skipped (``ZephonLoader.skip_batches``).
        self.steps = 0
        #: The ranges skipped in this pass: ``[{"from_step": s, "batches": n}, ...]`` (steps s .. s + n - 1).
        self.skips: list[dict[str, int]] = []

    # -- updates ------------------------------------------------------------------------
    def reset(self) -> None:
        """A new pass from the beginning: delivered counts start again from zero.

        Drop events stay: they are keyed by stream position (Zephon's cursor),
        and the new pass reads the same records at the same positions again.
        """
        self._lanes = {}
        self.steps = 0
        self.skips = []

    def _lane(self, lane: int) -> dict[str, Any]:
        return self._lanes.setdefault(int(lane), {"batches": 0, "carried": 0, "label_only": 0, "delivered": {}})

    def add_delivered(self, lane_counts: Sequence[Any], *, carried: bool = False) -> None:
        """Count one yielded batch: ``[lane, batch_source_counts(batch), label_only]`` (what
        :class:`CountingCollate` adds).

        ``carried``: it was left over from an earlier epoch's pass (the ranks ended that pass early).
        """
        lane, counts, label_only, *rest = lane_counts
        cp, phase = (rest[0] if rest else 0), rest[1:]
        entry = self._lane(lane)
        self.steps += 1
        entry["batches"] += 1
        entry["carried"] += int(carried)
        entry["label_only"] += int(label_only)
        if cp:
            entry["cp_padding"] = entry.get("cp_padding", 0) + int(cp)
        self._add(entry["delivered"], counts, 1)
        if phase:  # a mixture schedule's phase: counted per phase too
            self._add(entry.setdefault("phases", {}).setdefault(str(phase[0]), {}), counts, 1)

    def add_skipped(self, lane: int, counts: Sequence[Sequence[int]]) -> None:
        """Count one batch skipped by ``ZephonLoader.skip_batches`` (read and packed, never yielded):
        ``counts`` is :func:`batch_source_counts` of it. It is a step (``steps``), not a delivered batch."""
        entry = self._lane(lane)
        entry["skipped"] = entry.get("skipped", 0) + 1
        self._add(entry.setdefault("skipped_sources", {}), counts, 1)

    def record_skip(self, from_step: int, batches: int) -> None:
        """Steps ``from_step .. from_step + batches - 1`` of this pass were skipped (this rank's count)."""
        self.skips.append({"from_step": int(from_step), "batches": int(batches)})
        self.steps = int(from_step) + int(batches)

    def _add(self, delivered: dict[str, list[int]], counts: Sequence[Sequence[int]], sign: int) -> None:
        for cid, documents, tokens in counts:
            pair = delivered.setdefault(self._name(cid), [0, 0])
            pair[0] += sign * int(documents)
            pair[1] += sign * int(tokens)

    def _name(self, cid: int) -> str:
        return self.source_names[cid] if 0 <= cid < len(self.source_names) else f"component {cid}"

    def _merge_log(self) -> None:
        for event in self.drop_log.read():
            self._drops.setdefault(_event_key(event), event)

    def _owns(self, lane: int) -> bool:
        return self.owned_lanes is None or lane in self.owned_lanes

    # -- state --------------------------------------------------------------------------
    @property
    def batches(self) -> int:
        """Batches delivered in this pass from the lanes this rank owns."""
        return sum(entry["batches"] for lane, entry in self._lanes.items() if self._owns(lane))

    def state_dict(self, undelivered: Sequence[Sequence[Any]] = ()) -> dict[str, Any]:
        """JSON-safe counts of every lane known here (delivered: exact at the delivered batch; drops: as read).

        Args:
            undelivered: ``[lane, counts, label_only]`` (:class:`CountingCollate`) of delivered batches the
                state hands back (a state taken as of some batches back): they are not counted as delivered.
        """
        self._merge_log()
        lanes = copy.deepcopy(self._lanes)
        for lane, counts, label_only, *rest in undelivered:
            cp, phase = (rest[0] if rest else 0), rest[1:]
            entry = lanes[int(lane)]
            entry["batches"] -= 1
            entry["label_only"] -= int(label_only)
            if cp:
                entry["cp_padding"] -= int(cp)
            self._add(entry["delivered"], counts, -1)
            if phase:
                self._add(entry["phases"][str(phase[0])], counts, -1)
        state = {
            "lanes": {str(lane): entry for lane, entry in sorted(lanes.items())},
            "drops": [copy.deepcopy(event) for event in self._drops.values()],
            "steps": self.steps - len(undelivered),
        }
        if self.skips:
            state["skips"] = copy.deepcopy(self.skips)
        return state

    def round_value(self, undelivered: Sequence[Sequence[Any]] = ()) -> dict[str, Any]:
        """What this rank contributes to a state's round: :meth:`state_dict` and the lanes it owns."""
        return {"owned": sorted(self.owned_lanes) if self.owned_lanes is not None else None,
                **self.state_dict(undelivered)}

    @staticmethod
    def merge(values: Sequence[Mapping[str, Any] | None]) -> dict[str, Any]:
        """Every rank's :meth:`round_value` (in global-rank order) -> one :meth:`state_dict`, the same on every rank.

        Each lane's counts come from the first rank that owns it (its model-parallel peers count the same
        batches); a lane no contributor owns keeps the first rank's copy. Drop events are merged by key.
        """
        lanes: dict[str, Any] = {}
        drops: dict[str, Any] = {}
        present = [value for value in values if value]
        for value in present:
            owned = value.get("owned")
            for lane, entry in value["lanes"].items():
                if owned is None or int(lane) in owned:
                    lanes.setdefault(lane, entry)
        for value in present:
            for lane, entry in value["lanes"].items():
                lanes.setdefault(lane, entry)
            for event in value["drops"]:
                drops.setdefault(_event_key(event), event)
        merged = {"lanes": {lane: lanes[lane] for lane in sorted(lanes, key=int)}, "drops": list(drops.values()),
                  # every rank counts the same steps (a step is one batch on each rank); the first's skips
                  "steps": max((int(value.get("steps", 0)) for value in present), default=0)}
        skips = next((value["skips"] for value in present if value.get("skips")), None)
        if skips:
            merged["skips"] = skips
        return merged

    @staticmethod
    def steps_of(state: Mapping[str, Any]) -> tuple[int, list[dict[str, int]]]:
        """``(steps, skips)`` of a :meth:`state_dict`: the step of the pass it resumes at, the ranges skipped.
        A state saved before steps were counted: every lane's batches (exact at the DP size of one rank)."""
        try:
            skips = [{"from_step": int(skip["from_step"]), "batches": int(skip["batches"])}
                     for skip in state.get("skips") or []]
            if "steps" in state:
                return int(state["steps"]), skips
            return sum(int(entry["batches"]) for entry in state["lanes"].values()), skips
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"state_dict.stats: malformed ({type(error).__name__}: {error}); "
                             "expected the dict returned by ZephonLoader.state_dict()") from error

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` output (drop events are merged by key, never double counted)."""
        try:
            lanes = {}
            for lane, entry in state["lanes"].items():
                delivered = {str(k): [int(v[0]), int(v[1])] for k, v in entry["delivered"].items()}
                lanes[int(lane)] = {"batches": int(entry["batches"]), "carried": int(entry.get("carried", 0)),
                                    "label_only": int(entry.get("label_only", 0)), "delivered": delivered}
                if "phases" in entry:  # a mixture schedule's per-phase counts
                    lanes[int(lane)]["phases"] = {
                        str(phase): {str(k): [int(v[0]), int(v[1])] for k, v in by_source.items()}
                        for phase, by_source in entry["phases"].items()}
                if entry.get("cp_padding"):
                    lanes[int(lane)]["cp_padding"] = int(entry["cp_padding"])
                if entry.get("skipped"):
                    lanes[int(lane)]["skipped"] = int(entry["skipped"])
                    lanes[int(lane)]["skipped_sources"] = {str(k): [int(v[0]), int(v[1])]
                                                           for k, v in entry.get("skipped_sources", {}).items()}
            drops = {_event_key(event): dict(event) for event in state["drops"]}
            skips = [{"from_step": int(skip["from_step"]), "batches": int(skip["batches"])}
                     for skip in state.get("skips") or []]
            # A state saved before steps were counted: every lane's batches, as one rank read them.
            steps = int(state["steps"]) if "steps" in state else sum(entry["batches"] for entry in lanes.values())
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
            raise ValueError(f"state_dict.stats: malformed ({type(error).__name__}: {error}); "
                             "expected the dict returned by ZephonLoader.state_dict()") from error
        self._lanes = lanes
        self._drops = drops
        self.steps = steps
        self.skips = skips
        self._merge_log()

    # -- report -------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The report ``loader.stats()`` returns: the lanes this rank owns.

        ``{"batches": int, "carried_batches": int, "label_only_tokens": int, "sources": {name: {"delivered":
        {"documents", "tokens"}, "dropped": {reason: {"documents", "tokens"}}}}, "dropped": {reason:
        {"documents", "tokens", "first": "<source, shard, line>"}}, "reasons": {reason: meaning}}``; with a
        mixture schedule also ``"phases": {"<phase>": {source: {"documents", "tokens"}}}``: what each phase
        delivered (the phases this rank's lanes reached).
        ``tokens`` of a record dropped before tokenization is 0 (unknown). ``label_only_tokens``: delivered
        tokens that reached the model only as a label (see the module docstring): the input tokens
        delivered are the sources' delivered ``tokens`` minus these. ``cp_padding_tokens``: the padding
        added after documents for context parallelism (``contract.cp_size > 1``; 0 otherwise), included in
        the sources' delivered ``tokens``. ``steps``: this rank's steps of the pass (batches delivered plus
        skipped); ``skipped_batches``: batches :meth:`ZephonLoader.skip_batches` read and never yielded (the
        lanes this rank owns), per source under ``sources[name]["skipped"]`` (``{"documents", "tokens"}``, only
        for sources that had some), and ``skipped_steps``: the ranges skipped, ``[{"from_step", "batches"}]``.
        """
        self._merge_log()
        totals: dict[str, list[int]] = {name: [0, 0] for name in self.source_names}
        for lane, entry in self._lanes.items():
            if self._owns(lane):
                for name, (docs, toks) in entry["delivered"].items():
                    pair = totals.setdefault(name, [0, 0])
                    pair[0] += docs
                    pair[1] += toks
        sources: dict[str, Any] = {
            name: {"delivered": {"documents": docs, "tokens": toks}, "dropped": {}}
            for name, (docs, toks) in totals.items()
        }
        dropped: dict[str, Any] = {}
        for event in sorted(self._drops.values(), key=_event_order):
            if not self._owns(_event_lane(event)):
                continue
            reason = str(event.get("reason"))
            tokens = int(event.get("tokens") or 0)
            per_source = sources.setdefault(str(event.get("source")), {
                "delivered": {"documents": 0, "tokens": 0}, "dropped": {}})["dropped"]
            entry = per_source.setdefault(reason, {"documents": 0, "tokens": 0})
            entry["documents"] += 1
            entry["tokens"] += tokens
            total = dropped.setdefault(reason, {"documents": 0, "tokens": 0, "first": event.get("where")})
            total["documents"] += 1
            total["tokens"] += tokens
        phases: dict[str, dict[str, Any]] = {}
        for lane, entry in self._lanes.items():
            if self._owns(lane):
                for phase, by_source in entry.get("phases", {}).items():
                    per_phase = phases.setdefault(phase, {})
                    for name, (docs, toks) in by_source.items():
                        counted = per_phase.setdefault(name, {"documents": 0, "tokens": 0})
                        counted["documents"] += docs
                        counted["tokens"] += toks
        report = {
            "batches": self.batches,
            "carried_batches": sum(entry.get("carried", 0) for lane, entry in self._lanes.items() if self._owns(lane)),
            "label_only_tokens": sum(entry["label_only"] for lane, entry in self._lanes.items()
                                     if self._owns(lane)),
            "cp_padding_tokens": sum(entry.get("cp_padding", 0) for lane, entry in self._lanes.items()
                                     if self._owns(lane)),
            "sources": sources,
            "dropped": dropped,
            "reasons": dict(self.reasons),
            "steps": self.steps,
            "skipped_batches": sum(entry.get("skipped", 0) for lane, entry in self._lanes.items() if self._owns(lane)),
            "skipped_steps": copy.deepcopy(self.skips),
        }
        for lane, entry in self._lanes.items():
            if self._owns(lane):
                for name, (docs, toks) in entry.get("skipped_sources", {}).items():
                    skipped = sources.setdefault(name, {"delivered": {"documents": 0, "tokens": 0}, "dropped": {}}
                                                 ).setdefault("skipped", {"documents": 0, "tokens": 0})
                    skipped["documents"] += docs
                    skipped["tokens"] += toks
        if phases:  # a mixture schedule: {"<phase>": {source: {"documents", "tokens"}}}, phases in order
            report["phases"] = {phase: {name: phases[phase][name] for name in sorted(phases[phase])}
                                for phase in sorted(phases, key=int)}
        return report


def _event_lane(event: Mapping[str, Any]) -> int:
    key = event.get("key") or [0]
    return int(key[0]) if isinstance(key[0], int) else 0


def _event_key(event: Mapping[str, Any]) -> str:
    return repr(event.get("key"))


def _event_order(event: Mapping[str, Any]) -> tuple:
    key = event.get("key") or []
    return tuple(x if isinstance(x, int) else 0 for x in key[:3])
