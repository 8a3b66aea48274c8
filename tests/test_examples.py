"""Every example in ``examples/`` runs as a user would run it (a subprocess, at tiny size, in a temporary folder).

Each training example is run twice: ``--steps 6`` with a checkpoint at step 3, then resumed from that
checkpoint in a new process; the resumed steps (loss, trained tokens; per rank under torchrun) must equal
the uninterrupted run's steps 4 to 6. The data is ``examples/train.yaml`` with a shorter row
(``sequence_length`` 64, ``micro_batch_size`` 2) and the model a random Llama of hidden size 32.
``examples/automodel.yaml`` needs AutoModel's own environment to run (``bash scripts/dev.sh recipe``
runs that recipe); here its data blocks are read by the loader's own config reader and built on the
bundled demo data.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from zephon_loader import build_text_loader, load_yaml, read_loader_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TIMEOUT_S = 240
TINY = ["--hidden-size", "32", "--layers", "2"]


def tiny_config(tmp_path: Path, **settings) -> Path:
    """``examples/train.yaml`` with shorter rows, its relative paths still resolved against ``examples/``."""
    node = load_yaml(EXAMPLES / "train.yaml")["dataloader"]
    node.update({"base_dir": str(EXAMPLES), "sequence_length": 64, "micro_batch_size": 2, **settings})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({"dataloader": node}))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port())]


def run(command: list[str], cwd: Path, **env: str) -> str:
    """Run ``command`` in ``cwd``; its stdout (a failure shows the output's tail)."""
    started = time.monotonic()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S,
                            env={**os.environ, **env})
    print(f"{' '.join(command[1:])}: {time.monotonic() - started:.1f} s")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def step_lines(stdout: str) -> list[str]:
    """What the examples print per training step (``step N loss L tokens T``, maybe after ``rank R``).

    Found anywhere in the output: under torchrun two ranks' lines can run into one another.
    """
    return re.findall(r"(?:rank \d+ )?step \d+ loss \S+ tokens \d+(?: epoch \d+)?", stdout)


def test_train_loop_resumes_exactly_across_an_epoch(tmp_path):
    """40 steps of 16 rows (a pass of the demo is about 30 such batches), resumed from step 20: into epoch 1."""
    script = str(EXAMPLES / "train_loop.py")
    config = str(tiny_config(tmp_path, sequence_length=256, micro_batch_size=16))
    full = step_lines(run([sys.executable, script, "--config", config, *TINY, "--steps", "40", "--save-every", "20",
                           "--out", "full"], tmp_path))
    assert [int(line.split()[1]) for line in full] == list(range(1, 41))
    epochs = [line.split()[-1] for line in full]
    assert epochs[19] == "0" and epochs[-1] == "1"
    checkpoint = tmp_path / "full" / "step-20"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["loader.pt", "training.pt"]
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["step-20", "step-40"]
    resumed = step_lines(run([sys.executable, script, "--config", config, *TINY, "--steps", "40",
                              "--resume", str(checkpoint), "--out", "resumed"], tmp_path))
    assert resumed == full[20:]


def test_lightning_resumes_exactly(tmp_path):
    script, config = str(EXAMPLES / "lightning_train.py"), str(tiny_config(tmp_path))
    full = step_lines(run([sys.executable, script, "--config", config, *TINY, "--steps", "6", "--save-every", "3",
                           "--out", "full"], tmp_path))
    assert [line.split()[1] for line in full] == ["1", "2", "3", "4", "5", "6"]
    checkpoint = tmp_path / "full" / "epoch=0-step=3.ckpt"
    assert checkpoint.is_file()
    resumed = step_lines(run([sys.executable, script, "--config", config, *TINY, "--steps", "6",
                              "--resume", str(checkpoint), "--out", "resumed"], tmp_path))
    assert resumed == full[3:]


@pytest.mark.parametrize("processes", [1, 2], ids=["python", "torchrun-2"])
def test_accelerate_resumes_exactly(tmp_path, processes):
    """One process, and data parallel on 2 CPU processes (torchrun, gloo): each rank resumes exactly."""
    launch = (lambda: [sys.executable]) if processes == 1 else (lambda: torchrun(processes))
    script, config = str(EXAMPLES / "accelerate_train.py"), str(tiny_config(tmp_path))
    env = {"ACCELERATE_USE_CPU": "1"}
    full = step_lines(run([*launch(), script, "--config", config, *TINY, "--steps", "6", "--save-every", "3",
                           "--out", "full"], tmp_path, **env))
    checkpoint = tmp_path / "full" / "step_3"
    assert {p.name for p in checkpoint.glob("zephon_loader_*")} == {
        f"zephon_loader_0_rank{r}.json" for r in range(processes)}
    resumed = step_lines(run([*launch(), script, "--config", config, *TINY, "--steps", "6",
                              "--resume", str(checkpoint), "--out", "resumed"], tmp_path, **env))
    firsts = []
    for rank in range(processes):
        mine = [line for line in full if line.startswith(f"rank {rank} ")]
        assert [line.split()[3] for line in mine] == ["1", "2", "3", "4", "5", "6"]
        assert [line for line in resumed if line.startswith(f"rank {rank} ")] == mine[3:]
        firsts.append(mine[0].split(maxsplit=4)[4])
    assert len(set(firsts)) == processes  # each rank trained on its own data


