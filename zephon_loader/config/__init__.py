"""The loader configuration: the typed YAML reader, ``_target_`` resolution and the one schema.

* :mod:`~zephon_loader.config.reader`: plain YAML values to schema dataclasses, ``_target_``, YAML files.
* :mod:`~zephon_loader.config.schema`: :class:`LoaderConfig` (every shared key) and the text record section.
* :mod:`~zephon_loader.config.image`: the image-text record section.

Imports no torch: a configuration is read and checked before anything heavy loads.
"""

from zephon_loader.config.image import (
    ImageLoaderConfig,
    ImagePackingOptions,
    ImageRuntimeConfig,
    ProcessorConfig,
    ProcessorTarget,
    RecordsConfig,
    default_image_config_path,
)
from zephon_loader.config.reader import LOADER_SECTION, from_mapping, instantiate, load_yaml, resolve_target
from zephon_loader.config.schema import (
    PACKAGE_DATA_PREFIX,
    PACKING_ALGORITHMS,
    ContractConfig,
    DistributedConfig,
    LoaderConfig,
    MixturePhase,
    MixtureSchedule,
    PackingOptions,
    RunnerOptions,
    RuntimeConfig,
    SourceConfig,
    TextLoaderConfig,
    TokenizerConfig,
    default_config_path,
    package_data_dir,
    read_loader_config,
    text_loader_config,
)

__all__ = [
    "LOADER_SECTION", "PACKAGE_DATA_PREFIX", "PACKING_ALGORITHMS", "ContractConfig", "DistributedConfig",
    "ImageLoaderConfig", "ImagePackingOptions", "ImageRuntimeConfig", "LoaderConfig", "MixturePhase",
    "MixtureSchedule", "PackingOptions",
    "ProcessorConfig", "ProcessorTarget", "RecordsConfig", "RunnerOptions", "RuntimeConfig", "SourceConfig",
    "TextLoaderConfig", "TokenizerConfig", "default_config_path", "default_image_config_path", "from_mapping",
    "instantiate", "load_yaml", "package_data_dir", "read_loader_config", "resolve_target", "text_loader_config",
]
