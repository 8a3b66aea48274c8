"""Per-rank loader state (``distributed.state_scope: rank``) under the trainers that save it, or refuse it.

* ``ZephonTrainer`` (tests/hf_trainer_worker.py): two torchrun processes
  checkpoint mid-pass, each writing its own lanes; resumed at one process
  (it reads every rank's file) the run trains the rows the two processes
  trained after that step, and resumed at two each process trains exactly
  its own batches again.
* Accelerate's ``checkpoint_loaders`` (tests/accelerate_worker.py): the same
  at two processes and then one; ``register_for_checkpointing`` of a
  per-rank loader at two processes is refused (Accelerate saves the main
  process's objects only).
* Lightning DDP (tests/lightning_cases.py, Lightning's own launcher): a
  per-rank loader is refused at ``fit`` (Lightning saves rank 0's
  checkpoint only), and runs at one process.

The loaders deal the demo into 4 lanes: rank 0 of 2 owns lanes 0-1, rank 1
lanes 2-3; a rank reads its lanes in turn, a batch each. A resume at one
process is compared lane by lane (:func:`assert_each_lane_goes_on_at_its_next_batch`):
each lane goes on at its next batch, none lost or repeated.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spawned_ranks import free_port

#: Fails a launch that is not done by then (a hang): far above what it needs on a busy 2-core machine.
BOUND_S = 900
#: The loader keys of every run here: 4 lanes, each rank's state holds its own.
RANK_SCOPE = {"distributed": {"canonical_replicas": 4, "state_scope": "rank"}}
#: The lanes each of two ranks owns.
OWNED = {0: [0, 1], 1: [2, 3]}

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="torchrun / gloo on loopback")


def _env(worker: Path) -> dict[str, str]:
    """The worker's folder, and the folder of the zephon_loader this test imported (a subprocess run elsewhere, or
    in another checkout than the installed one, tests this code)."""
    import zephon_loader

    package_root = str(Path(zephon_loader.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(worker.parent), package_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _torchrun(worker: Path, processes: int, *arguments: str) -> subprocess.CompletedProcess:
    """``worker arguments`` at ``processes`` processes (torchrun when more than one); fails on a non-zero exit."""
    command = [sys.executable, str(worker), *arguments]
    if processes > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                   "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *command[1:]]
    done = subprocess.run(command, env=_env(worker), capture_output=True, text=True, timeout=BOUND_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


# -- ZephonTrainer ---------------------------------------------------------------------------------------------------

HF_WORKER = Path(__file__).with_name("hf_trainer_worker.py")
#: Two processes train STEPS steps (a micro-batch each, 8 rows) and checkpoint every SAVE_AT, inside the first pass.
STEPS, SAVE_AT, ROWS = 12, 4, 8


def _hf(out: Path, phase: str, processes: int, **options) -> list[dict]:
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    options = {"save_strategy": "steps", "save_steps": SAVE_AT, "loader": RANK_SCOPE, **options}
    _torchrun(HF_WORKER, processes, str(out), phase, json.dumps(options))
    return [json.loads((out / f"{phase}_rank{rank}.json").read_text()) for rank in range(processes)]


def _batches(rows: list[str]) -> list[frozenset[str]]:
    return [frozenset(rows[start:start + ROWS]) for start in range(0, len(rows), ROWS)]


def assert_each_lane_goes_on_at_its_next_batch(resumed: list[str], full: list[list[str]], step: int) -> None:
    """``resumed``: the row hashes one process trained from a checkpoint at ``step`` of a two-process run whose
    ranks trained the rows ``full[rank]`` (from the stream's start, ``ROWS`` a batch, a rank's lanes in turn).
    Each resumed batch is a batch of ``full`` (a lane's); lane by lane, in order, they are the batches that lane
    gave after ``step``, from its first on: no row lost, none repeated, none from before the checkpoint.

    By lane, not by step: after a resume at another size the lanes interleave otherwise than in a fresh run (with
    read-ahead, job scope as well: a lane comes a batch early), so ``2 n`` steps at one process need not hold the
    rows of ``n`` steps of each of two processes; ``full`` must run far enough past ``step`` for the lane ahead.
    """
    where = {batch: (rank, index) for rank, rows in enumerate(full) for index, batch in enumerate(_batches(rows))}
    by_lane: dict[int, list[int]] = {}
    for position, batch in enumerate(_batches(resumed)):
        assert batch in where, f"resumed batch {position} is no batch the two processes trained (rows mixed up)"
        rank, index = where[batch]
        by_lane.setdefault(OWNED[rank][index % 2], []).append(index)
    for lane, indices in sorted(by_lane.items()):
        first = step + (step + OWNED[lane // 2].index(lane)) % 2  # the lane's first batch after the checkpoint
        assert indices == list(range(first, first + 2 * len(indices), 2)), (
            f"lane {lane}: resumed with its batches {indices} of rank {lane // 2}, expected {first}, {first + 2}, "
            "... (each lane at its next batch, none lost or repeated)")
    assert sorted(by_lane) == [0, 1, 2, 3], f"lanes {sorted(by_lane)} only: a rank's lanes were not resumed"


@pytest.fixture(scope="module")
def hf_two(tmp_path_factory):
    """The uninterrupted two-process ZephonTrainer run (checkpoints every SAVE_AT steps)."""
    out = tmp_path_factory.mktemp("hf_rank_scope")
    return out, _hf(out, "full", 2, max_steps=STEPS)


@linux_only
def test_zephon_trainer_saves_each_ranks_lanes_and_resumes_at_one_process_and_at_two(hf_two):
    out, full = hf_two
    saved = list(range(SAVE_AT, STEPS + 1, SAVE_AT))
    assert [record["saved"] for record in full] == [saved] * 2
    for rank, record in enumerate(full):
        assert len(record["seen"]) == STEPS and len(record["rows"]) == STEPS * ROWS
        # Each process's file holds the lanes it owns, not every lane (a job-wide state has no "lanes").
        assert record["lanes"] == {str(step): OWNED[rank] for step in saved}, rank
    assert set(full[0]["rows"]).isdisjoint(full[1]["rows"])  # each process its own lanes
    checkpoint = str(out / "full" / f"checkpoint-{SAVE_AT}")

    # One process reads every rank's file and trains what both had left: 2 x SAVE_AT batches here.
    [one] = _hf(out, "one", 1, max_steps=3 * SAVE_AT, resume=checkpoint)
    assert len(one["rows"]) == 2 * SAVE_AT * ROWS
    assert_each_lane_goes_on_at_its_next_batch(one["rows"], [record["rows"] for record in full], SAVE_AT)
    assert one["lanes"][str(3 * SAVE_AT)] == [0, 1, 2, 3]  # one process owns every lane now

    # Two processes again: each trains exactly the batches it trained after the checkpoint.
    two = _hf(out, "two", 2, max_steps=STEPS, resume=checkpoint)
    for rank in (0, 1):
        assert two[rank]["seen"] == full[rank]["seen"][SAVE_AT:], f"rank {rank}: not its next batches"


# -- Accelerate ------------------------------------------------------------------------------------------------------

ACCELERATE_WORKER = Path(__file__).with_name("accelerate_worker.py")


@pytest.fixture(scope="module")
def accelerate_two(tmp_path_factory):
    """Two processes with checkpoint_loaders: save_state after HEAD steps, REST more, a resume from the folder;
    then a per-rank loader registered with register_for_checkpointing (tests/accelerate_worker.py rank_scope)."""
    pytest.importorskip("accelerate", reason="accelerate is not installed (the test extra has it)")
    out = tmp_path_factory.mktemp("accelerate_rank_scope")
    _torchrun(ACCELERATE_WORKER, 2, str(out), "rank-two")
    return out, [json.loads((out / f"rank-two_rank{rank}.json").read_text()) for rank in (0, 1)]


@linux_only
def test_checkpoint_loaders_saves_each_ranks_lanes_and_resumes_at_two_processes_and_at_one(accelerate_two):
    from accelerate_worker import HEAD, REST

    out, two = accelerate_two
    for rank, record in enumerate(two):
        assert record["files"] == ["zephon_loader_0_rank0.json", "zephon_loader_0_rank1.json"]
        assert record["lanes"] == OWNED[rank], f"rank {rank}'s file does not hold just its lanes"
        assert record["resumed"] == record["reference"], f"rank {rank}: the resume is not at its next batch"
        assert len(record["rows"]) == (HEAD + REST) * ROWS
    assert set(two[0]["rows"]).isdisjoint(two[1]["rows"])
    _torchrun(ACCELERATE_WORKER, 1, str(out), "rank-one")  # its load hook reads both processes' files
    one = json.loads((out / "rank-one_rank0.json").read_text())
    assert len(one["rows"]) == REST * ROWS
    assert_each_lane_goes_on_at_its_next_batch(one["rows"], [record["rows"] for record in two], HEAD)


@linux_only
def test_register_for_checkpointing_of_a_per_rank_loader_at_two_processes_is_refused(accelerate_two):
    _, two = accelerate_two
    for rank, record in enumerate(two):
        assert record["refused"] is not None, f"rank {rank}: a per-rank loader registered for checkpointing ran"
        assert "state_scope: got 'rank' for a loader registered with accelerator.register_for_checkpointing" \
            in record["refused"] and "checkpoint_loaders(accelerator, loader)" in record["refused"], record["refused"]


# -- Lightning -------------------------------------------------------------------------------------------------------

LIGHTNING_CASES = Path(__file__).with_name("lightning_cases.py")
#: What the refusal says: the setting, the value, and why (Lightning's checkpoint is rank 0's alone).
LIGHTNING_REFUSAL = ("distributed.state_scope: got 'rank' under a Lightning Trainer of 2 processes, expected 'job': "
                     "Lightning writes its checkpoint on rank 0 only")


@linux_only
def test_lightning_ddp_refuses_a_per_rank_loader_at_fit_and_one_process_trains(tmp_path):
    """Lightning's own DDP launcher (2 CPU processes, gloo): fit stops at the loader's first iter() with the
    ValueError, before any checkpoint that could not resume. At one process a per-rank state is every lane's."""
    pytest.importorskip("lightning.pytorch", reason="lightning is not installed (the test extra has it)")
    import lightning_cases as C

    options = {"max_epochs": 1, "limit_train_batches": 2, "loader": RANK_SCOPE,
               "checkpoint": {"every_n_train_steps": 1, "filename": "{step}"}}
    done = subprocess.run([sys.executable, str(LIGHTNING_CASES), str(tmp_path), "ddp", "2", json.dumps(options)],
                          env=_env(LIGHTNING_CASES), capture_output=True, text=True, timeout=BOUND_S, cwd=tmp_path)
    assert done.returncode != 0, "a per-rank loader trained under Lightning DDP:\n" + done.stderr[-3000:]
    assert LIGHTNING_REFUSAL in done.stderr, done.stdout[-3000:] + done.stderr[-3000:]
    assert not list((tmp_path / "ddp").glob("*.ckpt")), "a checkpoint was written before the refusal"
    assert not list(tmp_path.glob("ddp_rank*.json"))

    trained, _ = C.fit(tmp_path / "one", **options)
    assert len(trained) == 2
    assert len(list((tmp_path / "one").glob("*.ckpt"))) == 2
