"""The AutoModel recipe slots: config objects with ``DataloaderConfig``'s (LLM) and ``VlmDataloaderConfig``'s (VLM)
protocols.

**LLM.** AutoModel 0.7.0's LLM recipe (``recipes/llm/train_ft.py``) instantiates the
YAML ``dataloader`` block, reads ``seed``, ``dataset_builds_on_all_ranks``,
``emits_thd`` and ``packing`` from it, then calls ``build(dp_rank=...,
dp_world_size=..., pp_enabled=..., tokenizer=..., dataset_build_context=...,
supports_seq_lens=..., cp_size=..., packing_contract=..., collate_wrapper=...)``
and iterates the result, saving its ``state_dict()`` per DP rank with the model
checkpoint. :class:`ZephonDataloaderConfig` answers all of that::

    dataloader:
      _target_: zephon_loader.ZephonDataloaderConfig
      sources: [{name: web, path: /data/web, weight: 1.0}]
      sequence_length: 4096
      micro_batch_size: 8
      ...            # every key of zephon_loader.config.TextLoaderConfig

AutoModel 0.7.0's ``DataloaderConfig`` refuses other ``dataloader._target_``
values, so a recipe must hold this object where it held ``DataloaderConfig``:
:class:`zephon_loader.integrations.automodel.ZephonFinetuneRecipe` is AutoModel's LLM recipe
doing that (``recipe: zephon_loader.integrations.automodel.ZephonFinetuneRecipe``).

Validation: AutoModel builds validation loaders from
``dataclasses.replace(config, packing=None)`` (``_should_pack_validation``).
Such a copy (or a YAML ``packing: null``) is a *validation loader*: one
unshuffled pass, ``wrap`` packing, so every token of every document is
delivered exactly once (documents longer than a row are split across rows,
never skipped; ``loader.stats()`` shows every record delivered and nothing
dropped), read whole on every DP rank.

**VLM.** AutoModel 0.7.0's VLM recipe (``recipes/vlm/finetune.py``, ``setup``) reads
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

from torchdata.stateful_dataloader import StatefulDataLoader

from zephon_loader.build import build_image_loader, build_text_loader
from zephon_loader.config import (
    DistributedConfig,
    ImageLoaderConfig,
    PackingOptions,
    ProcessorConfig,
    ProcessorTarget,
    TextLoaderConfig,
)
from zephon_loader.contract import contract_for_attention, validate_packing_contract
from zephon_loader.loader import ImageLoader, ZephonLoader

__all__ = ["ImageLoaderBuild", "RecipeImageLoader", "RecipeLoader", "ZephonDataloaderConfig", "ZephonVLMDataloaderConfig"]


class RecipeLoader(ZephonLoader, StatefulDataLoader):
    """The :class:`~zephon_loader.loader.ZephonLoader` an AutoModel recipe holds: also a torchdata
    ``StatefulDataLoader``, because AutoModel 0.7.0 saves a dataloader's state per DP rank only when
    ``is_dataloader`` (an ``isinstance`` check) accepts it. None of the ``DataLoader`` machinery runs: every
    method is the ``ZephonLoader``'s."""


class RecipeImageLoader(ImageLoader, StatefulDataLoader):
    """:class:`RecipeLoader` for image-text batches (AutoModel's VLM recipe)."""


