"""Zephon's repeated packing notices: counted while they happen, reported once under ``zephon_loader``.

Zephon's ``PackSequences`` logs a ``WARNING`` at every flush of a packing
group (to :data:`ZEPHON_PACK_LOGGER`, which has no handler of its own, so
Python's last-resort handler prints each one to stderr, through any progress
bar):

* ``PackSequences wrap: dropping N trailing token(s) across G packing group(s)
  in L lane(s) that did not fill a full max_length=M bin; emitted T
  tombstone(s) to close contributor offsets.`` (uncapped ``wrap``, at every
  flush: each pass, and every ``flush_every_k_chunks`` chunks);
* ``PackSequences first_fit: dropped N document(s) (K token(s)) longer than
  max_length=M; ...`` (``first_fit``/``best_fit``, at the end of the stream).

:class:`ZephonLogSummary` is a :class:`logging.Filter` on that logger: it adds
up the numbers of each of these records and stops the record there; any other
record (and a record whose arguments it cannot read, e.g. from another Zephon
version) passes unchanged, so nothing is hidden that is not counted. The
totals are read with :meth:`ZephonLogSummary.totals` / :meth:`lines`, or logged
once, under the ``zephon_loader`` logger, by :meth:`ZephonLogSummary.report`
(what :func:`summarize_zephon_logs` does on exit).

The loader's own pipelines do not produce these records (``wrap`` runs capped,
so Zephon pads the tail row instead of dropping it, and records longer than a
row are dropped and counted by :mod:`zephon_loader.pipeline.records` before packing);
they come from pipelines built on Zephon directly (e.g. the baseline of
``benchmarks/bench_loader.py``). The filter sees records logged in this
process only: under Zephon's process runner, operators running in worker
processes log there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from zephon_loader.zephon_compat import ZEPHON_PACK_LOGGER

__all__ = ["PACKAGE_LOGGER", "ZEPHON_PACK_LOGGER", "ZephonLogSummary", "summarize_zephon_logs"]

#: This package's logger: the summaries are logged here.
PACKAGE_LOGGER = "zephon_loader"

_WRAP_TAIL = "PackSequences wrap: dropping"
_OVERSIZED = "dropped %d document(s) (%d token(s)) longer than max_length"


@dataclass
class _Tally:
    """Running totals of one kind of notice."""

    records: int = 0  # log records folded into this tally
    tokens: int = 0
    documents: int = 0  # oversized drops: documents; wrap tails: packing groups
    tombstones: int = 0
    max_length: int | None = None
    algorithm: str | None = None


class ZephonLogSummary(logging.Filter):
    """Counts Zephon's per-flush packing warnings instead of printing each one.

    Install it on :data:`ZEPHON_PACK_LOGGER` (``logger.addFilter``), or use
    :func:`summarize_zephon_logs`. Thread-safe: Zephon logs from its worker
    threads.
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._wrap_tail = _Tally(algorithm="wrap")
        self._oversized: dict[str, _Tally] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        """False (stop the record) for a counted notice; True for every other record."""
        if record.levelno < logging.WARNING or not isinstance(record.msg, str):
            return True  # e.g. the DEBUG variant Zephon logs for an early-close drain (not data loss)
        args = record.args if isinstance(record.args, tuple) else ()
        try:
            if record.msg.startswith(_WRAP_TAIL):
                tokens, groups, _lanes, max_length, tombstones = (int(a) for a in args)
                with self._lock:
                    tally = self._wrap_tail
                    tally.records += 1
                    tally.tokens += tokens
                    tally.documents += groups
                    tally.tombstones += tombstones
                    tally.max_length = max_length
                return False
            if record.msg.startswith("PackSequences %s: ") and _OVERSIZED in record.msg:
                algorithm, documents, tokens, max_length = args
                with self._lock:
                    tally = self._oversized.setdefault(str(algorithm), _Tally(algorithm=str(algorithm)))
                    tally.records += 1
                    tally.documents += int(documents)
                    tally.tokens += int(tokens)
                    tally.max_length = int(max_length)
                return False
        except (TypeError, ValueError):
            return True  # not the shape this module knows: let Zephon's line through as it is
        return True

    def totals(self) -> dict[str, dict[str, Any]]:
        """What was counted, JSON-able: ``{"wrap_trailing_tokens_dropped": {...}, "<algorithm>_longer_than_row": {...}}``.

        ``wrap_trailing_tokens_dropped``: ``log_records`` (flushes that logged
        it), ``tokens``, ``packing_groups``, ``tombstones``, ``max_length``.
        ``<algorithm>_longer_than_row``: ``log_records``, ``documents``,
        ``tokens``, ``max_length``. Kinds never seen are absent.
        """
        with self._lock:
            out: dict[str, dict[str, Any]] = {}
            tail = self._wrap_tail
            if tail.records:
                out["wrap_trailing_tokens_dropped"] = {
                    "log_records": tail.records, "tokens": tail.tokens, "packing_groups": tail.documents,
                    "tombstones": tail.tombstones, "max_length": tail.max_length,
                }
            for algorithm, tally in sorted(self._oversized.items()):
                out[f"{algorithm}_longer_than_row"] = {
                    "log_records": tally.records, "documents": tally.documents, "tokens": tally.tokens,
                    "max_length": tally.max_length,
                }
            return out

    def lines(self) -> list[str]:
        """One line per kind of notice counted (empty when nothing was counted)."""
        lines = []
        for kind, entry in self.totals().items():
            if kind == "wrap_trailing_tokens_dropped":
                lines.append(
                    f"Zephon PackSequences wrap dropped {entry['tokens']:,} trailing token(s) that did not fill a "
                    f"max_length={entry['max_length']} row ({entry['packing_groups']:,} packing group(s), "
                    f"{entry['tombstones']:,} tombstone(s); logged by {entry['log_records']:,} flush(es)); "
                    "a capped wrap (pack_flat max_sequences_per_bin) pads that row instead"
                )
            else:
                algorithm = kind.removesuffix("_longer_than_row")
                lines.append(
                    f"Zephon PackSequences {algorithm} dropped {entry['documents']:,} document(s) "
                    f"({entry['tokens']:,} token(s)) longer than max_length={entry['max_length']} "
                    f"(logged by {entry['log_records']:,} flush(es)); wrap splits them instead"
                )
        return lines

    def report(self, logger: logging.Logger | None = None) -> None:
        """Log each line of :meth:`lines` once, at ``WARNING``, under ``zephon_loader`` (or ``logger``)."""
        logger = logger or logging.getLogger(PACKAGE_LOGGER)
        for line in self.lines():
            logger.warning("%s", line)


@contextmanager
def summarize_zephon_logs(*, report: bool = True) -> Iterator[ZephonLogSummary]:
    """Count Zephon's packing notices inside the block; on exit, log the totals once (``report=True``).

    Example::

        with summarize_zephon_logs() as notices:
            for batch in pipeline: ...
        notices.totals()   # also logged once under ``zephon_loader``
    """
    summary = ZephonLogSummary()
    zephon_logger = logging.getLogger(ZEPHON_PACK_LOGGER)
    zephon_logger.addFilter(summary)
    try:
        yield summary
    finally:
        zephon_logger.removeFilter(summary)
        if report:
            summary.report()
