"""Lightning's default checkpoints resume exactly (issue 36): epoch ends, a pass's last batch, a forgotten callback.

Lightning restores a loader's state only when it resumes inside an epoch, and
its fetcher pulls a batch ahead; these are the checkpoints users get from
Lightning's defaults and documented idioms (tests/lightning_cases.py). Each
case: the steps of the run stopped by the checkpoint plus the steps of the run
resumed from it equal the uninterrupted run's, step for step (epoch and batch
hash), at one process in this process and at two with Lightning's own DDP
launcher. ``batch_idx`` is Lightning's own count: after a resume at an
epoch's last batch it goes on from the old epoch's (Lightning's bookkeeping
for loaders without ``len()``), so it is not compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning.pytorch", reason="lightning is not installed (the test extra has it)")

import lightning_cases as C  # noqa: E402

#: One process: the pass's batch count (the demo at S=256, B=8).
PER_EPOCH = 59


def steps(records: list[list]) -> list[tuple]:
    """What a step trained: (epoch, batch hash)."""
    return [(epoch, digest) for epoch, _, digest in records]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted runs: three epochs, and three epochs of limit_train_batches=20."""
    out = tmp_path_factory.mktemp("full")
    plain, _ = C.fit(out / "plain", max_epochs=3)
    limited, _ = C.fit(out / "limited", max_epochs=3, limit_train_batches=20)
    assert [sum(1 for s in plain if s[0] == e) for e in range(3)] == [PER_EPOCH] * 3
    return {"plain": plain, "limited": limited}


