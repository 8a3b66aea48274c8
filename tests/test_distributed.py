"""Two data-parallel ranks in two processes: Zephon lanes, the checkpoint collective, exact per-rank resume."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from pathlib import Path

import pytest
import torch
import yaml

from zephon_loader.config import default_config_path

WORLD = 2
TAKEN = 3


def _config(aggregate_dir: str, run_id: str) -> dict:
    node = yaml.safe_load(default_config_path().read_text())["dataloader"]
    node.pop("_target_")
    node.update(
        base_dir=str(default_config_path().parent),
        distributed={"aggregate_dir": aggregate_dir, "run_id": run_id},
        runtime={"runner": "threads"},
        sequence_length=128,
    )
    return node


def _rank(rank: int, aggregate_dir: str, out: str, phase: str) -> None:
    """One rank: 'first' iterates TAKEN batches, saves state (collective), then the rest; 'resume' reloads."""
    try:
        from zephon_loader.build import build_text_loader

        if phase == "first":
            with build_text_loader(_config(aggregate_dir, "first"), dp_rank=rank, dp_world_size=WORLD) as loader:
                it = iter(loader)
                head = [next(it)["input_ids"] for _ in range(TAKEN)]
                state = loader.state_dict()
                rest = [batch["input_ids"] for batch in it]
            torch.save({"head": head, "rest": rest, "state": state}, Path(out) / f"first{rank}.pt")
        else:
            saved = torch.load(Path(out) / f"first{rank}.pt", weights_only=False)
            with build_text_loader(_config(aggregate_dir, "resume"), dp_rank=rank, dp_world_size=WORLD) as loader:
                loader.load_state_dict(saved["state"])
                rest = [batch["input_ids"] for batch in loader]
            torch.save({"rest": rest}, Path(out) / f"resume{rank}.pt")
    except BaseException:
        (Path(out) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise


def _run_ranks(tmp_path: Path, phase: str) -> None:
    context = mp.get_context("spawn")
    aggregate = tmp_path / f"aggregate-{phase}"
    aggregate.mkdir()
    processes = [context.Process(target=_rank, args=(r, str(aggregate), str(tmp_path), phase)) for r in range(WORLD)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(240)
    for rank, process in enumerate(processes):
        if process.is_alive():
            process.kill()
            pytest.fail(f"rank {rank} hung in phase {phase!r}")
        error = tmp_path / f"error{rank}.txt"
        assert process.exitcode == 0, error.read_text() if error.exists() else f"rank {rank} exit {process.exitcode}"


def test_two_ranks_read_their_own_lanes_and_resume_exactly(tmp_path):
    _run_ranks(tmp_path, "first")
    first = [torch.load(tmp_path / f"first{r}.pt", weights_only=False) for r in range(WORLD)]
    for rank, run in enumerate(first):
        assert len(run["rest"]) > TAKEN, f"rank {rank} got almost no data: its lane is starved"
    streams = [torch.cat([b.flatten() for b in run["head"] + run["rest"]]) for run in first]
    assert not torch.equal(streams[0][: streams[1].numel()], streams[1][: streams[0].numel()]), "ranks read the same data"

    _run_ranks(tmp_path, "resume")
    for rank in range(WORLD):
        resumed = torch.load(tmp_path / f"resume{rank}.pt", weights_only=False)["rest"]
        expected = first[rank]["rest"]
        assert len(resumed) == len(expected), f"rank {rank}"
        for got, want in zip(resumed, expected):
            assert torch.equal(got, want), f"rank {rank} resumed differently"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_torchrun_two_ranks_with_the_torch_store():
    """Real torch.distributed (gloo on loopback): Zephon's torch:// aggregate store and exact per-rank resume."""
    import subprocess
    import sys

    worker = Path(__file__).with_name("torchrun_worker.py")
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(worker),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("resume exact: True") == 2, result.stdout
