"""End-to-end: YAML/config → ZephonLoader → yielded batches, resume, errors, shutdown (issue: the loader)."""

from __future__ import annotations

import json
import pickle
import threading
from pathlib import Path

import pytest
import torch
import yaml

from conftest import collect, resealed, zephon_pipeline
from zephon_loader import fields as F
from zephon_loader.build import build_text_loader

CONTRACTS = {
    "document_ids": {"packed_mask_type": "document_ids"},
    "fa4": {"attn_implementation": "fa4"},
    "block_causal": {"packed_mask_type": "block_causal"},
    "flash_varlen": {"attn_implementation": "flash_attention_2"},
    "te_thd": {"attn_implementation": "te", "packed_mask_type": "document_ids", "qkv_format": "thd"},
}


@pytest.fixture(scope="module")
def sources(jsonl_sources):
    return [{"name": name, "path": str(path), "weight": 1.0 + i} for i, (name, path) in enumerate(sorted(jsonl_sources.items()))]


def config(sources, tokenizer_dir, **overrides):
    base = {
        "sources": sources,
        "tokenizer": {"path": str(tokenizer_dir)},
        "sequence_length": 48,
        "micro_batch_size": 3,
        "seed": 7,
        "runtime": {"runner": "threads"},
    }
    base.update(overrides)
    return base


def direct_input_tokens(cfg) -> list[torch.Tensor]:
    """What Zephon + to_training produce for the same config, without the loader (the reference stream)."""
    pipeline = zephon_pipeline(cfg)
    out = []
    iterator = iter(pipeline)
    try:
        for batch in iterator:
            training = batch.to_training(return_labels=True, return_padding_mask=True)
            out.append(training["input_ids"][~training["padding_mask"]])
    finally:
        iterator.close()
    return out


def _alive_threads():
    return {t for t in threading.enumerate() if t.is_alive()}


@pytest.fixture(scope="module")
def parquet_sources(parquet_text_source):
    return [{"name": "pq", "path": str(parquet_text_source), "weight": 1.0}]


@pytest.mark.parametrize("shards", ["jsonl", "parquet"])
@pytest.mark.parametrize("contract", sorted(CONTRACTS))
@pytest.mark.parametrize("algorithm", ["first_fit", "wrap"])
@pytest.mark.parametrize("xdoc", [False, True])
def test_yielded_batches_follow_contract_and_keep_every_token(
    request, tokenizer_dir, shards, contract, algorithm, xdoc
):
    chosen = request.getfixturevalue("sources" if shards == "jsonl" else "parquet_sources")
    cfg = config(chosen, tokenizer_dir, contract=CONTRACTS[contract], xdoc=xdoc, packing={"algorithm": algorithm})
    with build_text_loader(cfg) as loader:
        batches = collect(loader)
    assert batches, "the loader yielded nothing"
    reference = direct_input_tokens(cfg)
    assert len(batches) == len(reference)
    for batch, expected in zip(batches, reference):
        for name in loader.yielded_fields:
            assert name in batch, name
        padding = batch[F.PADDING_MASK]
        assert batch[F.INPUT_IDS].shape == (3, 48) and batch[F.INPUT_IDS].dtype == torch.int64
        # Nothing lost, duplicated or reordered between Zephon and the yield.
        assert torch.equal(batch[F.INPUT_IDS][~padding], expected)
        positions = batch[F.POSITION_IDS]
        if xdoc:  # text with local positions: 0..n-1 across each row
            for b in range(3):
                n = int((~padding[b]).sum())
                assert positions[b, :n].tolist() == list(range(n))
        if contract == "block_causal":
            assert batch[F.ATTENTION_MASK].shape == (3, 1, 48, 48)
        if contract in ("document_ids", "fa4", "te_thd"):
            ids = batch[F.ATTENTION_MASK]
            assert ids.shape == (3, 48)
            assert torch.equal(ids == 0, padding)
            if xdoc:
                assert int(ids.max()) == 1
        if contract == "flash_varlen":
            assert batch[F.CU_SEQ_LENS_Q][-1] == 3 * 48
        if contract == "fa4":
            assert int(batch[F.CU_SEQLENS].max()) <= 48
        if contract == "te_thd":
            sums = torch.where(batch[F.SEQ_LENS_PADDED] == F.THD_SENTINEL, 0, batch[F.SEQ_LENS_PADDED]).sum(dim=1)
            assert sums.tolist() == [48, 48, 48]


