"""The loader configuration: the typed YAML reader, ``_target_`` resolution and the one schema.

Imports no torch: a configuration is read and checked before anything heavy loads.
"""

from zephon_loader.config.schema import (
    LOADER_SECTION,
    PACKAGE_DATA_PREFIX,
    PACKING_ALGORITHMS,
    ContractConfig,
    DistributedConfig,
    LoaderSchema,
    PackingOptions,
    RuntimeConfig,
    SourceConfig,
    TextLoaderConfig,
    TokenizerConfig,
    default_config_path,
    from_mapping,
    instantiate,
    load_yaml,
    package_data_dir,
    read_loader_config,
    resolve_target,
    text_loader_config,
)

__all__ = [
    "LOADER_SECTION", "PACKAGE_DATA_PREFIX", "PACKING_ALGORITHMS", "ContractConfig", "DistributedConfig",
    "LoaderSchema", "PackingOptions", "RuntimeConfig", "SourceConfig", "TextLoaderConfig", "TokenizerConfig",
    "default_config_path", "from_mapping", "instantiate", "load_yaml", "package_data_dir", "read_loader_config",
    "resolve_target", "text_loader_config",
]
