"""``build_image_loader``: image-text configuration → validated contract → processor → Zephon pipeline → loader.

The same order as the text builder (SPEC §2): the packing contract is checked
first, then the processor is loaded (it fixes whether tokens carry
eligibility, which some contracts cannot represent), then the final-map
settings are frozen, and only then is the Zephon pipeline built. Nothing reads
data before every check passed.

The loader is a :class:`~zephon_loader.loader.ZephonLoader` (exact resume with
read-ahead, ``close()``, per-DP-rank lanes, epochs) whose collate is
:func:`~zephon_loader.collate.image.collate_images`; it exposes the processor
it used as :attr:`ImageLoader.processor`.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from functools import partial
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping

from zephon_loader import fields as F
from zephon_loader.build import (
    data_parallel,
    epoch_run_id_suffix,
    epoch_seed,
    resolve_contract,
    stream_fingerprint,
)
from zephon_loader.config import instantiate, read_loader_config
from zephon_loader.finalize.final_map import FinalizeSettings
from zephon_loader.collate.image import collate_images
from zephon_loader.config.image import (
    ImageLoaderConfig,
    ProcessorConfig,
    ProcessorTarget,
)
from zephon_loader.pipeline.image_records import IMAGE_REASONS
from zephon_loader.pipeline.image import build_image_pipeline
from zephon_loader.loader import ZephonLoader
from zephon_loader.contract import validate_packing_contract
from zephon_loader.pipeline.records import LONGER_THAN_ROW
from zephon_loader.nodes.source import ZephonSource
from zephon_loader.stats import CountingCollate, LoaderStats

__all__ = ["ImageLoader", "build_image_loader", "resolve_processor"]

#: Packed mask types an image loader can serve: each needs document ids only, not 1-D positions.
IMAGE_MASK_TYPES = ("block_causal", "document_ids", "flash_varlen")


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
        """Names every yielded batch carries; ``pixel_values``/``image_grid_thw`` come only with an image."""
        return self.settings.yielded_fields + F.IMAGE_ALWAYS


def build_image_loader(
    config: ImageLoaderConfig | Mapping[str, Any] | str | Path,
    *,
    packing_contract: object | None = None,
    processor: Any = None,
    get_rope_index: Callable[..., Any] | None = None,
    dp_rank: int | None = None,
    dp_world_size: int | None = None,
    dp_group: Any = None,
    collate_wrapper: Callable | None = None,
    dataset_build_context: ContextManager[Any] | None = None,
    pin_memory: bool | None = None,
    micro_batch_size: int | None = None,
    model_path: str | None = None,
) -> ImageLoader:
    """Build an :class:`ImageLoader` over JSONL (image paths) or Parquet (image bytes) image-text shards.

    Args:
        config: An :class:`~zephon_loader.config.image.ImageLoaderConfig`, its
            YAML mapping, or a YAML path (its ``dataloader`` section).
        packing_contract: The model's contract; ``None`` uses the YAML's
            ``contract`` (default: block-causal, no metadata).
        processor: A record processor object (:mod:`zephon_loader.processors`);
            ``None``: the YAML's ``processor``.
        get_rope_index: The model's ``get_rope_index``; when given, positions of
            every record come from it (the processor must have ``bind_get_rope_index``).
        dp_rank, dp_world_size: This rank's data-parallel coordinates (both or
            neither; neither: ``torch.distributed``'s default group, else one rank).
        dp_group: Instead of the two: the data-parallel ``ProcessGroup`` or 1-D ``DeviceMesh``.
        collate_wrapper: AutoModel-style wrapper applied to each yielded batch.
        dataset_build_context: Entered while the processor and the Zephon pipeline are built.
        pin_memory: ``None`` = pin when CUDA is available.
        micro_batch_size: ``B`` when the YAML leaves it unset (the recipe's batch
            size); both given must agree.
        model_path: The recipe's model folder: the built-in processor's folder
            when the YAML names none (a hub id is refused).

    Raises:
        TypeError/ValueError: Bad configuration, contract or processor, before anything starts.
    """
    cfg = read_loader_config(config, ImageLoaderConfig)
    rows = _micro_batch_size(cfg, micro_batch_size)
    contract = resolve_contract(cfg, packing_contract)
    mask_type = validate_packing_contract(contract)[0]
    if mask_type not in IMAGE_MASK_TYPES:
        raise ValueError(
            f"packing_contract.packed_mask_type: got {mask_type!r}, expected one of {list(IMAGE_MASK_TYPES)} for "
            "image-text batches: their position_ids are [3, B, S] mRoPE positions, which do not restart once per "
            "record on one axis; use 'document_ids' (with metadata for FA4) or 'block_causal'"
        )
    finalize = partial(
        FinalizeSettings.from_contract,
        contract,
        xdoc=cfg.xdoc,
        return_packed_sequence_metadata=cfg.return_packed_sequence_metadata,
        micro_batch_size=rows,
        sequence_length=cfg.sequence_length,
        block_mask_budget_bytes=cfg.block_mask_budget_bytes,
    )
    settings = finalize(attention_eligibility=False)  # everything but eligibility, before the processor loads
    dp = data_parallel(cfg, dp_rank, dp_world_size, dp_group)
    if get_rope_index is not None and cfg.runtime.runner == "process":
        raise ValueError(
            "dataloader.runtime.runner: got 'process' with a model get_rope_index, expected 'threads' (or 'auto'): "
            "worker processes would each receive a pickled copy of the model"
        )
    with dataset_build_context or contextlib.nullcontext():
        processor = resolve_processor(cfg, processor, get_rope_index, model_path)
    eligibility = bool(processor.attention_eligibility)
    if eligibility:  # refuses contracts that cannot exclude a token inside a record (flash_varlen, THD)
        settings = finalize(attention_eligibility=True)
    work_dir = tempfile.mkdtemp(prefix="zephon_loader_image_pipeline_")

    def pipeline_for_epoch(epoch: int) -> Any:
        """The Zephon pipeline of one epoch: the same data and lanes, the epoch's shuffle seed."""
        return build_image_pipeline(cfg, processor=processor, micro_batch_size=rows, work_dir=work_dir, dp=dp,
                                    seed=epoch_seed(cfg.seed, epoch), run_id_suffix=epoch_run_id_suffix(epoch)).pipeline

    try:
        with dataset_build_context or contextlib.nullcontext():
            built = build_image_pipeline(cfg, processor=processor, micro_batch_size=rows, work_dir=work_dir, dp=dp)
    except BaseException:
        shutil.rmtree(work_dir, ignore_errors=True)
        raise
    mask_cross = cfg.labels_mask_cross_document
    collate_fn = partial(
        collate_images,
        sequence_length=cfg.sequence_length,
        micro_batch_size=rows,
        pad_token_id=int(processor.pad_token_id),
        mask_cross_document_labels=mask_cross,
        eligibility=eligibility,
    )
    records = cfg.records
    fingerprint = stream_fingerprint(cfg, built.shards, dp, contract, rows, {
        "kind": "image",
        "records": [records.text_field, records.images_field, records.image_marker, cfg.on_bad_record,
                    cfg.max_record_tokens],
        "processor": processor_fingerprint(cfg, processor),
        "get_rope_index": get_rope_index is not None,
        "packing": [cfg.packing.algorithm, cfg.packing.num_bins, cfg.packing.oversized],
        "label_masking": mask_cross,
    })
    return ImageLoader(
        ZephonSource(built.pipeline, built.shards, pipeline_for_epoch=pipeline_for_epoch),
        CountingCollate(collate_fn),
        settings,
        read_ahead=cfg.read_ahead,
        collate_wrapper=collate_wrapper,
        fingerprint=fingerprint,
        pin_memory=pin_memory,
        on_close=partial(shutil.rmtree, work_dir, ignore_errors=True),
        stats=LoaderStats([source.name for source in cfg.sources], built.drop_log, reasons={
            **IMAGE_REASONS, LONGER_THAN_ROW: "longer than a row: image-text records are never split (packing.oversized)"}),
        processor=processor,
    )


