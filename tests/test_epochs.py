"""Epochs: each pass reads every source once, in an order derived from (seed, epoch), recorded in the state."""

from __future__ import annotations

import json
import pickle
from typing import Any

import pytest
import torch

from conftest import resealed
from zephon_loader import build_text_loader
from zephon_loader.build import epoch_seed


def _config(jsonl_sources, tokenizer_dir, **overrides: Any) -> dict[str, Any]:
    config = {
        "sources": [{"name": "a", "path": str(jsonl_sources["a"]), "weight": 1.0},
                    {"name": "b", "path": str(jsonl_sources["b"]), "weight": 2.0}],
        "tokenizer": {"path": str(tokenizer_dir)},
        "sequence_length": 32,
        "micro_batch_size": 4,
        "packing": {"algorithm": "wrap"},
        "seed": 7,
        "read_ahead": 0,
        "mask_cross_document_labels": False,  # the last label of a row is then always its (S+1)-th token
        "runtime": {"runner": "threads"},
    }
    config.update(overrides)
    return config


def _rows(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A batch's packed rows of S + 1 tokens: ``input_ids`` plus the last label (-100 at padding)."""
    return torch.cat([batch["input_ids"], batch["labels"][:, -1:]], dim=1)


def _pass(loader, limit: int | None = None) -> list[torch.Tensor]:
    rows = []
    for index, batch in enumerate(loader):
        rows.append(_rows(batch))
        if limit is not None and index + 1 == limit:
            break
    return rows


def _token_counts(batches: list[torch.Tensor], padding_mask_pad: int) -> torch.Tensor:
    """How often each token id occurs outside padding (pad id and -100 excluded)."""
    tokens = torch.cat([b.flatten() for b in batches])
    return torch.bincount(tokens[(tokens != padding_mask_pad) & (tokens >= 0)], minlength=1024)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_each_pass_after_an_exhausted_one_is_the_next_epoch_with_another_order(jsonl_sources, tokenizer_dir):
    with build_text_loader(_config(jsonl_sources, tokenizer_dir)) as loader:
        pad = loader.state_dict()["fingerprint"]["packing"][2]
        first = _pass(loader)
        assert loader.epoch == 0
        second = _pass(loader)
        assert loader.epoch == 1
        third = _pass(loader)
        assert loader.epoch == 2
    assert not _same(first, second) and not _same(second, third)  # reshuffled (the old code replayed epoch 0)
    # Every epoch reads every document once: the same tokens, in another order.
    assert torch.equal(_token_counts(first, pad), _token_counts(second, pad))
    assert torch.equal(_token_counts(first, pad), _token_counts(third, pad))


def test_set_epoch_chooses_the_epoch_and_every_run_gives_the_same_order(jsonl_sources, tokenizer_dir):
    config = _config(jsonl_sources, tokenizer_dir)
    with build_text_loader(config) as loader:
        epoch0 = _pass(loader)
        epoch1 = _pass(loader)
        loader.set_epoch(1)  # AutoModel / the HF Trainer call this before each epoch
        assert _same(_pass(loader), epoch1)
        loader.set_epoch(0)
        assert _same(_pass(loader), epoch0)
    with build_text_loader(config) as other:  # another run
        other.set_epoch(1)
        assert _same(_pass(other), epoch1)
        assert other.epoch == 1


def test_an_epoch_rebuild_reuses_the_loaded_tokenizer_and_its_batches_are_unchanged(jsonl_sources, tokenizer_dir,
                                                                                   monkeypatch):
    """The tokenizer is loaded and saved for Zephon once per loader (issue 21, item 4), and an epoch built
    over it yields exactly what one built from scratch (the tokenizer reloaded and re-saved) does."""
    import zephon_loader.pipeline.text as text
    import zephon_loader.stages as stages

    config = _config(jsonl_sources, tokenizer_dir)
    loads: list[object] = []
    load = text.load_tokenizer
    monkeypatch.setattr(text, "load_tokenizer", lambda *a, **k: loads.append(a) or load(*a, **k))
    with build_text_loader(config) as loader:
        reused = [_pass(loader) for _ in range(3)]
        assert loader.epoch == 2
    assert len(loads) == 1, "an epoch's rebuild loaded the tokenizer again"

    build = stages.build_pipeline  # as before the reuse: every build prepares the tokenizer afresh
    monkeypatch.setattr(stages, "build_pipeline", lambda *a, prepared=None, **k: build(*a, **k))
    with build_text_loader(config) as loader:
        fresh = [_pass(loader) for _ in range(3)]
    assert len(loads) == 1 + 3
    assert all(_same(a, b) for a, b in zip(reused, fresh))


def test_a_pass_restarted_before_its_end_restarts_the_same_epoch(jsonl_sources, tokenizer_dir):
    with build_text_loader(_config(jsonl_sources, tokenizer_dir)) as loader:
        head = _pass(loader, limit=3)
        assert _same(_pass(loader, limit=3), head)
        assert loader.epoch == 0


@pytest.mark.parametrize("read_ahead", [0, 2])
@pytest.mark.parametrize("round_trip", ["json", "pickle", "torch"])
def test_state_saved_in_a_later_epoch_resumes_that_epoch_exactly(jsonl_sources, tokenizer_dir, tmp_path, read_ahead,
                                                                  round_trip):
    config = _config(jsonl_sources, tokenizer_dir, read_ahead=read_ahead)
    with build_text_loader(config) as loader:
        loader.set_epoch(2)
        iterator = iter(loader)
        for _ in range(5):
            next(iterator)
        state = loader.state_dict()
        rest = [_rows(b) for b in iterator]
        following = _pass(loader)  # the pass after: epoch 3
    assert state["epoch"] == 2
    if round_trip == "json":
        state = json.loads(json.dumps(state))
    elif round_trip == "pickle":
        state = pickle.loads(pickle.dumps(state))
    else:
        torch.save(state, tmp_path / "state.pt")
        state = torch.load(tmp_path / "state.pt", weights_only=True)
    with build_text_loader(_config(jsonl_sources, tokenizer_dir, read_ahead=2 - read_ahead)) as resumed:
        resumed.load_state_dict(state)
        assert _same(_pass(resumed), rest)
        assert resumed.epoch == 2
        assert _same(_pass(resumed), following)


def test_a_state_without_an_epoch_is_epoch_0_and_a_bad_epoch_is_refused(jsonl_sources, tokenizer_dir):
    config = _config(jsonl_sources, tokenizer_dir)
    with build_text_loader(config) as loader:
        state = loader.state_dict()
        assert state["epoch"] == 0
        head = _pass(loader, limit=2)
    del state["epoch"]
    state = resealed(state)
    with build_text_loader(config) as loader:
        loader.load_state_dict(state)
        assert _same(_pass(loader, limit=2), head)
        for bad in (-1, "1", True):
            with pytest.raises(ValueError, match=r"state_dict\.epoch: got"):
                loader.load_state_dict(resealed({**state, "epoch": bad}))
            with pytest.raises(ValueError, match=r"epoch: got"):
                loader.set_epoch(bad)


def test_epoch_seeds_are_fixed_numbers():
    """The order of epoch e must not change between versions or machines: pin the derivation."""
    assert epoch_seed(7, 0) == 7
    assert [epoch_seed(7, e) for e in (1, 2)] == [epoch_seed(7, 1), epoch_seed(7, 2)]
    assert len({epoch_seed(7, e) for e in range(50)}) == 50
    assert epoch_seed(7, 1) == int.from_bytes(__import__("hashlib").sha256(b"zephon_loader.epoch:7:1").digest()[:4], "big")


@pytest.mark.parametrize("choose", [False, True])
def test_a_state_saved_after_its_pass_ended_resumes_at_the_next_epoch(jsonl_sources, tokenizer_dir, choose):
    """The common loop "one epoch, then checkpoint": the resumed run reads epoch 1, not an empty epoch 0."""
    config = _config(jsonl_sources, tokenizer_dir)
    with build_text_loader(config) as loader:
        _pass(loader)
        state = json.loads(json.dumps(loader.state_dict()))
        epoch1 = _pass(loader)
        documents = sum(s["delivered"]["documents"] for s in loader.stats()["sources"].values())
    assert state["epoch"] == 0 and state["pass_ended"] is True
    with build_text_loader(config) as resumed:
        resumed.load_state_dict(state)
        if choose:
            resumed.set_epoch(1)  # what AutoModel's step scheduler does at the next epoch
        assert _same(_pass(resumed), epoch1)
        assert resumed.epoch == 1
        assert sum(s["delivered"]["documents"] for s in resumed.stats()["sources"].values()) == documents


def test_automodels_step_scheduler_reaches_the_loader_through_its_sampler(jsonl_sources, tokenizer_dir):
    """AutoModel 0.7.0's ``StepScheduler.set_epoch`` calls ``dataloader.sampler.set_epoch`` (run on its own code)."""
    from types import SimpleNamespace

    step_scheduler = pytest.importorskip("nemo_automodel.components.training.step_scheduler")
    with build_text_loader(_config(jsonl_sources, tokenizer_dir)) as loader:
        epoch0 = _pass(loader)
        epoch1 = _pass(loader)
        step_scheduler.StepScheduler.set_epoch(SimpleNamespace(dataloader=loader), 0)
        assert _same(_pass(loader), epoch0)
        step_scheduler.StepScheduler.set_epoch(SimpleNamespace(dataloader=loader), 1)
        assert _same(_pass(loader), epoch1)


@pytest.mark.parametrize("read_ahead", [0, 2])
def test_set_epoch_after_iter_and_before_the_first_batch_restarts_that_pass_as_the_chosen_epoch(
        jsonl_sources, tokenizer_dir, read_ahead):
    """Trainers call iter() first and set_epoch() after (Lightning); until a batch came out, the pass follows it.
    After a batch came out the pass goes on, and the choice is the next pass's."""
    config = _config(jsonl_sources, tokenizer_dir, read_ahead=read_ahead)
    with build_text_loader(config) as loader:
        loader.set_epoch(1)
        epoch_1 = _pass(loader)
        loader.set_epoch(2)
        epoch_2 = _pass(loader)
    with build_text_loader(config) as loader:
        batches = iter(loader)
        loader.set_epoch(1)  # nothing yielded yet: this pass is epoch 1
        assert loader.epoch == 1
        assert _same([_rows(b) for b in batches], epoch_1)
        batches = iter(loader)  # after an ended pass: epoch 2 by itself
        first = _rows(next(batches))
        loader.set_epoch(5)  # a batch came out: the pass goes on; epoch 5 is the next pass's
        assert _same([first] + [_rows(b) for b in batches], epoch_2)
        assert loader.epoch == 2
        batches = iter(loader)
        assert loader.epoch == 5


def test_set_epoch_before_the_first_batch_of_a_resumed_pass_starts_that_epoch_fresh(jsonl_sources, tokenizer_dir):
    """A trainer that loaded a mid-pass state and then moves on to another epoch (Lightning at the last batch of
    limit_train_batches) gets that epoch from its start; the same epoch keeps the resumed position."""
    config = _config(jsonl_sources, tokenizer_dir)
    with build_text_loader(config) as loader:
        reference = _pass(loader)
        loader.set_epoch(1)
        epoch_1 = _pass(loader)
    with build_text_loader(config) as loader:
        batches = iter(loader)
        next(batches), next(batches)
        state = loader.state_dict()
    with build_text_loader(config) as loader:
        loader.load_state_dict(state)
        batches = iter(loader)
        loader.set_epoch(0)  # the state's epoch: the resume stands
        assert _same([_rows(b) for b in batches], reference[2:])
    with build_text_loader(config) as loader:
        loader.load_state_dict(state)
        batches = iter(loader)
        loader.set_epoch(1)
        assert _same([_rows(b) for b in batches], epoch_1)


def test_note_consumed_counts_from_where_the_pass_started(jsonl_sources, tokenizer_dir):
    """note_consumed(): one more batch trained, counted from the pass's start (0, or the resumed state's count)."""
    config = _config(jsonl_sources, tokenizer_dir)
    with build_text_loader(config) as loader:
        reference = _pass(loader)
    with build_text_loader(config) as loader:
        batches = iter(loader)
        for _ in range(2):  # a consumer one batch behind next(), as Lightning's fetcher is
            next(batches)
            loader.note_consumed()
        next(batches)  # 2 trained, 3 pulled
        state = loader.state_dict()
    with build_text_loader(config) as loader:
        loader.load_state_dict(state)
        batches = iter(loader)
        next(batches), next(batches)
        loader.note_consumed()  # 3 of the pass trained, 4 pulled
        again = loader.state_dict()
        with pytest.raises(ValueError, match=r"set_consumed: got 5, expected an int in \[3, 4\]"):
            loader.note_consumed(2)
    with build_text_loader(config) as loader:
        loader.load_state_dict(again)
        assert _same(_pass(loader), reference[3:])
