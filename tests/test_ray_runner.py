"""``runtime.runner: ray``: the tokenize stage on Zephon's Ray runner (``zephon_loader.pipeline.ray_runner``).

* The batches of ``runner: threads``, bit for bit, over a small corpus; the
  loader starts a local Ray instance when none is up and shuts it down at
  ``close()``; it leaves a caller's instance up.
* Resume from a mid-run ``state_dict()`` is exact (and a ``threads`` state resumes under ``ray``).
* A bad record is refused with its source, shard and line, as under threads.
* Without ``ray``: one ``ImportError`` naming ``pip install 'zephon-loader[ray]'``; pretokenized input refused.

The tests that run Ray are skipped when ``ray`` is not installed. Each loader
under ``ray`` starts its actors (a Python process each, importing Zephon):
seconds on a busy machine, so the tokenize stage runs 2 actors here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import collect, make_texts, text_config, write_jsonl_shards
from zephon_loader import build_text_loader
from zephon_loader.config import text_loader_config
from zephon_loader.errors import BadRecordError

try:
    import ray  # noqa: F401

    HAVE_RAY = True
except ImportError:
    HAVE_RAY = False

needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed (pip install 'zephon-loader[ray]')")

RAY = {"runner": "ray", "tokenize_parallelism": 2}


@pytest.fixture(scope="module")
def web(jsonl_sources: dict[str, Path]) -> Path:
    return jsonl_sources["a"]


def assert_same_batches(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want)):
        assert a.keys() == b.keys(), index
        for name in b:
            if isinstance(b[name], torch.Tensor):
                assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), (index, name)
            else:
                assert a[name] == b[name], (index, name)


@pytest.fixture(scope="module")
def threads_batches(web: Path, tokenizer_dir: Path) -> list[dict]:
    with build_text_loader(text_config(web, tokenizer_dir, runtime={"runner": "threads"})) as loader:
        batches = collect(loader)
    assert len(batches) >= 8
    return batches


@pytest.fixture()
def callers_ray():
    """A Ray instance the test starts (the caller's): the loader must use it and leave it up."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@needs_ray
def test_same_batches_as_threads_and_own_instance_shut_down(web, tokenizer_dir, threads_batches):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    loader = build_text_loader(text_config(web, tokenizer_dir, runtime=RAY))
    try:
        assert ray.is_initialized(), "the loader started no Ray instance"
        got = collect(loader)
    finally:
        loader.close()
    assert not ray.is_initialized(), "the loader left the Ray instance it started running"
    assert_same_batches(got, threads_batches)


@needs_ray
def test_resume_is_exact_and_callers_instance_stays_up(web, tokenizer_dir, threads_batches, callers_ray):
    cfg = text_config(web, tokenizer_dir, runtime=RAY)
    k = 3
    with build_text_loader(cfg) as first:
        iterator = iter(first)
        head = [next(iterator) for _ in range(k)]
        state = json.loads(json.dumps(first.state_dict()))
    assert callers_ray.is_initialized(), "the loader shut down the caller's Ray instance"
    with build_text_loader(cfg) as second:
        second.load_state_dict(state)
        rest = collect(second)
    assert_same_batches(head + rest, threads_batches)
    # A position saved under threads resumes under ray (the runner is not part of the stream).
    with build_text_loader(text_config(web, tokenizer_dir, runtime={"runner": "threads"})) as first:
        iterator = iter(first)
        for _ in range(k):
            next(iterator)
        state = first.state_dict()
    with build_text_loader(cfg) as second:
        second.load_state_dict(state)
        assert_same_batches(collect(second), threads_batches[k:])


@needs_ray
def test_bad_record_is_located_as_under_threads(tmp_path, tokenizer_dir, callers_ray):
    good = [json.dumps({"text": t}) for t in make_texts(12, seed=3, min_words=2, max_words=6)]
    lines = good[:8]
    lines.insert(5, '{"text": 7}')  # physical line 6
    folder = tmp_path / "web"
    write_jsonl_shards(folder, [json.loads(line) for line in good[8:]], shards=1)
    (folder / "part-00000.jsonl").rename(folder / "part-00001.jsonl")
    (folder / "part-00000.jsonl").write_text("".join(line + "\n" for line in lines))
    messages = {}
    for runtime in ({"runner": "threads"}, RAY):
        with build_text_loader(text_config(folder, tokenizer_dir, runtime=runtime)) as loader:
            with pytest.raises(BadRecordError) as info:
                collect(loader)
        messages[runtime["runner"]] = str(info.value)
    assert f"source 'web', shard {folder / 'part-00000.jsonl'}, line 6" in messages["ray"]
    assert "field 'text' got 7 (int)" in messages["ray"]
    assert messages["ray"] == messages["threads"]


def test_missing_ray_is_one_error_naming_the_extra(web, tokenizer_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ImportError, match=r"runtime\.runner: got 'ray'.*pip install 'zephon-loader\[ray\]'"):
        build_text_loader(text_config(web, tokenizer_dir, runtime={"runner": "ray"}))


def test_ray_needs_a_tokenize_stage(web):
    with pytest.raises(ValueError, match=r"runtime\.runner: got 'ray' with pretokenized input"):
        text_loader_config(sources=[{"name": "web", "path": str(web)}], sequence_length=32, micro_batch_size=2,
                           tokenizer={"pretokenized_field": "tokens"}, pad_token_id=0, runtime={"runner": "ray"})
    assert text_loader_config(sources=[{"name": "web", "path": str(web)}], sequence_length=32, micro_batch_size=2,
                              runtime={"runner": "ray"}).runtime.options() == {}


@needs_ray
def test_chat_batches_as_under_threads(chat_source, tokenizer_dir, callers_ray):
    """Chat mode on Ray: the actors load the tokenizer folder themselves; the batches are those of threads."""
    from conftest import CHAT_TEMPLATE

    def config(runtime):
        return {"sources": [{"name": "chat", "path": str(chat_source)}], "sequence_length": 64,
                "micro_batch_size": 2, "runtime": runtime,
                "tokenizer": {"path": str(tokenizer_dir), "chat_field": "messages", "chat_template": CHAT_TEMPLATE}}

    with build_text_loader(config({"runner": "threads"})) as loader:
        want = collect(loader)
    with build_text_loader(config(RAY)) as loader:
        got = collect(loader)
    assert want
    assert_same_batches(got, want)