def test_hf_trainer_resumes_exactly(tmp_path):
    script, config = str(EXAMPLES / "hf_trainer.py"), str(tiny_config(tmp_path))
    arguments = [sys.executable, script, "--config", config, *TINY, "--steps", "6", "--save-every", "3"]
    run([*arguments, "--out", "full"], tmp_path)
    assert (tmp_path / "full" / "checkpoint-3" / "zephon_loader_state_rank0.json").is_file()
    run([*arguments, "--out", "resumed", "--resume", str(tmp_path / "full" / "checkpoint-3")], tmp_path)

    def history(folder: str) -> list[tuple]:
        state = json.loads((tmp_path / folder / "checkpoint-6" / "trainer_state.json").read_text())
        return [(h["step"], h["loss"], h["grad_norm"], h["learning_rate"]) for h in state["log_history"] if "loss" in h]

    full, resumed = history("full"), history("resumed")
    assert [entry[0] for entry in full] == [1, 2, 3, 4, 5, 6]
    assert resumed == full  # steps 1-3 come from checkpoint-3's state, 4-6 were trained after the resume


@pytest.mark.parametrize("scope", ["job", "rank"])
def test_distributed_example_under_torchrun(tmp_path, scope):
    """``examples/distributed.py`` as its docstring runs it: 2 ranks saving at step 3, then resumed at 1 rank."""
    script = str(EXAMPLES / "distributed.py")
    out = run([*torchrun(2), script, "--steps", "6", "--save-at", "3", "--out", str(tmp_path / "states"),
               "--state-scope", scope], tmp_path)
    assert "rank 0/2: 6 batches" in out and "rank 1/2: 6 batches" in out
    assert sorted(p.name for p in (tmp_path / "states").iterdir()) == ["rank0.json", "rank1.json"]
    states = [json.loads((tmp_path / "states" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [state.get("lanes") for state in states] == ([None, None] if scope == "job" else [[0, 1], [2, 3]])
    out = run([*torchrun(1), script, "--resume", str(tmp_path / "states"), "--steps", "3", "--state-scope", scope],
              tmp_path)
    assert "rank 0/1: 3 batches" in out


def test_train_yaml_reads_the_bundled_demo_for_a_stock_model():
    config = read_loader_config(EXAMPLES / "train.yaml")
    assert config.contract.attn_implementation == "hf"
    with build_text_loader(config) as loader:
        batch = next(iter(loader))
    assert tuple(batch["input_ids"].shape) == (config.micro_batch_size, config.sequence_length)
    assert "attention_mask" not in batch and batch["use_cache"] is False


def test_automodel_yaml_is_the_stock_recipe_with_zephon_data_blocks(tmp_path):
    """The recipe YAML's data blocks pass the loader's own reader; the training block builds on the demo data."""
    recipe = load_yaml(EXAMPLES / "automodel.yaml")
    assert recipe["recipe"]["_target_"] == "zephon_loader.automodel.ZephonFinetuneRecipe"
    assert "dataset" not in recipe and "validation_dataset" not in recipe
    local_batch = recipe["step_scheduler"]["local_batch_size"]
    blocks = {key: node for key, node in recipe.items() if key.endswith("dataloader")}
    assert set(blocks) == {"dataloader", "validation_dataloader"}
    for node in blocks.values():  # what ZephonRecipeConfig passes: micro_batch_size = local_batch_size
        config = read_loader_config({**node, "micro_batch_size": local_batch})
        assert config.micro_batch_size == local_batch and config.sequence_length == 4096
    assert read_loader_config({**blocks["dataloader"], "micro_batch_size": local_batch}).passes is None

    # The training block on the bundled demo data (its paths and row length swapped): one batch.
    demo = read_loader_config(EXAMPLES / "train.yaml")
    node = {**blocks["dataloader"], "micro_batch_size": 2, "sequence_length": 64, "base_dir": demo.base_dir,
            "sources": [{"name": s.name, "path": s.path, "weight": s.weight} for s in demo.sources],
            "tokenizer": {"path": demo.tokenizer.path}}
    with build_text_loader(node) as loader:
        batch = next(iter(loader))
    assert tuple(batch["input_ids"].shape) == (2, 64)


def test_automodel_yaml_through_automodels_config_node():
    """AutoModel's own ``ConfigNode`` instantiates both data blocks as ``ZephonDataloaderConfig`` (as its recipe does).

    Only the data blocks: the whole file names AutoModel's recipe, which needs its full environment to import.
    """
    config_loader = pytest.importorskip("nemo_automodel.components.config.loader")
    from zephon_loader import ZephonDataloaderConfig

    raw = load_yaml(EXAMPLES / "automodel.yaml")
    local_batch = raw["step_scheduler"]["local_batch_size"]
    blocks = config_loader.ConfigNode({key: raw[key] for key in ("dataloader", "validation_dataloader")})
    for node in (blocks.dataloader, blocks.validation_dataloader):
        config = node.instantiate(micro_batch_size=local_batch)
        assert isinstance(config, ZephonDataloaderConfig) and config.micro_batch_size == local_batch
