"""The AutoModel recipe slot: a config object with ``DataloaderConfig``'s protocol.

AutoModel 0.7.0's LLM recipe (``recipes/llm/train_ft.py``) instantiates the
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
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable

from zephon_loader.build import build_text_loader
from zephon_loader.config import DistributedConfig, PackingOptions, TextLoaderConfig
from zephon_loader.loader import ZephonLoader
from zephon_loader.contract import validate_packing_contract


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
        known = {spec.name for spec in dataclasses.fields(TextLoaderConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"dataloader.{unknown[0]}: unknown key; expected one of {sorted(known)}")
        missing = sorted(name for name in ("sources", "sequence_length", "micro_batch_size") if name not in kwargs)
        if missing:
            raise ValueError(f"dataloader.{missing[0]}: missing; expected it in the dataloader section")
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
            pp_enabled: Pipeline parallelism needs full batches; Zephon always
                drops the final partial batch, so nothing more is needed.
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
        contract = packing_contract
        if contract is not None and self.contract is not None and _is_automodel_default(contract):
            contract = None  # the recipe passed its default, not the model's requirement
        if contract is None and attn_implementation is not None and self.contract is None:
            from zephon_loader.contract import contract_for_attention

            contract = contract_for_attention(attn_implementation)
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
        )


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
