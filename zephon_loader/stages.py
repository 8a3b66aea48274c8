"""A stage per modality: what differs between a text loader and an image-text loader, and nothing else.

:func:`~zephon_loader.build.build_loader` runs the same steps for every kind
of loader (contract → settings → DP → pipeline → nodes → loader); a
:class:`Stage` answers the questions those steps ask of the kind:

==========================  ==============================================  =============================================
step                        :class:`TextStage`                              :class:`ImageStage`
==========================  ==============================================  =============================================
``check_contract``          every mask type                                 every mask type; no model rope in workers
``attention_eligibility``   ``eligibility_field`` is set                    the processor emits eligibility
``prepare``                 save the recipe's tokenizer (when the YAML      load the processor (YAML, object or the
                            names none); Ray for ``runner: ray``            model folder), bind ``get_rope_index``
``build_pipeline``          :func:`~zephon_loader.pipeline.text.            :func:`~zephon_loader.pipeline.image.
                            build_pipeline` (tokenize, pack_flat)           build_image_pipeline` (process, pack_sequences)
``collate``                 :func:`~zephon_loader.collate.text.collate`     :func:`~zephon_loader.collate.image.
                                                                            collate_images`
``fingerprint``             tokenizer files, chat template, label masking   record format, processor, packing
``drop_reasons``            the text checks' reasons                        the image-text operator's reasons
==========================  ==============================================  =============================================

A stage is built per loader and holds what its ``prepare`` loaded.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

from zephon_loader.collate.image import collate_images
from zephon_loader.collate.text import TextCollate
from zephon_loader.config import ImageLoaderConfig, ProcessorConfig, ProcessorTarget, TextLoaderConfig
from zephon_loader.config.reader import instantiate_at, refuse_standard_library_target
from zephon_loader.contract import PackingContract
from zephon_loader.fingerprint import tokenizer_fingerprint
from zephon_loader.loader import ImageLoader, ZephonLoader
from zephon_loader.pipeline.image import build_image_pipeline
from zephon_loader.pipeline.image_records import IMAGE_REASONS
from zephon_loader.pipeline.ray_runner import RayLease
from zephon_loader.pipeline.ray_runner import acquire as acquire_ray
from zephon_loader.pipeline.records import LONGER_THAN_ROW
from zephon_loader.pipeline.text import DataParallel, PreparedTokenizer, build_pipeline
from zephon_loader.pipeline.work_source import OpenedSources
from zephon_loader.workdirs import make_work_dir

__all__ = ["ImageStage", "Stage", "TextStage", "resolve_processor"]

class Stage(Protocol):
    """What :func:`~zephon_loader.build.build_loader` asks of a kind of loader (see the module docstring)."""

    #: Prefix of the loader's work folder in the temp dir (drop log).
    work_prefix: str
    #: The loader class this kind builds (a caller's ``loader_class`` must subclass it).
    loader_class: type[ZephonLoader]
    #: The shard files every epoch reads: opened by the first ``build_pipeline`` (fixed at the build).
    sources: OpenedSources | None

    def loader_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :attr:`loader_class` beyond :class:`~zephon_loader.loader.ZephonLoader`'s."""

    @property
    def micro_batch_size(self) -> int:
        """``B``."""

    @property
    def attention_eligibility(self) -> bool:
        """Whether records carry per-token eligibility (known from the config, or once ``prepare`` ran)."""

    def check_contract(self, contract: PackingContract) -> None:
        """Refuse a contract this kind cannot serve (before anything loads)."""

    def prepare(self, owned: list[str]) -> None:
        """Load what the pipeline needs (tokenizer folder, processor); folders it creates go to ``owned``."""

    def release(self) -> None:
        """Let go of what ``prepare`` holds beyond folders (the Ray instance of ``runner: ray``); once, at close."""

    def build_pipeline(self, *, work_dir: str, dp: DataParallel, seed: int | None = None,
                       run_id_suffix: str = "", weights: Mapping[str, float] | None = None) -> Any:
        """The kind's built Zephon pipeline (``.pipeline``, ``.shards``, ``.drop_log``); ``weights``: a mixture
        schedule phase's weights instead of the sources'."""

    def collate(self, built: Any) -> Callable[[Any], dict[str, Any]]:
        """``zephon SampleBatch -> TrainingBatch`` for batches of ``built``."""

    def fingerprint(self, built: Any) -> dict[str, Any]:
        """The kind's part of the stream fingerprint (JSON)."""

    def drop_reasons(self) -> dict[str, str] | None:
        """Why a record is left out, for ``loader.stats()`` (``None``: the text checks' reasons)."""


