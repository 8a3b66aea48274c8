"""Builders: configuration → validated contract → Zephon pipeline → ZephonLoader.

The packing contract is checked first, once, before any Zephon source or
worker starts (SPEC §5): a loader that cannot serve the model never begins
reading data.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from functools import partial
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping

from zephon_loader.collate import collate
from zephon_loader.config import TextLoaderConfig, read_loader_config
from zephon_loader.finalize import FinalizeSettings
from zephon_loader.fingerprint import shard_list_fingerprint, tokenizer_fingerprint
from zephon_loader.loader import ZephonLoader
from zephon_loader.packing import PackingContract, validate_packing_contract
from zephon_loader.records import DropLog, ShardTable
from zephon_loader.stats import CountingCollate, LoaderStats
from zephon_loader.source import (
    DROP_LOG_NAME,
    SourceSpec,
    ZephonSource,
    _load_tokenizer,
    build_pipeline,
    pad_token_id_of,
)


    Returns:
        The contract as a frozen :class:`~zephon_loader.packing.PackingContract`:
        the model's is validated here (its one check), the YAML's was when the
        configuration built it. Nothing downstream validates it again.

def resolve_contract(config: TextLoaderConfig, packing_contract: object | None) -> object:
    """The contract to serve: the model's (``packing_contract``) or the configured one.

    A model contract without ``qkv_format`` (AutoModel 0.7.0's
    ``PackingCapabilities`` has none) takes the YAML's ``qkv_format``: THD is a
    layout the loader adds on top of the mask representation.

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
    dp_rank: int = 0,
    dp_world_size: int = 1,
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
            gives each DP rank its own lane. With ``dp_world_size > 1`` set
            ``distributed.aggregate_dir`` or ``aggregate_store`` (+ ``run_id``).
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
    for name, value, low in (("dp_rank", dp_rank, 0), ("dp_world_size", dp_world_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: got {value!r}, expected an int >= {low}")
    if dp_rank >= dp_world_size:
        raise ValueError(f"dp_rank: got {dp_rank}, expected < dp_world_size ({dp_world_size})")

    tok = cfg.tokenizer
    tokenizer_path: str | None = str(cfg.resolve_path(tok.path)) if tok.path is not None else None
    owned: list[str] = []
    if tokenizer_path is None and tok.pretokenized_field is None and tokenizer is not None:
        tokenizer_path = _save_recipe_tokenizer(tokenizer)
        owned.append(tokenizer_path)
    chat_template = tok.chat_template
    if chat_template is not None and not chat_template.lstrip().startswith("{"):
        chat_template = str(cfg.resolve_path(chat_template))
    sources = [SourceSpec(s.name, str(cfg.resolve_path(s.path)), s.weight) for s in cfg.sources]
    dist = cfg.distributed
    work_dir = tempfile.mkdtemp(prefix="zephon_loader_pipeline_")
    owned.append(work_dir)

    try:
        pipeline = _build_pipeline_in(
            dataset_build_context,
            sources,
            seq_len=cfg.sequence_length,
            micro_batch_size=cfg.micro_batch_size,
            tokenizer=tokenizer_path,
            text_field=tok.text_field,
            pretokenized_field=tok.pretokenized_field,
            chat_field=tok.chat_field,
            chat_template=chat_template,
            chat_loss_scope=tok.chat_loss_scope,
            special_tokens=tok.special_tokens,
            packing_algorithm=cfg.packing.algorithm,
            num_bins=cfg.packing.num_bins,
            pad_token_id=cfg.pad_token_id,
            seed=cfg.seed,
            shuffle=cfg.shuffle,
            chunk_size=cfg.chunk_size,
            eligibility_field=cfg.eligibility_field,
            # Zephon's world is the data-parallel group: tensor/pipeline peers of a
            # DP rank read the same lane, and only one of them saves its state
            # (AutoModel saves loader state on TP0/PP0 per DP rank), so the
            # checkpoint collective must span DP ranks only.
            world_size=dp_world_size,
            global_rank=dp_rank,
            dp_degree=dp_world_size,
            dp_group_id=dp_rank,
            canonical_replicas=dist.canonical_replicas,
            aggregate_dir=str(cfg.resolve_path(dist.aggregate_dir)) if dist.aggregate_dir else None,
            aggregate_store=dist.aggregate_store,
            run_id=dist.run_id,
            runtime_options=cfg.runtime.options() or None,
            on_bad_record=cfg.on_bad_record,
            max_record_tokens=cfg.max_record_tokens,
            max_record_bytes=cfg.max_record_bytes,
            work_dir=work_dir,
        )
    except BaseException:
        _remove(owned)
        raise
    mask_cross = cfg.mask_cross_document_labels if cfg.mask_cross_document_labels is not None else not cfg.xdoc
    collate_fn = partial(
        collate,
        mask_cross_document_labels=mask_cross,
        eos_mask_loss=cfg.eos_mask_loss,
        eos_token_id=cfg.eos_token_id,
        eligibility=cfg.eligibility_field is not None,
        physical_cu_seqlens=False,  # the final map never yields them
        # Zephon delivers the short batch of each flush and of the end of the stream: pad it to B rows.
        micro_batch_size=cfg.micro_batch_size,
        pad_token_id=(cfg.pad_token_id if cfg.pad_token_id is not None
                      else pad_token_id_of(_load_tokenizer(Path(tokenizer_path)))),
    )
    shards = ShardTable.from_folders([s.name for s in sources], [s.path for s in sources])
    fingerprint = {
        # Shard contents, not paths: a run may resume where the data is mounted elsewhere (zephon_loader.fingerprint).
        "sources": [[s.name, s.weight] for s in sources],
        "shards": {src.name: shard_list_fingerprint(src.folder, src.files) for src in shards.sources},
        "tokenizer": [tok.text_field, tok.pretokenized_field, tok.chat_field, tok.special_tokens],
        "tokenizer_files": tokenizer_fingerprint(tokenizer_path),
        "chat_template": [tok.chat_template, tok.chat_loss_scope],
        "canonical_replicas": dist.canonical_replicas or dp_world_size,
        "records": [cfg.on_bad_record, cfg.max_record_tokens, cfg.max_record_bytes],
        "sequence_length": cfg.sequence_length,
        "micro_batch_size": cfg.micro_batch_size,
        "packing": [cfg.packing.algorithm, cfg.packing.num_bins, cfg.pad_token_id],
        "seed": cfg.seed,
        "shuffle": cfg.shuffle,
        "chunk_size": cfg.chunk_size,
        "contract": list(validate_packing_contract(contract)),
        "xdoc": cfg.xdoc,
        "eligibility_field": cfg.eligibility_field,
        "label_masking": [mask_cross, cfg.eos_mask_loss, cfg.eos_token_id],
    }
    return ZephonLoader(
        ZephonSource(pipeline, shards),
        CountingCollate(collate_fn),
        settings,
        read_ahead=cfg.read_ahead,
        collate_wrapper=collate_wrapper,
        fingerprint=fingerprint,
        pin_memory=pin_memory,
        on_close=partial(_remove, owned),
        stats=LoaderStats([s.name for s in sources], DropLog(os.path.join(work_dir, DROP_LOG_NAME))),
    )


def _build_pipeline_in(context: ContextManager[Any] | None, *args: Any, **kwargs: Any) -> Any:
    """``build_pipeline`` inside the caller's context (AutoModel's rank ordering), if any."""
    with context or contextlib.nullcontext():
        return build_pipeline(*args, **kwargs)


def _remove(folders: list[str]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
