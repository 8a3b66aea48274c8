"""zephon_loader: packed token batches from Zephon pipelines for NeMo AutoModel-style models.

Data flow: config → builder → Zephon source → collate → final map → yield.
"""

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
from zephon_loader.builders import build_text_loader
from zephon_loader.config import TextLoaderConfig, instantiate, load_yaml
from zephon_loader.finalize import FinalizeSettings, finalize_batch
from zephon_loader.loader import ZephonLoader
from zephon_loader.packing import (
    DEFAULT_PACKED_SEQUENCE_CONTRACT,
    PackedSequenceContract,
    PackingContract,
    build_packed_sequence_metadata,
    contract_for_attention,
    flatten_packed_sequence_metadata,
)
from zephon_loader.readahead import ReadAhead
from zephon_loader.recipe import ZephonDataloaderConfig
from zephon_loader.source import ZephonSource, build_pipeline

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_PACKED_SEQUENCE_CONTRACT",
    "FinalizeSettings",
    "PackedSequenceContract",
    "PackingContract",
    "ReadAhead",
    "TextLoaderConfig",
    "TrainingBatch",
    "ZephonDataloaderConfig",
    "ZephonLoader",
    "ZephonSource",
    "adapt_model_inputs",
    "build_packed_sequence_metadata",
    "build_pipeline",
    "build_text_loader",
    "contract_for_attention",
    "enable_xdoc_attention",
    "finalize_batch",
    "flatten_packed_sequence_metadata",
    "initialize_attn_module_and_func",
    "instantiate",
    "load_yaml",
    "postprocess_output_for_attn",
    "preprocess_args_and_kwargs_for_attn",
    "require_supported_packing_contract",
]
