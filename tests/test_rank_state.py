"""Per-rank state (issue 38, part 2): ``distributed.state_scope: rank``.

A rank's state holds the lanes it owns and the job-wide fields, taken
without a collective; at another data-parallel size every old rank's state
is loaded (each new rank keeps the lanes it owns now). Checked here:

* size: at 4 ranks with ``canonical_replicas`` 32 a rank's state is within
  1.5x of a 1-rank state with 8 lanes (four real gloo ranks on loopback,
  the agreement on, the states taken mid-pass with read-ahead);
* elastic 4 -> 2 -> 4 with 32 lanes, exact: the rows after each state,
  over the new ranks, are the rows the old ranks had left (the rank loaders
  of one DP size are built side by side in one process: a per-rank state
  needs no collective, and with ``even_passes: false`` nothing else meets);
  the ranks' ``stats()`` add up to the pass;
* what a user gets wrong: one rank's state at another size (refused naming
  the missing lanes and the fix), states of two different steps, a lane
  edited out, a path without ``{dp_rank}``;
* ``save_state("...{dp_rank}...")`` / ``load_state("...*...")``, and a
  job-wide state loaded into a per-rank loader (and back).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from pathlib import Path

import pytest
from spawned_ranks import error_file, free_port, run_ranks

LANES = 32
#: Fails a run whose ranks are not done by then (a hang): far above what they need on a busy 2-core machine.
BOUND_S = 600.0


@pytest.fixture(scope="module")
def sources(jsonl_sources):
    return [{"name": name, "path": str(path), "weight": 1.0} for name, path in sorted(jsonl_sources.items())]


def _config(sources, tokenizer_dir, *, lanes: int = LANES, scope: str = "rank", read_ahead: int = 2,
            run_id: str = "rank-state", aggregate: str | None = None) -> dict:
    """``aggregate``: Zephon's shared folder, which it asks for at several ranks (a per-rank state meets in it
    only at a pass end with ``even_passes``)."""
    return {
        "sources": sources,
        "tokenizer": {"path": str(tokenizer_dir)},
        "sequence_length": 16,
        "micro_batch_size": 1,
        "packing": {"algorithm": "wrap"},
        "seed": 5,
        "read_ahead": read_ahead,
        "runtime": {"runner": "inline"},
        "passes": 1,
        "distributed": {"canonical_replicas": lanes, "state_scope": scope, "even_passes": False, "run_id": run_id,
                        **({"aggregate_dir": aggregate} if aggregate else {})},
    }


def _rows(batch) -> list[tuple[int, ...]]:
    return [tuple(row) for row in batch["input_ids"].tolist()]


def _loader(cfg: dict, rank: int, world: int):
    from zephon_loader.build import build_text_loader

    return build_text_loader(cfg, dp_rank=rank, dp_world_size=world)


@contextlib.contextmanager
def _ranks(cfg: dict, world: int):
    """The loaders of every rank of ``world`` in this process, closed at the end of the block."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(_loader(cfg, rank, world)) for rank in range(world)]


def _phase(cfg: dict, world: int, head: int, states: list[dict] | None) -> dict:
    """``world`` ranks: load ``states`` (every old rank's), take ``head`` batches each, a state each, then the
    rest of the pass. Returns the head/rest rows, the states, and each rank's stats at the end."""
    with _ranks(cfg, world) as loaders:
        if states is not None:
            for loader in loaders:
                loader.load_state_dict(states)
        iterators = [iter(loader) for loader in loaders]
        head_rows = [row for it in iterators for _ in range(head) for row in _rows(next(it))]
        taken = [loader.state_dict() for loader in loaders]
        rest = [row for it in iterators for batch in it for row in _rows(batch)]
        return {"head": head_rows, "states": taken, "rest": rest, "stats": [loader.stats() for loader in loaders]}


def _delivered(reports: list[dict]) -> dict:
    total: dict[str, list[int]] = {}
    for report in reports:
        for name, source in report["sources"].items():
            entry = total.setdefault(name, [0, 0])
            entry[0] += source["delivered"]["documents"]
            entry[1] += source["delivered"]["tokens"]
    return total