@dataclass(frozen=True, init=False)
class ZephonDataloaderConfig(TextLoaderConfig):
    """Typed loader settings plus AutoModel's ``DataloaderConfig`` protocol.

    It *is* a :class:`~zephon_loader.config.TextLoaderConfig` (a frozen
    dataclass), so AutoModel's ``dataclasses.replace(config, packing=None)``
    (how it asks for an unpacked validation loader) works. ``packing=None``
    makes a validation loader (Zephon's loader only produces packed rows):

    * finite and deterministic: one pass per ``iter()``, ``shuffle`` off, the
      same batches on every pass;
    * every token of every document exactly once: ``wrap`` packing splits
      documents longer than a row across consecutive rows instead of skipping
      them, and ``mixture: once`` reads every record of every source exactly
      once (the weights only interleave the sources; none repeats). A row holds ``S + 1`` tokens: its ``input_ids``
      and the target of its last label. Rows do not overlap, so the loss
      covers every token but each document's first and the first of each row
      that continues a split document (only an input there, with no context
      from the previous row);
    * read whole on every DP rank (lanes would give ranks different batch
      counts, and the model's forward is a collective under FSDP/DDP): the
      recipe's all-reduced validation loss is the whole set's at any DP size.
      The ``distributed`` settings do not apply to it.

    ``loader.stats()`` of a validation loader shows every record delivered
    once per pass (``documents`` equal to the source's records, ``tokens`` to
    its tokens) and ``dropped`` empty.

    Args:
        **kwargs: The keys of :class:`~zephon_loader.config.TextLoaderConfig`
            (validated now: unknown keys and wrong types raise here, before any
            worker starts).

    Raises:
        ValueError: Unknown or missing keys, or values the schema refuses.
    """

    def __init__(self, **kwargs: Any) -> None:
        _check_keys(TextLoaderConfig, kwargs, ("sources", "sequence_length", "micro_batch_size"))
        validation = "packing" in kwargs and kwargs["packing"] is None
        if validation:
            kwargs = {name: value for name, value in kwargs.items() if name != "packing"}
        object.__setattr__(self, "_validation", validation)
        super().__init__(**kwargs)

    @property
    def is_validation(self) -> bool:
        """Whether this is a validation loader (built from ``packing=None``; see the class docstring)."""
        return self._validation

    # -- what the recipe reads ------------------------------------------------------------
    @property
    def dataset_builds_on_all_ranks(self) -> bool:
        """True: every rank builds its own Zephon pipeline (its DP lane), with no rank-zero-first ordering."""
        return True

    @property
    def emits_thd(self) -> bool:
        """Whether batches carry TE THD fields (``contract.qkv_format == "thd"``)."""
        return validate_packing_contract(self.packing_contract())[2] == "thd"

    # -- the call the recipe makes --------------------------------------------------------
    def build(
        self,
        *,
        dp_rank: int,
        dp_world_size: int,
        pp_enabled: bool = False,
        tokenizer: Any = None,
        dataset_build_context: AbstractContextManager[object] | None = None,
        supports_seq_lens: bool = True,
        cp_size: int = 1,
        attn_implementation: str | None = None,
        packing_contract: object | None = None,
        collate_wrapper: Callable | None = None,
    ) -> ZephonLoader:
        """Build this rank's loader.

        Args:
            dp_rank, dp_world_size: Data-parallel coordinates → Zephon's DP
                lane. When they are ``torch.distributed``'s default group
                (plain data parallelism), the loader takes them from it, so
                ``distributed.aggregate_store`` defaults to ``torch://`` (see
                ``build_text_loader``). A validation loader ignores them: every
                rank reads it whole.
            pp_enabled: Pipeline parallelism needs full batches; every batch has
                ``micro_batch_size`` rows (the short last batch of a pass is
                completed with all-padding rows), so nothing more is needed.
            tokenizer: Used when the YAML names no tokenizer path.
            dataset_build_context: Entered while the pipeline is built.
            supports_seq_lens: Whether the model accepts THD ``seq_lens``; a THD
                contract for a model that does not is refused.
            cp_size: Context-parallel size. TE THD with ``cp_size > 1`` needs
                every document padded to a multiple of ``2 * cp_size``, which
                Zephon's ``pack_flat`` does not produce: refused.
            attn_implementation: Deprecated in AutoModel; when given and the
                recipe passes no contract, mapped like AutoModel does.
            packing_contract: The model's contract. AutoModel passes its
                default (block-causal) when the recipe has no neat packing; the
                YAML's ``contract`` is then used. Otherwise the two must agree.
            collate_wrapper: Applied to every yielded batch.

        Raises:
            ValueError/TypeError: Before any worker starts.
        """
        contract = _recipe_contract(self.contract, packing_contract, attn_implementation)
        effective = contract if contract is not None else self.packing_contract()
        qkv_format = validate_packing_contract(effective)[2]
        if qkv_format == "thd" and not supports_seq_lens:
            raise ValueError(
                "dataloader.contract.qkv_format: 'thd' yields seq_lens/seq_lens_padded, but the model's forward "
                "does not accept seq_lens (supports_seq_lens=False); use qkv_format 'bshd'"
            )
        if qkv_format == "thd" and cp_size > 1:
            raise ValueError(
                f"cp_size: got {cp_size} with qkv_format 'thd'; TE context parallelism needs each document padded "
                f"to a multiple of 2 * cp_size = {2 * cp_size}, which Zephon's pack_flat does not produce; use "
                "cp_size 1 or a 'bshd' contract (document_ids + metadata)"
            )
        config: TextLoaderConfig = self
        coordinates: tuple[int | None, int | None] = (dp_rank, dp_world_size)
        if self._validation:
            # One unshuffled pass of wrap-packed rows, the whole set on every rank (see the class docstring).
            config = dataclasses.replace(
                self, packing=PackingOptions(algorithm="wrap"), shuffle=False, mixture="once",
                distributed=DistributedConfig(),
            )
            coordinates = (0, 1)
        elif _is_default_group(dp_rank, dp_world_size):
            coordinates = (None, None)  # build_text_loader takes them from the group, with its torch:// store
        return build_text_loader(
            config,
            packing_contract=contract,
            tokenizer=tokenizer,
            dp_rank=coordinates[0],
            dp_world_size=coordinates[1],
            collate_wrapper=collate_wrapper,
            dataset_build_context=dataset_build_context,
            loader_class=RecipeLoader,
        )


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
        _check_keys(ImageLoaderConfig, kwargs, ("sources", "sequence_length"))
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
        contract = _recipe_contract(self.contract, packing_contract, packing_attn_implementation,
                                    attention_names_the_model=True)
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
            loader_class=RecipeImageLoader,
        )
        return ImageLoaderBuild(dataloader=loader, processor=loader.processor)


