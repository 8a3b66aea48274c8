"""Step provenance and skipping a range of steps (issue 39 items 2 and 3).

Provenance: what ``loader.provenance(batch)`` says of every yielded batch of an instrumented pass is checked
against the batch itself (each piece's ``input_ids`` span is a contiguous run of the tokens of the record at
that source, shard and line, read back from the file and tokenized here; the pieces tile every non-padding
column of the row), and ``provenance_of_steps`` / ``zephon-loader show`` (a loader that never trains, one rank
alone, from the start or from a state) must say exactly the same, at 1 and 2 ranks.

Skipping: ``skip_batches(n)`` after a state, then ``k`` batches, equals batches ``n .. n + k`` after that state
of the uninterrupted run, at 1 and 2 ranks (same DP size) and elastic 2 -> 1 (a 2-rank state resumed by one
rank: that rank's steps), with the skipped count in ``stats()`` and the skip recorded in the state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from spawned_ranks import error_file, run_ranks

TAKEN = 2  # steps before the state
SKIP = 3  # steps skipped after it
AFTER = 3  # steps compared after the skip
SPECIAL = {0, 1, 2}  # pad, eos, bos of the test tokenizer


def _config(sources, tokenizer_dir: str, aggregate: str | None = None, run_id: str = "t") -> dict:
    cfg = {"sources": sources, "tokenizer": {"path": tokenizer_dir}, "sequence_length": 48, "micro_batch_size": 3,
           "seed": 7, "read_ahead": 2, "runtime": {"runner": "threads"}, "packing": {"algorithm": "wrap"}}
    cfg["distributed"] = {"canonical_replicas": 2, **({"aggregate_dir": aggregate, "run_id": run_id}
                                                      if aggregate else {})}
    return cfg


def _rows(batch) -> list[list[int]]:
    return batch["input_ids"].tolist()


def _worker(task: dict) -> None:
    """One rank: ``mode`` "run" (uninterrupted: provenance of every step, state after TAKEN, the rest),
    "skip" (load the state, skip SKIP, AFTER batches), "resume" (load the state, the rest)."""
    out = Path(task["out"])
    with error_file(out.with_suffix(".error")):
        from zephon_loader.build import build_text_loader

        cfg = _config(task["sources"], task["tokenizer"], task.get("aggregate"), task.get("run", "t"))
        with build_text_loader(cfg, dp_rank=task["rank"], dp_world_size=task["world"]) as loader:
            result: dict = {}
            if task["mode"] == "run":
                it = iter(loader)
                batches, provenance = [], []
                for _ in range(TAKEN):
                    batch = next(it)
                    batches.append(_rows(batch))
                    provenance.append(loader.provenance(batch))
                result["state"] = loader.state_dict()
                for batch in it:
                    batches.append(_rows(batch))
                    provenance.append(loader.provenance(batch))
                result.update(batches=batches, provenance=provenance)
            else:
                loader.load_state_dict(json.loads(Path(task["state"]).read_text()))
                if task["mode"] == "skip":
                    loader.skip_batches(SKIP)
                    result["state"] = loader.state_dict()
                result["batches"] = [_rows(batch) for batch in loader]
                result["stats"] = loader.stats()
        out.write_text(json.dumps(result))


def _run(tasks: list[dict]) -> list[dict]:
    run_ranks(_worker, [(task,) for task in tasks], [Path(task["out"]).with_suffix(".error") for task in tasks],
              bound_s=300, what=Path(tasks[0]["out"]).parent.name)
    return [json.loads(Path(task["out"]).read_text()) for task in tasks]


@pytest.fixture(scope="module")
def sources(jsonl_sources):
    return [{"name": name, "path": str(path), "weight": 1.0} for name, path in sorted(jsonl_sources.items())]


def _record_tokens(tokenizer, piece: dict, cache: dict) -> list[int]:
    """The tokens of the record a piece names, read back from its shard file and line (no loader code)."""
    key = (piece["shard"], piece["line"])
    if key not in cache:
        line = Path(piece["shard"]).read_text().splitlines()[piece["line"] - 1]
        cache[key] = [t for t in tokenizer(json.loads(line)["text"])["input_ids"] if t not in SPECIAL]
    return cache[key]


def _contains(haystack: list[int], needle: list[int]) -> bool:
    n = len(needle)
    return any(haystack[i:i + n] == needle for i in range(len(haystack) - n + 1))


def _check_against_batches(batches: list, provenance: list, tokenizer, sources) -> int:
    """Every piece's span holds tokens of the record it names; the pieces tile each row's non-padding columns."""
    names = {source["name"] for source in sources}
    cache: dict = {}
    checked = 0
    for step, (rows, prov) in enumerate(zip(batches, provenance)):
        assert prov["step"] == step, (prov["step"], step)
        assert len(prov["rows"]) == len(rows)
        for row, pieces in zip(rows, prov["rows"]):
            if not pieces:  # the short last batch of a flush: collate pads the missing rows
                assert all(t == 0 for t in row), "a row with tokens and no piece"
                continue
            column = 0
            for piece in pieces:
                assert piece["source"] in names and Path(piece["shard"]).name.endswith(".jsonl")
                assert piece["start"] == column, (piece, column)
                column = piece["end"]
                span = [t for t in row[piece["start"]:piece["end"]] if t not in SPECIAL]
                assert _contains(_record_tokens(tokenizer, piece, cache), span), (
                    f"step {step}: {piece} holds {span}, not a run of that record's tokens")
                checked += 1
            assert all(t == 0 for t in row[column:]), "columns after the last piece are not padding"
    return checked


def _strip(provenance: list) -> list:
    return [{key: entry[key] for key in ("step", "epoch", "lane", "rows")} for entry in provenance]


@pytest.mark.parametrize("world", [1, 2], ids=["1-rank", "2-ranks"])
def test_provenance_and_skip(tmp_path, sources, tokenizer_dir, tokenizer, world):
    from zephon_loader.build import build_text_loader
    from zephon_loader.cli.show import show

    aggregate = tmp_path / "aggregate"
    aggregate.mkdir()
    common = {"sources": sources, "tokenizer": str(tokenizer_dir), "world": world}
    runs = _run([{**common, "mode": "run", "rank": rank, "aggregate": str(aggregate), "run": "run",
                  "out": str(tmp_path / f"run{rank}.json")} for rank in range(world)])
    state_file = tmp_path / "state.json"
    state_file.write_text(json.dumps(runs[0]["state"]))
    assert all(run["state"] == runs[0]["state"] for run in runs), "every rank's state is the same"
    assert runs[0]["state"]["stats"]["steps"] == TAKEN

    # Provenance of the instrumented pass, checked against the batches themselves.
    for run in runs:
        assert len(run["batches"]) >= TAKEN + SKIP + AFTER, "too few batches: the test would prove little"
        assert _check_against_batches(run["batches"], run["provenance"], tokenizer, sources) > 20
    # show (one rank alone, no training): from the start, and from the state (steps after it only).
    config = tmp_path / "config.yaml"
    import yaml

    config.write_text(yaml.safe_dump({"dataloader": _config(sources, str(tokenizer_dir))}))
    last = TAKEN + SKIP
    for rank, run in enumerate(runs):
        fresh = show(config, (0, last), None, rank, world)
        assert _strip(fresh["steps"]) == _strip(run["provenance"][:last + 1])
        resumed = show(config, (TAKEN, last), state_file, rank, world)
        assert _strip(resumed["steps"]) == _strip(run["provenance"][TAKEN:last + 1])
    with pytest.raises(ValueError, match="before the state's step 2"):
        show(config, (0, 1), state_file, 0, world)

    # Skip SKIP steps after the state: the next batches are the uninterrupted run's, at this DP size ...
    tasks = [{**common, "mode": "skip", "rank": rank, "aggregate": str(aggregate), "run": "skip",
              "state": str(state_file), "out": str(tmp_path / f"skip{rank}.json")} for rank in range(world)]
    if world == 2:  # ... and elastic 2 -> 1: one rank resumes the 2-rank state, plainly and with the skip
        tasks += [{**common, "world": 1, "mode": mode, "rank": 0, "state": str(state_file),
                   "out": str(tmp_path / f"elastic-{mode}.json")} for mode in ("resume", "skip")]
    results = _run(tasks)
    for rank in range(world):
        skipped = results[rank]
        expected = runs[rank]["batches"][TAKEN + SKIP:]
        assert skipped["batches"][:AFTER] == expected[:AFTER]
        assert skipped["batches"] == expected, "the rest of the pass after the skip differs"
        assert skipped["stats"]["skipped_batches"] == SKIP  # this rank's
        assert skipped["stats"]["skipped_steps"] == [{"from_step": TAKEN, "batches": SKIP}]
        assert skipped["state"]["stats"]["steps"] == TAKEN + SKIP
        assert skipped["state"]["stats"]["skips"] == [{"from_step": TAKEN, "batches": SKIP}]
        skipped_docs = sum(entry.get("skipped", {}).get("documents", 0) for entry in skipped["stats"]["sources"].values())
        assert skipped_docs > 0
    if world == 2:
        plain, elastic = results[2], results[3]
        assert len(plain["batches"]) > SKIP + AFTER
        assert elastic["batches"] == plain["batches"][SKIP:], "2 -> 1: the batches after the skip differ"
        assert elastic["stats"]["skipped_batches"] == SKIP

    # show knows a skip recorded in a state; a later state taken after the skip resumes at its step.
    skip_state = tmp_path / "skipped.json"
    skip_state.write_text(json.dumps(results[0]["state"]))
    after = show(config, (TAKEN + SKIP, TAKEN + SKIP), skip_state, 0, world)
    assert after["skipped_steps"] == [{"from_step": TAKEN, "batches": SKIP}]
    assert _strip(after["steps"]) == _strip(runs[0]["provenance"][TAKEN + SKIP:TAKEN + SKIP + 1])
    if world == 1:  # Python provenance(batch) of a resumed loader names the same steps
        with build_text_loader(_config(sources, str(tokenizer_dir)), dp_rank=0, dp_world_size=1) as loader:
            loader.load_state_dict(results[0]["state"])
            batch = next(iter(loader))
            assert _strip([loader.provenance(batch)]) == _strip(runs[0]["provenance"][TAKEN + SKIP:TAKEN + SKIP + 1])
            with pytest.raises(ValueError, match="not one of the last"):
                loader.provenance({"input_ids": batch["input_ids"].clone()})


def test_skip_cli_and_errors(tmp_path, sources, tokenizer_dir):
    """``zephon-loader skip`` writes the state ``skip_batches`` makes; bad counts fail with the numbers."""
    import yaml

    from zephon_loader.build import build_text_loader
    from zephon_loader.cli.commands import main

    cfg = _config(sources, str(tokenizer_dir))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"dataloader": cfg}))
    with build_text_loader(cfg, dp_rank=0, dp_world_size=1) as loader:
        it = iter(loader)
        for _ in range(TAKEN):
            next(it)
        loader.save_state(tmp_path / "state.json")
        rest = [_rows(batch) for batch in it]
    assert main(["skip", str(config), str(tmp_path / "state.json"), "--batches", str(SKIP),
                 "--out", str(tmp_path / "skipped.json")]) == 0
    with build_text_loader(cfg, dp_rank=0, dp_world_size=1) as loader:
        loader.load_state(tmp_path / "skipped.json")
        assert [_rows(batch) for batch in loader] == rest[SKIP:]
        assert loader.stats()["skipped_batches"] == SKIP
        with pytest.raises(ValueError, match="expected an int >= 1"):
            loader.skip_batches(0)
        loader.load_state(tmp_path / "state.json")
        with pytest.raises(ValueError, match="at most the batches left in the pass"):
            loader.skip_batches(10_000)
        assert [_rows(batch) for batch in loader] == rest, "a refused skip leaves the loader at its state"
    assert main(["show", str(config), "--steps", "3-1"]) == 2


def test_skip_and_show_cli_with_per_rank_states(tmp_path, sources, tokenizer_dir, capsys):
    """``distributed.state_scope: rank``: ``show``/``skip`` read every rank's file of a pattern, and ``skip``
    writes a file per rank (``--out`` with ``{dp_rank}``; without it, refused naming the fix)."""
    import yaml

    from zephon_loader.build import build_text_loader
    from zephon_loader.cli.commands import main

    cfg = _config(sources, str(tokenizer_dir), str(tmp_path / "aggregate"), "per-rank")
    (tmp_path / "aggregate").mkdir()
    cfg["distributed"].update(state_scope="rank", even_passes=False)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"dataloader": cfg}))
    loaders = [build_text_loader(cfg, dp_rank=rank, dp_world_size=2) for rank in range(2)]
    try:
        iterators = [iter(loader) for loader in loaders]
        for it in iterators:
            for _ in range(TAKEN):
                next(it)
        for loader in loaders:
            loader.save_state(str(tmp_path / "state-{dp_rank}.json"))
        rest = [[_rows(batch) for batch in it] for it in iterators]
    finally:
        for loader in loaders:
            loader.close()
    pattern = str(tmp_path / "state-*.json")
    assert main(["skip", str(config), pattern, "--batches", str(SKIP), "--world", "2",
                 "--out", str(tmp_path / "skipped.json")]) == 2  # one file for two ranks' states
    assert main(["skip", str(config), pattern, "--batches", str(SKIP), "--world", "2",
                 "--out", str(tmp_path / "skipped-{dp_rank}.json")]) == 0
    for rank in range(2):
        with build_text_loader(cfg, dp_rank=rank, dp_world_size=2) as loader:
            loader.load_state(str(tmp_path / "skipped-{dp_rank}.json"))
            assert [_rows(batch) for batch in loader] == rest[rank][SKIP:], f"rank {rank}"
    capsys.readouterr()
    assert main(["show", str(config), "--steps", f"{TAKEN}-{TAKEN}", "--state", pattern, "--rank", "1", "--world",
                 "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [entry["step"] for entry in report["steps"]] == [TAKEN] and report["rank"] == 1
    assert report["steps"][0]["lane"] == 1, "rank 1 of 2 owns lane 1 of 2"