def test_elastic_four_two_four_with_32_lanes_is_exact(sources, tokenizer_dir, tmp_path):
    cfg = _config(sources, tokenizer_dir, aggregate=str(tmp_path))
    whole = _phase(cfg, 4, 0, None)  # the uninterrupted pass at 4 ranks
    whole_rows = Counter(whole["rest"])
    assert sum(whole_rows.values()) > 100, "a short pass would prove little"

    four = _phase(cfg, 4, 3, None)
    assert Counter(four["head"] + four["rest"]) == whole_rows
    for rank, state in enumerate(four["states"]):
        assert state["lanes"] == list(range(rank * 8, rank * 8 + 8)), "a rank's state holds its 8 of 32 lanes"
    two = _phase(cfg, 2, 5, four["states"])
    assert Counter(two["head"] + two["rest"]) == Counter(four["rest"]), "4 -> 2 lost or repeated rows"
    assert all(len(state["lanes"]) == 16 for state in two["states"])
    back = _phase(cfg, 4, 2, two["states"])
    assert Counter(back["head"] + back["rest"]) == Counter(two["rest"]), "2 -> 4 lost or repeated rows"
    assert all(back["head"]), "a new rank got nothing"
    # The ranks' reports add up to the whole pass, whatever the topology it went through.
    assert _delivered(back["stats"]) == _delivered(whole["stats"])
    assert sum(report["batches"] for report in back["stats"]) == sum(report["batches"] for report in whole["stats"])


def test_one_ranks_state_at_another_size_is_refused_naming_the_fix(sources, tokenizer_dir, tmp_path):
    cfg = _config(sources, tokenizer_dir, aggregate=str(tmp_path))
    four = _phase(cfg, 4, 1, None)
    with _loader(cfg, 1, 2) as loader:
        with pytest.raises(ValueError) as caught:
            loader.load_state_dict(four["states"][0])  # AutoModel at another size: rank r's file only
        message = str(caught.value)
        assert "lanes [0-7] of 32" in message and "[16-31]" in message and "every rank's state" in message
        with pytest.raises(ValueError, match=r"lanes \[0-15\] of 32, expected also \[16-31\]"):
            loader.load_state_dict(four["states"][:2])  # half of the old ranks
        loader.load_state_dict(four["states"][2:])  # the two that hold its lanes are enough
    job = {**cfg, "distributed": {**cfg["distributed"], "state_scope": "job"}}  # state_scope: rank forgotten
    with _loader(job, 1, 4) as loader, pytest.raises(ValueError, match="set distributed.state_scope: rank"):
        loader.load_state_dict(four["states"][1])  # the same size: its own state would do, with the scope
    with _loader(job, 1, 2) as loader, pytest.raises(ValueError, match="saved with distributed.state_scope: rank "
                                                                        r"\(a state per rank, its own lanes\) at 4 "
                                                                        "rank.s.: pass every rank's state"):
        loader.load_state_dict(four["states"][1])  # another size: only every rank's states do


def test_states_of_two_steps_or_edited_lanes_are_refused(sources, tokenizer_dir, tmp_path):
    from zephon_loader.state import content_checksum

    cfg = _config(sources, tokenizer_dir, aggregate=str(tmp_path))
    early, late = _phase(cfg, 4, 1, None), _phase(cfg, 4, 2, None)
    mixed = [early["states"][0], late["states"][1], late["states"][2], late["states"][3]]
    with _loader(cfg, 0, 2) as loader:
        with pytest.raises(ValueError, match="one step of one job"):
            loader.load_state_dict(mixed)
        edited = json.loads(json.dumps(late["states"][0]))
        edited["lanes"] = edited["lanes"][:-1]  # a lane removed from the list, its checkpoint kept
        edited["checksum"] = content_checksum(edited)
        with pytest.raises(ValueError, match="zephon_checkpoint: holds lanes"):
            loader.load_state_dict(edited)


