"""Builders: configuration → validated contract → Zephon pipeline → ZephonLoader.

The packing contract is checked first, once, before any Zephon source or
worker starts (SPEC §5): a loader that cannot serve the model never begins
reading data.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
from functools import partial
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping

from zephon_loader.collate.text import collate
from zephon_loader.config import TextLoaderConfig, read_loader_config
from zephon_loader.finalize.final_map import FinalizeSettings
from zephon_loader.fingerprint import shard_list_fingerprint, tokenizer_fingerprint
from zephon_loader.loader import ZephonLoader
from zephon_loader.contract import PackingContract, validate_packing_contract
from zephon_loader.pipeline.text import BuiltPipeline, DataParallel, build_pipeline
from zephon_loader.nodes.source import ZephonSource
from zephon_loader.stats import CountingCollate, LoaderStats


def resolve_contract(config: TextLoaderConfig, packing_contract: object | None) -> PackingContract:
    """The contract to serve: the model's (``packing_contract``) or the configured one.

    A model contract without ``qkv_format`` (AutoModel 0.7.0's
    ``PackingCapabilities`` has none) takes the YAML's ``qkv_format``: THD is a
    layout the loader adds on top of the mask representation.

    Returns:
        The contract as a frozen :class:`~zephon_loader.packing.PackingContract`:
        the model's is validated here (its one check), the YAML's was when the
        configuration built it. Nothing downstream validates it again.

    Raises:
        TypeError/ValueError: The model's contract is malformed, or both are
            given and disagree on mask type or metadata (the model's contract
            wins only when the YAML leaves ``contract`` unset).
    """
    if packing_contract is None:
        return config.packing_contract()
    model = PackingContract.of(packing_contract)
    if config.contract is None:
        return model
    configured = config.packing_contract()
    if not hasattr(packing_contract, "qkv_format") and configured.qkv_format != model.qkv_format:
        model = PackingContract(model.packed_mask_type, model.requires_packed_sequence_metadata, configured.qkv_format)
    if model != configured:
        raise ValueError(
            f"dataloader.contract: the YAML asks for {configured.fields} (mask type, metadata, qkv format) but the "
            f"model requires {model.fields}; remove 'contract' from the YAML to follow the model, or make them agree"
        )
    return model


def _save_recipe_tokenizer(tokenizer: Any) -> str:
    """Save the recipe's tokenizer object to a fresh local folder Zephon can load (never a hub id).

    The object itself is saved (not its ``name_or_path``), so tokens added in
    memory are kept. The caller owns the folder and removes it on close.
    """
    if not hasattr(tokenizer, "save_pretrained"):
        raise TypeError(
            f"tokenizer: got {type(tokenizer).__name__} without save_pretrained; expected a Hugging Face tokenizer, "
            "or set dataloader.tokenizer.path to a local tokenizer folder"
        )
    folder = tempfile.mkdtemp(prefix="zephon_loader_tokenizer_")
    tokenizer.save_pretrained(folder)
    return folder


def build_text_loader(
    config: TextLoaderConfig | Mapping[str, Any] | str | Path,
    *,
    packing_contract: object | None = None,
    tokenizer: Any = None,
    dp_rank: int | None = None,
    dp_world_size: int | None = None,
    dp_group: Any = None,
    collate_wrapper: Callable | None = None,
    dataset_build_context: ContextManager[Any] | None = None,
    pin_memory: bool | None = None,
) -> ZephonLoader:
    """Build a :class:`~zephon_loader.loader.ZephonLoader` for text (or pretokenized, or chat) sources.

    Args:
        config: A :class:`~zephon_loader.config.TextLoaderConfig`, its YAML
            mapping, or a YAML path (its ``dataloader`` section, relative
            paths resolved against the file's folder).
        packing_contract: The model's contract; ``None`` uses the YAML's
            ``contract`` (default: block-causal, no metadata).
        tokenizer: The recipe's tokenizer, used when the YAML names none.
        dp_rank, dp_world_size: This rank's data-parallel coordinates; Zephon
            gives each DP rank its own lane(s). Unset (both): taken from
            ``torch.distributed``'s default group when it is initialized
            (then ``aggregate_store`` defaults to ``torch://`` and ``run_id``
            to one derived from the config, the same on every rank), else a
            single rank. With several ranks and explicit coordinates set
            ``distributed.aggregate_dir`` or ``aggregate_store``.
        dp_group: Instead of the two: the data-parallel ``ProcessGroup`` or
            1-D ``DeviceMesh`` (e.g. ``mesh["dp"]``) whose rank and size they are.
        collate_wrapper: AutoModel-style wrapper applied to each yielded batch.
        dataset_build_context: Entered while the Zephon pipeline is built (AutoModel's rank ordering).
        pin_memory: ``None`` = pin when CUDA is available.

    Raises:
        TypeError/ValueError: Bad configuration or contract, before anything starts.
    """
    cfg = read_loader_config(config)
    contract = resolve_contract(cfg, packing_contract)
    settings = FinalizeSettings.from_contract(
        contract,
        xdoc=cfg.xdoc,
        return_packed_sequence_metadata=cfg.return_packed_sequence_metadata,
        attention_eligibility=cfg.eligibility_field is not None,
        micro_batch_size=cfg.micro_batch_size,
        sequence_length=cfg.sequence_length,
        block_mask_budget_bytes=cfg.block_mask_budget_bytes,
    )
    dp = data_parallel(cfg, dp_rank, dp_world_size, dp_group)

    owned: list[str] = []
    tokenizer_dir: str | None = None
    if cfg.tokenizer.path is None and cfg.input_mode != "pretokenized" and tokenizer is not None:
        tokenizer_dir = _save_recipe_tokenizer(tokenizer)
        owned.append(tokenizer_dir)
    work_dir = tempfile.mkdtemp(prefix="zephon_loader_pipeline_")
    owned.append(work_dir)

    def pipeline_for_epoch(epoch: int) -> Any:
        """The Zephon pipeline of one epoch: the same data and lanes, the epoch's shuffle seed."""
        return build_pipeline(cfg, work_dir=work_dir, tokenizer_dir=tokenizer_dir, dp=dp,
                              seed=epoch_seed(cfg.seed, epoch), run_id_suffix=epoch_run_id_suffix(epoch)).pipeline

    try:
        built: BuiltPipeline = _build_pipeline_in(
            dataset_build_context, cfg, work_dir=work_dir, tokenizer_dir=tokenizer_dir, dp=dp)
    except BaseException:
        _remove(owned)
        raise
    mask_cross = cfg.labels_mask_cross_document
    collate_fn = partial(
        collate,
        mask_cross_document_labels=mask_cross,
        eos_mask_loss=cfg.eos_mask_loss,
        eos_token_id=cfg.eos_token_id,
        eligibility=cfg.eligibility_field is not None,
        physical_cu_seqlens=False,  # the final map never yields them
        # Zephon delivers the short batch of each flush and of the end of the stream: pad it to B rows.
        micro_batch_size=cfg.micro_batch_size,
        pad_token_id=built.pad_token_id,
    )
    tok = cfg.tokenizer
    names = [source.name for source in cfg.sources]
    fingerprint = stream_fingerprint(cfg, built.shards, dp, contract, cfg.micro_batch_size, {
        "tokenizer": [tok.text_field, tok.pretokenized_field, tok.chat_field, tok.special_tokens],
        "tokenizer_files": tokenizer_fingerprint(str(built.tokenizer_dir) if built.tokenizer_dir else None),
        "chat_template": [tok.chat_template, tok.chat_loss_scope],
        "records": [cfg.on_bad_record, cfg.max_record_tokens, cfg.max_record_bytes],
        "packing": [cfg.packing.algorithm, cfg.packing.num_bins, built.pad_token_id],
        "eligibility_field": cfg.eligibility_field,
        "label_masking": [mask_cross, cfg.eos_mask_loss, cfg.eos_token_id],
    })
    return ZephonLoader(
        ZephonSource(built.pipeline, built.shards, pipeline_for_epoch=pipeline_for_epoch),
        CountingCollate(collate_fn),
        settings,
        read_ahead=cfg.read_ahead,
        collate_wrapper=collate_wrapper,
        fingerprint=fingerprint,
        pin_memory=pin_memory,
        on_close=partial(_remove, owned),
        stats=LoaderStats(names, built.drop_log),
    )


def stream_fingerprint(
    cfg: Any, shards: Any, dp: DataParallel, contract: object, micro_batch_size: int, specific: Mapping[str, Any]
) -> dict[str, Any]:
    """What fixes a loader's batch stream, as JSON: a state saved under another one is refused.

    The keys every loader shares (sources and their shard contents, lanes, shapes,
    order, contract), then the builder's own (``specific``: tokenizer, processor,
    packing, label masking, ...). Shard contents, not paths: a run may resume
    where the data is mounted elsewhere (:mod:`zephon_loader.fingerprint`).
    ``mixture`` and ``passes`` are named only when not their defaults, so states
    saved before those keys existed still load.
    """
    fingerprint = {
        "sources": [[source.name, source.weight] for source in cfg.sources],
        "shards": {src.name: shard_list_fingerprint(src.folder, src.files) for src in shards.sources},
        "canonical_replicas": cfg.distributed.canonical_replicas or dp.size,
        "sequence_length": cfg.sequence_length,
        "micro_batch_size": micro_batch_size,
        "seed": cfg.seed,
        "shuffle": cfg.shuffle,
        "chunk_size": cfg.chunk_size,
        "contract": list(validate_packing_contract(contract)),
        "xdoc": cfg.xdoc,
        **specific,
    }
    for key, default in (("mixture", "repeat"), ("passes", 1)):
        if getattr(cfg, key, default) != default:
            fingerprint[key] = getattr(cfg, key)
    return fingerprint


def data_parallel(
    cfg: TextLoaderConfig, dp_rank: int | None, dp_world_size: int | None, dp_group: Any = None
) -> DataParallel:
    """This rank's DP coordinates: the ones passed, else ``dp_group``'s, else torch.distributed's default
    group's, else one rank.

    ``dp_group`` is the data-parallel ``ProcessGroup``, or a 1-D ``DeviceMesh``
    (e.g. ``mesh["dp"]``): its rank and size are the coordinates.

    When torch.distributed is initialized (coordinates passed or not), the
    aggregation store defaults to ``torch://`` (the process group's
    rendezvous) unless the YAML sets one. With several
    ranks the run id defaults to one derived from the config, identical on
    every rank that reads the same configuration.

    Raises:
        ValueError: Only one of the two passed; bad values; ``canonical_replicas``
            not a multiple of the DP size.
    """
    if (dp_rank is None) != (dp_world_size is None):
        raise ValueError(
            f"dp_rank/dp_world_size: got {dp_rank!r}/{dp_world_size!r}, expected both or neither "
            "(neither: taken from dp_group, or from torch.distributed when it is initialized)"
        )
    if dp_group is not None and dp_rank is not None:
        raise ValueError("dp_group: got a group and dp_rank/dp_world_size; expected one of them (the group's rank "
                         "and size are the coordinates)")
    import torch.distributed as dist

    configured = cfg.distributed
    initialized = dist.is_available() and dist.is_initialized()
    if dp_group is not None:
        dp_rank, dp_world_size = _group_coordinates(dp_group)
    elif dp_rank is None:
        dp_rank, dp_world_size = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)
    # With a process group (also when the recipe passes DP coordinates under TP/CP), Zephon can meet
    # at its rendezvous store; without one, the YAML must name a shared folder or store.
    store = ("torch://" if initialized and dp_world_size > 1  # type: ignore[operator]
             and configured.aggregate_dir is None and configured.aggregate_store is None else None)
    # Zephon's default run id is derived from the pipeline, which names per-process folders (the
    # saved tokenizer): ranks would not meet at the first checkpoint. Derive one from the config.
    run_id = f"zephon_loader-{_config_digest(cfg)}" if configured.run_id is None and dp_world_size > 1 else None
    dp = DataParallel(dp_rank, dp_world_size, aggregate_store=store, run_id=run_id)  # type: ignore[arg-type]
    replicas = cfg.distributed.canonical_replicas
    if replicas is not None and replicas % dp.size:
        raise ValueError(
            f"dataloader.distributed.canonical_replicas: got {replicas}, expected a multiple of the data-parallel "
            f"size {dp.size}. Pick one divisible by every DP size you will run or resume with (e.g. 8 for 1, 2, 4, 8)."
        )
    return dp


def _group_coordinates(group: Any) -> tuple[int, int]:
    """``(rank, size)`` in a data-parallel ``ProcessGroup`` or 1-D ``DeviceMesh``."""
    import torch.distributed as dist

    if hasattr(group, "get_local_rank") and hasattr(group, "size"):  # a DeviceMesh
        if getattr(group, "ndim", 1) != 1:
            raise ValueError(f"dp_group: got a {group.ndim}-D DeviceMesh, expected its data-parallel dimension "
                             "(e.g. mesh['dp'])")
        return int(group.get_local_rank()), int(group.size())
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("dp_group: got a process group but torch.distributed is not initialized")
    try:
        return int(dist.get_rank(group)), int(dist.get_world_size(group))
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"dp_group: got {type(group).__name__}, expected a torch.distributed ProcessGroup this "
                         f"rank belongs to, or a 1-D DeviceMesh ({error})") from error


def _config_digest(cfg: TextLoaderConfig) -> str:
    """A short hash of the config (the same on every rank that reads the same YAML)."""
    return hashlib.sha256(repr(cfg).encode()).hexdigest()[:16]


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of ``epoch``: ``seed`` itself for epoch 0, then a hash of ``(seed, epoch)``.

    Deterministic: the same on every run, rank and data-parallel size.
    """
    if epoch == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"zephon_loader.epoch:{seed}:{epoch}".encode()).digest()[:4], "big")


def epoch_run_id_suffix(epoch: int) -> str:
    """Suffix of the aggregation run id per epoch: a new pipeline's rounds never meet the last epoch's files."""
    return "" if epoch == 0 else f".epoch{epoch}"


def _build_pipeline_in(context: ContextManager[Any] | None, *args: Any, **kwargs: Any) -> Any:
    """``build_pipeline`` inside the caller's context (AutoModel's rank ordering), if any."""
    with context or contextlib.nullcontext():
        return build_pipeline(*args, **kwargs)


def _remove(folders: list[str]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