class TextStage:
    """Text, chat or pretokenized records: checked, tokenized by Zephon, packed with ``pack_flat(S + 1)``.

    Args:
        cfg: The validated config.
        tokenizer: The recipe's tokenizer, used when the YAML names none.
    """

    work_prefix = "zephon_loader_pipeline_"
    loader_class = ZephonLoader

    def __init__(self, cfg: TextLoaderConfig, tokenizer: Any = None) -> None:
        self.cfg = cfg
        self._recipe_tokenizer = tokenizer
        self._tokenizer_dir: str | None = None
        self.sources: OpenedSources | None = None  # the shard files, opened by the first build_pipeline()
        # The tokenizer loaded and saved by the first build_pipeline(): an epoch's rebuild reuses it.
        self._prepared: PreparedTokenizer | None = None
        self._ray: RayLease | None = None

    @property
    def micro_batch_size(self) -> int:
        return self.cfg.micro_batch_size

    @property
    def attention_eligibility(self) -> bool:
        return self.cfg.eligibility_field is not None

    def check_contract(self, contract: PackingContract) -> None:
        """Every contract serves text (the checks live in the final-map settings)."""

    def prepare(self, owned: list[str]) -> None:
        cfg = self.cfg
        if cfg.tokenizer.path is None and cfg.input_mode != "pretokenized" and self._recipe_tokenizer is not None:
            self._tokenizer_dir = _save_recipe_tokenizer(self._recipe_tokenizer)
            owned.append(self._tokenizer_dir)
        if cfg.runtime.runner == "ray":
            self._ray = acquire_ray()  # the process's Ray, or a local instance released with the loader

    def release(self) -> None:
        lease, self._ray = self._ray, None
        if lease is not None:
            lease.release()

    def close_first(self, close: Callable[[], Any]) -> None:
        """``runner: ray``: at exit, ``close`` (the loader's finalizer) runs before Ray shuts down."""
        if self._ray is not None:
            self._ray.close_first(close)

    def build_pipeline(self, *, work_dir: str, dp: DataParallel, seed: int | None = None,
                       run_id_suffix: str = "", weights: Mapping[str, float] | None = None) -> Any:
        cfg = self.cfg.with_weights(weights) if weights is not None else self.cfg
        built = build_pipeline(cfg, work_dir=work_dir, tokenizer_dir=self._tokenizer_dir, dp=dp, seed=seed,
                               run_id_suffix=run_id_suffix, sources=self.sources, prepared=self._prepared)
        self.sources = built.sources  # opened by the first build; every epoch's reads the same files
        self._prepared = built.prepared  # loaded and saved by the first build; every epoch's uses the same
        return built

    def collate(self, built: Any) -> Callable[[Any], dict[str, Any]]:
        cfg = self.cfg
        return TextCollate(  # its fixed arguments checked here, once
            mask_cross_document_labels=cfg.labels_mask_cross_document,
            eos_mask_loss=cfg.eos_mask_loss,
            eos_token_id=cfg.eos_token_id,
            eligibility=cfg.eligibility_field is not None,
            physical_cu_seqlens=False,  # the final map never yields them
            # Zephon delivers the short batch of each flush and of the end of the stream: pad it to B rows.
            micro_batch_size=cfg.micro_batch_size,
            pad_token_id=built.pad_token_id,
        )

    def fingerprint(self, built: Any) -> dict[str, Any]:
        cfg, tok = self.cfg, self.cfg.tokenizer
        return {
            "tokenizer": [tok.text_field, tok.pretokenized_field, tok.chat_field, tok.special_tokens],
            "tokenizer_files": tokenizer_fingerprint(str(built.tokenizer_dir) if built.tokenizer_dir else None),
            "chat_template": [tok.chat_template, tok.chat_loss_scope],
            "records": [cfg.on_bad_record, cfg.max_record_tokens, cfg.max_record_bytes],
            "packing": [cfg.packing.algorithm, cfg.packing.num_bins, built.pad_token_id],
            "eligibility_field": cfg.eligibility_field,
            "label_masking": [cfg.labels_mask_cross_document, cfg.eos_mask_loss, cfg.eos_token_id],
            # Context-parallel padding changes what is packed where (absent at 1: states of earlier versions load).
            **({"contract.cp_size": cfg.cp_multiple // 2} if cfg.cp_multiple else {}),
            # Only when the default flush window was shortened: states of the unshortened stream still load.
            **({"flush_window": built.flush_window} if built.flush_window is not None else {}),
        }

    def drop_reasons(self) -> dict[str, str] | None:
        return None

    def loader_kwargs(self) -> dict[str, Any]:
        return {}


class ImageStage:
    """Image-text records: decoded and processed in Zephon's workers, packed whole with ``pack_sequences(S)``.

    Args:
        cfg: The validated config.
        processor: A record processor object; ``None``: the YAML's ``processor``.
        get_rope_index: The model's ``get_rope_index`` (every record's positions come from it).
        micro_batch_size: ``B`` when the YAML leaves it unset (the recipe's batch size); both given must agree.
        model_path: The recipe's model folder: the built-in processor's folder when the YAML names none.

    Raises:
        ValueError: ``B`` missing or disagreeing; ``runner: process`` with a model ``get_rope_index``.
    """

    work_prefix = "zephon_loader_image_pipeline_"
    loader_class = ImageLoader

    def __init__(self, cfg: ImageLoaderConfig, *, processor: Any = None,
                 get_rope_index: Callable[..., Any] | None = None, micro_batch_size: int | None = None,
                 model_path: str | None = None) -> None:
        self.cfg = cfg
        self._rows = _micro_batch_size(cfg, micro_batch_size)
        self._processor_arg = processor
        self._get_rope_index = get_rope_index
        self._model_path = model_path
        self.processor: Any = None
        self.sources: OpenedSources | None = None  # the shard files, opened by the first build_pipeline()

    @property
    def micro_batch_size(self) -> int:
        return self._rows

    @property
    def attention_eligibility(self) -> bool:
        return bool(self.processor.attention_eligibility) if self.processor is not None else False

    def check_contract(self, contract: PackingContract) -> None:
        """Every mask type serves image-text batches (``position_ids``: text positions before the mRoPE axes);
        a model ``get_rope_index`` cannot travel to worker processes."""
        if self._get_rope_index is not None and self.cfg.runtime.runner == "process":
            raise ValueError(
                "dataloader.runtime.runner: got 'process' with a model get_rope_index, expected 'threads' (or "
                "'auto'): worker processes would each receive a pickled copy of the model"
            )

    def prepare(self, owned: list[str]) -> None:
        self.processor = resolve_processor(self.cfg, self._processor_arg, self._get_rope_index, self._model_path)

    def release(self) -> None:
        """Nothing beyond folders."""

    def build_pipeline(self, *, work_dir: str, dp: DataParallel, seed: int | None = None,
                       run_id_suffix: str = "", weights: Mapping[str, float] | None = None) -> Any:
        cfg = self.cfg.with_weights(weights) if weights is not None else self.cfg
        built = build_image_pipeline(cfg, processor=self.processor, micro_batch_size=self._rows,
                                     work_dir=work_dir, dp=dp, seed=seed, run_id_suffix=run_id_suffix,
                                     sources=self.sources)
        self.sources = built.sources  # opened by the first build; every epoch's reads the same files
        return built

    def collate(self, built: Any) -> Callable[[Any], dict[str, Any]]:
        return partial(
            collate_images,
            sequence_length=self.cfg.sequence_length,
            micro_batch_size=self._rows,
            pad_token_id=int(self.processor.pad_token_id),
            mask_cross_document_labels=self.cfg.labels_mask_cross_document,
            eligibility=self.attention_eligibility,
        )

    def fingerprint(self, built: Any) -> dict[str, Any]:
        cfg, records = self.cfg, self.cfg.records
        return {
            "kind": "image",
            "records": [records.text_field, records.images_field, records.image_marker, cfg.on_bad_record,
                        cfg.max_record_tokens],
            "processor": processor_fingerprint(cfg, self.processor),
            "get_rope_index": self._get_rope_index is not None,
            "packing": [cfg.packing.algorithm, cfg.packing.num_bins, cfg.packing.oversized],
            "label_masking": cfg.labels_mask_cross_document,
        }

    def drop_reasons(self) -> dict[str, str] | None:
        return {**IMAGE_REASONS,
                LONGER_THAN_ROW: "longer than a row: image-text records are never split (packing.oversized)"}

    def loader_kwargs(self) -> dict[str, Any]:
        return {"processor": self.processor}


# ----------------------------------------------------------------------------- text: the recipe's tokenizer


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
    folder = make_work_dir("zephon_loader_tokenizer_")  # swept at the next build if this process dies
    tokenizer.save_pretrained(folder)
    return folder


# ----------------------------------------------------------------------------- image: the processor


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
        refuse_standard_library_target(node.node(), "dataloader.processor")  # by name, before any import
        return instantiate_at(node.node(), "dataloader.processor")  # by what each target is, before any call
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
