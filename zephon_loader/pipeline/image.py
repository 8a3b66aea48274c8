"""The Zephon pipeline of an image-text loader, built stage by stage from a validated config.

Reads top to bottom as the data flow::

    work source (shard folders, whole passes, this rank's lane)      work_source.py (shared with text)
      -> process image records: check, decode (Pillow), processor,
         positions, length / oversized policy                         image_records.py
      -> pack_sequences(S, first_fit | best_fit), payloads kept      (records never split)
      -> batch(B), short batches kept
      -> runtime options (lanes, flush cadence, runner)

``image_collate`` turns each batch into tensors. Nothing starts here: Zephon's
workers start at the first ``next()``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from zephon.ops import CountingAccumulator

from zephon_loader.config.image import DEFAULT_PROCESSOR_PARALLELISM, ImageLoaderConfig
from zephon_loader.pipeline.image_records import ProcessImageRecords, RecordFormat
from zephon_loader.pipeline.text import DEFAULT_NUM_BINS, DROP_LOG_NAME, DataParallel, runtime_options
from zephon_loader.pipeline.provenance import DropLog, ShardTable
from zephon_loader.zephon_compat import ZephonKeys
from zephon_loader.pipeline.work_source import OpenedSources, build_work_source

__all__ = ["PROCESS_CALL_RECORDS", "BuiltImagePipeline", "build_image_pipeline"]

#: Records per call of the processing operator (Zephon runs ``processor_parallelism`` calls at once).
PROCESS_CALL_RECORDS = 16


@dataclass(frozen=True)
class BuiltImagePipeline:
    """What :func:`build_image_pipeline` returns.

    Attributes:
        pipeline: The configured ``zephon.Pipeline`` (nothing started).
        shards: Sample id → source, shard file and line/row.
        drop_log: Where bad and oversized records left out are logged (read by ``loader.stats()``).
        sources: The shard files read (an epoch's pipeline is built over the same: ``sources=``).
    """

    pipeline: Any
    shards: ShardTable
    drop_log: DropLog
    sources: OpenedSources


def build_image_pipeline(
    config: ImageLoaderConfig,
    *,
    processor: Any,
    micro_batch_size: int,
    work_dir: str | os.PathLike[str],
    dp: DataParallel = DataParallel(),
    seed: int | None = None,
    run_id_suffix: str = "",
    sources: OpenedSources | None = None,
) -> BuiltImagePipeline:
    """Build the ``zephon.Pipeline`` that yields batches of ``B`` rows of whole processed records.

    Args:
        config: The validated image loader config.
        processor: The record processor (:mod:`zephon_loader.processors`).
        micro_batch_size: ``B`` (the config's, or the recipe's batch size).
        work_dir: Existing folder owned by the caller; ``drops.jsonl`` is written there.
        dp: This rank's data-parallel coordinates.
        seed: Overrides ``config.seed`` (an epoch's seed).
        sources: The shard files opened at the build (:func:`~zephon_loader.pipeline.work_source.open_sources`);
            ``None`` opens them.
        run_id_suffix: Appended to the aggregation run id (one per epoch).

    Raises:
        ValueError / TypeError: naming the key, the value seen, what was
        expected and the fix; raised before any worker starts.
    """
    import zephon

    dist = config.distributed
    work = build_work_source(config, lanes=dist.canonical_replicas or dp.size, seed=seed, sources=sources)
    drop_log = DropLog(os.path.join(work_dir, DROP_LOG_NAME))
    records = config.records
    process = ProcessImageRecords(
        processor=processor,
        record_format=RecordFormat(records.text_field, records.images_field, records.image_marker),
        shards=work.shards,
        policy=config.on_bad_record,
        oversized=config.packing.oversized,
        row_capacity=config.sequence_length,
        max_record_tokens=config.max_record_tokens,
        log=drop_log,
        source_marks=config.return_source_ids,
    )
    # Records reach the operator in micro-batches as large as a work chunk; cutting them into calls of
    # PROCESS_CALL_RECORDS lets the processor_parallelism workers share a chunk (count-only: deterministic).
    pipeline = zephon.Pipeline(work.source).add_op(
        "zephon_loader.process_image_records", process_many=process, validation_samples=process.validation_samples,
        preserves_cursor_order=True,
        parallelism=config.runtime.processor_parallelism or DEFAULT_PROCESSOR_PARALLELISM,
        accumulator=_process_accumulator,
    )
    # Whole records only: every record reaching the packer fits a row (longer ones were dropped
    # or refused above, with their location), so Zephon's own silent drop never triggers.
    pipeline = pipeline.pack_sequences(
        config.sequence_length, algorithm=config.packing.algorithm,
        num_bins=config.packing.num_bins or DEFAULT_NUM_BINS, tokens_field=ZephonKeys.TOKENS,
    ).batch(micro_batch_size, drop_last=False)
    pipeline = pipeline.options(**runtime_options(config, dp, work, run_id_suffix))
    return BuiltImagePipeline(pipeline, work.shards, drop_log, work.opened)


def _process_accumulator() -> CountingAccumulator:
    """Zephon accumulator factory of the processing operator: count-only batches of ``PROCESS_CALL_RECORDS``."""
    return CountingAccumulator(max_batch=PROCESS_CALL_RECORDS)
