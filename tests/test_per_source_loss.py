"""The per-source loss recipe (README "Per-source loss", examples/per_source_loss.py) against losses by hand."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as torch_functional

from zephon_loader import fields as F

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "per_source_loss.py"


def _example():
    spec = importlib.util.spec_from_file_location("per_source_loss_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_per_source_loss_equals_the_loss_of_each_source_by_hand():
    example = _example()
    checked = []

    def by_hand(record, batch, logits):
        labels, source_ids = batch[F.LABELS], batch[F.SOURCE_IDS]
        trained = labels != F.IGNORE_INDEX
        assert bool((source_ids[trained] >= 0).all())  # every trained token has a source
        for k, name in enumerate(["stories", "notes"]):
            mask = trained & (source_ids == k)
            if not bool(mask.any()):
                assert name not in record["per_source"]
                continue
            want = torch_functional.cross_entropy(logits[mask].float(), labels[mask]).item()
            assert abs(record["per_source"][name] - want) < 1e-5, (name, record["per_source"][name], want)
            assert record["tokens"][name] == int(mask.sum())
        overall = torch_functional.cross_entropy(logits[trained].float(), labels[trained]).item()
        assert abs(record["loss"] - overall) < 1e-5
        checked.append(record["step"])

    log = example.train(4, on_step=by_hand)
    assert checked == [0, 1, 2, 3] and len(log) == 4
    assert all(set(record["per_source"]) == {"stories", "notes"} for record in log)


def test_per_source_loss_of_a_batch_without_a_source():
    example = _example()
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[1, 2, -100, 3, -100], [4, -100, -100, -100, -100]])
    source_ids = torch.tensor([[2, 2, 2, 0, -1], [0, -1, -1, -1, -1]])
    loss, sums, counts = example.per_source_loss(logits, labels, source_ids, 3)
    assert counts.tolist() == [2, 0, 2]
    for k in (0, 2):
        mask = (source_ids == k) & (labels != -100)
        assert torch.allclose(sums[k] / counts[k], torch_functional.cross_entropy(logits[mask], labels[mask]))
    assert torch.allclose(loss, torch_functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))


def test_the_example_runs_as_a_script():
    env = {**os.environ, "PYTHONPATH": str(EXAMPLE.parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "2", "--json"], capture_output=True, text=True,
                          env=env, timeout=300, check=True)
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [record["step"] for record in records] == [0, 1]
    assert all(set(record["per_source"]) == {"stories", "notes"} for record in records)
