"""zephon_loader: packed token batches from Zephon pipelines for NeMo AutoModel-style models.

Data flow: config → builder → Zephon source → collate → final map → yield.

Usage::

    from zephon_loader import build_text_loader

    with build_text_loader("train.yaml") as loader:          # the YAML's ``dataloader`` section
        for step, batch in enumerate(loader):                # dicts of CPU tensors, AutoModel's names
            ...
            state = loader.state_dict()                      # a later loader.load_state_dict(state)
                                                             # yields the next batch exactly

Public names (imported on first use; ``help(name)`` documents each): ``build_text_loader``,
``build_image_loader``, ``ZephonLoader``, ``ImageLoader``, ``TextLoaderConfig``, ``ImageLoaderConfig``,
``ZephonDataloaderConfig``, ``ZephonVLMDataloaderConfig``, ``read_loader_config``, ``load_yaml``,
``instantiate``, ``build_pipeline``, ``ZephonSource``, ``ReadAhead``, ``FinalizeSettings``,
``finalize_batch``, ``TrainingBatch``, ``adapt_model_inputs``, ``enable_xdoc_attention``,
``require_supported_packing_contract``, ``PackingContract``, ``PackedSequenceContract``,
``DEFAULT_PACKED_SEQUENCE_CONTRACT``, ``contract_for_attention``, ``build_packed_sequence_metadata``,
``flatten_packed_sequence_metadata``, the attention backends (``initialize_attn_module_and_func``,
``preprocess_args_and_kwargs_for_attn``, ``postprocess_output_for_attn``), and the image processors
(``Qwen2VLRecordProcessor``, ``ImageTextRecord``, ``ProcessedRecord``).

What each batch holds per packing contract: ``docs/contract.md``. Trainers:
``zephon_loader.lightning``, ``zephon_loader.accelerate``, ``zephon_loader.hf``,
``zephon_loader.automodel``. The CLI: ``zephon-loader run | inspect``.

The public names below are imported on first use (PEP 562), so that
``import zephon_loader`` — and ``zephon-loader --help`` / ``--version`` —
do not pay for torch, Zephon and transformers until something needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    # config -> builder
    "TextLoaderConfig": "zephon_loader.config",
    "instantiate": "zephon_loader.config",
    "load_yaml": "zephon_loader.config",
    "read_loader_config": "zephon_loader.config",
    "build_text_loader": "zephon_loader.build",
    "ZephonDataloaderConfig": "zephon_loader.integrations.recipe",
    # Zephon source
    "build_pipeline": "zephon_loader.pipeline.text",
    "ZephonSource": "zephon_loader.nodes.source",
    # final map and yield
    "TrainingBatch": "zephon_loader.attention",
    "adapt_model_inputs": "zephon_loader.attention",
    "enable_xdoc_attention": "zephon_loader.attention",
    "require_supported_packing_contract": "zephon_loader.attention",
    "FinalizeSettings": "zephon_loader.finalize.final_map",
    "finalize_batch": "zephon_loader.finalize.final_map",
    "DEFAULT_PACKED_SEQUENCE_CONTRACT": "zephon_loader.contract",
    "PackedSequenceContract": "zephon_loader.contract",
    "PackingContract": "zephon_loader.contract",
    "build_packed_sequence_metadata": "zephon_loader.packing",
    "contract_for_attention": "zephon_loader.contract",
    "flatten_packed_sequence_metadata": "zephon_loader.packing",
    "ReadAhead": "zephon_loader.nodes.readahead",
    "ZephonLoader": "zephon_loader.loader",
    # attention backends
    "initialize_attn_module_and_func": "zephon_loader.backends",
    "postprocess_output_for_attn": "zephon_loader.backends",
    "preprocess_args_and_kwargs_for_attn": "zephon_loader.backends",
    # image-text loader
    "ImageLoader": "zephon_loader.loader",
    "build_image_loader": "zephon_loader.build",
    "ImageLoaderConfig": "zephon_loader.config.image",
    "ZephonVLMDataloaderConfig": "zephon_loader.integrations.recipe",
    "ImageTextRecord": "zephon_loader.processors",
    "ProcessedRecord": "zephon_loader.processors",
    "Qwen2VLRecordProcessor": "zephon_loader.processors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'zephon_loader' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    """The names loaded so far (``__all__`` lists every public one): ``help(zephon_loader)`` shows this
    docstring without importing torch for every lazy name, and a name joins ``dir()`` once used."""
    return sorted(globals())


if TYPE_CHECKING:  # static type checkers and IDEs see the eager imports
    from zephon_loader.attention import (
        TrainingBatch,
        adapt_model_inputs,
        enable_xdoc_attention,
        require_supported_packing_contract,
    )
    from zephon_loader.backends import (
        initialize_attn_module_and_func,
        postprocess_output_for_attn,
        preprocess_args_and_kwargs_for_attn,
    )
    from zephon_loader.build import build_text_loader
    from zephon_loader.config import TextLoaderConfig, instantiate, load_yaml, read_loader_config
    from zephon_loader.finalize.final_map import FinalizeSettings, finalize_batch
    from zephon_loader.build import build_image_loader
    from zephon_loader.config.image import ImageLoaderConfig
    from zephon_loader.integrations.recipe import ZephonVLMDataloaderConfig
    from zephon_loader.loader import ImageLoader, ZephonLoader
    from zephon_loader.packing import build_packed_sequence_metadata, flatten_packed_sequence_metadata
    from zephon_loader.contract import DEFAULT_PACKED_SEQUENCE_CONTRACT, PackedSequenceContract, PackingContract, contract_for_attention
    from zephon_loader.pipeline.text import build_pipeline
    from zephon_loader.processors import ImageTextRecord, ProcessedRecord, Qwen2VLRecordProcessor
    from zephon_loader.nodes.readahead import ReadAhead
    from zephon_loader.integrations.recipe import ZephonDataloaderConfig
    from zephon_loader.nodes.source import ZephonSource
