"""The AutoModel 0.7.0 VLM recipe slot: ``ZephonVLMDataloaderConfig`` driven exactly as ``recipes/vlm/finetune.py`` does.

The keyword set of ``build`` and the attributes the recipe reads are parsed
from the installed recipe's source (it cannot be imported without CUDA
extras); the YAML goes through AutoModel's ``ConfigNode``; the contract is
AutoModel's ``PackingCapabilities``; ``get_rope_index`` is a tiny local
Qwen2-VL's; states go through ``torch.save`` and AutoModel's ``load_torch_ckpt``.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("nemo_automodel.components.config.loader",
                    reason="nemo-automodel==0.7.0 is not importable: pip install --no-deps nemo-automodel==0.7.0")
from nemo_automodel.components.checkpoint.checkpointing import load_torch_ckpt  # noqa: E402
from nemo_automodel.components.config.loader import ConfigNode  # noqa: E402
from nemo_automodel.components.datasets.packing import DEFAULT_PACKED_SEQUENCE_CONTRACT  # noqa: E402
from nemo_automodel.components.models.common.packing import PackingCapabilities  # noqa: E402

from conftest import collect  # noqa: E402
from image_data import LAYOUTS, PROCESSOR_DIR, make_record, tiny_qwen2_vl, write_jsonl_images  # noqa: E402
from zephon_loader import ImageLoader, ZephonVLMDataloaderConfig  # noqa: E402
from zephon_loader import fields as F  # noqa: E402
from zephon_loader.processors import Qwen2VLRecordProcessor  # noqa: E402

pytestmark = pytest.mark.automodel


def _load_pp_media():
    """AutoModel's ``vlm/pp_media.py`` (torch only). Its package ``__init__`` imports Hugging Face ``datasets``,
    which the ``--no-deps`` test install lacks; registering the module lets ``zephon_loader.integrations.recipe``
    import it the way it does inside a full AutoModel install."""
    import sys

    name = "nemo_automodel.components.datasets.vlm.pp_media"
    if name not in sys.modules:
        try:
            importlib.import_module(name)
        except ImportError:
            root = Path(importlib.util.find_spec("nemo_automodel").origin).parent
            spec = importlib.util.spec_from_file_location(name, root / "components/datasets/vlm/pp_media.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[name] = module
    return sys.modules[name]


VLM_PP_MEDIA_KEY = _load_pp_media().VLM_PP_MEDIA_KEY

#: What ``setup`` in AutoModel 0.7.0's ``recipes/vlm/finetune.py`` passes to ``dataloader_config.build``.
RECIPE_KEYWORDS = {
    "pretrained_model_name_or_path", "dp_rank", "dp_world_size", "batch_size", "dataset_build_context",
    "get_rope_index", "packing_contract", "pp_n_microbatches", "cp_size",
}
TARGET = "zephon_loader.ZephonVLMDataloaderConfig"
FA4_MODEL = PackingCapabilities("document_ids", True, uses_native_fa4=True)


def _finetune_setup() -> ast.FunctionDef:
    spec = importlib.util.find_spec("nemo_automodel")
    tree = ast.parse((Path(spec.origin).parent / "recipes" / "vlm" / "finetune.py").read_text())
    (setup,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "setup"]
    return setup


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    rng = random.Random(8)
    records = [make_record(rng, i, LAYOUTS[i % len(LAYOUTS)]) for i in range(16)]
    return write_jsonl_images(tmp_path_factory.mktemp("recipe_source"), records)


@pytest.fixture(scope="module")
def model():
    return tiny_qwen2_vl(Qwen2VLRecordProcessor(PROCESSOR_DIR))


def recipe_yaml(source, **overrides) -> dict:
    block = {
        "_target_": TARGET,
        "sources": [{"name": "captions", "path": str(source), "weight": 1.0}],
        "processor": {"path": str(PROCESSOR_DIR)},
        "sequence_length": 128,
        "seed": 5,
        "runtime": {"runner": "threads"},
    }
    block.update(overrides)
    return {"seed": 42, "model": {"pretrained_model_name_or_path": str(PROCESSOR_DIR)}, "dataloader": block}


def instantiate(source, **overrides) -> ZephonVLMDataloaderConfig:
    return ConfigNode(recipe_yaml(source, **overrides)).dataloader.instantiate()


def recipe_build(config, model, **overrides):
    """``setup`` of AutoModel 0.7.0's VLM recipe: single rank, no PP, no CP."""
    kwargs = {
        "pretrained_model_name_or_path": str(PROCESSOR_DIR),
        "dp_rank": 0,
        "dp_world_size": 1,
        "batch_size": 2,
        "dataset_build_context": contextlib.nullcontext(),
        "get_rope_index": model.model.get_rope_index,
        "packing_contract": FA4_MODEL,  # packing.packing_format != "thd": the recipe asks the model
        "pp_n_microbatches": None,
        "cp_size": 1,
    }
    assert set(kwargs) == RECIPE_KEYWORDS
    kwargs.update(overrides)
    return config.build(**kwargs)