def test_save_and_load_state_files_per_rank(sources, tokenizer_dir, tmp_path):
    cfg = _config(sources, tokenizer_dir, aggregate=str(tmp_path / "aggregate"))
    with _ranks(cfg, 4) as loaders:
        iterators = [iter(loader) for loader in loaders]
        for it in iterators:
            next(it)
        with pytest.raises(ValueError, match=r"\{dp_rank\}"):
            loaders[0].save_state(tmp_path / "loader.pt")  # four ranks would write one file
        for loader in loaders:
            loader.save_state(str(tmp_path / "loader-{dp_rank}.pt"))
        rest = Counter(row for it in iterators for batch in it for row in _rows(batch))
    assert sorted(p.name for p in tmp_path.glob("loader*")) == [f"loader-{rank}.pt" for rank in range(4)]
    with _ranks(cfg, 2) as resumed:
        for loader in resumed:
            loader.load_state(str(tmp_path / "loader-*.pt"))
        again = Counter(row for loader in resumed for batch in loader for row in _rows(batch))
    assert again == rest
    with pytest.raises(FileNotFoundError, match="no file matches"):
        with _loader(cfg, 0, 1) as loader:
            loader.load_state(str(tmp_path / "nothing-*.pt"))


def test_job_state_loads_into_rank_scope_and_back(sources, tokenizer_dir, tmp_path):
    job_cfg = _config(sources, tokenizer_dir, scope="job", lanes=8)
    rank_cfg = _config(sources, tokenizer_dir, scope="rank", lanes=8, aggregate=str(tmp_path))
    with _loader(job_cfg, 0, 1) as loader:  # one rank: a job state without a collective
        it = iter(loader)
        [next(it) for _ in range(3)]
        job_state = loader.state_dict()
        rest = Counter(row for batch in it for row in _rows(batch))
    assert "lanes" not in job_state
    halves = _phase(rank_cfg, 2, 0, [job_state])
    assert Counter(halves["rest"]) == rest, "a job state cut to each rank's lanes"
    with _ranks(rank_cfg, 2) as two:
        for loader in two:
            loader.load_state_dict(job_state)
        rank_states = [loader.state_dict() for loader in two]  # before iter(): the loaded state, cut
    assert [state["lanes"] for state in rank_states] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with _loader(job_cfg, 0, 1) as loader:  # every rank's states make a job state again
        loader.load_state_dict(rank_states)
        assert "lanes" not in loader.state_dict()
        assert Counter(row for batch in loader for row in _rows(batch)) == rest


# -- four gloo ranks: the size of a rank's state ---------------------------------------------------------------------


def _size_rank(rank: int, world: int, port: int, task: dict) -> None:
    out = Path(task["out"]) / f"rank{rank}.json"
    with error_file(out.with_suffix(".error")):
        import torch.distributed as dist

        from zephon_loader.build import build_text_loader

        if world > 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=rank, world_size=world)
        cfg = _config(task["sources"], task["tokenizer"], lanes=task["lanes"], scope=task["scope"],
                      run_id=task["run"])
        cfg["distributed"]["even_passes"] = True  # the ranks in step, the agreement on
        with build_text_loader(cfg) as loader:
            it = iter(loader)
            rows = [row for _ in range(4) for row in _rows(next(it))]
            state = loader.state_dict()
            rest = [row for batch in it for row in _rows(batch)]
        resumed = []
        with build_text_loader(cfg) as loader:  # the same rank at the same size: its own state
            loader.load_state_dict(state)
            resumed = [row for batch in loader for row in _rows(batch)]
        out.write_text(json.dumps({"bytes": len(json.dumps(state)), "lanes": state.get("lanes"),
                                   "head": rows, "rest": rest, "resumed": resumed}))
        if world > 1:
            dist.destroy_process_group()


def _run_size(tmp_path: Path, sources, tokenizer_dir, name: str, world: int, lanes: int, scope: str) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    task = {"out": str(out), "sources": sources, "tokenizer": str(tokenizer_dir), "lanes": lanes, "scope": scope,
            "run": name}
    port = free_port()
    run_ranks(_size_rank, [(rank, world, port, task) for rank in range(world)],
              [out / f"rank{rank}.error" for rank in range(world)], bound_s=BOUND_S, what=name)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.mark.skipif(not __import__("torch").distributed.is_available(), reason="torch.distributed")
def test_a_ranks_state_at_4_ranks_and_32_lanes_is_within_1_5x_of_one_rank_with_8(tmp_path, sources, tokenizer_dir):
    one = _run_size(tmp_path, sources, tokenizer_dir, "one", 1, 8, "job")
    four = _run_size(tmp_path, sources, tokenizer_dir, "four", 4, 32, "rank")
    job = _run_size(tmp_path, sources, tokenizer_dir, "job", 4, 32, "job")
    for rank, result in enumerate(four):
        assert result["lanes"] == list(range(rank * 8, rank * 8 + 8))
        assert result["bytes"] <= 1.5 * one[0]["bytes"], (result["bytes"], one[0]["bytes"])
        assert result["resumed"] == result["rest"], f"rank {rank}: its own state did not resume exactly"
    # What the job-wide state of the same job costs each rank (the reason for the per-rank one).
    assert min(result["bytes"] for result in job) > 2.5 * max(result["bytes"] for result in four)
    assert all(result["resumed"] == result["rest"] for result in job)