#: name: (uninterrupted run, stop-run options, its checkpoint's file pattern, resume-run options)
CASES = {
    "default ModelCheckpoint after validation, into epochs 2 and 3": (
        "plain", dict(max_epochs=1, val=True, checkpoint={}), "epoch=0-*.ckpt", dict(max_epochs=3, val=True)),
    "save_on_train_epoch_end, into epoch 3": (
        "plain", dict(max_epochs=2, checkpoint=dict(save_on_train_epoch_end=True)), "epoch=1-*.ckpt",
        dict(max_epochs=3)),
    "limit_train_batches with an end-of-epoch checkpoint": (
        "limited", dict(max_epochs=1, limit_train_batches=20, checkpoint=dict(save_on_train_epoch_end=True)),
        "epoch=0-*.ckpt", dict(max_epochs=3, limit_train_batches=20)),
    "every_n_train_steps on the pass's last batch": (
        "plain", dict(max_epochs=2, max_steps=PER_EPOCH, checkpoint=dict(every_n_train_steps=PER_EPOCH,
                                                                          filename="{step}")),
        f"step={PER_EPOCH}.ckpt", dict(max_epochs=2)),
    "accumulate_grad_batches=4: the partial window at the epoch's end": (
        "plain", dict(max_epochs=2, max_steps=15, accumulate_grad_batches=4,
                      checkpoint=dict(every_n_train_steps=15, filename="{step}")),
        "step=15.ckpt", dict(max_epochs=2, accumulate_grad_batches=4)),
    "limit_train_batches divisible by every_n_train_steps": (
        "limited", dict(max_epochs=2, max_steps=20, limit_train_batches=20,
                        checkpoint=dict(every_n_train_steps=10, filename="{step}")),
        "step=20.ckpt", dict(max_epochs=2, limit_train_batches=20)),
    "ZephonLoaderCallback forgotten, mid-epoch": (
        "plain", dict(max_epochs=2, max_steps=7, callback=False, checkpoint=dict(every_n_train_steps=7,
                                                                                 filename="{step}")),
        "step=7.ckpt", dict(max_epochs=2, callback=False)),
    "ZephonLoaderCallback forgotten, default ModelCheckpoint": (
        "plain", dict(max_epochs=1, val=True, callback=False, checkpoint={}), "epoch=0-*.ckpt",
        dict(max_epochs=2, val=True, callback=False)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_process_resumes_exactly(tmp_path, full, case):
    reference, stop, pattern, resume = CASES[case]
    head, _ = C.fit(tmp_path / "stop", **stop)
    tail, _ = C.fit(tmp_path / "resume", ckpt=C.only_checkpoint(tmp_path / "stop", pattern), **resume)
    expected = steps(full[reference])[: len(head) + len(tail)]
    assert len(head) + len(tail) == len(expected) == resume["max_epochs"] * (
        20 if reference == "limited" else PER_EPOCH)
    assert steps(head) + steps(tail) == expected


def _launch(out: Path, phase: str, **options) -> list[list[list]]:
    """One fit under Lightning's own DDP launcher (2 CPU processes); each rank's steps."""
    worker = Path(__file__).with_name("lightning_cases.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(worker.parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    done = subprocess.run([sys.executable, str(worker), str(out), phase, "2", json.dumps(options)], env=env,
                          capture_output=True, text=True, timeout=900, cwd=out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Zephon window" not in done.stderr or "checkpoint" in json.dumps(options), done.stderr[-2000:]
    return [json.loads((out / f"{phase}_rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.skipif(sys.platform != "linux", reason="gloo on loopback")
def test_ddp_two_processes_resume_exactly_from_lightnings_default_checkpoints(tmp_path):
    """Lightning's launcher (strategy="ddp", devices=2): the default ModelCheckpoint with a val loader into
    epochs 2 and 3, save_on_train_epoch_end into epoch 3, and a checkpoint on the pass's last batch with the
    callback forgotten. The ranks hold the same number of batches per epoch (the loader's pass agreement); a
    run without checkpoints prints no warning about Zephon windows (the carry between passes is the loader's
    own)."""
    full = _launch(tmp_path, "full", max_epochs=3)
    per_epoch = [sum(1 for s in full[0] if s[0] == e) for e in range(3)]
    assert per_epoch == [sum(1 for s in full[1] if s[0] == e) for e in range(3)] and all(per_epoch)
    assert {s[2] for s in full[0]}.isdisjoint(s[2] for s in full[1])
    cases = {
        "val": (dict(max_epochs=1, val=True, checkpoint={}), "epoch=0-*.ckpt", dict(max_epochs=3, val=True)),
        "train_end": (dict(max_epochs=2, checkpoint=dict(save_on_train_epoch_end=True)), "epoch=1-*.ckpt",
                      dict(max_epochs=3)),
        "last_batch": (dict(max_epochs=2, max_steps=per_epoch[0], callback=False,
                            checkpoint=dict(every_n_train_steps=per_epoch[0], filename="{step}")),
                       f"step={per_epoch[0]}.ckpt", dict(max_epochs=2, callback=False)),
    }
    for name, (stop, pattern, resume) in cases.items():
        head = _launch(tmp_path, f"{name}_stop", **stop)
        ckpt = C.only_checkpoint(tmp_path / f"{name}_stop", pattern)
        tail = _launch(tmp_path, f"{name}_resume", ckpt=ckpt, **resume)
        for rank in (0, 1):
            total = sum(per_epoch[: resume["max_epochs"]])
            assert len(head[rank]) + len(tail[rank]) == total, (name, rank)
            assert steps(head[rank]) + steps(tail[rank]) == steps(full[rank])[:total], (name, rank)


def test_a_loader_rebuilt_every_epoch_reads_the_trainers_epoch(tmp_path, full):
    """reload_dataloaders_every_n_epochs=1 with the loader built in train_dataloader(): each epoch's new loader
    starts at its epoch 0 and Lightning's set_epoch comes after its fetcher pulled a batch; the callback restarts
    it at the trainer's epoch, so the run reads the same epochs as one loader does."""
    trained, _ = C.fit(tmp_path, max_epochs=3, reload_dataloaders_every_n_epochs=1)
    assert steps(trained) == steps(full["plain"])
