"""AutoModel 0.7.0's own LLM fine-tune recipe, chosen by YAML, trains on this loader (``bash scripts/dev.sh recipe``).

The YAML is AutoModel's stock ``examples/llm_finetune/llama3_2/llama3_2_1b_squad.yaml``
(:data:`STOCK_YAML`) with the user's edit (:func:`user_config`: the ``recipe:``
line, the Zephon ``dataloader`` / ``validation_dataloader`` blocks in place of
the ``dataset`` / ``dataloader`` / ``validation_dataset`` /
``validation_dataloader`` blocks), then the harness's edits for a CPU test
(:func:`cpu_config`: a tiny random Llama from a local config, gloo, small
batches, a few steps). It runs through AutoModel's CLI entry point under
``torchrun`` (``recipe_worker.py``, which patches AutoModel's CUDA-only calls and
records every batch the recipe consumes) at 1 and 2 ranks, is resumed from its
mid-way checkpoint, and the batches after the checkpoint are compared with the
uninterrupted run's.

Needs nemo-automodel with all its dependencies; without them (the default
suite's environment) the module is skipped.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

try:
    from nemo_automodel.components.config.loader import ConfigNode
    from nemo_automodel.recipes._typed_config import RecipeConfig
    from nemo_automodel.recipes.llm.train_ft import _build_tokenizer

    from zephon_loader.automodel import ZephonRecipeConfig
except ImportError as error:  # the default suite's environment: nemo-automodel without its dependencies
    pytest.skip(
        f"AutoModel's recipe needs nemo-automodel==0.7.0 with its dependencies ({error}); "
        "run `bash scripts/dev.sh recipe`",
        allow_module_level=True,
    )

from conftest import make_texts, train_tokenizer, write_jsonl_shards  # noqa: E402
from zephon_loader import ZephonDataloaderConfig  # noqa: E402

WORKER = Path(__file__).with_name("recipe_worker.py")
SEQUENCE_LENGTH = 32
LOCAL_BATCH = 2
MAX_STEPS = 6
CKPT_EVERY = 3  # checkpoint (and validation) after steps 3 and 6; resume from the first
TIMEOUT_S = 300

#: AutoModel's examples/llm_finetune/llama3_2/llama3_2_1b_squad.yaml (nemo-automodel 0.7.0), comments removed.
STOCK_YAML = """
recipe:
  _target_: nemo_automodel.recipes.llm.train_ft.TrainFinetuneRecipeForNextTokenPrediction

step_scheduler:
  global_batch_size: 64
  local_batch_size: 8
  ckpt_every_steps: 1000
  val_every_steps: 10
  num_epochs: 1

dist_env:
  backend: nccl
  timeout_minutes: 1

rng:
  _target_: nemo_automodel.components.training.rng.StatefulRNG
  seed: 1111
  ranked: true

model:
  _target_: nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained
  pretrained_model_name_or_path: meta-llama/Llama-3.2-1B

compile:
  enabled: false
  mode: "default"
  fullgraph: false
  dynamic: true
  backend: null

clip_grad_norm:
  max_norm: 1.0

distributed:
  strategy: fsdp2
  dp_size: none
  tp_size: 1
  cp_size: 1

loss_fn:
  _target_: nemo_automodel.components.loss.masked_ce.MaskedCrossEntropy

dataset:
  _target_: nemo_automodel.components.datasets.llm.squad.make_squad_dataset
  dataset_name: rajpurkar/squad
  split: train

packed_sequence:
  packed_sequence_size: 0

dataloader:
  _target_: torchdata.stateful_dataloader.StatefulDataLoader
  collate_fn:
    _target_: nemo_automodel.components.datasets.utils.default_collater
  shuffle: false

validation_dataset:
  _target_: nemo_automodel.components.datasets.llm.squad.make_squad_dataset
  dataset_name: rajpurkar/squad
  split: validation
  limit_dataset_samples: 64

validation_dataloader:
  _target_: torchdata.stateful_dataloader.StatefulDataLoader
  collate_fn:
    _target_: nemo_automodel.components.datasets.utils.default_collater

optimizer:
  _target_: torch.optim.Adam
  betas: [0.9, 0.999]
  eps: 1e-8
  lr: 1.0e-5
  weight_decay: 0

