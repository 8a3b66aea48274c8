"""The Zephon pipeline of a text loader, built stage by stage from a validated config.

Reads top to bottom as the data flow::

    work source (shard folders, whole passes, this rank's lane)    work_source.py
      -> [transform]                                                 (API only)
      -> check raw records -> tokenize | tokenize_chat | (pretokenized)   (runner ray: tokenize on Ray, ray_runner.py)
      -> check tokens -> pack_flat(S + 1, positions) -> batch(B)
      -> runtime options (lanes, flush cadence, runner)

The config (:class:`~zephon_loader.config.TextLoaderConfig`) has already
checked types, ranges and combinations of keys; this module checks only what
needs the data or the tokenizer (folders exist, ids inside the vocabulary,
a chat template exists), before any Zephon worker starts.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zephon_loader.config import TextLoaderConfig
from zephon_loader.errors import field_error as _err
from zephon_loader.pipeline.records import CheckRawRecords, CheckTokens
from zephon_loader.pipeline.provenance import DropLog, ShardTable
from zephon_loader.pipeline.ray_runner import require_ray, tokenize_placement
from zephon_loader.zephon_compat import ZEPHON_LOSS_MASK_KEY, ZEPHON_TOKENS_KEY, set_records_per_call
from zephon_loader.tokenizing import (SharedTokenizer, check_token_id, check_tokenizer_dir, load_tokenizer,
                                     pad_token_id_of)
from zephon_loader.pipeline.object_store import store_options
from zephon_loader.pipeline.shards import cache_dir
from zephon_loader.pipeline.work_source import OpenedSources, WorkSource, build_work_source, lane_options

__all__ = ["DEFAULT_NUM_BINS", "DROP_LOG_NAME", "FETCH_RECORDS_PER_CALL", "TOKENIZE_RECORDS_PER_CALL", "BuiltPipeline",
           "DataParallel", "PreparedTokenizer", "build_pipeline", "prepare_tokenizer", "runtime_options"]

#: Bins kept open by ``first_fit``/``best_fit`` when the config does not say.
DEFAULT_NUM_BINS = 8
#: Records per tokenize call (Zephon's default is 64). Zephon's deterministic accumulator waits for a full call
#: before tokenizing, so the first batch waited for 64 documents; 8 start packing as soon as a few documents are
#: read (stdlib corpus, S=2048, B=8: first batch 2.6 -> 0.4 s, peak RSS 1,242 -> 828 MiB, pass time unchanged;
#: ``benchmarks/bench_first_batch.py``).
TOKENIZE_RECORDS_PER_CALL = 8
#: Records per read call (Zephon's default is 64). The inline runner carries each read call's records through
#: every stage before the next, so the first batch waited for 64 documents to be tokenized (~850k tokens of the
#: stdlib corpus for the 16k of one 8x2048 batch); 8 match the tokenize call (first batch 0.61 -> 0.15 s after
#: the build, pass time unchanged; ``benchmarks/bench_first_batch.py``).
FETCH_RECORDS_PER_CALL = 8
#: File name of the drop log inside ``build_pipeline``'s ``work_dir``.
DROP_LOG_NAME = "drops.jsonl"
_BINNED = ("first_fit", "best_fit")


@dataclass(frozen=True)
class DataParallel:
    """This rank's data-parallel coordinates (Zephon's world is the DP group).

    Attributes:
        rank: This rank's DP index, in ``[0, size)``.
        size: Number of DP ranks.
        aggregate_store: Overrides ``distributed.aggregate_store`` (the builder
            sets ``torch://`` when it took the coordinates from torch.distributed).
        run_id: Overrides ``distributed.run_id``.
        defaulted: One rank only because nothing said otherwise (no coordinates,
            group, process group or launcher environment): not part of equality.
    """

    rank: int = 0
    size: int = 1
    aggregate_store: str | None = None
    run_id: str | None = None
    defaulted: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        for name, value, low in (("dp_world_size", self.size, 1), ("dp_rank", self.rank, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(_err(name, value, f"an int >= {low}", "Pass this rank's data-parallel coordinates."))
        if self.rank >= self.size:
            raise ValueError(_err("dp_rank", self.rank, f"< dp_world_size ({self.size})",
                                  "Pass this rank's data-parallel coordinates."))


@dataclass(frozen=True)
class PreparedTokenizer:
    """The tokenizer as every epoch's pipeline uses it, loaded once (:func:`prepare_tokenizer`).

    Attributes:
        tokenizer: The loaded, checked tokenizer (``None``: pretokenized without one), loaded with
            ``split_special_tokens=True``; in text mode handed to Zephon's ``tokenize``. Chat mode hands
            Zephon the folder (``tokenizer_id``): its chat operator's setup checks switch the tokenizer's
            truncation on and off, so its copies must not share one tokenizer.
    """

    tokenizer: Any


def prepare_tokenizer(config: TextLoaderConfig, *,
                      tokenizer_dir: str | os.PathLike[str] | None = None) -> PreparedTokenizer:
    """Load and check the tokenizer: once per loader.

    Text mode hands this object to Zephon's ``tokenize`` (wrapped in
    :class:`~zephon_loader.tokenizing.SharedTokenizer`, so that Zephon's per-engine-start copies of its
    operator share it instead of copying it): a folder for Zephon to load would make its op import
    AutoTokenizer's model registry in the engine thread (~1 s before the first batch).

    Args and raises: as :func:`build_pipeline`'s ``config`` and ``tokenizer_dir``.
    """
    return PreparedTokenizer(_load_tokenizer(config, config.input_mode, tokenizer_dir))


@dataclass(frozen=True)
class BuiltPipeline:
    """What :func:`build_pipeline` returns.

    Attributes:
        pipeline: The configured ``zephon.Pipeline`` (nothing started).
        shards: Sample id → source, shard file and line/row.
        pad_token_id: The pad id rows are packed with (configured, else the tokenizer's pad, else its EOS).
        tokenizer_dir: The tokenizer folder used (``None``: pretokenized without one).
        drop_log: Where the record checks log what ``on_bad_record: skip`` left out.
        sources: The shard files read (an epoch's pipeline is built over the same: ``sources=``).
        prepared: The tokenizer loaded and saved for it (an epoch's pipeline reuses it: ``prepared=``).
        flush_window: Records per lane between Zephon's flushes when the default cadence was shortened
            (:func:`~zephon_loader.pipeline.work_source.default_flush_window`; fingerprinted), else ``None``.
    """

    pipeline: Any
    shards: ShardTable
    pad_token_id: int
    tokenizer_dir: Path | None
    drop_log: DropLog
    sources: OpenedSources
    prepared: PreparedTokenizer | None = None
    flush_window: int | None = None


def build_pipeline(
    config: TextLoaderConfig,
    *,
    work_dir: str | os.PathLike[str],
    tokenizer_dir: str | os.PathLike[str] | None = None,
    dp: DataParallel = DataParallel(),
    seed: int | None = None,
    run_id_suffix: str = "",
    sources: OpenedSources | None = None,
    transform: Callable[[Any], Any] | None = None,
    prepared: PreparedTokenizer | None = None,
) -> BuiltPipeline:
    """Build the ``zephon.Pipeline`` that yields packed batches of ``B`` rows of ``S + 1`` tokens.

    Args:
        config: The validated loader config.
        work_dir: Existing folder the pipeline writes to, owned (and removed)
            by the caller: ``drops.jsonl`` (drop events of the record checks,
            read by :mod:`zephon_loader.stats`).
        tokenizer_dir: Tokenizer folder; default ``config.tokenizer.path``
            (the builder passes the recipe's tokenizer, saved, when the YAML names none).
        dp: This rank's data-parallel coordinates.
        seed: Overrides ``config.seed`` (an epoch's seed).
        sources: The shard files opened at the build (:func:`~zephon_loader.pipeline.work_source.open_sources`);
            ``None`` opens them.
        run_id_suffix: Appended to the aggregation run id (an epoch's pipeline
            must not meet the previous epoch's coordination files).
        transform: Optional payload map run first (pretokenized mode: it must
            emit the pretokenized field, and the eligibility field if configured).
        prepared: The tokenizer an earlier build of this loader prepared
            (``BuiltPipeline.prepared``, same ``config``): an epoch's rebuild
            does not reload it. ``None``:
            :func:`prepare_tokenizer` (``tokenizer_dir`` is then used).

    Raises:
        ValueError / TypeError: naming the key, the value seen, what was
        expected and the fix; raised before any worker starts.
    """
    import zephon

    if transform is not None and not callable(transform):
        raise TypeError(_err("transform", type(transform).__name__, "a callable payload -> payload", "Pass a function."))
    if config.runtime.runner == "ray":
        require_ray()  # one ImportError naming the extra, before anything starts
    mode = config.input_mode
    if prepared is None:
        prepared = prepare_tokenizer(config, tokenizer_dir=tokenizer_dir)
    tokenizer = prepared.tokenizer
    pad_token_id = _pad_token_id(config, tokenizer)
    dist = config.distributed
    lanes = dist.canonical_replicas or dp.size
    # batch_shape: a resume re-reads what came since the last flush, at the default about 1024 batches of bytes at most.
    work = build_work_source(config, lanes=lanes, seed=seed, sources=sources,
                             batch_shape=(config.micro_batch_size, config.sequence_length + 1))
    drop_log = DropLog(os.path.join(work_dir, DROP_LOG_NAME))
    checks = {"shards": work.shards, "policy": config.on_bad_record, "log": drop_log}

    pipeline = zephon.Pipeline(work.source).fetch(max_batch=FETCH_RECORDS_PER_CALL)
    if transform is not None:
        pipeline = pipeline.map_transform(transform)
    pipeline, loss_mask_field = _tokenize(pipeline, config, mode, tokenizer, checks)
    pipeline = _check_tokens(pipeline, config, tokenizer, loss_mask_field, checks, pad_token_id)
    pipeline = _pack_and_batch(pipeline, config, pad_token_id)
    pipeline = pipeline.options(**runtime_options(config, dp, work, run_id_suffix))
    return BuiltPipeline(pipeline, work.shards, pad_token_id,
                         Path(tokenizer.name_or_path) if tokenizer is not None else None, drop_log, work.opened,
                         prepared, work.flush_window)


# ----------------------------------------------------------------------------- stages


#: transformers' ``model_max_length`` when a tokenizer folder sets none (``VERY_LARGE_INTEGER``, int(1e30)).
_NO_LIMIT = 10**18


def check_sequence_length(sequence_length: int, tokenizer: Any, path: Any) -> None:
    """Warn when rows are longer than the tokenizer says its model takes; quiet transformers' own warning.

    The loader tokenizes whole documents and packs them into rows of ``sequence_length``, so a document longer
    than ``model_max_length`` is expected; transformers' "Token indices sequence length is longer ... will result
    in indexing errors" (once per tokenizer) would point at the wrong thing. What reaches the model is the row:
    that is what is compared here.
    """
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < _NO_LIMIT and sequence_length > limit:
        warnings.warn(
            f"dataloader.sequence_length: got {sequence_length}, more than the tokenizer's model_max_length "
            f"{limit} ({path}/tokenizer_config.json): a model made for {limit} positions would see positions up to "
            f"{sequence_length - 1} (an index error, or silently wrong position embeddings). Set sequence_length <= "
            f"{limit}, or, if the model takes longer rows, set model_max_length in that tokenizer_config.json",
            UserWarning, stacklevel=4,
        )
    flags = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(flags, dict):
        flags["sequence-length-is-longer-than-the-specified-maximum"] = True  # transformers' once-flag


def _load_tokenizer(config: TextLoaderConfig, mode: str, tokenizer_dir: Any) -> Any:
    """The tokenizer, loaded once: it validates ids here and, in text mode, is saved for Zephon."""
    if tokenizer_dir is None and config.tokenizer.path is not None:
        tokenizer_dir = config.resolve_path(config.tokenizer.path)
    if tokenizer_dir is None:
        if mode != "pretokenized":
            # Zephon would silently fall back to a hash stub whose ids change per process.
            raise ValueError(
                _err("dataloader.tokenizer.path", None, f"a local tokenizer folder for {mode} input",
                     "Set tokenizer.path: <folder written by save_pretrained>, pass the recipe's tokenizer, "
                     "or set tokenizer.pretokenized_field: <token column>.")
            )
        return None
    path = check_tokenizer_dir("dataloader.tokenizer.path", Path(tokenizer_dir))
    # split_special_tokens changes only how text is split, not ids, vocabulary or special tokens.
    tokenizer = load_tokenizer(path, split_special_tokens=True)
    if mode == "text":
        special = config.tokenizer.special_tokens
        for needed, token_id, name in ((("bos_eos", "bos"), tokenizer.bos_token_id, "bos_token"),
                                       (("bos_eos", "eos"), tokenizer.eos_token_id, "eos_token")):
            if special in needed and token_id is None:
                raise ValueError(
                    _err("dataloader.tokenizer.special_tokens", special, f"a mode this tokenizer can serve (it has no {name})",
                         "Set tokenizer.special_tokens to one whose tokens the tokenizer has ('bos', 'eos' or "
                         f"'none'), or add a {name} to the tokenizer folder.")
                )
    check_sequence_length(config.sequence_length, tokenizer, path)
    if mode == "chat" and config.tokenizer.chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            _err("dataloader.tokenizer.chat_template", None, "a chat template (the tokenizer has none)",
                 "Set tokenizer.chat_template: <jinja text or file>.")
        )
    return tokenizer


def _pad_token_id(config: TextLoaderConfig, tokenizer: Any) -> int:
    pad = config.pad_token_id
    if pad is None and tokenizer is not None:
        pad = pad_token_id_of(tokenizer)
    if pad is None:
        # Every algorithm pads: the last row of the stream (and of each Zephon flush) and the
        # all-padding rows that complete the last batch.
        raise ValueError(
            _err("dataloader.pad_token_id", None, "a pad id (every packing algorithm pads the last row of a pass)",
                 "Set pad_token_id: <id>, or use a tokenizer with a pad or eos token.")
        )
    if tokenizer is not None:
        check_token_id("dataloader.pad_token_id", pad, len(tokenizer))
    if config.eos_token_id is not None and tokenizer is not None:
        check_token_id("dataloader.eos_token_id", config.eos_token_id, len(tokenizer))
    return int(pad)


def _tokenize(
    pipeline: Any, config: TextLoaderConfig, mode: str, tokenizer: Any, checks: dict[str, Any],
) -> tuple[Any, str | None]:
    """Raw-record checks and tokenizing; returns the pipeline and the loss-mask field (chat) or None."""
    tok = config.tokenizer
    parallelism = config.runtime.tokenize_calls()
    if mode == "pretokenized":
        return pipeline, None
    raw_check = CheckRawRecords(
        mode=mode, field=tok.text_field if mode == "text" else tok.chat_field,
        max_record_bytes=config.max_record_bytes,
        special_strings=tokenizer.all_special_tokens if mode == "chat" else (), **checks)
    pipeline = pipeline.add_op("zephon_loader.check_raw_records", process_many=raw_check,
                               validation_samples=raw_check.validation_samples, preserves_cursor_order=True)
    placement = tokenize_placement(config)
    if mode == "text":
        # Special-token strings inside documents ("<|endoftext|>", the pad token) stay ordinary text:
        # a control id never comes from data. BOS/EOS bracketing is added by id, not by string.
        # Zephon tokenizes with the object prepare_tokenizer loaded (split_special_tokens=True), one for the
        # process: its operator copies (one per engine start) share it (SharedTokenizer).
        pipeline = pipeline.tokenize(tokenizer=SharedTokenizer(tokenizer), field=tok.text_field, add_attention_mask=False,
                                     special_tokens=tok.special_tokens, parallelism=parallelism, placement=placement)
        set_records_per_call(pipeline, TOKENIZE_RECORDS_PER_CALL)
        return pipeline, None
    chat: dict[str, Any] = {"field": tok.chat_field}
    if tok.chat_template is not None:
        template = tok.chat_template
        chat["chat_template"] = template if template.lstrip().startswith("{") else str(config.resolve_path(template))
    if tok.chat_loss_scope is not None:
        chat["loss_scope"] = tok.chat_loss_scope
    # Zephon loads the folder per operator instance: its chat setup checks probe with truncation on, which
    # would race with another instance's calls on a shared tokenizer (PreparedTokenizer).
    pipeline = pipeline.tokenize_chat(tokenizer_id=tokenizer.name_or_path, parallelism=parallelism,
                                      placement=placement, **chat)
    set_records_per_call(pipeline, TOKENIZE_RECORDS_PER_CALL)
    return pipeline, ZEPHON_LOSS_MASK_KEY


def _check_tokens(
    pipeline: Any, config: TextLoaderConfig, tokenizer: Any, loss_mask_field: str | None, checks: dict[str, Any],
    pad_token_id: int,
) -> Any:
    """Per-record token checks (vocabulary, empty, aligned fields, lengths); see :mod:`zephon_loader.pipeline.records`.

    With ``contract.cp_size > 1`` the same operator pads each kept record to a multiple of ``2 * cp_size``
    (before ``pack_flat``, so the packer gives the padding room; only first_fit/best_fit are allowed then) and
    a row holds at most ``S`` tokens of padded records (a padded record ends on a multiple of ``2 * cp_size``
    and ``S`` is one, so the ``S + 1``-th packed token is always the row's padding).
    """
    tok = config.tokenizer
    cp_multiple = config.cp_multiple
    capacity = config.sequence_length if cp_multiple else config.sequence_length + 1
    check = CheckTokens(
        tokens_field=tok.pretokenized_field or ZEPHON_TOKENS_KEY,
        vocab_size=len(tokenizer) if tokenizer is not None else None,
        max_record_tokens=config.max_record_tokens,
        row_capacity=capacity if config.packing.algorithm in _BINNED else None,
        eligibility_field=config.eligibility_field, loss_mask_field=loss_mask_field,
        cp_multiple=cp_multiple, pad_token_id=pad_token_id, source_marks=config.return_source_ids, **checks)
    # After a Ray tokenize stage the checks run on the trainer's threads again (see tokenize_placement).
    after = "local" if tokenize_placement(config) == "remote" else "auto"
    return pipeline.add_op("zephon_loader.check_tokens", process_many=check,
                           validation_samples=check.validation_samples, preserves_cursor_order=True, placement=after)


def _pack_and_batch(pipeline: Any, config: TextLoaderConfig, pad_token_id: int) -> Any:
    """``pack_flat(S + 1)`` with segment positions, then ``batch(B)`` keeping the short batch of each flush."""
    algorithm = config.packing.algorithm
    pack: dict[str, Any] = {"algorithm": algorithm, "tokens_field": ZEPHON_TOKENS_KEY, "emit_positions": True,
                            "pad_token_id": pad_token_id}
    if algorithm in _BINNED:
        pack["num_bins"] = config.packing.num_bins or DEFAULT_NUM_BINS
    if algorithm == "wrap":
        # Uncapped wrap drops the partial row left at each flush (every flush_every_k_chunks chunks and
        # the end of the stream). A cap of S + 1 segments never closes a row early (every segment
        # holds a token), but makes Zephon pad that row and emit it instead.
        pack["max_sequences_per_bin"] = config.sequence_length + 1
    # drop_last=False: the short batch of each flush is delivered; collate pads it to B rows.
    return pipeline.pack_flat(config.sequence_length + 1, **pack).batch(config.micro_batch_size, drop_last=False)


def runtime_options(config: Any, dp: DataParallel, work: WorkSource, run_id_suffix: str) -> dict[str, Any]:
    """Zephon ``RuntimeOptions``: this rank's lanes, the flush cadence of the chunk size, the runner.

    ``config`` is a text or image loader config (``distributed``, ``runtime``, ``resolve_path``).
    """
    from zephon.options import DEFAULT_RUN_ID

    dist = config.distributed
    run_id = dp.run_id or dist.run_id
    if run_id_suffix:
        run_id = (run_id or DEFAULT_RUN_ID) + run_id_suffix
    options = lane_options(
        dp.rank, dp.size, canonical_replicas=dist.canonical_replicas,
        aggregate_dir=str(config.resolve_path(dist.aggregate_dir)) if dist.aggregate_dir else None,
        aggregate_store=dp.aggregate_store or dist.aggregate_store, run_id=run_id,
    )
    options["flush_every_k_chunks"] = work.flush_every_k_chunks
    options.update(store_options(work.opened.files, cache_dir()))  # sources on object storage: Zephon's shard cache
    options.update(config.runtime.options())
    return options