def test_parquet_sources_and_cross_document_labels(parquet_text_source, tokenizer_dir):
    cfg = config([{"name": "pq", "path": str(parquet_text_source)}], tokenizer_dir, contract={"attn_implementation": "fa4"})
    with build_text_loader(cfg) as loader:
        batches = collect(loader)
    assert batches
    for batch in batches:
        ids = batch[F.PACKED_SEQ_IDS] if F.PACKED_SEQ_IDS in batch else batch[F.ATTENTION_MASK]
        # xdoc off: the label of a subdocument's last token (target: next document) is masked.
        last_of_document = (ids[:, :-1] != ids[:, 1:]) & (ids[:, :-1] != 0)
        assert bool((batch[F.LABELS][:, :-1][last_of_document] == F.IGNORE_INDEX).all())
        assert bool((batch[F.LABELS][batch[F.PADDING_MASK]] == F.IGNORE_INDEX).all())


@pytest.mark.parametrize("read_ahead", [0, 2])
@pytest.mark.parametrize("codec", ["json", "pickle", "none"])
def test_resume_is_exact(sources, tokenizer_dir, read_ahead, codec):
    cfg = config(sources, tokenizer_dir, read_ahead=read_ahead, contract={"attn_implementation": "fa4"})
    with build_text_loader(cfg) as loader:
        full = collect(loader)
    assert len(full) >= 8
    for k in (0, 1, 3, len(full) - 1, len(full)):
        with build_text_loader(cfg) as first:
            iterator = iter(first)
            for _ in range(k):
                next(iterator)
            state = first.state_dict()
        if codec == "json":
            state = json.loads(json.dumps(state))
        elif codec == "pickle":
            state = pickle.loads(pickle.dumps(state))
        with build_text_loader(cfg) as second:
            second.load_state_dict(state)
            rest = collect(second)
        assert len(rest) == len(full) - k, f"k={k}"
        for got, want in zip(rest, full[k:]):
            for name in want:
                if isinstance(want[name], torch.Tensor):
                    assert torch.equal(got[name], want[name]), (k, name)
                else:
                    assert got[name] == want[name], (k, name)


def test_checkpoint_is_called_only_for_state_dict(sources, tokenizer_dir, monkeypatch):
    """Zephon's checkpoint (a collective across ranks) runs in state_dict() only, never per batch."""
    import zephon

    from zephon_loader.nodes import source as source_module

    cfg = config(sources, tokenizer_dir, read_ahead=2)
    calls = []
    original = zephon.Pipeline.checkpoint
    original_at = source_module.checkpoint_at

    def spy(self):
        calls.append(1)
        return original(self)

    def spy_at(*args, **kwargs):
        calls.append(1)
        return original_at(*args, **kwargs)

    # On the class: the pass after an exhausted one reads the next epoch, on a new pipeline.
    monkeypatch.setattr(zephon.Pipeline, "checkpoint", spy)
    monkeypatch.setattr(source_module, "checkpoint_at", spy_at)
    with build_text_loader(cfg) as loader:
        batches = collect(loader)
        assert len(batches) > 5 and calls == []
        it = iter(loader)
        next(it)
        next(it)
        loader.state_dict()
        assert len(calls) == 1


def test_second_iter_starts_a_new_pass(sources, tokenizer_dir):
    cfg = config(sources, tokenizer_dir)
    with build_text_loader(cfg) as loader:
        first = collect(loader, 4)
        again = collect(loader, 4)
    for a, b in zip(first, again):
        assert torch.equal(a[F.INPUT_IDS], b[F.INPUT_IDS])