def test_build_accepts_exactly_what_the_recipe_passes():
    setup = _finetune_setup()
    calls = [n for n in ast.walk(setup) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "build" and isinstance(n.func.value, ast.Name)
             and n.func.value.id in ("dataloader_config", "validation_config")]
    keywords = {call.func.value.id: {kw.arg for kw in call.keywords} for call in calls}
    assert keywords["dataloader_config"] == RECIPE_KEYWORDS
    assert keywords["validation_config"] <= RECIPE_KEYWORDS
    read = {n.attr for n in ast.walk(setup) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "dataloader_config"}
    assert read == {"build", "packing"}
    used = {n.attr for n in ast.walk(setup) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "dataloader_build"}
    assert used == {"dataloader", "processor"}
    parameters = inspect.signature(ZephonVLMDataloaderConfig.build).parameters
    for name in RECIPE_KEYWORDS:
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    required = {n for n, p in parameters.items() if n != "self" and p.default is inspect.Parameter.empty}
    assert required <= RECIPE_KEYWORDS


def test_yaml_through_configenode_and_recipe_build(source, model):
    config = instantiate(source)
    assert isinstance(config, ZephonVLMDataloaderConfig)
    assert config.packing is not None and config.packing.packing_format == "neat"
    result = recipe_build(config, model)
    with result.dataloader as loader:
        assert isinstance(loader, ImageLoader)
        assert result.processor is loader.processor and loader.processor.uses_get_rope_index
        assert isinstance(result.processor.tokenizer.pad_token_id, int)  # what the recipe's CP sharder reads
        batches = collect(loader)
    assert batches
    for batch in batches:
        assert batch[F.INPUT_IDS].shape == (2, 128)  # B = the recipe's batch_size
        assert set(F.METADATA) <= set(batch) and batch[F.ATTENTION_MASK].shape == (2, 128)  # the model's FA4 contract
        assert batch[F.POSITION_IDS].shape == (3, 2, 128)


def test_recipe_default_contract_leaves_the_yaml_contract(source, model):
    config = instantiate(source, contract={"packed_mask_type": "block_causal"})
    with recipe_build(config, model, packing_contract=DEFAULT_PACKED_SEQUENCE_CONTRACT).dataloader as loader:
        assert collect(loader, 1)[0][F.ATTENTION_MASK].shape == (2, 1, 128, 128)


def test_batch_size_and_yaml_micro_batch_size_must_agree(source, model):
    with pytest.raises(ValueError, match="micro_batch_size: got 3, but the recipe's batch size is 2"):
        recipe_build(instantiate(source, micro_batch_size=3), model)


def test_processor_folder_defaults_to_the_local_model_folder(source, model):
    config = instantiate(source, processor=None)
    with recipe_build(config, model).dataloader as loader:
        assert Path(loader.processor.path) == PROCESSOR_DIR
    with pytest.raises(ValueError, match="is not a local folder; expected a local processor folder"):
        recipe_build(config, model, pretrained_model_name_or_path="Qwen/Qwen2-VL-2B-Instruct")


def test_processor_target_is_instantiated_by_confignode(source, model):
    config = instantiate(source, processor={"_target_": "zephon_loader.Qwen2VLRecordProcessor",
                                            "path": str(PROCESSOR_DIR), "image_token_alignment": 4})
    with recipe_build(config, model).dataloader as loader:
        assert loader.processor.image_token_alignment == 4
        assert collect(loader, 1)


def test_pipeline_parallel_media_is_prechunked(source, model):
    with recipe_build(instantiate(source), model, pp_n_microbatches=2).dataloader as loader:
        batches = collect(loader)
    media = [batch for batch in batches if VLM_PP_MEDIA_KEY in batch]
    assert media
    for batch in media:
        assert F.PIXEL_VALUES not in batch and F.IMAGE_GRID_THW not in batch and F.N_IMAGES_PER_SAMPLE not in batch
        chunks = batch[VLM_PP_MEDIA_KEY]
        # One chunk per microbatch (one row each at B=2), holding exactly that row's images and patches.
        mm = batch[F.MM_TOKEN_TYPE_IDS]
        starts = (mm == 1) & torch.cat([torch.ones(2, 1, dtype=torch.bool), mm[:, :-1] == 0], dim=1)
        assert [len(grid) for grid in chunks["image_grid_hws"]] == starts.sum(dim=1).tolist()
        assert [len(p) for p in chunks["pixel_values"]] == [int(g.prod(dim=1).sum()) for g in chunks["image_grid_hws"]]


def test_context_parallel_is_refused(source, model):
    with pytest.raises(ValueError, match="cp_size: got 2, expected 1"):
        recipe_build(instantiate(source), model, cp_size=2)


def test_state_saved_per_dp_rank_with_torch_save_resumes_exactly(source, model, tmp_path):
    config = instantiate(source, read_ahead=2)
    with recipe_build(config, model).dataloader as loader:
        full = collect(loader)
    with recipe_build(config, model).dataloader as loader:
        iterator = iter(loader)
        for _ in range(2):
            next(iterator)
        torch.save(loader.state_dict(), tmp_path / "dataloader.pt")
    state = load_torch_ckpt(str(tmp_path / "dataloader.pt"), weights_only=True)
    with recipe_build(config, model).dataloader as loader:
        loader.load_state_dict(state)
        rest = collect(loader)
    assert len(rest) == len(full) - 2
    for got, want in zip(rest, full[2:]):
        for name, value in want.items():
            assert torch.equal(got[name], value) if isinstance(value, torch.Tensor) else got[name] == value
