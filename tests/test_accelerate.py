"""Hugging Face Accelerate 1.15: ``prepare(model, optimizer, loader)`` passes the loader through (Zephon's lanes
shard it), and ``save_state``/``load_state`` resume each process at exactly its next batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="accelerate is not installed (the test extra has it)")

from test_distributed import _free_port  # noqa: E402

WORKER = Path(__file__).with_name("accelerate_worker.py")


def _run(tmp_path: Path, processes: int, how: str = "hooks") -> dict[int, dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(WORKER.parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    command = [sys.executable, str(WORKER), str(tmp_path), how]
    if processes > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                   "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), *command[1:]]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "does not checkpoint it" not in done.stderr
    return {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(processes)}


@pytest.mark.parametrize("processes", [1, 2])
def test_prepare_passes_the_loader_through_and_save_load_state_resume_exactly(tmp_path, processes):
    records = _run(tmp_path, processes)
    for rank, record in records.items():
        assert record["same_object"], "accelerator.prepare re-wrapped the loader"
        assert record["resumed"] == record["reference"], f"rank {rank}: the resume is not at the next batch"
        assert len(set(record["head"] + record["reference"])) == 12
        assert record["files"] == [f"zephon_loader_0_rank{r}.json" for r in range(processes)]
    if processes == 2:
        assert set(records[0]["head"]).isdisjoint(records[1]["head"])  # each process reads its own lane


def test_checkpoint_loaders_refuses_what_is_not_a_zephon_loader():
    from accelerate import Accelerator

    from zephon_loader.accelerate import checkpoint_loaders

    with pytest.raises(TypeError, match="loader 0 is list, expected a ZephonLoader"):
        checkpoint_loaders(Accelerator(cpu=True), [])


def test_load_state_without_this_process_file_names_it(tmp_path):
    from accelerate import Accelerator

    from zephon_loader import build_text_loader
    from zephon_loader.accelerate import checkpoint_loaders
    from lightning_worker import demo_config

    accelerator = Accelerator(cpu=True)
    with build_text_loader(demo_config()) as loader:
        checkpoint_loaders(accelerator, loader)
        folder = tmp_path / "saved_without_hooks"
        folder.mkdir()
        with pytest.raises(FileNotFoundError, match=r"zephon_loader_0_rank0\.json: no state of loader 0"):
            accelerator.load_state(str(folder))


@pytest.mark.parametrize("processes", [1, 2])
def test_register_for_checkpointing_resumes_every_process_exactly(tmp_path, processes):
    """Accelerate's own idiom: it saves the main process's state (every rank's state is the job's) and loads
    it into each process's loader."""
    records = _run(tmp_path, processes, how="register")
    for rank, record in records.items():
        assert record["resumed"] == record["reference"], f"rank {rank}: the resume is not at the next batch"
        assert record["files"] == ["custom_checkpoint_0.pkl"]


@pytest.mark.parametrize("setting", ["split_batches", "dispatch_batches"])
def test_split_and_dispatch_batches_are_refused_by_name(setting):
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    from lightning_worker import demo_config
    from zephon_loader import build_text_loader
    from zephon_loader.accelerate import checkpoint_loaders

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**{setting: True}))
    with build_text_loader(demo_config()) as loader:
        prepared = accelerator.prepare(loader)
        with pytest.raises(ValueError, match=rf"accelerate {setting}: got True, expected False .*micro_batch_size"):
            iter(prepared)  # the user's loop, checkpoint_loaders forgotten
        with pytest.raises(ValueError, match=rf"accelerate {setting}: got True"):
            checkpoint_loaders(accelerator, prepared)


def test_a_loader_iterated_under_an_accelerator_that_does_not_checkpoint_it_is_warned_once():
    from accelerate import Accelerator

    from lightning_worker import demo_config
    from zephon_loader import build_text_loader
    from zephon_loader.accelerate import checkpoint_loaders

    accelerator = Accelerator(cpu=True)
    with build_text_loader(demo_config()) as loader, build_text_loader(demo_config()) as hooked:
        prepared = accelerator.prepare(loader)
        with pytest.warns(RuntimeWarning, match=r"does not checkpoint it: accelerator\.save_state\(\) will not "
                                               r"save its position.*checkpoint_loaders\(accelerator, loader\)"):
            next(iter(prepared))
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")
            next(iter(prepared))  # once per loader
            checkpoint_loaders(accelerator, hooked)
            next(iter(hooked))


def test_skip_first_batches_is_refused_with_the_fix():
    from accelerate import Accelerator

    from lightning_worker import demo_config
    from zephon_loader import build_text_loader
    from zephon_loader.accelerate import checkpoint_loaders

    accelerator = Accelerator(cpu=True)
    with build_text_loader(demo_config()) as loader:
        checkpoint_loaders(accelerator, loader)
        with pytest.raises(AttributeError, match=r"skip_first_batches.*resumes itself.*drop that call"):
            accelerator.skip_first_batches(loader, 3)


def test_a_loader_dealt_to_more_ranks_than_the_accelerators_processes_is_refused(tmp_path):
    """Under torchrun on a CPU machine a plain Accelerator() runs one process, while the loader takes torchrun's
    WORLD_SIZE: each process would train its own model on half the data."""
    from accelerate import Accelerator

    from lightning_worker import demo_config
    from zephon_loader import build_text_loader
    from zephon_loader.accelerate import checkpoint_loaders

    accelerator = Accelerator(cpu=True)
    config = demo_config(distributed={"aggregate_dir": str(tmp_path)})
    with build_text_loader(config, dp_rank=0, dp_world_size=2) as loader:
        checkpoint_loaders(accelerator, loader)
        with pytest.raises(ValueError, match=r"dp_world_size: got 2, expected a divisor of the Accelerator's 1 "
                                             r"process.*Accelerator\(cpu=True\)"):
            iter(loader)
