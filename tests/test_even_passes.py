"""Ranks in step at every pass end (issue 18, part 1): the same number of batches per rank in every epoch.

Four gloo ranks on loopback in a process group, the default ``passes: 1``, a
plain ``for epoch: for batch in loader`` loop with one ``all_reduce`` per batch
(what DDP/FSDP do) and a ``state_dict()`` at each epoch's end. Without the
agreement the lanes hold different numbers of batches, the loop pairs one
rank's epoch 1 with another's epoch 0 and then hangs or crashes. With it:

* every rank finishes, every step's collective pairs the same epoch, and each
  epoch has the same batch count on every rank;
* nothing is lost or repeated: each rank's batches over the epochs are, in
  order, its lanes' own stream (pass 0, then pass 1), which the same ranks read
  with ``even_passes: false`` (each pass ending with its own lanes);
* the state at an epoch's end resumes the next epoch exactly (what was carried
  included), and the ranks' states are the same.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import traceback
from pathlib import Path

import pytest

WORLD = 4
EPOCHS = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _config(sources, tokenizer_dir: str, read_ahead: int, even: bool, run_id: str) -> dict:
    return {
        "sources": sources,
        "tokenizer": {"path": tokenizer_dir},
        "sequence_length": 40,
        "micro_batch_size": 2,
        "seed": 11,
        "read_ahead": read_ahead,
        "runtime": {"runner": "threads"},
        "distributed": {"run_id": run_id, "even_passes": even},
    }


def _rows(batch) -> list[list[int]]:
    return batch["input_ids"].tolist()


def _rank(rank: int, port: int, task: dict) -> None:
    out = Path(task["out"]) / f"rank{rank}.json"
    try:
        import os

        import torch
        import torch.distributed as dist

        from zephon_loader.build import build_text_loader

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # as torchrun sets them
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        results = {}
        for read_ahead in (0, 2):
            # Reference: each rank's own lanes, pass after pass (no agreement; counts differ).
            reference, counts = [], []
            with build_text_loader(_config(task["sources"], task["tokenizer"], read_ahead, False,
                                           f"ref-{read_ahead}")) as loader:
                for _ in range(EPOCHS + 1):
                    rows = [row for batch in loader for row in _rows(batch)]
                    reference += rows
                    counts.append(len(rows))
            dist.barrier()
            # The loop users write: an all_reduce per batch, a state at each epoch's end.
            epochs, states, stats = [], [], []
            with build_text_loader(_config(task["sources"], task["tokenizer"], read_ahead, True,
                                           f"even-{read_ahead}")) as loader:
                for epoch in range(EPOCHS):
                    rows = []
                    for batch in loader:
                        seen = torch.tensor([epoch, -epoch])
                        dist.all_reduce(seen, op=dist.ReduceOp.MIN)  # pairs the same step on every rank
                        assert seen.tolist() == [epoch, -epoch], f"rank {rank} paired epoch {epoch} with another"
                        rows += _rows(batch)
                    epochs.append(rows)
                    states.append(loader.state_dict())
                    stats.append(loader.stats())
            # The state at the end of epoch 0 resumes epoch 1 exactly, carried batches first.
            with build_text_loader(_config(task["sources"], task["tokenizer"], read_ahead, True,
                                           f"resume-{read_ahead}")) as loader:
                loader.load_state_dict(json.loads(json.dumps(states[0])))
                resumed = [row for batch in loader for row in _rows(batch)]
            results[read_ahead] = {"reference": reference, "pass_counts": counts, "epochs": epochs,
                                   "states": states, "resumed": resumed, "stats": stats}
        dist.destroy_process_group()
        out.write_text(json.dumps(results))
    except BaseException:
        out.with_suffix(".error").write_text(traceback.format_exc())
        raise


@pytest.mark.skipif(not __import__("torch").distributed.is_available(), reason="torch.distributed")
def test_epoch_loops_stay_in_step_and_lose_nothing(tmp_path, jsonl_sources, tokenizer_dir):
    sources = [{"name": name, "path": str(path), "weight": 1.0} for name, path in sorted(jsonl_sources.items())]
    task = {"sources": sources, "tokenizer": str(tokenizer_dir), "out": str(tmp_path)}
    context = mp.get_context("spawn")
    port = _free_port()
    processes = [context.Process(target=_rank, args=(rank, port, task)) for rank in range(WORLD)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(420)
    for rank, process in enumerate(processes):
        if process.is_alive():
            for other in processes:
                other.kill()
            pytest.fail(f"rank {rank} hung")
        error = tmp_path / f"rank{rank}.error"
        assert process.exitcode == 0, error.read_text() if error.exists() else f"rank {rank}: exit {process.exitcode}"
    ranks = [{int(k): v for k, v in json.loads((tmp_path / f"rank{r}.json").read_text()).items()} for r in range(WORLD)]

    for read_ahead in (0, 2):
        runs = [r[read_ahead] for r in ranks]
        uneven = {tuple(run["pass_counts"][:1]) for run in runs}
        assert len(uneven) > 1, f"the lanes hold the same number of rows per pass ({uneven}): the test proves nothing"
        for epoch in range(EPOCHS):
            assert len({len(run["epochs"][epoch]) for run in runs}) == 1, (
                read_ahead, epoch, [len(run["epochs"][epoch]) for run in runs])
        for rank, run in enumerate(runs):
            delivered = [row for rows in run["epochs"] for row in rows]
            assert delivered == run["reference"][:len(delivered)], (
                f"read_ahead={read_ahead}, rank {rank}: not its lanes' own stream in order (lost or repeated rows)")
            assert run["resumed"] == run["epochs"][1], f"read_ahead={read_ahead}, rank {rank}: resume of epoch 1"
            assert run["stats"][0]["batches"] * 2 == len(run["epochs"][0])  # B = 2 rows per batch
        assert all(run["states"] == runs[0]["states"] for run in runs), "the ranks' states differ"
        carried = [run["stats"][1]["carried_batches"] for run in runs]
        assert any(carried), f"nothing was carried into epoch 1 ({carried}): the test proves nothing"
        assert runs[0]["states"][0]["pass_ended"] and runs[0]["states"][0]["carry"], "the ended pass records its carry"
