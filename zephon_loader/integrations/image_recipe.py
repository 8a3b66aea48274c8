"""The AutoModel VLM recipe slot: a config object with ``VlmDataloaderConfig``'s protocol.

AutoModel 0.7.0's VLM recipe (``recipes/vlm/finetune.py``, ``setup``) reads
``packing`` from its dataloader config (a ``packing_format`` other than
``"thd"`` makes it ask the model for its packing contract), then calls::

    build(pretrained_model_name_or_path=, dp_rank=, dp_world_size=, batch_size=,
          dataset_build_context=, get_rope_index=, packing_contract=,
          pp_n_microbatches=, cp_size=)

and keeps ``.dataloader`` (iterated; its state saved per DP rank) and
``.processor`` of the result. :class:`ZephonVLMDataloaderConfig` answers that::

    dataloader:
      _target_: zephon_loader.ZephonVLMDataloaderConfig
      sources: [{name: captions, path: /data/captions}]
      processor: {path: /models/qwen2-vl-processor}    # or omit: the model folder
      sequence_length: 4096
      ...              # every key of zephon_loader.config.image.ImageLoaderConfig

0.7.0's ``RecipeConfig.resolve_vlm_dataloader`` refuses a foreign
``dataloader._target_``, so a recipe must hold this object where it held
``VlmDataloaderConfig`` (as with the text slot).
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from zephon_loader.build_image import ImageLoader, build_image_loader
from zephon_loader.config.image import ImageLoaderConfig, ProcessorConfig, ProcessorTarget
from zephon_loader.integrations.recipe import _is_automodel_default

__all__ = ["ImageLoaderBuild", "ZephonVLMDataloaderConfig"]


@dataclass(frozen=True)
class ImageLoaderBuild:
    """What :meth:`ZephonVLMDataloaderConfig.build` returns (AutoModel's ``VlmDataloaderBuild`` shape).

    Attributes:
        dataloader: This rank's loader.
        processor: The record processor it runs (``dataloader.processor``); it
            has ``tokenizer`` (the recipe reads ``processor.tokenizer.pad_token_id``).
    """

    dataloader: ImageLoader
    processor: Any


@dataclass(frozen=True, init=False)
class ZephonVLMDataloaderConfig(ImageLoaderConfig):
    """Typed image loader settings plus AutoModel's VLM dataloader protocol.

    It *is* an :class:`~zephon_loader.config.image.ImageLoaderConfig`.
    ``micro_batch_size`` may be left out: the recipe's ``batch_size`` is used.
    A ``processor`` node with ``_target_`` arrives already instantiated when
    AutoModel's ``ConfigNode`` builds this object (it instantiates nested
    targets first); that processor object is used as is.

    Args:
        **kwargs: The keys of :class:`~zephon_loader.config.image.ImageLoaderConfig`
            (validated now, before any worker starts).
    """

    def __init__(self, **kwargs: Any) -> None:
        known = {spec.name for spec in dataclasses.fields(ImageLoaderConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"dataloader.{unknown[0]}: unknown key; expected one of {sorted(known)}")
        missing = sorted(name for name in ("sources", "sequence_length") if name not in kwargs)
        if missing:
            raise ValueError(f"dataloader.{missing[0]}: missing; expected it in the dataloader section")
        processor = kwargs.get("processor")
        instance = None
        if processor is not None and not isinstance(processor, (dict, ProcessorConfig, ProcessorTarget)) \
                and callable(processor):
            instance, kwargs = processor, {k: v for k, v in kwargs.items() if k != "processor"}
        object.__setattr__(self, "_processor_instance", instance)
        super().__init__(**kwargs)

    def build(
        self,
        *,
        pretrained_model_name_or_path: str | None = None,
        dp_rank: int,
        dp_world_size: int,
        batch_size: int,
        dataset_build_context: AbstractContextManager[object] | None = None,
        get_rope_index: Callable[..., Any] | None = None,
        packing_attn_implementation: str | None = None,
        packing_contract: object | None = None,
        pp_n_microbatches: int | None = None,
        cp_size: int = 1,
    ) -> ImageLoaderBuild:
        """Build this rank's loader and return it with its processor.

        Args:
            pretrained_model_name_or_path: The model; its folder is the built-in
                processor's when the YAML names no ``processor.path`` (a hub id is refused).
            dp_rank, dp_world_size: Data-parallel coordinates → Zephon's DP lane.
            batch_size: The recipe's local batch size: ``B`` (must equal a YAML ``micro_batch_size``).
            dataset_build_context: Entered while the processor and pipeline are built.
            get_rope_index: The model's ``get_rope_index``: every record's positions come from it.
            packing_attn_implementation: Deprecated in AutoModel; mapped to a
                contract like AutoModel does when no other contract is given.
            packing_contract: The model's contract. AutoModel's default object
                means "no model requirement": the YAML's ``contract`` then wins.
            pp_n_microbatches: Pipeline parallelism: media is pre-chunked per
                microbatch with AutoModel's ``wrap_vlm_collate_for_pp``.
            cp_size: Context-parallel size; only 1 is supported.

        Raises:
            ValueError/TypeError/ImportError: Before any worker starts.
        """
        if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size != 1:
            raise ValueError(
                f"cp_size: got {cp_size!r}, expected 1: context-parallel sharding of packed image-text rows "
                "([3, B, S] mRoPE positions, media per row) is not supported by this loader; use cp_size 1"
            )
        contract = packing_contract
        if contract is not None and (self.contract is not None or packing_attn_implementation is not None) \
                and _is_automodel_default(contract):
            contract = None  # the recipe passed its default, not the model's requirement
        if contract is None and packing_attn_implementation is not None and self.contract is None:
            from zephon_loader.contract import contract_for_attention

            contract = contract_for_attention(packing_attn_implementation)
        wrapper = None
        if pp_n_microbatches is not None:
            try:
                from nemo_automodel.components.datasets.vlm.pp_media import wrap_vlm_collate_for_pp
            except ImportError as error:
                raise ImportError("pp_n_microbatches: pipeline-parallel media chunking uses nemo_automodel's "
                                  "wrap_vlm_collate_for_pp; install nemo-automodel") from error
            wrapper = partial(wrap_vlm_collate_for_pp, n_microbatches=pp_n_microbatches)
        loader = build_image_loader(
            self,
            packing_contract=contract,
            processor=self._processor_instance,
            get_rope_index=get_rope_index,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            collate_wrapper=wrapper,
            dataset_build_context=dataset_build_context,
            micro_batch_size=batch_size,
            model_path=pretrained_model_name_or_path,
        )
        return ImageLoaderBuild(dataloader=loader, processor=loader.processor)