# -- torch.distributed.checkpoint: the per-rank key idiom of docs/distributed.md ----------------------------------------


def _dcp_rank(rank: int, world: int, port: int, task: dict) -> None:
    out = Path(task["out"]) / f"{task['phase']}-rank{rank}.json"
    with error_file(out.with_suffix(".error")):
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        from zephon_loader.build import build_text_loader

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        # even_passes off: each rank reads its lanes to their end (with it, what the longer ranks have left at
        # the agreed end waits for the next epoch, and that remainder depends on the number of ranks).
        cfg = _config(task["sources"], task["tokenizer"], run_id=task["phase"])
        with build_text_loader(cfg) as loader:
            if task["phase"] == "save":
                it = iter(loader)
                head = [row for _ in range(3) for row in _rows(next(it))]
                # Each rank's state under a key of its own (DCP writes one copy of a key every rank shares).
                dcp.save({f"loader_dp_rank_{loader.dp_rank}": json.dumps(loader.state_dict())},
                         checkpoint_id=task["checkpoint"])
                rest = [row for batch in it for row in _rows(batch)]
            else:  # another number of ranks: every old rank's key, found in the checkpoint's metadata
                reader = dcp.FileSystemReader(task["checkpoint"])
                keys = sorted(k for k in reader.read_metadata().state_dict_metadata if k.startswith("loader_dp_rank_"))
                states = {key: "" for key in keys}
                dcp.load(states, checkpoint_id=task["checkpoint"])
                loader.load_state_dict([json.loads(states[key]) for key in keys])
                head, rest = [], [row for batch in loader for row in _rows(batch)]
        out.write_text(json.dumps({"head": head, "rest": rest}))
        dist.destroy_process_group()


@pytest.mark.skipif(not __import__("torch").distributed.is_available(), reason="torch.distributed")
def test_torch_distributed_checkpoint_per_rank_keys_resume_at_another_size(tmp_path, sources, tokenizer_dir):
    task = {"out": str(tmp_path), "sources": sources, "tokenizer": str(tokenizer_dir),
            "checkpoint": str(tmp_path / "dcp")}
    results = {}
    for phase, world in (("save", 4), ("load", 2)):
        port = free_port()
        run_ranks(_dcp_rank, [(rank, world, port, {**task, "phase": phase}) for rank in range(world)],
                  [tmp_path / f"{phase}-rank{rank}.error" for rank in range(world)], bound_s=BOUND_S, what=phase)
        results[phase] = [json.loads((tmp_path / f"{phase}-rank{rank}.json").read_text()) for rank in range(world)]
    saved_rest = Counter(tuple(row) for r in results["save"] for row in r["rest"])
    assert sum(saved_rest.values()) > 50
    assert Counter(tuple(row) for r in results["load"] for row in r["rest"]) == saved_rest


def test_mixture_schedule_phase_survives_per_rank_states(sources, tokenizer_dir, tmp_path):
    """A schedule's phase and each lane's batches in it are per lane too: states taken in phase 1 at 2 ranks
    resume at 1 rank with the rows the 2 ranks went on to read (the same phase, nothing lost or repeated)."""
    cfg = _config(sources, tokenizer_dir, lanes=4, aggregate=str(tmp_path))
    cfg.update(passes=None, mixture={"schedule": [{"until_steps": 3, "weights": {"a": 9.0, "b": 1.0}},
                                                  {"weights": {"a": 1.0, "b": 9.0}}]})
    with _ranks(cfg, 2) as loaders:
        iterators = [iter(loader) for loader in loaders]
        for it in iterators:
            for _ in range(8):  # into phase 1: a step is a batch of every lane, 2 lanes a rank (steps 4 on)
                next(it)
        states = [loader.state_dict() for loader in loaders]
        after = Counter(row for it in iterators for _ in range(6) for row in _rows(next(it)))
    assert all(state["phase"]["index"] == 1 for state in states)
    assert [sorted(map(int, state["phase"]["batches"])) for state in states] == [[0, 1], [2, 3]]
    with _loader(cfg, 0, 1) as loader:
        loader.load_state_dict(states)
        it = iter(loader)
        resumed = Counter(row for _ in range(12) for row in _rows(next(it)))
    assert resumed == after, "the schedule's phase 1 did not continue exactly at 1 rank"