lr_scheduler:
  lr_decay_style: cosine
  min_lr: 1.0e-6
"""


# ----------------------------------------------------------------------------- the YAML


def user_config(data: Path) -> dict:
    """The stock YAML after the user's edit (the README's "AutoModel" diff): recipe line and data blocks."""
    config = yaml.safe_load(STOCK_YAML)
    config["recipe"] = {"_target_": "zephon_loader.automodel.ZephonFinetuneRecipe"}
    for stock in ("dataset", "validation_dataset"):
        del config[stock]
    config["dataloader"] = {
        "_target_": "zephon_loader.ZephonDataloaderConfig",
        "sources": [{"name": "train", "path": str(data / "train")}],
        "tokenizer": {"path": str(data / "tokenizer")},
        "sequence_length": SEQUENCE_LENGTH,
        "passes": None,  # endless: with several ranks, lanes would end a pass at different steps
    }
    config["validation_dataloader"] = {
        "_target_": "zephon_loader.ZephonDataloaderConfig",
        "sources": [{"name": "val", "path": str(data / "val")}],
        "tokenizer": {"path": str(data / "tokenizer")},
        "sequence_length": SEQUENCE_LENGTH,
    }
    return config


def cpu_config(data: Path) -> dict:
    """:func:`user_config` with the harness's edits for a CPU test; none of them touches the data blocks."""
    config = user_config(data)
    config["model"] = {
        "_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_config",
        "config": {"_target_": "transformers.AutoConfig.from_pretrained",
                   "pretrained_model_name_or_path": str(data / "model")},
        "torch_dtype": "float32",
    }
    config["dist_env"]["backend"] = "gloo"
    config["step_scheduler"] = {
        "global_batch_size": 2 * LOCAL_BATCH,  # 2 accumulation steps at 1 rank, 1 at 2 ranks
        "local_batch_size": LOCAL_BATCH,
        "ckpt_every_steps": CKPT_EVERY,
        "val_every_steps": CKPT_EVERY,
        "max_steps": MAX_STEPS,
        "num_epochs": 1,
    }
    config["optimizer"]["lr"] = 1.0e-3
    return config


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A local tokenizer, a tiny random Llama config, a training source and a validation source."""
    from transformers import LlamaConfig

    root = tmp_path_factory.mktemp("recipe")
    texts = make_texts(300, seed=0, max_words=40)
    train_tokenizer(texts, root / "tokenizer")
    write_jsonl_shards(root / "train", [{"text": t} for t in texts[:240]], shards=2)
    write_jsonl_shards(root / "val", [{"text": t} for t in texts[240:]], shards=1)
    LlamaConfig(
        vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2 * SEQUENCE_LENGTH, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=2,
    ).save_pretrained(root / "model")
    return root


def write_yaml(config: dict, path: Path) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# ----------------------------------------------------------------------------- the config view


def test_import_zephon_loader_leaves_nemo_automodel_alone():
    """The ``automodel`` module is optional: importing the package imports neither it nor nemo_automodel."""
    code = (
        "import sys, zephon_loader\n"
        "print(sorted(m for m in sys.modules if m.startswith(('nemo_automodel', 'zephon_loader.automodel'))))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_user_edit_touches_only_the_recipe_line_and_the_data_blocks(data):
    stock, user = yaml.safe_load(STOCK_YAML), user_config(data)
    changed = {key for key in stock.keys() | user.keys() if stock.get(key) != user.get(key)}
    assert changed == {"recipe", "dataset", "dataloader", "validation_dataset", "validation_dataloader"}


def test_stock_recipe_config_refuses_the_zephon_blocks_and_ours_reads_them(data):
    """Where AutoModel 0.7.0 refuses (``recipes/_typed_config.py``), and what :class:`ZephonRecipeConfig` returns."""
    user = user_config(data)
    # No dataset block: the stock view has no training loader and no `dataset` for _build_tokenizer.
    stock = RecipeConfig(ConfigNode(user))
    assert stock.dataloader is None and stock.validation_dataloaders == {}
    with pytest.raises(AttributeError, match="dataset"):
        stock.dataset
    # With the stock dataset block kept: the foreign dataloader target is refused.
    kept = {**user, "dataset": yaml.safe_load(STOCK_YAML)["dataset"]}
    with pytest.raises(ValueError, match="Unsupported dataloader _target_"):
        RecipeConfig(ConfigNode(kept)).dataloader

    ours = ZephonRecipeConfig(ConfigNode(user))
    assert isinstance(ours.dataloader, ZephonDataloaderConfig)
    assert ours.dataloader.micro_batch_size == 8  # the stock step_scheduler.local_batch_size
    assert not ours.dataloader.is_validation
    assert set(ours.validation_dataloaders) == {"default"}
    assert [s.name for s in ours.validation_dataloaders["default"].sources] == ["val"]
    # The recipe's tokenizer comes from the Zephon block's folder, through AutoModel's own _build_tokenizer.
    _, tokenizer = _build_tokenizer(ours.model, ours.dataset)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, len(tokenizer)) == (0, 1, 400)


def test_without_a_tokenizer_path_the_recipe_takes_the_models(data):
    user = user_config(data)
    del user["dataloader"]["tokenizer"]
    dataset = ZephonRecipeConfig(ConfigNode(user)).dataset
    assert "tokenizer" not in dataset and dataset._target_ is None  # _build_tokenizer then loads the model's


def test_named_validation_blocks(data):
    user = user_config(data)
    user["validation_dataloader_held_out"] = {**user["validation_dataloader"], "micro_batch_size": 5}
    loaders = ZephonRecipeConfig(ConfigNode(user)).validation_dataloaders
    assert set(loaders) == {"default", "held_out"}
    assert (loaders["default"].micro_batch_size, loaders["held_out"].micro_batch_size) == (8, 5)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c.update(dataset=yaml.safe_load(STOCK_YAML)["dataset"]), r"^dataset: got a dataset block"),
        (lambda c: c.update(validation_dataset=yaml.safe_load(STOCK_YAML)["validation_dataset"]),
         r"^validation_dataset: got an AutoModel validation block"),
        (lambda c: c["dataloader"].update(micro_batch_size=3),
         r"^dataloader\.micro_batch_size: got 3, but step_scheduler\.local_batch_size is 8"),
        (lambda c: c["dataloader"].update(packing=None), r"^dataloader\.packing: got null, which makes a validation"),
    ],
    ids=["dataset", "validation_dataset", "micro_batch_size", "training_packing_null"],
)
def test_blocks_that_would_be_ignored_or_miscounted_are_refused(data, edit, match):
    user = user_config(data)
    edit(user)
    view = ZephonRecipeConfig(ConfigNode(user))
    with pytest.raises(ValueError, match=match):
        view.dataloader
        view.validation_dataloaders


# ----------------------------------------------------------------------------- the real recipe


def run_recipe(config_path: Path, run_dir: Path, ranks: int, *overrides: str) -> dict:
    """``torchrun --nproc-per-node RANKS recipe_worker.py CONFIG`` (AutoModel's CLI); returns what it recorded."""
    env = {**os.environ, "ZEPHON_RECIPE_RECORD": str(run_dir / "batches"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
        str(WORKER), str(config_path), f"--checkpoint.checkpoint_dir={run_dir / 'checkpoints'}", *overrides,
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, (
        f"recipe failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    )

    def jsonl(path: Path) -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines()]

    return {
        "batches": [jsonl(run_dir / "batches" / f"rank{rank}.jsonl") for rank in range(ranks)],
        "training": jsonl(run_dir / "checkpoints" / "training.jsonl"),
        "validation": jsonl(run_dir / "checkpoints" / "validation.jsonl"),
        "checkpoints": run_dir / "checkpoints",
    }


def train_steps(batches: list[dict]) -> dict[int, list[dict]]:
    """Recorded training batches by optimizer step (one per accumulation micro-step)."""
    steps: dict[int, list[dict]] = {}
    for entry in batches:
        if entry["train"]:
            steps.setdefault(entry["step"], []).append({k: entry[k] for k in ("input_ids", "labels", "position_ids")})
    return steps


def validation_passes(batches: list[dict]) -> list[list[list[list[int]]]]:
    """Each validation's ``input_ids`` batches, in order."""
    passes: dict[int, list] = {}
    for entry in batches:
        if not entry["train"]:
            passes.setdefault(entry["step"], []).append(entry["input_ids"])
    return [passes[step] for step in sorted(passes)]


@pytest.mark.parametrize("ranks", [1, 2])
def test_recipe_trains_checkpoints_and_resumes_exactly(data, tmp_path, ranks):
    config_path = write_yaml(cpu_config(data), tmp_path / "config.yaml")
    full = run_recipe(config_path, tmp_path / "full", ranks)

    # AutoModel's own loop ran: MAX_STEPS optimizer steps of global_batch_size rows, the loss fell.
    losses = [entry["loss"] for entry in full["training"]]
    assert len(losses) == MAX_STEPS and losses[-1] < losses[0]
    accumulation = 2 // ranks
    for batches in full["batches"]:
        steps = train_steps(batches)
        assert sorted(steps) == list(range(MAX_STEPS))
        assert all(len(micro) == accumulation for micro in steps.values())
        for micro in steps.values():
            assert all(len(batch["input_ids"]) == LOCAL_BATCH for batch in micro)
    if ranks == 2:  # each DP rank reads its own lane
        rank0, rank1 = (train_steps(b) for b in full["batches"])
        assert all(rank0[step] != rank1[step] for step in rank0)

    # The loader's state was saved per DP rank by AutoModel's checkpointer, at the mid-way checkpoint.
    middle = full["checkpoints"] / f"epoch_0_step_{CKPT_EVERY - 1}"
    assert sorted(p.name for p in (middle / "dataloader").iterdir()) == [
        f"dataloader_dp_rank_{rank}.pt" for rank in range(ranks)
    ]

    # Resume from it (same YAML, new checkpoint folder): the batches after it are the uninterrupted run's.
    resumed = run_recipe(config_path, tmp_path / "resumed", ranks, f"--checkpoint.restore_from={middle}")
    for before, after in zip(full["batches"], resumed["batches"]):
        expected = {step: micro for step, micro in train_steps(before).items() if step >= CKPT_EVERY}
        assert train_steps(after) == expected
    # ... and so are the model's steps (optimizer and RNG restored by AutoModel, the data by the loader).
    assert [e["loss"] for e in resumed["training"]] == pytest.approx(losses[CKPT_EVERY:], rel=1e-5)
    assert resumed["validation"][-1]["val_loss"] == pytest.approx(full["validation"][-1]["val_loss"], rel=1e-5)

    # The Zephon validation loader: every validation (and every rank) reads the same whole set.
    assert [e["step"] for e in full["validation"]] == [CKPT_EVERY - 1, MAX_STEPS - 1]
    assert len({e["num_label_tokens"] for e in full["validation"] + resumed["validation"]}) == 1
    passes = [p for batches in full["batches"] + resumed["batches"] for p in validation_passes(batches)]
    assert len(passes) == 3 * ranks and all(p == passes[0] for p in passes)


def test_recipe_with_per_rank_loader_states_resumes_exactly(data, tmp_path):
    """``distributed.state_scope: rank`` in the recipe's dataloader block: AutoModel's per-DP-rank files each hold
    that rank's lanes, and the same-size resume is exact (each rank loads its own file)."""
    import torch

    config = cpu_config(data)
    config["dataloader"]["distributed"] = {"canonical_replicas": 4, "state_scope": "rank"}
    config_path = write_yaml(config, tmp_path / "config.yaml")
    full = run_recipe(config_path, tmp_path / "full", 2)
    middle = full["checkpoints"] / f"epoch_0_step_{CKPT_EVERY - 1}"
    lanes = [torch.load(middle / "dataloader" / f"dataloader_dp_rank_{rank}.pt", weights_only=True).get("lanes")
             for rank in range(2)]
    assert lanes == [[0, 1], [2, 3]], lanes
    resumed = run_recipe(config_path, tmp_path / "resumed", 2, f"--checkpoint.restore_from={middle}")
    for before, after in zip(full["batches"], resumed["batches"]):
        expected = {step: micro for step, micro in train_steps(before).items() if step >= CKPT_EVERY}
        assert train_steps(after) == expected
    losses = [entry["loss"] for entry in full["training"]]
    assert [e["loss"] for e in resumed["training"]] == pytest.approx(losses[CKPT_EVERY:], rel=1e-5)
