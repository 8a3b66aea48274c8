"""AutoModel 0.7.0's LLM fine-tune recipe on a Zephon dataloader, selected by YAML alone.

Optional (``pip install 'zephon-loader[automodel]'``): ``import zephon_loader``
never imports this module or ``nemo_automodel``. A stock AutoModel LLM YAML
needs two edits::

    recipe: zephon_loader.integrations.automodel.ZephonFinetuneRecipe
    dataloader:
      _target_: zephon_loader.ZephonDataloaderConfig
      sources: [{name: web, path: /data/web, weight: 1.0}]
      tokenizer: {path: /models/tok}      # optional: else the model's tokenizer
      sequence_length: 4096               # micro_batch_size: step_scheduler.local_batch_size
    validation_dataloader:                # optional; validation_dataloader_<name> for more
      _target_: zephon_loader.ZephonDataloaderConfig
      ...

(the stock ``dataset:`` / ``validation_dataset:`` blocks go: the Zephon
blocks name the data), then ``torchrun --nproc-per-node N -m
nemo_automodel.cli.app config.yaml`` as usual: AutoModel's CLI imports the
class the ``recipe:`` line names.

Where the stock recipe refuses (AutoModel 0.7.0, ``recipes/_typed_config.py``):

* ``RecipeConfig.dataloader`` / ``validation_dataloaders`` return ``None`` /
  ``{}`` without a ``dataset`` / ``validation_dataset*`` node, and otherwise
  ``_resolve_dataloader`` raises ``ValueError: Unsupported dataloader _target_
  ... typed recipes use ParallelAwareDataloader`` for any ``dataloader._target_``
  but ``DataLoader`` / ``StatefulDataLoader``;
* ``TrainFinetuneRecipeForNextTokenPrediction.setup`` builds its tokenizer with
  ``_build_tokenizer(self.cfg.model, self.cfg.dataset)``, which needs a
  ``dataset`` node.

``TrainFinetuneRecipeForNextTokenPrediction.__init__`` keeps a config that
already is a ``RecipeConfig``, so the one hook is the config view:
:class:`ZephonRecipeConfig` answers those three attributes for Zephon blocks
and defers to AutoModel for everything else. The recipe body is AutoModel's
own: ``materialize_loader`` builds each loader through
:meth:`~zephon_loader.integrations.recipe.ZephonDataloaderConfig.build`, the step scheduler
iterates it (its ``set_epoch`` reaches the loader through ``loader.sampler``), ``save_checkpoint`` /
``load_checkpoint`` save and restore its state per DP rank, and validation
loaders come from ``replace(config, packing=None)`` (a Zephon validation
loader: every token of every document once, see ``ZephonDataloaderConfig``).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from nemo_automodel.components.config._arg_parser import parse_args_and_load_config
from nemo_automodel.components.config.loader import ConfigNode
from nemo_automodel.recipes._typed_config import RecipeConfig
from nemo_automodel.recipes.llm.train_ft import TrainFinetuneRecipeForNextTokenPrediction

from zephon_loader.integrations.recipe import ZephonDataloaderConfig

__all__ = ["ZephonFinetuneRecipe", "ZephonRecipeConfig", "main"]

#: Prefix of the YAML keys of named validation loaders (``validation_dataloader_<name>``).
VALIDATION_KEY = "validation_dataloader"


def _is_zephon(node: Any) -> bool:
    """Whether a YAML node is a ``_target_: zephon_loader.ZephonDataloaderConfig`` block (resolved by ConfigNode)."""
    target = node.get("_target_", None) if isinstance(node, ConfigNode) else None
    return isinstance(target, type) and issubclass(target, ZephonDataloaderConfig)


def _validation_name(key: str) -> str:
    """``validation_dataloader`` -> ``default``, ``validation_dataloader_<name>`` -> ``<name>`` (AutoModel's rule)."""
    name = key[len(VALIDATION_KEY):]
    if len(name) > 1 and name[0] in ("_", "-", "."):
        name = name[1:]
    return name or "default"


class ZephonRecipeConfig(RecipeConfig):
    """AutoModel's typed recipe config, plus ``dataloader`` blocks that target :class:`ZephonDataloaderConfig`.

    * ``dataloader``: a Zephon block is instantiated (its schema is checked
      now); any other block is AutoModel's. Its ``micro_batch_size`` defaults
      to ``step_scheduler.local_batch_size`` and must equal it: the step
      scheduler counts each yielded batch as one local batch.
    * ``validation_dataloaders``: a Zephon ``validation_dataloader`` block is
      the ``default`` validation loader and each Zephon
      ``validation_dataloader_<name>`` block the loader ``<name>``, so
      ``validation.jsonl`` / ``validation_<name>.jsonl`` are written as
      AutoModel writes them (``micro_batch_size`` defaults to
      ``step_scheduler.local_batch_size``, like AutoModel's validation
      ``batch_size``). Without Zephon blocks: AutoModel's.
    * ``dataset``: what ``_build_tokenizer`` reads. With a Zephon ``dataloader``
      it is ``{tokenizer: {pretrained_model_name_or_path: <its tokenizer.path>}}``,
      or empty when that names none (then AutoModel takes the model's
      tokenizer, and the loader tokenizes with it).

    Raises:
        ValueError: When the config is read: a ``dataset:`` /
            ``validation_dataset*:`` block next to the Zephon block that would
            silently ignore it (they name the data twice), a training
            ``dataloader`` with ``packing: null`` (a validation loader), or a
            ``dataloader.micro_batch_size`` other than the local batch size.
    """

    @property
    def _local_batch_size(self) -> int:
        return self._raw.get("step_scheduler.local_batch_size", 1)  # AutoModel's default

    def _instantiate(self, node: ConfigNode) -> ZephonDataloaderConfig:
        """The Zephon block, ``micro_batch_size`` defaulting to the local batch size."""
        if node.get("micro_batch_size", None) is None:
            return node.instantiate(micro_batch_size=self._local_batch_size)
        return node.instantiate()

    @cached_property
    def dataloader(self) -> Any:
        node = self._raw.get("dataloader", None)
        if not _is_zephon(node):
            return super().dataloader
        if self._raw.get("dataset", None) is not None:
            raise ValueError(
                "dataset: got a dataset block next to dataloader._target_: zephon_loader.ZephonDataloaderConfig, "
                "which reads its data from dataloader.sources (the dataset block would be ignored); remove the "
                "dataset block, and name the tokenizer in dataloader.tokenizer.path (default: the model's)"
            )
        config = self._instantiate(node)
        if config.is_validation:
            raise ValueError(
                "dataloader.packing: got null, which makes a validation loader (one unshuffled pass, the whole set "
                "on every DP rank); expected packing settings for training: omit packing (first_fit) or set "
                "packing.algorithm"
            )
        if config.micro_batch_size != self._local_batch_size:
            raise ValueError(
                f"dataloader.micro_batch_size: got {config.micro_batch_size}, but step_scheduler.local_batch_size is "
                f"{self._local_batch_size}; AutoModel's step scheduler counts each yielded batch as one local batch "
                "(global_batch_size = local_batch_size x DP size x accumulation steps), so they must agree: drop "
                "micro_batch_size (it defaults to local_batch_size) or set both to the same value"
            )
        return config

    @cached_property
    def validation_dataloaders(self) -> dict[str, Any]:
        keys = [key for key in self._raw.to_dict() if key.startswith(VALIDATION_KEY)]
        zephon = [key for key in keys if _is_zephon(self._raw.get(key, None))]
        if not zephon:
            return super().validation_dataloaders
        foreign = [key for key in keys if key not in zephon] + [
            key for key in self._raw.to_dict() if key.startswith("validation_dataset")
        ]
        if foreign:
            raise ValueError(
                f"{foreign[0]}: got an AutoModel validation block next to Zephon validation blocks {zephon}; a "
                f"Zephon '{VALIDATION_KEY}[_<name>]' block names its own data (AutoModel would pair every "
                "validation_dataset with validation_dataloader): give each validation set its own Zephon "
                f"'{VALIDATION_KEY}_<name>' block, or use AutoModel's validation_dataset blocks without Zephon ones"
            )
        return {_validation_name(key): self._instantiate(self._raw.get(key)) for key in zephon}

    @cached_property
    def dataset(self) -> Any:
        if not _is_zephon(self._raw.get("dataloader", None)):
            return self._raw.dataset  # AutoModel's: the raw node
        loader = self.dataloader  # refuses a dataset block
        path = loader.tokenizer.path
        tokenizer = {} if path is None else {
            "tokenizer": {"pretrained_model_name_or_path": str(loader.resolve_path(path))}
        }
        # Missing keys read as None: _build_tokenizer looks up `_target_` on the node.
        return ConfigNode(tokenizer, raise_on_missing_attr=False)


class ZephonFinetuneRecipe(TrainFinetuneRecipeForNextTokenPrediction):
    """``TrainFinetuneRecipeForNextTokenPrediction`` reading its config through :class:`ZephonRecipeConfig`.

    Nothing else is overridden: setup, the training and validation loops,
    checkpointing (the loader's state per DP rank) and resume are AutoModel's.

    Args:
        cfg: The YAML's ``ConfigNode`` (or an AutoModel ``RecipeConfig`` over one).
    """

    def __init__(self, cfg: Any) -> None:
        if not isinstance(cfg, ZephonRecipeConfig):
            cfg = ZephonRecipeConfig(cfg._raw if isinstance(cfg, RecipeConfig) else cfg)
        super().__init__(cfg)


def main(config_path: str | None = None) -> None:
    """``python -m zephon_loader.integrations.automodel -c config.yaml [--key.sub=value ...]`` (what AutoModel's own
    multi-process launcher runs on each worker for this recipe, like ``train_ft.main``)."""
    recipe = ZephonFinetuneRecipe(parse_args_and_load_config(config_path))
    recipe.setup()
    recipe.run_train_validation_loop()


if __name__ == "__main__":
    main()
