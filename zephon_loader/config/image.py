"""The image-text record section of the loader schema: :class:`ImageLoaderConfig` and its sections.

:class:`ImageLoaderConfig` is a :class:`~zephon_loader.config.schema.LoaderConfig`
(every shared key, the same reader and messages:
``dataloader.packing.oversized: got 'keep', expected one of 'drop', 'error'``)
with the image-text record section: the processor, the record format, whole-record packing and the
processor stage's runtime options.

The processor is either the built-in one (:class:`ProcessorConfig`, closed) or
any factory named by ``_target_`` (:class:`ProcessorTarget`: its other keys are
the factory's keyword arguments, as AutoModel's ``ConfigNode`` passes them)::

    processor: {path: image_processor, image_token_alignment: 8}
    processor: {_target_: my_pkg.make_processor, size: 448}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from zephon_loader.config.reader import LOADER_SECTION, from_mapping
from zephon_loader.config.schema import LoaderConfig, RunnerOptions, package_data_dir

__all__ = [
    "DEFAULT_PROCESSOR_PARALLELISM",
    "ImageLoaderConfig",
    "ImagePackingOptions",
    "ImageRuntimeConfig",
    "ProcessorConfig",
    "ProcessorTarget",
    "RecordsConfig",
    "default_image_config_path",
]

#: Processor calls Zephon keeps in flight when ``runtime.processor_parallelism`` is unset.
DEFAULT_PROCESSOR_PARALLELISM = 4


@dataclass(frozen=True)
class ProcessorConfig:
    """The built-in Qwen2-VL-style processor (:class:`~zephon_loader.processors.Qwen2VLRecordProcessor`).

    Attributes:
        path: Local processor folder: a tokenizer with ``<|vision_start|>``,
            ``<|vision_end|>``, ``<|image_pad|>`` and a Qwen2-VL
            ``preprocessor_config.json`` (never a hub id). ``None``: the
            recipe's model folder (``pretrained_model_name_or_path``), when local.
        image_token_alignment: ``k``: pad every image span with ineligible filler
            tokens to a multiple of ``k``; ``None``: no fillers, every token eligible.
        append_eos: End every record with EOS.
        min_pixels, max_pixels: Override the image processor's resize bounds.
        backend: ``pil`` (default) or ``torchvision`` image processing.
    """

    path: str | None = None
    image_token_alignment: int | None = None
    append_eos: bool = True
    min_pixels: int | None = None
    max_pixels: int | None = None
    backend: Literal["pil", "torchvision"] = "pil"


@dataclass(frozen=True)
class ProcessorTarget:
    """A user processor factory named by ``_target_`` (dotted import path), called with ``kwargs``.

    The factory returns an object with the
    :class:`~zephon_loader.processors.RecordProcessor` interface.
    """

    target: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def from_node(cls, node: Mapping[str, Any], where: str) -> "ProcessorTarget":
        target = node.get("_target_")
        if not isinstance(target, str) or not target:
            raise TypeError(f"{where}._target_: got {target!r}, expected a dotted import path string")
        return cls(target, tuple((str(k), v) for k, v in node.items() if k != "_target_"))

    def node(self) -> dict[str, Any]:
        """The YAML node again (``{"_target_": ..., **kwargs}``), for ``config.instantiate``."""
        return {"_target_": self.target, **dict(self.kwargs)}


@dataclass(frozen=True)
class RecordsConfig:
    """The record format (see :mod:`zephon_loader.pipeline.image_records`).

    Attributes:
        text_field: Text column, with one ``image_marker`` per image.
        images_field: Images column: paths relative to the shard (JSONL) or encoded bytes (Parquet).
        image_marker: The string standing for one image in the text.
    """

    text_field: str = "text"
    images_field: str = "images"
    image_marker: str = "<image>"


@dataclass(frozen=True)
class ImagePackingOptions:
    """Zephon ``pack_sequences`` options: records are kept whole (an image is never split across rows).

    Attributes:
        algorithm: ``first_fit`` or ``best_fit``.
        num_bins: Open bins (``None``: the text loader's default, 8).
        oversized: A record longer than a row: ``drop`` (counted as
            ``longer_than_row`` in ``loader.stats()`` and logged with its
            location) or ``error`` (stop, naming the record).
    """

    algorithm: Literal["first_fit", "best_fit"] = "first_fit"
    num_bins: int | None = None
    oversized: Literal["drop", "error"] = "drop"

    @property
    def packing_format(self) -> str:
        """``"neat"``: what AutoModel 0.7.0's VLM recipe reads to ask the model for its packing contract."""
        return "neat"


@dataclass(frozen=True)
class ImageRuntimeConfig(RunnerOptions):
    """Zephon runtime options of an image-text loader: :class:`~zephon_loader.config.schema.RunnerOptions`
    (``runner: process`` is refused with a model's ``get_rope_index``: it would pickle the model) and the
    processor stage's parallelism.

    Attributes:
        processor_parallelism: Processor calls in flight (decode + process);
            ``None``: :data:`DEFAULT_PROCESSOR_PARALLELISM`.
    """

    processor_parallelism: int | None = None

    STAGE_KEYS: ClassVar[tuple[str, ...]] = ("processor_parallelism",)


@dataclass(frozen=True, kw_only=True)
class ImageLoaderConfig(LoaderConfig):
    """An image-text loader's config: :class:`~zephon_loader.config.schema.LoaderConfig` and the image-text
    record section.

    Every token of a packed record is an input token (rows of ``S``); records are never split.

    Attributes:
        micro_batch_size: Rows per batch ``B`` (``None`` only through
            :class:`~zephon_loader.integrations.recipe.ZephonVLMDataloaderConfig`, which takes the recipe's
            batch size).
        processor: :class:`ProcessorConfig` or :class:`ProcessorTarget`; ``None``:
            the processor passed to the builder (or the built-in one on the recipe's model folder).
        records: See :class:`RecordsConfig`.
        packing: See :class:`ImagePackingOptions`.
        read_ahead: Default 0 (inline): decoding and processing already run ahead in Zephon's workers
            (``bench_image_loader.py``: 0.94 of the processor alone inline, 0.90 with 2).
        runtime: See :class:`ImageRuntimeConfig`.

    ``xdoc`` continues positions on all three mRoPE axes.
    """

    micro_batch_size: int | None = None
    processor: ProcessorConfig | ProcessorTarget | None = None
    records: RecordsConfig = field(default_factory=RecordsConfig)
    packing: ImagePackingOptions = field(default_factory=ImagePackingOptions)
    read_ahead: int = 0
    runtime: ImageRuntimeConfig = field(default_factory=ImageRuntimeConfig)

    EXAMPLE_CONFIG: ClassVar[str] = "configs/image_demo.yaml"
    YAML_TARGET: ClassVar[str] = "zephon_loader.ZephonVLMDataloaderConfig"

    @classmethod
    def prepare_node(cls, node: dict[str, Any]) -> dict[str, Any]:
        """The ``processor`` node has its own reader (built-in keys or a ``_target_``)."""
        if "processor" in node:
            node = {**node, "processor": processor_from_node(node["processor"], f"{LOADER_SECTION}.processor")}
        return node

    def __post_init__(self) -> None:
        object.__setattr__(self, "processor", processor_from_node(self.processor, f"{LOADER_SECTION}.processor"))
        super().__post_init__()

    def positive_ints(self) -> dict[str, int | None]:
        out = super().positive_ints()
        if isinstance(self.processor, ProcessorConfig):
            out.update({f"processor.{name}": getattr(self.processor, name)
                        for name in ("image_token_alignment", "min_pixels", "max_pixels")})
        return out

    def _check_record_section(self) -> None:
        records = self.records
        for name in ("text_field", "images_field", "image_marker"):
            if not getattr(records, name):
                raise ValueError(f"dataloader.records.{name}: got '', expected a non-empty string")
        if records.text_field == records.images_field:
            raise ValueError(f"dataloader.records.images_field: got {records.images_field!r}, the same as "
                             "text_field; expected two different fields")


def processor_from_node(value: Any, where: str) -> Any:
    """A ``processor`` YAML node as :class:`ProcessorTarget` (it has ``_target_``) or :class:`ProcessorConfig`.

    Instances and ``None`` pass through; anything else is left for the typed
    reader to refuse.

    Raises:
        ValueError / TypeError: An unknown key or a wrong type in a built-in processor node.
    """
    if not isinstance(value, Mapping):
        return value
    if "_target_" in value:
        return ProcessorTarget.from_node(value, where)
    try:
        return from_mapping(ProcessorConfig, value, where)
    except ValueError as error:
        raise ValueError(f"{error} (or name a processor factory with _target_)") from None


def default_image_config_path() -> Path:
    """The bundled image demo YAML (``zephon_loader/data/image_demo.yaml``)."""
    return package_data_dir() / "image_demo.yaml"
