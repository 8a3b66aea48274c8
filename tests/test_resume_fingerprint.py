"""Resume refuses what it cannot honour, at load_state_dict, naming the difference; accounting continues exactly."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import collect, make_texts, train_tokenizer, write_jsonl_shards
from zephon_loader import build_text_loader


def config(source, tokenizer_dir, **extra):
    out = {
        "sources": [{"name": "web", "path": str(source)}],
        "tokenizer": {"path": str(tokenizer_dir)},
        "sequence_length": 32,
        "micro_batch_size": 2,
        "packing": {"algorithm": "wrap"},
        "read_ahead": 0,
    }
    out.update(extra)
    return out


@pytest.fixture()
def web(tmp_path, corpus_texts):
    return write_jsonl_shards(tmp_path / "web", [{"text": t} for t in corpus_texts[:60]], shards=2)


def saved_state(cfg, steps=2):
    with build_text_loader(cfg) as loader:
        collect(loader, limit=steps)
        return json.loads(json.dumps(loader.state_dict()))


def refusal(cfg, state):
    with build_text_loader(cfg) as loader:
        with pytest.raises(ValueError, match="state_dict.fingerprint") as info:
            loader.load_state_dict(state)
    return str(info.value)


def test_another_folder_with_the_same_source_name_is_refused(web, tmp_path, tokenizer_dir, corpus_texts):
    state = saved_state(config(web, tokenizer_dir))
    other = write_jsonl_shards(tmp_path / "other", [{"text": t} for t in corpus_texts[60:120]], shards=2)
    assert "shards: source 'web': part-00000.jsonl changed, part-00001.jsonl changed)" in refusal(
        config(other, tokenizer_dir), state)


def test_a_changed_or_added_shard_is_refused(web, tokenizer_dir):
    state = saved_state(config(web, tokenizer_dir))
    with (web / "part-00001.jsonl").open("a") as handle:
        handle.write(json.dumps({"text": "one more record"}) + "\n")
    assert "shards:" in refusal(config(web, tokenizer_dir), state)
    shutil.copy(web / "part-00000.jsonl", web / "part-00002.jsonl")
    assert "part-00002.jsonl" in refusal(config(web, tokenizer_dir), state)


def test_the_same_data_moved_elsewhere_resumes(web, tmp_path, tokenizer_dir):
    cfg = config(web, tokenizer_dir)
    with build_text_loader(cfg) as loader:
        reference = [b["input_ids"].tolist() for b in collect(loader)]
    state = saved_state(cfg)
    moved = tmp_path / "mounted" / "elsewhere"
    shutil.copytree(web, moved)  # new path and new mtimes, same content
    with build_text_loader(config(moved, tokenizer_dir)) as loader:
        loader.load_state_dict(state)
        assert [b["input_ids"].tolist() for b in collect(loader)] == reference[2:]


def test_another_tokenizer_folder_is_refused(web, tmp_path, tokenizer_dir):
    state = saved_state(config(web, tokenizer_dir))
    other = train_tokenizer(make_texts(80, seed=9), tmp_path / "tok2", vocab_size=300)
    assert "tokenizer_files: saved" in refusal(config(web, other), state)


def test_a_changed_canonical_replicas_is_refused_at_load(web, tokenizer_dir):
    state = saved_state(config(web, tokenizer_dir, distributed={"canonical_replicas": 2}))
    assert "canonical_replicas: saved 2, now 4" in refusal(
        config(web, tokenizer_dir, distributed={"canonical_replicas": 4}), state)


@pytest.mark.parametrize("changed", [{"seed": 1}, {"sequence_length": 16}, {"on_bad_record": "skip"},
                                     {"packing": {"algorithm": "best_fit_wrap"}}])
def test_stream_settings_are_refused(changed, web, tokenizer_dir):
    state = saved_state(config(web, tokenizer_dir))
    assert "different configuration" in refusal(config(web, tokenizer_dir, **changed), state)


@pytest.mark.parametrize(("saved_with", "resumed_with"), [(0, 2), (2, 0)])
def test_stats_continue_exactly_across_a_resume(saved_with, resumed_with, web, tokenizer_dir):
    with build_text_loader(config(web, tokenizer_dir, read_ahead=saved_with)) as loader:
        collect(loader)
        reference = loader.stats()
    state = saved_state(config(web, tokenizer_dir, read_ahead=saved_with), steps=3)
    assert sum(lane["batches"] for lane in state["stats"]["lanes"].values()) == 3
    with build_text_loader(config(web, tokenizer_dir, read_ahead=resumed_with)) as loader:
        loader.load_state_dict(state)
        collect(loader)
        resumed = loader.stats()
    assert resumed["sources"] == reference["sources"]
    assert resumed["batches"] == reference["batches"]
    delivered = reference["sources"]["web"]["delivered"]
    assert delivered["documents"] > 0 and delivered["tokens"] > 0