def _micro_batch_size(cfg: ImageLoaderConfig, passed: int | None) -> int:
    if passed is not None and (isinstance(passed, bool) or not isinstance(passed, int) or passed <= 0):
        raise ValueError(f"batch_size: got {passed!r}, expected an int > 0")
    configured = cfg.micro_batch_size
    if configured is None and passed is None:
        raise ValueError("dataloader.micro_batch_size: missing; expected the rows per batch B (an int > 0)")
    if configured is not None and passed is not None and configured != passed:
        raise ValueError(f"dataloader.micro_batch_size: got {configured}, but the recipe's batch size is {passed}; "
                         "remove micro_batch_size from the YAML or make them agree")
    return int(configured if configured is not None else passed)  # type: ignore[arg-type]


def resolve_processor(
    cfg: ImageLoaderConfig, processor: Any, get_rope_index: Callable[..., Any] | None, model_path: str | None = None
) -> Any:
    """The processor to run: the object passed, else the YAML's (built-in or ``_target_``), bound to ``get_rope_index``.

    Raises:
        ValueError: Both an object and a YAML processor, none at all, a hub id as folder.
        TypeError: An object without the processor interface, or ``get_rope_index``
            for a processor that cannot take it.
    """
    if processor is not None and cfg.processor is not None:
        raise ValueError("processor: got both a processor object and dataloader.processor in the YAML; expected one "
                         "(drop one of them)")
    if processor is None:
        processor = _processor_from_config(cfg, model_path)
    where = f"processor ({type(processor).__name__})"
    if not callable(processor):
        raise TypeError(f"{where}: not callable; expected ImageTextRecord -> ProcessedRecord")
    pad = getattr(processor, "pad_token_id", None)
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
        raise TypeError(f"{where}.pad_token_id: got {pad!r}, expected the pad id (an int >= 0)")
    eligibility = getattr(processor, "attention_eligibility", None)
    if not isinstance(eligibility, bool):
        raise TypeError(f"{where}.attention_eligibility: got {eligibility!r}, expected a bool (whether records "
                        "carry per-token eligibility)")
    if get_rope_index is not None:
        bind = getattr(processor, "bind_get_rope_index", None)
        if bind is None:
            raise TypeError(f"{where}: has no bind_get_rope_index, but the model's get_rope_index was passed; "
                            "expected a processor that computes positions with it (add bind_get_rope_index)")
        processor = bind(get_rope_index)
    return processor