# -- each rank its own file at the same size (AutoModel's pattern): files of two steps are refused at the first batch --


def _steps_rank(rank: int, world: int, port: int, task: dict) -> None:
    out = Path(task["out"]) / f"{task['phase']}-rank{rank}.json"
    with error_file(out.with_suffix(".error")):
        import torch.distributed as dist

        from zephon_loader.build import build_text_loader
        from zephon_loader.nodes.agreement import AgreementError

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        cfg = _config(task["sources"], task["tokenizer"], lanes=4, run_id=task["phase"])
        cfg["distributed"]["even_passes"] = True  # the agreement on
        result: dict = {}
        with build_text_loader(cfg) as loader:
            if task["phase"] == "save":
                it = iter(loader)
                for step in range(1, 5):
                    next(it)
                    if step in (2, 4):
                        loader.save_state(str(Path(task["out"]) / f"step{step}-{{dp_rank}}.json"))
                result["after"] = [row for _ in range(3) for row in _rows(next(it))]
            else:
                steps = task["steps"]
                loader.load_state(str(Path(task["out"]) / f"step{steps[rank]}-{rank}.json"))
                try:
                    it = iter(loader)
                    result["after"] = [row for _ in range(3) for row in _rows(next(it))]
                except AgreementError as error:
                    result["error"] = str(error)
        out.write_text(json.dumps(result))
        dist.destroy_process_group()


@pytest.mark.skipif(not __import__("torch").distributed.is_available(), reason="torch.distributed")
def test_own_files_of_two_steps_are_refused_at_the_first_batch(tmp_path, sources, tokenizer_dir):
    task = {"out": str(tmp_path), "sources": sources, "tokenizer": str(tokenizer_dir)}

    def run(phase: str, steps=None) -> list[dict]:
        port = free_port()
        run_ranks(_steps_rank, [(rank, 2, port, {**task, "phase": phase, "steps": steps}) for rank in range(2)],
                  [tmp_path / f"{phase}-rank{rank}.error" for rank in range(2)], bound_s=BOUND_S, what=phase)
        return [json.loads((tmp_path / f"{phase}-rank{rank}.json").read_text()) for rank in range(2)]

    saved = run("save")
    same = run("same", (4, 4))
    assert [r.get("after") for r in same] == [r["after"] for r in saved], "each rank's own file resumes it exactly"
    mixed = run("mixed", (2, 4))
    for result in mixed:
        assert "steps 2..4" in result.get("error", ""), result
        assert "saved at different steps" in result["error"]


def test_out_of_step_lanes_are_said_at_a_resume_at_another_size_only(sources, tokenizer_dir, tmp_path):
    """A per-rank state cannot tell at save whether the job's lanes were in step; a resume at another size
    says so once (Zephon's own warning needs every lane's count, which a rank restoring its lanes lacks)."""
    import warnings

    from zephon_loader import zephon_compat

    cfg = _config(sources, tokenizer_dir, aggregate=str(tmp_path))
    four = _phase(cfg, 4, 3, None)  # 12 global batches over 32 lanes: out of step
    cuts = [(state["zephon_checkpoint"], state["skip"]) for state in four["states"]]
    assert zephon_compat.lanes_out_of_step(cuts, LANES)
    for world, said in ((4, False), (2, True)):
        zephon_compat._explained.clear()
        with warnings.catch_warnings(record=True) as caught, _ranks(cfg, world) as loaders:
            warnings.simplefilter("always")
            for loader in loaders:
                loader.load_state_dict(four["states"] if world != 4 else four["states"][loader.dp_rank])
        texts = [str(w.message) for w in caught]
        ours = [t for t in texts if t.startswith("zephon_loader: resuming at another data-parallel size")]
        assert len(ours) == int(said), (world, texts)
        assert not any(t.startswith("[zephon]") for t in texts), texts
