"""ZephonTrainer by the loader's passes (issue 36): "epoch" save and eval strategies, resumes at a pass's end.

The Trainer never sees an epoch end (the loader's passes are chained into one
stream: it trains by ``max_steps``); ``save_strategy="epoch"`` and
``eval_strategy="epoch"`` act at the optimizer step that trained a pass's
last batch, and a checkpoint there holds an ended pass. Each resume trains
exactly the micro-batches the uninterrupted run trained after the checkpoint,
at one process and at two (torchrun, gloo, the ranks' passes in step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import hf_trainer_worker as H  # noqa: E402
from test_distributed import _free_port  # noqa: E402

PER_PASS = 59  # micro-batches of a pass at one process (the demo at S=256, B=8)


def test_epoch_strategies_act_at_each_pass_end_and_resume_there_exactly(tmp_path):
    full = H.run(tmp_path, "full", dict(max_steps=130, save_strategy="epoch", eval_strategy="epoch", eval=True))
    # The two pass ends, and max_steps (the Trainer's own epoch end: it stops there).
    assert full["saved"] == full["evaluated"] == [PER_PASS, 2 * PER_PASS, 130]
    assert full["ended"] == {str(PER_PASS): [0, True], str(2 * PER_PASS): [1, True], "130": [2, False]}
    resumed = H.run(tmp_path, "resumed", dict(max_steps=130, save_strategy="epoch",
                                              resume=str(tmp_path / "full" / f"checkpoint-{PER_PASS}")))
    assert full["seen"][:PER_PASS] + resumed["seen"] == full["seen"]
    assert resumed["saved"] == [2 * PER_PASS, 130]


def test_accumulation_window_across_a_pass_end_saves_after_it_and_resumes_exactly(tmp_path):
    """gradient_accumulation_steps=2 over a pass of 59 micro-batches: the window of its last batch holds the next
    pass's first; the "epoch" checkpoint comes after that window (step 30), one batch into epoch 1."""
    full = H.run(tmp_path, "full", dict(max_steps=45, gradient_accumulation_steps=2, save_strategy="epoch"))
    assert full["saved"] == [30, 45] and full["ended"]["30"] == [1, False]
    resumed = H.run(tmp_path, "resumed", dict(max_steps=45, gradient_accumulation_steps=2, save_strategy="epoch",
                                              resume=str(tmp_path / "full" / "checkpoint-30")))
    assert full["seen"][:60] + resumed["seen"] == full["seen"]


def test_the_last_step_of_a_pass_by_save_steps_resumes_at_the_next_epoch(tmp_path):
    full = H.run(tmp_path, "full", dict(max_steps=70, save_strategy="steps", save_steps=PER_PASS))
    assert full["ended"][str(PER_PASS)] == [0, True]
    resumed = H.run(tmp_path, "resumed", dict(max_steps=70, save_strategy="steps", save_steps=PER_PASS,
                                              resume=str(tmp_path / "full" / f"checkpoint-{PER_PASS}")))
    assert full["seen"][:PER_PASS] + resumed["seen"] == full["seen"]


def _torchrun(out: Path, phase: str, **options) -> list[dict]:
    worker = Path(__file__).with_name("hf_trainer_worker.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(worker.parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(_free_port()), str(worker), str(out), phase, json.dumps(options)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "goes out of step" not in done.stderr  # the ranks' passes end together: no warning
    return [json.loads((out / f"{phase}_rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun on loopback")
def test_two_processes_save_at_the_same_pass_end_and_resume_exactly(tmp_path):
    full = _torchrun(tmp_path, "full", max_steps=70, save_strategy="epoch")
    assert full[0]["saved"] == full[1]["saved"] and len(full[0]["saved"]) == 3, full[0]["saved"]
    first = full[0]["saved"][0]
    assert full[0]["ended"][str(first)] == full[1]["ended"][str(first)] == [0, True]
    assert set(full[0]["seen"]).isdisjoint(full[1]["seen"])  # each rank its own lanes
    resumed = _torchrun(tmp_path, "resumed", max_steps=70, save_strategy="epoch",
                        resume=str(tmp_path / "full" / f"checkpoint-{first}"))
    for rank in (0, 1):
        assert full[rank]["seen"][:first] + resumed[rank]["seen"] == full[rank]["seen"], rank
