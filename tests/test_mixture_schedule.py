"""Mixture schedules (issue 40 item 1): ``mixture: {schedule: [...]}`` phases by steps or tokens.

* the weights switch exactly at each boundary (per-phase accounting: nothing of a phase after its end);
* a state taken before, at and after each boundary of a three-phase schedule resumes to exactly the
  uninterrupted run, at 1 rank (read_ahead 0 and 2), at 2 ranks, and elastically 2 -> 1;
* a phase that had not begun may change on resume (it takes effect at its boundary); a past or the current
  phase may not (refused, naming it);
* ``stats()`` reports tokens per source per phase.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path

import pytest
from spawned_ranks import error_file, run_ranks

ENDS = (3, 6)  # phase 0: steps 1-3, phase 1: 4-6, phase 2: 7 on
CUTS = (2, 3, 4, 5, 6, 7)  # before, at and after each boundary
TOTAL = 9
WEIGHTS = ({"a": 9.0, "b": 1.0}, {"a": 1.0, "b": 9.0}, {"a": 1.0, "b": 1.0})


def _schedule(ends=ENDS, weights=WEIGHTS, key="until_steps"):
    phases = [{key: end, "weights": dict(w)} for end, w in zip(ends, weights)]
    return {"schedule": phases + [{"weights": dict(weights[-1])}]}


def _config(sources, tokenizer_dir, **extra) -> dict:
    config = {"sources": sources, "tokenizer": {"path": str(tokenizer_dir)}, "sequence_length": 32,
              "micro_batch_size": 2, "seed": 5, "passes": None, "read_ahead": 2, "runtime": {"runner": "threads"},
              "mixture": _schedule()}
    config.update(extra)
    return config


def _rows(batch) -> list[list[int]]:
    return batch["input_ids"].tolist()


@pytest.fixture(scope="module")
def sources(jsonl_sources):
    return [{"name": name, "path": str(path)} for name, path in sorted(jsonl_sources.items())]


def _take(loader, n):
    it = iter(loader)
    return [_rows(next(it)) for _ in range(n)]


# ----------------------------------------------------------------------------- configuration


def test_schedule_is_validated_in_one_place(sources, tokenizer_dir):
    from zephon_loader.config import MixtureSchedule, text_loader_config

    config = text_loader_config(**_config(sources, tokenizer_dir, mixture=_schedule(key="until_tokens")))
    assert isinstance(config.mixture, MixtureSchedule) and config.schedule[0].until_tokens == 3.0
    assert text_loader_config(**_config(sources, tokenizer_dir, mixture={"schedule": [
        {"until_tokens": "2e9", "weights": {"a": 3, "b": 1}}, {"weights": {"a": 1, "b": 1}}]})).schedule[0].until_tokens == 2e9
    bad = [
        ({"schedule": [{"until_steps": 3, "weights": {"a": 1}}, {"weights": {"a": 1, "b": 1}}]},
         r"schedule\[0\]\.weights: .*missing \['b'\]"),
        ({"schedule": [{"until_steps": 3, "weights": {"a": 1, "b": 0}}, {"weights": {"a": 1, "b": 1}}]},
         r"schedule\[0\]\.weights\.b: got 0"),
        ({"schedule": [{"until_steps": 3, "weights": {"a": 1, "b": 1}}, {"until_steps": 3, "weights": {"a": 1, "b": 1}},
                       {"weights": {"a": 1, "b": 1}}]}, r"schedule\[1\]\.until_steps: got 3, expected a number > 3"),
        ({"schedule": [{"weights": {"a": 1, "b": 1}}, {"weights": {"a": 1, "b": 1}}]},
         r"schedule\[0\]: .*expected exactly one of until_steps or until_tokens"),
        ({"schedule": [{"until_steps": 3, "weights": {"a": 1, "b": 1}}]}, r"schedule\[0\]: got until_steps on the last"),
        ({"schedule": [{"until_steps": 3, "weights": {"a": 1, "b": 1}}, {"until_tokens": 900, "weights": {"a": 1, "b": 1}},
                       {"weights": {"a": 1, "b": 1}}]}, r"schedule\[1\]\.until_tokens: got until_tokens after phases"),
        ({"schedule": [{"until_step": 3, "weights": {"a": 1, "b": 1}}]}, r"did you mean 'until_steps'"),
    ]
    for mixture, message in bad:
        with pytest.raises((ValueError, TypeError), match=message):
            text_loader_config(**_config(sources, tokenizer_dir, mixture=mixture))
    with pytest.raises(ValueError, match="dataloader.passes: got 1 with a mixture schedule, expected null"):
        text_loader_config(**_config(sources, tokenizer_dir, passes=1))


# ----------------------------------------------------------------------------- one rank


@pytest.mark.parametrize("read_ahead", [0, 2])
def test_one_rank_resumes_exactly_before_at_and_after_each_boundary(sources, tokenizer_dir, read_ahead):
    from zephon_loader.build import build_text_loader

    cfg = _config(sources, tokenizer_dir, read_ahead=read_ahead)
    with build_text_loader(cfg) as loader:
        it = iter(loader)
        full, phases_seen = [], []
        for step in range(1, TOTAL + 1):
            full.append(_rows(next(it)))
            phases_seen.append(sorted(loader.stats()["phases"], key=int)[-1])
        report = loader.stats()
    # The weights switch exactly at each boundary: the batch after step 3 is phase 1's, after 6 phase 2's.
    assert phases_seen == ["0"] * 3 + ["1"] * 3 + ["2"] * 3
    # Phase 0 reads a:b at 9:1, phase 1 at 1:9: the switch shows in what each phase delivered.
    tokens = {phase: {name: counts["tokens"] for name, counts in by_source.items()}
              for phase, by_source in report["phases"].items()}
    assert tokens["0"].get("a", 0) > 3 * tokens["0"].get("b", 0), tokens
    assert tokens["1"].get("b", 0) > 3 * tokens["1"].get("a", 0), tokens
    for name, counts in report["sources"].items():  # per phase adds up to per source
        assert sum(by_source.get(name, {}).get("tokens", 0) for by_source in report["phases"].values()) == \
            counts["delivered"]["tokens"]

    for cut in CUTS:
        with build_text_loader(cfg) as loader:
            head = _take(loader, cut)
            state = json.loads(json.dumps(loader.state_dict()))
        assert head == full[:cut]
        expected_phase = sum(cut >= end for end in ENDS)
        assert state["phase"]["index"] == expected_phase, (cut, state["phase"])
        assert len(state["fingerprint"]["schedule"]) == expected_phase + 1  # past and current phases only
        with build_text_loader(cfg) as loader:
            loader.load_state_dict(state)
            rest = _take(loader, TOTAL - cut)
            phases = loader.stats()["phases"]
        assert head + rest == full, f"cut {cut}: resumed stream differs"
        assert phases == report["phases"], f"cut {cut}: per-phase accounting continues exactly across the resume"


def test_until_tokens_is_the_step_whose_token_slots_reach_it(sources, tokenizer_dir):
    """``until_tokens: T`` ends at step ``ceil(T / (lanes * B * S))``: the same stream as ``until_steps``."""
    from zephon_loader.build import build_text_loader

    per_step = 1 * 2 * 32
    by_tokens = _schedule(ends=(2 * per_step + 1, 6 * per_step), key="until_tokens")  # -> steps 3 and 6
    with build_text_loader(_config(sources, tokenizer_dir)) as loader:
        by_steps_rows = _take(loader, TOTAL)
    with build_text_loader(_config(sources, tokenizer_dir, mixture=by_tokens)) as loader:
        assert _take(loader, TOTAL) == by_steps_rows
        assert loader.fingerprint["schedule"][0]["until_steps"] == 3


def test_a_future_phase_may_change_and_takes_effect_at_its_boundary(sources, tokenizer_dir):
    from zephon_loader.build import build_text_loader

    edited = _schedule(weights=(WEIGHTS[0], WEIGHTS[1], {"a": 1.0, "b": 20.0}))
    edited_cfg = _config(sources, tokenizer_dir, mixture=edited)
    with build_text_loader(_config(sources, tokenizer_dir)) as loader:
        original = _take(loader, TOTAL)
    with build_text_loader(edited_cfg) as loader:
        edited_full = _take(loader, TOTAL)
    assert edited_full[:6] == original[:6] and edited_full[6:] != original[6:]
    for cut in (2, 4):  # saved in phase 0 and in phase 1: phase 2 had not begun
        with build_text_loader(_config(sources, tokenizer_dir)) as loader:
            _take(loader, cut)
            state = loader.state_dict()
        with build_text_loader(edited_cfg) as loader:
            loader.load_state_dict(state)
            assert _take(loader, TOTAL - cut) == edited_full[cut:], f"cut {cut}"
    # A later phase added after the last one that had begun is a future phase too.
    with build_text_loader(_config(sources, tokenizer_dir)) as loader:
        _take(loader, 4)
        state = loader.state_dict()
    longer = _schedule(ends=(3, 6, 8), weights=(*WEIGHTS, {"a": 5.0, "b": 1.0}))
    with build_text_loader(_config(sources, tokenizer_dir, mixture=longer)) as loader:
        loader.load_state_dict(state)
        assert _take(loader, 2) == original[4:6]


def test_a_past_or_the_current_phase_may_not_change(sources, tokenizer_dir):
    from zephon_loader.build import build_text_loader

    with build_text_loader(_config(sources, tokenizer_dir)) as loader:
        _take(loader, 4)  # phase 1
        state = loader.state_dict()
    past = _schedule(weights=({"a": 8.0, "b": 1.0}, WEIGHTS[1], WEIGHTS[2]))
    current_weights = _schedule(weights=(WEIGHTS[0], {"a": 1.0, "b": 8.0}, WEIGHTS[2]))
    current_end = _schedule(ends=(3, 7))
    earlier_boundary = _schedule(ends=(2, 6))
    for mixture, phase, which in ((past, 0, "a past phase"), (current_weights, 1, "the current phase"),
                                  (current_end, 1, "the current phase"), (earlier_boundary, 0, "a past phase")):
        with build_text_loader(_config(sources, tokenizer_dir, mixture=mixture)) as loader:
            with pytest.raises(ValueError, match=rf"mixture\.schedule\[{phase}\] \({which}: the state was saved in "
                                                 r"phase 1\).*a phase that has begun cannot change"):
                loader.load_state_dict(copy.deepcopy(state))
    # Without a schedule, or with the schedule removed, the state is refused too.
    plain = _config(sources, tokenizer_dir, mixture="repeat")
    with build_text_loader(plain) as loader:
        with pytest.raises(ValueError, match="state_dict.fingerprint"):
            loader.load_state_dict(copy.deepcopy(state))


# ----------------------------------------------------------------------------- 2 ranks, elastic 2 -> 1


def _rank(task: dict) -> None:
    """One rank: ``full`` (states at every cut, batches with their lanes) or ``resume`` (each cut's state)."""
    out = Path(task["out"])
    with error_file(out.with_suffix(".error")):
        from zephon_loader.build import build_text_loader

        def config(run: str) -> dict:
            cfg = _config(task["sources"], task["tokenizer"])
            cfg["distributed"] = {"canonical_replicas": 2, "aggregate_dir": task["aggregate"], "run_id": run}
            return cfg

        def read(loader, n):
            it, got = iter(loader), []
            for _ in range(n):
                batch = next(it)
                got.append([loader._read_ahead.last_key[1], _rows(batch)])
            return got

        results: dict = {}
        if task["mode"] == "full":
            with build_text_loader(config("full"), dp_rank=task["rank"], dp_world_size=task["world"]) as loader:
                it, batches, states = iter(loader), [], {}
                for step in range(1, TOTAL + 1):
                    batch = next(it)
                    batches.append([loader._read_ahead.last_key[1], _rows(batch)])
                    if step in CUTS:
                        states[step] = loader.state_dict()
                results = {"batches": batches, "states": states, "stats": loader.stats()}
        else:
            states = json.loads(Path(task["states"]).read_text())["states"]
            for cut in CUTS:
                with build_text_loader(config(f"resume-{cut}"), dp_rank=task["rank"],
                                       dp_world_size=task["world"]) as loader:
                    loader.load_state_dict(states[str(cut)])
                    results[cut] = {"batches": read(loader, task["steps"](cut) if callable(task["steps"])
                                                    else task["steps"] * (TOTAL - cut)),
                                    "stats": loader.stats()}
        out.write_text(json.dumps(results))


def _run(tasks: list[dict]) -> list[dict]:
    run_ranks(_rank, [(task,) for task in tasks], [Path(task["out"]).with_suffix(".error") for task in tasks],
              bound_s=300, what=Path(tasks[0]["out"]).parent.name)
    return [json.loads(Path(task["out"]).read_text()) for task in tasks]


def test_two_ranks_resume_exactly_and_elastically_to_one(tmp_path, sources, tokenizer_dir):
    aggregate = tmp_path / "aggregate"
    aggregate.mkdir()
    common = {"sources": sources, "tokenizer": str(tokenizer_dir), "aggregate": str(aggregate)}

    def task(name, mode, rank, world, states=None, steps=1):
        return {**common, "out": str(tmp_path / f"{name}.json"), "mode": mode, "rank": rank, "world": world,
                "states": states, "steps": steps}

    full0, full1 = _run([task("full0", "full", 0, 2), task("full1", "full", 1, 2)])
    states = str(tmp_path / "full0.json")
    again0, again1, one = _run([task("again0", "resume", 0, 2, states), task("again1", "resume", 1, 2, states),
                                task("one", "resume", 0, 1, states, steps=2)])
    for cut in CUTS:
        assert full0["states"][str(cut)] == full1["states"][str(cut)], "every rank's state is the same"
        state = full0["states"][str(cut)]
        assert state["phase"]["index"] == sum(cut >= end for end in ENDS)
        assert state["phase"]["batches"] == ({} if cut in ENDS else {"0": cut - max([0, *[e for e in ENDS if e <= cut]]),
                                                                      "1": cut - max([0, *[e for e in ENDS if e <= cut]])})
    # Every rank switches at the same step: rank r reads lane r, and its phases are 3 steps each.
    for full in (full0, full1):
        assert sorted(full["stats"]["phases"], key=int) == ["0", "1", "2"]
    for cut in CUTS:
        # Same DP size: each rank's batches after the state are the uninterrupted run's.
        for full, again in ((full0, again0), (full1, again1)):
            assert again[str(cut)]["batches"] == full["batches"][cut:], f"2 ranks, cut {cut}"
        # 2 -> 1: the single rank reads both lanes; each lane's batches are the uninterrupted run's.
        got = one[str(cut)]["batches"]
        for lane, full in ((0, full0), (1, full1)):
            mine = [rows for batch_lane, rows in got if batch_lane == lane]
            assert mine == [rows for _, rows in full["batches"][cut:]], f"2 -> 1, cut {cut}, lane {lane}"
        expected = Counter(tuple(map(tuple, rows)) for full in (full0, full1) for _, rows in full["batches"][cut:])
        assert Counter(tuple(map(tuple, rows)) for _, rows in got) == expected
        # Per-phase accounting continues across the resume: the lanes' phases add up to the uninterrupted run's.
        merged = one[str(cut)]["stats"]["phases"]
        for phase in merged:
            for name, counts in merged[phase].items():
                assert counts["tokens"] == sum(full["stats"]["phases"].get(phase, {}).get(name, {}).get("tokens", 0)
                                               for full in (full0, full1)), (cut, phase, name)