def _processor_from_config(cfg: ImageLoaderConfig, model_path: str | None) -> Any:
    from zephon_loader.processors import Qwen2VLRecordProcessor

    node = cfg.processor
    if isinstance(node, ProcessorTarget):
        return instantiate(node.node())
    node = node if isinstance(node, ProcessorConfig) else ProcessorConfig()
    if node.path is not None:
        folder = cfg.resolve_path(node.path)
    elif model_path is not None:
        if not Path(model_path).is_dir():
            raise ValueError(f"dataloader.processor.path: unset, and the model {model_path!r} is not a local folder; "
                             "expected a local processor folder (a hub id cannot load offline): set processor.path")
        folder = Path(model_path)
    else:
        raise ValueError("dataloader.processor: missing; expected {path: <local processor folder>} (tokenizer with "
                         "the vision tokens + preprocessor_config.json), a {_target_: ...} factory, or a processor "
                         "passed to build_image_loader(processor=...)")
    return Qwen2VLRecordProcessor(folder, image_token_alignment=node.image_token_alignment,
                                  append_eos=node.append_eos, min_pixels=node.min_pixels,
                                  max_pixels=node.max_pixels, backend=node.backend)


def processor_fingerprint(cfg: ImageLoaderConfig, processor: Any) -> Any:
    """What identifies the processor in a saved state: its ``fingerprint()``, else the YAML target, else its type."""
    method = getattr(processor, "fingerprint", None)
    if callable(method):
        return method()
    if isinstance(cfg.processor, ProcessorTarget):
        return [cfg.processor.target, repr(cfg.processor.kwargs)]
    return f"{type(processor).__module__}.{type(processor).__qualname__}"
