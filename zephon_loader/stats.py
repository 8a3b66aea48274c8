"""Accounting: what the loader delivered and what it dropped, per source and reason.

* **Delivered** documents and tokens are counted from Zephon's own per-row
  provenance (``SampleMeta.component_sample_counts`` — a document split by
  ``wrap`` counts once, on its closing piece — and
  ``component_token_counts``), when a batch reaches the training loop: batches
  read ahead but not yet yielded are not counted, and the counts travel in the
  loader's state, so a resumed run continues them exactly.
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
from collections.abc import Mapping, Sequence
from typing import Any

from zephon_loader import fields as F
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
    for record in sample_batch.records:
        meta = record.meta
        for cid, count in meta.component_sample_counts.items():
            documents[int(cid)] = documents.get(int(cid), 0) + int(count)
        for cid, count in (meta.component_token_counts or {}).items():
            tokens[int(cid)] = tokens.get(int(cid), 0) + int(count)
    return [[cid, documents.get(cid, 0), tokens.get(cid, 0)] for cid in sorted(set(documents) | set(tokens))]


class CountingCollate:
    """``collate`` plus the batch's :func:`batch_source_counts` under ``fields.SOURCE_COUNTS`` (picklable)."""

    def __init__(self, collate_fn: Any) -> None:
        self.collate_fn = collate_fn

    def __call__(self, sample_batch: Any) -> dict[str, Any]:
        out = self.collate_fn(sample_batch)
        out[F.SOURCE_COUNTS] = batch_source_counts(sample_batch)
        return out


class LoaderStats:
    """Delivered and dropped documents/tokens per source (see the module docstring).

    Args:
        source_names: Zephon component id -> source name (the mixture's dataset order).
        drop_log: The file the record operators append drop events to.
        reasons: Drop reason -> meaning, reported with the drops (default: the text checks'
            :data:`~zephon_loader.pipeline.records.REASONS` and ``longer_than_row``).
    """

    STATE_KEYS = ("delivered", "drops")

    def __init__(self, source_names: Sequence[str], drop_log: DropLog,
                 reasons: Mapping[str, str] | None = None) -> None:
        self.source_names = list(source_names)
        self.drop_log = drop_log
        self.reasons = dict(reasons) if reasons is not None else {
            **REASONS, LONGER_THAN_ROW: "longer than a row: first_fit/best_fit cannot split it"}
        self._delivered: dict[str, list[int]] = {name: [0, 0] for name in self.source_names}
        self._batches = 0
        #: Drop events by cursor key (merged from the log and from a loaded state).
        self._drops: dict[str, dict[str, Any]] = {}

    # -- updates ------------------------------------------------------------------------
    def reset(self) -> None:
        """A new pass from the beginning: delivered counts start again from zero.

        Drop events stay: they are keyed by stream position (Zephon's cursor),
        and the new pass reads the same records at the same positions again.
        """
        self._delivered = {name: [0, 0] for name in self.source_names}
        self._batches = 0

    def add_delivered(self, counts: Sequence[Sequence[int]]) -> None:
        """Count one yielded batch (``batch_source_counts`` output)."""
        self._batches += 1
        for cid, documents, tokens in counts:
            name = self._name(cid)
            entry = self._delivered.setdefault(name, [0, 0])
            entry[0] += int(documents)
            entry[1] += int(tokens)

    def _name(self, cid: int) -> str:
        return self.source_names[cid] if 0 <= cid < len(self.source_names) else f"component {cid}"

    def _merge_log(self) -> None:
        for event in self.drop_log.read():
            self._drops.setdefault(_event_key(event), event)

    # -- state --------------------------------------------------------------------------
    @property
    def batches(self) -> int:
        """Batches delivered in this pass."""
        return self._batches

    def state_dict(self, undelivered: Sequence[Sequence[Sequence[int]]] = ()) -> dict[str, Any]:
        """JSON-safe counts so far (delivered: exact at the delivered batch; drops: as read).

        Args:
            undelivered: :func:`batch_source_counts` of delivered batches the state hands back (a state taken
                as of some batches back): they are not counted as delivered.
        """
        self._merge_log()
        delivered = copy.deepcopy(self._delivered)
        for counts in undelivered:
            for cid, documents, tokens in counts:
                entry = delivered[self._name(cid)]
                entry[0] -= int(documents)
                entry[1] -= int(tokens)
        return {
            "batches": self._batches - len(undelivered),
            "delivered": delivered,
            "drops": [copy.deepcopy(event) for event in self._drops.values()],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` output (drop events are merged by key, never double counted)."""
        try:
            delivered = {str(k): [int(v[0]), int(v[1])] for k, v in state["delivered"].items()}
            drops = {_event_key(event): dict(event) for event in state["drops"]}
            batches = int(state["batches"])
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
            raise ValueError(f"state_dict.stats: malformed ({type(error).__name__}: {error}); "
                             "expected the dict returned by ZephonLoader.state_dict()") from error
        self._delivered = {name: [0, 0] for name in self.source_names} | delivered
        self._batches = batches
        self._drops = drops
        self._merge_log()

    # -- report -------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The report ``loader.stats()`` returns.

        ``{"batches": int, "sources": {name: {"delivered": {"documents", "tokens"},
        "dropped": {reason: {"documents", "tokens"}}}}, "dropped": {reason: {"documents",
        "tokens", "first": "<source, shard, line>"}}, "reasons": {reason: meaning}}``.
        ``tokens`` of a record dropped before tokenization is 0 (unknown).
        """
        self._merge_log()
        sources: dict[str, Any] = {
            name: {"delivered": {"documents": docs, "tokens": toks}, "dropped": {}}
            for name, (docs, toks) in self._delivered.items()
        }
        dropped: dict[str, Any] = {}
        for event in sorted(self._drops.values(), key=_event_order):
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
        return {
            "batches": self._batches,
            "sources": sources,
            "dropped": dropped,
            "reasons": dict(self.reasons),
        }


def _event_key(event: Mapping[str, Any]) -> str:
    return repr(event.get("key"))


def _event_order(event: Mapping[str, Any]) -> tuple:
    key = event.get("key") or []
    return tuple(x if isinstance(x, int) else 0 for x in key[:3])
