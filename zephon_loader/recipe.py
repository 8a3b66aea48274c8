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
values, so a recipe must hold this object where it held ``DataloaderConfig``.
"""

from __future__ import annotations

import dataclasses
import warnings
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable

from zephon_loader.builders import build_text_loader
from zephon_loader.config import PackingOptions, TextLoaderConfig
from zephon_loader.loader import ZephonLoader
from zephon_loader.packing import validate_packing_contract


@dataclass(frozen=True, init=False)
class ZephonDataloaderConfig(TextLoaderConfig):
    """Typed loader settings plus AutoModel's ``DataloaderConfig`` protocol.

    It *is* a :class:`~zephon_loader.config.TextLoaderConfig` (a frozen
    dataclass), so AutoModel's ``dataclasses.replace(config, packing=None)``
    (used for validation loaders) works; such a copy still packs (Zephon's
    loader only produces packed batches) and warns when built.

    Args:
        **kwargs: The keys of :class:`~zephon_loader.config.TextLoaderConfig`
            (validated now: unknown keys and wrong types raise here, before any
            worker starts).
    """

    def __init__(self, **kwargs: Any) -> None:
        known = {spec.name for spec in dataclasses.fields(TextLoaderConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"dataloader.{unknown[0]}: unknown key; expected one of {sorted(known)}")
        missing = sorted(name for name in ("sources", "sequence_length", "micro_batch_size") if name not in kwargs)
        if missing:
            raise ValueError(f"dataloader.{missing[0]}: missing; expected it in the dataloader section")
        unpacked = "packing" in kwargs and kwargs["packing"] is None
        if unpacked:
            kwargs = {name: value for name, value in kwargs.items() if name != "packing"}
        object.__setattr__(self, "_unpacked_request", unpacked)
        super().__init__(**kwargs)

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
            dp_rank, dp_world_size: Data-parallel coordinates → Zephon's DP lane.
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
            from zephon_loader.packing import contract_for_attention

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
        if self._unpacked_request:
            warnings.warn(
                "zephon_loader: the recipe asked for an unpacked loader (packing=None, e.g. for validation); "
                f"Zephon's loader always packs, so it is built with packing {PackingOptions()}",
                stacklevel=2,
            )
        return build_text_loader(
            self,
            packing_contract=contract,
            tokenizer=tokenizer,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
            collate_wrapper=collate_wrapper,
            dataset_build_context=dataset_build_context,
        )


def _is_automodel_default(contract: object) -> bool:
    """Whether ``contract`` is AutoModel's (or our) default-contract object, i.e. "no model requirement"."""
    from zephon_loader.packing import DEFAULT_PACKED_SEQUENCE_CONTRACT as ours

    if contract is ours:
        return True
    try:
        from nemo_automodel.components.datasets.packing import DEFAULT_PACKED_SEQUENCE_CONTRACT
    except ImportError:
        return False
    return contract is DEFAULT_PACKED_SEQUENCE_CONTRACT