def _is_default_group(dp_rank: int, dp_world_size: int) -> bool:
    """Whether ``(dp_rank, dp_world_size)`` are this process's rank and size in torch.distributed's default group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    return (dp_rank, dp_world_size) == (dist.get_rank(), dist.get_world_size())


def _is_automodel_default(contract: object) -> bool:
    """Whether ``contract`` is AutoModel's (or our) default-contract object, i.e. "no model requirement"."""
    from zephon_loader.contract import DEFAULT_PACKED_SEQUENCE_CONTRACT as ours

    if contract is ours:
        return True
    try:
        from nemo_automodel.components.datasets.packing import DEFAULT_PACKED_SEQUENCE_CONTRACT
    except ImportError:
        return False
    return contract is DEFAULT_PACKED_SEQUENCE_CONTRACT


def _check_keys(schema: type, kwargs: dict[str, Any], required: tuple[str, ...]) -> None:
    """Refuse keys ``schema`` does not have and missing required ones, as the YAML reader does."""
    known = {spec.name for spec in dataclasses.fields(schema)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"dataloader.{unknown[0]}: unknown key; expected one of {sorted(known)}")
    missing = sorted(name for name in required if name not in kwargs)
    if missing:
        raise ValueError(f"dataloader.{missing[0]}: missing; expected it in the dataloader section")


def _recipe_contract(
    configured: object | None, packing_contract: object | None, attn_implementation: str | None,
    *, attention_names_the_model: bool = False,
) -> object | None:
    """The contract the recipe's arguments ask for; ``None``: the YAML's ``contract`` (or the default).

    AutoModel passes its default contract object when the recipe has no packing requirement: with a YAML
    ``contract`` (or, where ``attention_names_the_model``, an attention name) that object means "no model
    requirement". A deprecated attention name is mapped like AutoModel does when nothing else is given.
    """
    contract = packing_contract
    overrides_default = configured is not None or (attention_names_the_model and attn_implementation is not None)
    if contract is not None and overrides_default and _is_automodel_default(contract):
        contract = None  # the recipe passed its default, not the model's requirement
    if contract is None and attn_implementation is not None and configured is None:
        contract = contract_for_attention(attn_implementation)
    return contract
