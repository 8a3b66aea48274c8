"""Edges of the pass agreement (issue 37, items 1-3), two gloo ranks on loopback in a process group.

* Fewer records than ranks: a rank whose lanes hold no record has no batch in
  the pass. Before, every rank ended every epoch at 0 batches without a word
  while the other's carried chain grew by a pipeline per epoch; now every rank
  raises ``EmptyRankError`` at its first ``next()`` naming the ranks and the fix.
* ``set_epoch(0)`` before every pass (a loop that pins the epoch): a pass of
  epoch 0 from its start reads all of epoch 0 again, so what an earlier pass of
  it left is dropped rather than carried. Before, the chain grew by an epoch-0
  pipeline per pass and a state taken late in a pass resumed other rows on the
  rank that carried; now every pass yields the same batches, the state carries
  nothing and resumes exactly.
* A loader iterated on one rank only (evaluation on rank 0): before, its first
  ``next()`` waited in ``new_group`` forever; now it raises ``AgreementError``
  naming ``distributed.even_passes`` and the fix after
  ``ZEPHON_LOADER_AGREEMENT_TIMEOUT_S`` (5 s here), and a loader built with
  ``dp_rank=0, dp_world_size=1`` iterates on that rank alone.

Each run is bounded (a hang fails after ``BOUND_S`` with the children killed).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

import pytest

from conftest import write_jsonl_shards
from spawned_ranks import error_file, free_port, run_ranks

pytestmark = pytest.mark.skipif(not __import__("torch").distributed.is_available(), reason="torch.distributed")

WORLD = 2
#: Fails a run whose ranks are not done by then (a hang): far above what they need on a busy 2-core machine.
BOUND_S = 420.0
#: The agreement's wait for the other ranks at a loader's first batch, in these runs.
START_TIMEOUT_S = 5



def _config(sources, tokenizer_dir: str, run_id: str, **extra) -> dict:
    config = {
        "sources": sources,
        "tokenizer": {"path": tokenizer_dir},
        "sequence_length": 40,
        "micro_batch_size": 2,
        "seed": 11,
        "read_ahead": 1,
        "runtime": {"runner": "threads"},
        "distributed": {"run_id": run_id},
    }
    config.update(extra)
    return config


def _rows(batch) -> list[list[int]]:
    return batch["input_ids"].tolist()


def _rank(rank: int, port: int, scenario: str, task: dict) -> None:
    out = Path(task["out"])
    with error_file(out / f"rank{rank}.error"):
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.environ["ZEPHON_LOADER_AGREEMENT_TIMEOUT_S"] = str(START_TIMEOUT_S)
        dist.init_process_group("gloo", rank=rank, world_size=WORLD)
        result = globals()[f"_{scenario}"](rank, task)
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        if scenario != "alone":  # there rank 1 never joins the loader's group: leave without a collective
            dist.barrier()
            dist.destroy_process_group()


def _run(tmp_path: Path, scenario: str, task: dict) -> list[dict]:
    task = dict(task, out=str(tmp_path))
    port = free_port()
    run_ranks(_rank, [(rank, port, scenario, task) for rank in range(WORLD)],
              [tmp_path / f"rank{rank}.error" for rank in range(WORLD)], bound_s=BOUND_S, what=scenario)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


# ----------------------------------------------------------------------------- 1: a rank without records


def _empty_rank(rank: int, task: dict) -> dict:
    from zephon_loader.build import build_text_loader

    sources = [{"name": "tiny", "path": task["tiny"]}]
    result = {}
    with build_text_loader(_config(sources, task["tokenizer"], "empty")) as loader:
        started = time.monotonic()
        try:
            next(iter(loader), None)
            result["error"] = None
        except Exception as error:  # noqa: BLE001 - the type is checked by the test
            result["error"] = f"{type(error).__name__}: {error}"
        result["seconds"] = time.monotonic() - started
        try:  # the same error again on a retry (no collective, no hang), not a silent empty pass
            next(iter(loader), None)
            result["again"] = None
        except Exception as error:  # noqa: BLE001
            result["again"] = f"{type(error).__name__}: {error}"
    # even_passes: false, as the message advises: each rank reads its own lanes (one rank has the record).
    with build_text_loader(_config(sources, task["tokenizer"], "uneven", distributed={
            "run_id": "uneven", "even_passes": False})) as loader:
        result["uneven_batches"] = sum(1 for _ in loader)
    return result


def test_a_rank_without_records_fails_at_once_naming_the_fix(tmp_path, tokenizer_dir):
    tiny = write_jsonl_shards(tmp_path / "tiny", [{"text": "alpha beta gamma delta"}], shards=1)
    ranks = _run(tmp_path, "empty_rank", {"tiny": str(tiny), "tokenizer": str(tokenizer_dir)})
    errors = [rank["error"] for rank in ranks]
    assert all(errors), f"a rank ended its pass without an error (before: 0 batches on every rank): {ranks}"
    assert errors[0] == errors[1], "the ranks raised different errors"
    empty = [rank for rank in range(WORLD) if ranks[rank]["uneven_batches"] == 0]
    assert sorted(rank["uneven_batches"] for rank in ranks) == [0, 1], ranks
    message = errors[0]
    assert message.startswith("EmptyRankError: distributed.even_passes: "), message
    assert f"rank(s) {empty} of the {WORLD} in the process group have no batch in epoch 0's pass" in message
    assert "distributed.even_passes: false" in message and "dp_world_size=1" in message
    assert "micro_batch_size 2" in message
    assert [rank["again"] for rank in ranks] == errors


# ----------------------------------------------------------------------------- 2: the epoch pinned


PASSES = 3


def _pinned_epoch(rank: int, task: dict) -> dict:
    from zephon_loader.build import build_text_loader

    config = _config(task["sources"], task["tokenizer"], "pinned")
    passes, ended_states = [], []
    with build_text_loader(config) as loader, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index in range(PASSES):
            loader.set_epoch(0)  # pinned: every pass is epoch 0
            rows = []
            iterator = iter(loader)
            if index == PASSES - 1:  # late in the last pass: a state, then the rest
                count = len(passes[0]) // 2
                for _ in range(count - 1):
                    rows += _rows(next(iterator))
                late_state = json.loads(json.dumps(loader.state_dict()))
                late_at = len(rows)
            rows += [row for batch in iterator for row in _rows(batch)]
            passes.append(rows)
            ended_states.append(loader.state_dict())
        chain = loader._source.chain_epochs
    pinned = [str(w.message) for w in caught if "starts again from its beginning" in str(w.message)]
    with build_text_loader(config) as loader:
        loader.load_state_dict(late_state)
        resumed = [row for batch in loader for row in _rows(batch)]
    return {"passes": passes, "chain": chain, "late_state": late_state, "late_at": late_at, "resumed": resumed,
            "ended_states": ended_states, "pinned_warnings": pinned}


def test_a_pinned_epoch_reads_the_same_pass_and_resumes_exactly(tmp_path, jsonl_sources, tokenizer_dir):
    sources = [{"name": name, "path": str(path), "weight": 1.0} for name, path in sorted(jsonl_sources.items())]
    ranks = _run(tmp_path, "pinned_epoch", {"sources": sources, "tokenizer": str(tokenizer_dir)})
    assert any(ranks[0]["ended_states"][0]["carry"]), "no rank had batches left at the agreed end: proves nothing"
    for rank, run in enumerate(ranks):
        assert run["passes"][1:] == run["passes"][:1] * (PASSES - 1), f"rank {rank}: the pinned passes differ"
        assert run["chain"] == [0], f"rank {rank}: the chain grew to epochs {run['chain']}"
        assert not run["late_state"].get("carried") and not run["late_state"].get("carry"), (
            f"rank {rank}: the state late in a pinned pass carries {run['late_state'].get('carried')}")
        assert run["resumed"] == run["passes"][-1][run["late_at"]:], f"rank {rank}: the resume read other rows"
    # What a rank had left is not carried into a pass that reads the same epoch again: said once, with the fix.
    assert all(len(run["pinned_warnings"]) == 1 and "distributed.even_passes: false" in run["pinned_warnings"][0]
               for run in ranks), [run["pinned_warnings"] for run in ranks]
    sizes = [len(json.dumps(state)) for state in ranks[0]["ended_states"]]
    assert max(sizes) <= min(sizes) + 64, f"the state grows pass after pass: {sizes} bytes"


# ----------------------------------------------------------------------------- 3: one rank iterates


def _alone(rank: int, task: dict) -> dict:
    from zephon_loader.build import build_text_loader

    config = _config(task["sources"], task["tokenizer"], "alone")
    done = Path(task["out"]) / "rank0.done"
    if rank != 0:  # built on every rank, iterated on rank 0 only (evaluation on rank 0)
        with build_text_loader(config):
            deadline = time.monotonic() + BOUND_S
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
        return {}
    result = {}
    try:
        with build_text_loader(config) as loader:
            started = time.monotonic()
            try:
                next(iter(loader))
                result["error"] = None
            except Exception as error:  # noqa: BLE001 - the type is checked by the test
                result["error"] = f"{type(error).__name__}: {error}"
            result["seconds"] = time.monotonic() - started
        # The advice: built as the only rank, it reads every record here.
        with build_text_loader(config, dp_rank=0, dp_world_size=1) as loader:
            result["alone_batches"] = sum(1 for _ in loader)
    finally:
        done.write_text("")
    return result


def test_a_loader_iterated_on_one_rank_fails_within_seconds(tmp_path, jsonl_sources, tokenizer_dir):
    sources = [{"name": "a", "path": str(jsonl_sources["a"])}]
    first, _ = _run(tmp_path, "alone", {"sources": sources, "tokenizer": str(tokenizer_dir)})
    assert first["error"], "iterated on rank 0 alone, the loader ran without the other rank"
    assert first["seconds"] < START_TIMEOUT_S + 60, first
    message = first["error"]
    assert message.startswith("AgreementError: distributed.even_passes: rank 0 began iterating"), message
    assert "distributed.even_passes" in message and f"rank(s) [1] of the {WORLD}" in message
    assert "dp_rank=0, dp_world_size=1" in message and "even_passes: false" in message
    assert "ZEPHON_LOADER_AGREEMENT_TIMEOUT_S" in message
    assert first["alone_batches"] > 0