def test_bad_states_are_refused(sources, tokenizer_dir):
    cfg = config(sources, tokenizer_dir)
    with build_text_loader(cfg) as loader:
        it = iter(loader)
        next(it)
        state = json.loads(json.dumps(loader.state_dict()))
    with build_text_loader(cfg) as loader:
        with pytest.raises(ValueError, match="empty dict"):
            loader.load_state_dict({})
        with pytest.raises(ValueError, match="got an empty list"):  # a list: every rank's per-rank state
            loader.load_state_dict([])
        with pytest.raises(TypeError, match=r"states\[1\]: state_dict: got str"):
            loader.load_state_dict([state, "state.json"])
        with pytest.raises(ValueError, match="state_dict.format"):
            loader.load_state_dict({**state, "format": "other"})
        corrupt = json.loads(json.dumps(state))
        del corrupt["zephon_checkpoint"]
        with pytest.raises(ValueError, match="state_dict.checksum: the content does not match"):
            loader.load_state_dict(corrupt)
        # Behind the checksum (a state resealed by hand), each field is still checked.
        with pytest.raises(ValueError, match="state_dict.zephon_checkpoint: missing"):
            loader.load_state_dict(resealed(corrupt))
        corrupt["zephon_checkpoint"] = [1]
        with pytest.raises(ValueError, match="zephon_checkpoint: got list"):
            loader.load_state_dict(resealed(corrupt))
        broken = json.loads(json.dumps(state))
        broken["zephon_checkpoint"] = {"version": 2}
        with pytest.raises(ValueError, match="corrupt or incompatible"):
            loader.load_state_dict(resealed(broken))
    other = config(sources, tokenizer_dir, sequence_length=40)
    with build_text_loader(other) as loader:
        with pytest.raises(ValueError, match=r"fingerprint.*sequence_length: saved 48, now 40"):
            loader.load_state_dict(state)


def test_close_stops_every_thread(sources, tokenizer_dir):
    before = _alive_threads()
    loader = build_text_loader(config(sources, tokenizer_dir, read_ahead=3))
    it = iter(loader)
    next(it)
    loader.close()
    loader.close()  # idempotent
    leaked = [t.name for t in _alive_threads() - before if t.is_alive()]
    assert leaked == []
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)


def _errors_before_start(cfg, error, match):
    before = _alive_threads()
    with pytest.raises(error, match=match):
        build_text_loader(cfg)
    assert [t.name for t in _alive_threads() - before] == []


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"shuffel": True}, ValueError, r"dataloader\.shuffel: unknown key"),
        ({"packing": {"algo": "wrap"}}, ValueError, r"dataloader\.packing\.algo: unknown key"),
        ({"sequence_length": "48"}, TypeError, r"dataloader\.sequence_length: got str '48', expected an int"),
        ({"sequence_length": 0}, ValueError, r"dataloader\.sequence_length: got 0, expected an int > 0"),
        ({"micro_batch_size": -1}, ValueError, r"micro_batch_size: got -1"),
        ({"xdoc": "yes"}, TypeError, r"dataloader\.xdoc: got str 'yes', expected a bool"),
        ({"packing": {"algorithm": "greedy"}}, ValueError, r"dataloader\.packing\.algorithm: got 'greedy'"),
        ({"contract": {"packed_mask_type": "causal"}}, ValueError, r"dataloader\.contract\.packed_mask_type: got 'causal'"),
        ({"contract": {"packed_mask_type": "block_causal"}, "micro_batch_size": 3, "block_mask_budget_bytes": 100}, ValueError, "over the budget"),
        ({"contract": {"attn_implementation": "flash_attention_2"}, "eligibility_field": "keep",
          "tokenizer": {"pretokenized_field": "tokens"}, "pad_token_id": 0}, ValueError, "flash_varlen.*eligibility"),
        ({"tokenizer": {"path": "gpt2"}}, ValueError, "tokenizer"),
        ({"tokenizer": {}}, ValueError, "tokenizer"),
    ],
)
def test_config_errors_before_any_worker(sources, tokenizer_dir, change, error, match):
    _errors_before_start(config(sources, tokenizer_dir, **change), error, match)


