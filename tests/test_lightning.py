"""PyTorch Lightning 2.6 takes a ZephonLoader as it is, and resumes mid-epoch at exactly the next untrained batch.

Each run records ``(epoch, batch_idx, hash of input_ids)`` per ``training_step``
(tests/lightning_worker.py). "Exact" means: the steps of a run stopped at a
checkpoint plus the steps of the run resumed from it (``ckpt_path``) equal
the uninterrupted run's, step for step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pl = pytest.importorskip("lightning.pytorch", reason="lightning is not installed (the test extra has it)")

import lightning_worker as W  # noqa: E402  (tests/ is on sys.path: conftest.py)
from test_distributed import _free_port  # noqa: E402

from zephon_loader import build_text_loader  # noqa: E402
from zephon_loader.lightning import ZephonLoaderCallback, zephon_loaders  # noqa: E402

def config(**overrides):
    """The demo at short rows (lightning_worker.demo_config): a pass holds about 120 batches."""
    return W.demo_config(**overrides)


def run(out: Path, mode: str, *, max_epochs: int, stop: int | None = None, callback: bool = True,
        read_ahead: int = 2) -> list[list]:
    """One in-process fit (loader passed to ``fit``); returns its training steps."""
    module = W.TinyLM()
    callbacks = None if callback else []
    every = stop if mode == "stop" else None
    fit = W.trainer(out / mode, max_epochs=max_epochs, max_steps=stop if mode == "stop" else -1, every=every,
                    devices=1)
    if callbacks is not None:
        fit.callbacks[:] = [c for c in fit.callbacks if not isinstance(c, ZephonLoaderCallback)]
    loader = build_text_loader(config(read_ahead=read_ahead))
    try:
        ckpt = str(out / "stop" / f"step={stop}.ckpt") if mode == "resume" else None
        fit.fit(module, train_dataloaders=loader, ckpt_path=ckpt)
    finally:
        loader.close()
    return module.trained


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run(tmp_path_factory.mktemp("full"), "full", max_epochs=2)


def test_fit_takes_the_loader_as_is_for_training_and_validation(tmp_path):
    module = W.TinyLM()
    fit = W.trainer(tmp_path, max_epochs=1, devices=1, limit_val_batches=3)
    with build_text_loader(config()) as train, build_text_loader(config(shuffle=False, mixture="once")) as val:
        fit.fit(module, train_dataloaders=train, val_dataloaders=val)
        assert train.stats()["batches"] == len(module.trained) > 10
    assert len(module.validated) == 3
    assert [step[1] for step in module.trained] == list(range(len(module.trained)))


@pytest.mark.parametrize("stop_at", ["inside the first epoch", "inside the second epoch"])
def test_mid_epoch_resume_continues_at_the_next_untrained_batch(tmp_path, uninterrupted, stop_at):
    per_epoch = sum(1 for step in uninterrupted if step[0] == 0)
    stop = 7 if stop_at == "inside the first epoch" else per_epoch + 5
    head = run(tmp_path, "stop", max_epochs=2, stop=stop)
    tail = run(tmp_path, "resume", max_epochs=2, stop=stop)
    assert len(head) == stop
    assert head + tail == uninterrupted  # every step: same epoch, batch index and tokens
    assert len(uninterrupted) == 2 * per_epoch


def test_without_the_callback_the_loader_adds_it_and_the_resume_is_exact(tmp_path, uninterrupted):
    """Lightning's fetcher pulls a batch ahead: the callback keeps the saved state at the trained batches. A user
    who forgets it gets it anyway (the training loader adds it at its first iter()), and the run logs that."""
    head = run(tmp_path, "stop", max_epochs=2, stop=7, callback=False)
    tail = run(tmp_path, "resume", max_epochs=2, stop=7, callback=False)
    assert head + tail == uninterrupted


def test_the_callback_is_added_once_to_the_trainer_that_trains_the_loader(tmp_path, caplog):
    module = W.TinyLM()
    fit = W.trainer(tmp_path, max_epochs=1, devices=1, limit_train_batches=2, limit_val_batches=1)
    fit.callbacks[:] = [c for c in fit.callbacks if not isinstance(c, ZephonLoaderCallback)]
    with caplog.at_level("INFO", logger="zephon_loader.integrations.lightning"), \
            build_text_loader(config()) as train, build_text_loader(config(shuffle=False, mixture="once")) as val:
        fit.fit(module, train_dataloaders=train, val_dataloaders=val)
    assert sum(isinstance(c, ZephonLoaderCallback) for c in fit.callbacks) == 1
    assert "added ZephonLoaderCallback" in caplog.text


def test_the_callback_finds_loaders_in_every_shape_lightning_holds_them():
    with build_text_loader(config()) as loader:
        combined = pl.utilities.CombinedLoader({"a": loader, "b": [loader]})
        assert list(zephon_loaders(combined)) == [loader, loader]
        assert list(zephon_loaders([1, {"x": loader}])) == [loader]


def test_set_consumed_refuses_a_count_it_cannot_hand_back():
    with build_text_loader(config(read_ahead=0)) as loader:
        it = iter(loader)
        for _ in range(3):
            next(it)
        with pytest.raises(ValueError, match=r"set_consumed: got 1, expected an int in \[2, 3\]"):
            loader.set_consumed(1)
        loader.set_consumed(2)
        state = loader.state_dict()
        assert sum(lane["batches"] for lane in state["stats"]["lanes"].values()) == 2
    with build_text_loader(config(read_ahead=0)) as fresh, build_text_loader(config(read_ahead=0)) as resumed:
        batches = iter(fresh)
        reference = [next(batches)[W.F.INPUT_IDS] for _ in range(6)][2:]  # batches 3..6: after the 2 consumed
        resumed.load_state_dict(state)
        again = iter(resumed)
        assert all((next(again)[W.F.INPUT_IDS] == ref).all() for ref in reference)


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun on loopback")
@pytest.mark.parametrize("built", ["in train_dataloader()", "passed in"])
def test_ddp_two_processes_resume_exactly_per_rank(tmp_path, built):
    """Lightning DDP (CPU, gloo) under torchrun; the loader is built in ``train_dataloader()`` on each rank, or
    before ``fit`` (its lanes from torchrun's RANK/WORLD_SIZE) and passed in; endless (``passes: null``: lanes
    hold different numbers of batches per pass), trained by steps."""
    worker = Path(__file__).with_name("lightning_worker.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(worker.parent), os.environ.get("PYTHONPATH", "")])}

    def torchrun(*args: str) -> None:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                   "127.0.0.1", "--master_port", str(_free_port()), str(worker), str(tmp_path), *args]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    where = "passed" if built == "passed in" else "module"
    torchrun("full", "20", "-", where)
    torchrun("stop", "20", "9", where)
    torchrun("resume", "20", "9", where)
    records = {(mode, rank): json.loads((tmp_path / f"{mode}_rank{rank}.json").read_text())
               for mode in ("full", "stop", "resume") for rank in (0, 1)}
    for rank in (0, 1):
        assert records["stop", rank] + records["resume", rank] == records["full", rank]
    assert {step[2] for step in records["full", 0]}.isdisjoint(step[2] for step in records["full", 1])  # two lanes
    assert len(records["full", 0]) == len(records["full", 1]) == 20


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun on loopback")
def test_ddp_by_epochs_stays_in_step_and_resumes_exactly(tmp_path):
    """Lightning DDP with the default ``passes: 1`` and ``max_epochs=2`` (no ``max_steps``): both ranks train the
    same number of steps in each epoch (the loader ends every rank's pass at the same batch), and a run stopped
    inside the second epoch and resumed trains exactly the uninterrupted run's batches."""
    worker = Path(__file__).with_name("lightning_worker.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(worker.parent), os.environ.get("PYTHONPATH", "")])}

    def torchrun(*args: str) -> None:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                   "127.0.0.1", "--master_port", str(_free_port()), str(worker), str(tmp_path), *args]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    def record(mode: str, rank: int) -> list:
        return json.loads((tmp_path / f"epochs_{mode}_rank{rank}.json").read_text())

    torchrun("full", "2", "-", "module", "epochs")
    full = [record("full", rank) for rank in (0, 1)]
    per_epoch = [[sum(1 for step in steps if step[0] == epoch) for epoch in (0, 1)] for steps in full]
    assert per_epoch[0] == per_epoch[1] and all(per_epoch[0]), per_epoch
    stop = per_epoch[0][0] + 2  # inside the second epoch, after what was carried into it began
    torchrun("stop", "2", str(stop), "module", "epochs")
    torchrun("resume", "2", str(stop), "module", "epochs")
    for rank in (0, 1):
        assert record("stop", rank) + record("resume", rank) == full[rank], rank