def test_source_errors_before_any_worker(sources, tokenizer_dir, tmp_path):
    missing = [{"name": "x", "path": str(tmp_path / "missing")}]
    _errors_before_start(config(missing, tokenizer_dir), (ValueError, FileNotFoundError), "missing|exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    _errors_before_start(config([{"name": "x", "path": str(empty)}], tokenizer_dir), ValueError, "empty|no .*shard")
    bad_weight = [dict(sources[0], weight=0)]
    _errors_before_start(config(bad_weight, tokenizer_dir), ValueError, r"sources\[0\]\.weight: got 0.0")


def test_yaml_path_and_relative_paths(sources, tokenizer_dir, tmp_path):
    cfg = config(sources, tokenizer_dir)
    cfg["tokenizer"]["path"] = str(Path(tokenizer_dir).resolve())
    path = tmp_path / "loader.yaml"
    path.write_text(yaml.safe_dump({"dataloader": {"_target_": "zephon_loader.ZephonDataloaderConfig", **cfg}}))
    with build_text_loader(path) as loader:
        assert len(collect(loader, 2)) == 2


def test_bundled_default_runs_from_package_data():
    from zephon_loader.cli.configs import build_from_yaml
    from zephon_loader.config import default_config_path

    with build_from_yaml(default_config_path()) as loader:
        batch = next(iter(loader))
    assert batch[F.INPUT_IDS].shape == (4, 256)
    assert set(loader.yielded_fields) <= set(batch)


def test_chat_sources_supervise_assistant_turns_only(chat_source, tokenizer_dir):
    from conftest import CHAT_TEMPLATE

    cfg = {
        "sources": [{"name": "chat", "path": str(chat_source)}],
        "tokenizer": {"path": str(tokenizer_dir), "chat_field": "messages", "chat_template": CHAT_TEMPLATE},
        "sequence_length": 64,
        "micro_batch_size": 2,
        "contract": {"attn_implementation": "fa4"},
        "runtime": {"runner": "threads"},
    }
    with build_text_loader(cfg) as loader:
        batches = collect(loader)
    assert batches
    supervised = sum(int((b[F.LABELS] != F.IGNORE_INDEX).sum()) for b in batches)
    real = sum(int((~b[F.PADDING_MASK]).sum()) for b in batches)
    assert 0 < supervised < real, "user turns must be unsupervised, assistant turns supervised"


def test_collate_wrapper_and_eligibility_are_applied(pretokenized_parquet_source, tokenizer_dir):
    seen = []

    def wrapper(base):
        def wrapped(examples):
            out = base(examples)
            seen.append(1)
            out["causal_mask_mapping"] = "added"
            return out

        return wrapped

    cfg = {
        "sources": [{"name": "tok", "path": str(pretokenized_parquet_source)}],
        "tokenizer": {"path": str(tokenizer_dir), "pretokenized_field": "tokens"},
        "eligibility_field": "elig",
        "sequence_length": 40,
        "micro_batch_size": 2,
        "contract": {"attn_implementation": "fa4"},
        "runtime": {"runner": "threads"},
    }
    with build_text_loader(cfg, collate_wrapper=wrapper) as loader:
        batch = next(iter(loader))
    assert seen and batch["causal_mask_mapping"] == "added"
    excluded = (batch[F.ATTENTION_MASK] == 0) & ~batch[F.PADDING_MASK]
    assert bool(excluded.any()), "eligibility holes must reach the attention ids"
    assert bool((batch[F.PACKED_TOKEN_INDICES][excluded] == -1).all())


def test_eos_mask_loss_on_pretokenized_input(pretokenized_parquet_source, tokenizer_dir, tokenizer):
    eos = tokenizer.eos_token_id
    cfg = {
        "sources": [{"name": "tok", "path": str(pretokenized_parquet_source)}],
        "tokenizer": {"pretokenized_field": "tokens"},
        "pad_token_id": tokenizer.pad_token_id,
        "sequence_length": 40,
        "micro_batch_size": 2,
        "mask_cross_document_labels": False,
        "eos_mask_loss": True,
        "eos_token_id": eos,
        "contract": {"attn_implementation": "fa4"},
        "runtime": {"runner": "threads"},
    }
    with build_text_loader(cfg) as loader:
        batches = collect(loader)
    assert batches
    for batch in batches:
        from_eos = batch[F.INPUT_IDS] == eos
        assert bool(from_eos.any())
        assert bool((batch[F.LABELS][from_eos] == F.IGNORE_INDEX).all())


def test_preview_mid_iteration_then_a_new_pass(sources, tokenizer_dir):
    with build_text_loader(config(sources, tokenizer_dir, read_ahead=2, xdoc=True)) as loader:
        it = iter(loader)
        first = next(it)
        next(it)
        preview = loader.preview()
        again = next(iter(loader))
    assert torch.equal(preview[F.INPUT_IDS], first[F.INPUT_IDS])
    assert torch.equal(again[F.INPUT_IDS], first[F.INPUT_IDS])
    assert int(preview[F.ATTENTION_DOCUMENT_IDS].max()) == 1  # xdoc joined
    assert int(preview[F.DOCUMENT_IDS].max()) >= 1
