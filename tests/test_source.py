"""zephon_loader.pipeline.text / zephon_loader.source: pipeline construction, refusals, the torchdata node, resume."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torchdata.nodes import Loader

from conftest import zephon_pipeline
from zephon_loader import fields as F
from zephon_loader.config import text_loader_config
from zephon_loader.pipeline.text import DataParallel
from zephon_loader.nodes.source import ZephonSource
from zephon_loader.zephon_compat import ZephonKeys
from zephon_loader.pipeline.work_source import choose_chunk_size

L = 32
B = 4


def text_keys(jsonl_sources: dict[str, Path], tokenizer_dir: Path, algorithm: str = "first_fit",
              **keys: Any) -> dict[str, Any]:
    """Loader-config keys of the reference text pipeline (sources ``a``: 1, ``b``: 2), plus ``keys``."""
    return {
        "sources": [{"name": "a", "path": str(jsonl_sources["a"]), "weight": 1.0},
                    {"name": "b", "path": str(jsonl_sources["b"]), "weight": 2.0}],
        "sequence_length": L,
        "micro_batch_size": B,
        "tokenizer": {"path": str(tokenizer_dir)},
        "packing": {"algorithm": algorithm},
        "seed": 3,
        **keys,
    }


def text_pipeline(jsonl_sources: dict[str, Path], tokenizer_dir: Path, algorithm: str = "first_fit", **kw: Any):
    """The reference text pipeline; ``kw`` are further ``build_pipeline`` keywords."""
    return zephon_pipeline(text_keys(jsonl_sources, tokenizer_dir, algorithm), **kw)


def signature(batch: Any) -> list[tuple[tuple[int, ...], tuple[int, ...], int | None]]:
    """Comparable content of one Zephon batch: tokens, positions and padding length per row."""
    return [
        (
            tuple(int(x) for x in record.payload[ZephonKeys.TOKENS]),
            tuple(int(x) for x in record.payload[ZephonKeys.POSITIONS]),
            record.meta.padding_length,
        )
        for record in batch.records
    ]


def run_all(source: ZephonSource) -> list[Any]:
    out = [signature(b) for b in source]
    source.close()
    return out


def wait_for_threads(limit: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while threading.active_count() > limit and time.monotonic() < deadline:
        time.sleep(0.05)
    return threading.active_count()


@pytest.fixture(scope="module")
def reference(jsonl_sources, tokenizer_dir) -> dict[str, list[Any]]:
    """Uninterrupted runs per packing algorithm."""
    return {
        alg: run_all(ZephonSource(text_pipeline(jsonl_sources, tokenizer_dir, alg)))
        for alg in ("first_fit", "wrap")
    }


# ----------------------------------------------------------------------------- builds


@pytest.mark.parametrize("algorithm", ["first_fit", "wrap"])
def test_jsonl_pipeline_yields_packed_batches(jsonl_sources, tokenizer_dir, tokenizer, reference, algorithm):
    batches = reference[algorithm]
    assert len(batches) > 10
    last = len(batches) - 1
    for index, batch in enumerate(batches):
        assert len(batch) == B or (index == last and 0 < len(batch) < B)  # the final short batch is delivered
        for row, (tokens, positions, pad) in enumerate(batch):
            assert len(tokens) == len(positions) == L + 1
            assert positions[0] == 0
            if algorithm == "wrap" and not (index == last and row == len(batch) - 1):
                assert pad == 0  # wrap fills every row but the stream's last (padded, not dropped)
            else:
                assert pad is not None and 0 <= pad <= L + 1
                if pad:
                    assert set(tokens[L + 1 - pad :]) == {tokenizer.pad_token_id}
    # Zephon brackets every document BOS ... EOS (special_tokens="bos_eos").
    first_row = batches[0][0][0]
    assert first_row[0] == tokenizer.bos_token_id
    assert tokenizer.eos_token_id in first_row


def test_pipeline_is_deterministic(jsonl_sources, tokenizer_dir, reference):
    assert run_all(ZephonSource(text_pipeline(jsonl_sources, tokenizer_dir))) == reference["first_fit"]


def test_parquet_text_with_side_columns(parquet_text_source, tokenizer_dir):
    pipeline = zephon_pipeline({
        "sources": [{"name": "pq", "path": str(parquet_text_source)}], "sequence_length": L, "micro_batch_size": B,
        "tokenizer": {"path": str(tokenizer_dir)}, "packing": {"algorithm": "wrap"},
    })
    with ZephonSource(pipeline) as source:
        batch = next(source)
    assert set(batch.records[0].payload) == {ZephonKeys.TOKENS, ZephonKeys.POSITIONS}


@pytest.mark.parametrize("algorithm", ["first_fit", "wrap"])
def test_pretokenized_parquet_drops_side_columns_and_carries_eligibility(pretokenized_parquet_source, algorithm):
    pipeline = zephon_pipeline({
        "sources": [{"name": "tok", "path": str(pretokenized_parquet_source)}], "sequence_length": L,
        "micro_batch_size": B, "tokenizer": {"pretokenized_field": "tokens"}, "eligibility_field": "elig",
        "pad_token_id": 0, "packing": {"algorithm": algorithm},
    })
    batches = list(ZephonSource(pipeline))
    assert batches
    for batch in batches:
        for record in batch.records:
            payload = record.payload
            # "name" (a string: sliceable!) and "score" were dropped before packing.
            assert set(payload) == {ZephonKeys.TOKENS, ZephonKeys.POSITIONS, F.ATTENTION_ELIGIBILITY}
            elig = np.asarray(payload[F.ATTENTION_ELIGIBILITY])
            assert elig.shape == (L + 1,)
            pad = record.meta.padding_length or 0
            if pad:
                assert not elig[L + 1 - pad :].any()


def test_pretokenized_without_filter_is_the_pitfall(pretokenized_parquet_source):
    """What CheckTokens protects against: Zephon slices a string column as if per-token."""
    import zephon

    ds = zephon.Dataset.from_path("tok", str(pretokenized_parquet_source))
    ws = zephon.StaticMixtureWorkSource([ds], {"tok": 1.0}, chunk_size=16)
    pipeline = zephon.Pipeline(ws).pack_flat(L + 1, algorithm="first_fit", num_bins=4, pad_token_id=0,
                                             tokens_field="tokens").batch(B)
    with pytest.raises(ValueError, match="name"):
        for _ in pipeline:
            pass


def test_chat_pipeline_carries_loss_mask(chat_source, tokenizer_dir):
    from conftest import CHAT_TEMPLATE

    pipeline = zephon_pipeline({
        "sources": [{"name": "chat", "path": str(chat_source)}], "sequence_length": 64, "micro_batch_size": 2,
        "tokenizer": {"path": str(tokenizer_dir), "chat_field": "messages", "chat_template": CHAT_TEMPLATE},
    })
    with ZephonSource(pipeline) as source:
        batch = next(source)
    payload = batch.records[0].payload
    assert ZephonKeys.LOSS_MASK in payload
    mask = np.asarray(payload[ZephonKeys.LOSS_MASK])
    assert mask.shape == (65,) and 0 < mask.sum() < 65


def tokenize_parallelism(pipeline: Any) -> int:
    """The parallelism of the pipeline's ``tokenize`` stage."""
    (node,) = [node for node in pipeline._graph.nodes if node.name == "tokenize"]
    return node.parallelism


def test_options_are_passed(jsonl_sources, tokenizer_dir):
    pipeline = zephon_pipeline(text_keys(
        jsonl_sources, tokenizer_dir, distributed={"canonical_replicas": 2, "run_id": "r1"},
        runtime={"max_workers": 2, "prefetch_batches": 2, "tokenize_parallelism": 1},
    ))
    opts = pipeline._options
    assert (opts.world_size, opts.global_rank, opts.dp_degree, opts.dp_group_id, opts.canonical_replicas) == (1, 0, 1, 0, 2)
    assert opts.run_id == "r1" and opts.max_workers == 2 and opts.prefetch_batches == 2
    # runtime.tokenize_parallelism sets the tokenize stage's calls in flight (not a RuntimeOptions field).
    assert tokenize_parallelism(pipeline) == 1
    # unset: from the cores this process may use (half of them, 1 to 4)
    from zephon_loader.config.schema import available_cores

    assert tokenize_parallelism(text_pipeline(jsonl_sources, tokenizer_dir)) == max(1, min(4, available_cores() // 2))
    assert not hasattr(opts, "tokenize_parallelism")


def test_multi_rank_options_are_passed(jsonl_sources, tokenizer_dir, tmp_path):
    """Zephon's world is the data-parallel group: one lane per DP rank (tensor/pipeline peers share it)."""
    keys = text_keys(jsonl_sources, tokenizer_dir,
                     distributed={"canonical_replicas": 4, "aggregate_dir": str(tmp_path), "run_id": "r2"})
    opts = zephon_pipeline(keys, dp=DataParallel(1, 2))._options
    assert (opts.world_size, opts.global_rank, opts.dp_degree, opts.dp_group_id, opts.canonical_replicas) == (2, 1, 2, 1, 4)
    assert opts.aggregate_dir == str(tmp_path) and opts.run_id == "r2"
    # The store and run id the builder takes from torch.distributed win over the YAML's; an epoch suffix follows.
    keys = text_keys(jsonl_sources, tokenizer_dir, distributed={"canonical_replicas": 4, "run_id": "r2"})
    opts = zephon_pipeline(keys, dp=DataParallel(1, 2, aggregate_store="torch://", run_id="r3"),
                           run_id_suffix=".epoch1")._options
    assert (opts.world_size, opts.global_rank, opts.canonical_replicas) == (2, 1, 4)
    assert opts.aggregate_store == "torch://" and opts.run_id == "r3.epoch1"


def test_transform_feeds_pretokenized_mode(jsonl_sources):
    def to_bytes(payload):
        data = list(payload["text"].encode())[:20]
        return {"ids": data, "ok": [b != 32 for b in data]}

    pipeline = zephon_pipeline(
        {"sources": [{"name": "a", "path": str(jsonl_sources["a"])}], "sequence_length": L, "micro_batch_size": B,
         "tokenizer": {"pretokenized_field": "ids"}, "eligibility_field": "ok", "pad_token_id": 0},
        transform=to_bytes,
    )
    with ZephonSource(pipeline) as source:
        batch = next(source)
    payload = batch.records[0].payload
    tokens = np.asarray(payload[ZephonKeys.TOKENS])
    elig = np.asarray(payload[F.ATTENTION_ELIGIBILITY])
    real = L + 1 - (batch.records[0].meta.padding_length or 0)
    np.testing.assert_array_equal(elig[:real], tokens[:real] != 32)


def test_chunk_size_is_chosen_to_fit(tmp_path, tokenizer_dir):
    from conftest import make_texts, write_jsonl_shards

    small = write_jsonl_shards(tmp_path / "small", [{"text": t} for t in make_texts(5, seed=1)], shards=1)
    big = write_jsonl_shards(tmp_path / "big", [{"text": t} for t in make_texts(50, seed=2)], shards=2)
    pipeline = zephon_pipeline({
        "sources": [{"name": "small", "path": str(small)}, {"name": "big", "path": str(big)}],
        "sequence_length": L, "micro_batch_size": 1, "tokenizer": {"path": str(tokenizer_dir)},
        "packing": {"algorithm": "wrap"},
    })
    assert sum(1 for _ in ZephonSource(pipeline)) > 0
    assert choose_chunk_size([5, 50], [1.0, 1.0]) == 10  # 5 per source per chunk: both passes read whole
    assert choose_chunk_size([10**9], [1.0]) == 16000  # the largest size <= 16384 that divides the source
    assert choose_chunk_size([0, 10], [1.0, 1.0]) == 0


# ----------------------------------------------------------------------------- node contract


def test_checkpoint_only_when_state_is_asked(jsonl_sources, tokenizer_dir, reference, monkeypatch):
    """Zephon's checkpoint of a position (a collective across ranks) runs only when the state is asked for."""
    from zephon_loader.nodes import source as source_module

    pipeline = text_pipeline(jsonl_sources, tokenizer_dir)
    calls = []
    real = source_module.checkpoint_at

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(source_module, "checkpoint_at", spy)
    loader = Loader(ZephonSource(pipeline))
    seen = [signature(b) for b in loader]
    assert seen == reference["first_fit"]
    assert calls == []
    state = loader.state_dict()
    assert len(calls) == 1
    json.dumps(state)
    loader.root.close()


@pytest.mark.parametrize("algorithm", ["first_fit", "wrap"])
def test_resume_matches_uninterrupted_run(jsonl_sources, tokenizer_dir, reference, algorithm):
    full = reference[algorithm]
    for k in (0, 1, 3, 7, len(full) - 1, len(full)):
        first = ZephonSource(text_pipeline(jsonl_sources, tokenizer_dir, algorithm))
        got = [signature(next(first)) for _ in range(k)]
        state = json.loads(json.dumps(first.state_dict()))
        first.close()
        second = ZephonSource(text_pipeline(jsonl_sources, tokenizer_dir, algorithm))
        second.reset(state)
        assert got + run_all(second) == full, f"resume after {k} batches diverged"


def test_resume_through_loader(jsonl_sources, tokenizer_dir, reference):
    full = reference["first_fit"]
    loader = Loader(ZephonSource(text_pipeline(jsonl_sources, tokenizer_dir)))
    it = iter(loader)
    got = [signature(next(it)) for _ in range(5)]
    state = json.loads(json.dumps(loader.state_dict()))
    loader.root.close()
    resumed = Loader(ZephonSource(text_pipeline(jsonl_sources, tokenizer_dir)))
    resumed.load_state_dict(state)
    rest = [signature(b) for b in resumed]
    resumed.root.close()
    assert got + rest == full


def test_state_before_first_batch_and_reset(jsonl_sources, tokenizer_dir, reference):
    full = reference["first_fit"]
    source = ZephonSource(text_pipeline(jsonl_sources, tokenizer_dir))
    state = source.state_dict()  # before any batch: builds no workers' output
    assert [signature(next(source)) for _ in range(3)] == full[:3]
    source.reset(None)  # from scratch
    assert [signature(next(source)) for _ in range(2)] == full[:2]
    source.reset(json.loads(json.dumps(state)))
    assert run_all(source) == full


def test_state_after_restore_before_next_is_the_restored_state(jsonl_sources, tokenizer_dir, reference):
    full = reference["first_fit"]
    first = ZephonSource(text_pipeline(jsonl_sources, tokenizer_dir))
    for _ in range(4):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    second = ZephonSource(text_pipeline(jsonl_sources, tokenizer_dir))
    second.reset(state)
    again = json.loads(json.dumps(second.state_dict()))
    second.close()
    third = ZephonSource(text_pipeline(jsonl_sources, tokenizer_dir))
    third.reset(again)
    assert run_all(third) == full[4:]


def test_a_bad_initial_state_is_refused_with_the_loader_states_wording(jsonl_sources, tokenizer_dir):
    """The node checks epoch, skip and carried links with the functions the loader's state uses (one place)."""
    source = ZephonSource(text_pipeline(jsonl_sources, tokenizer_dir))
    state = json.loads(json.dumps(source.state_dict()))
    for change, match in (
        ({"skip": {"0": -2}}, r"initial_state\.skip\['0'\]: got -2, expected an int >= 0"),
        ({"skip": {"lane": 1}}, r"initial_state\.skip: got lane 'lane', expected a lane id"),
        ({"epoch": True}, r"initial_state\.epoch: got True, expected an int >= 0"),
        ({"carried": [{"epoch": 0}]}, r"initial_state\.carried\[0\]: got keys \['epoch'\], expected"),
    ):
        with pytest.raises(ValueError, match=match):
            source.reset({**state, **change})
    source.close()


def test_close_stops_workers(jsonl_sources, tokenizer_dir):
    baseline_threads = wait_for_threads(threading.active_count())
    baseline_children = len(multiprocessing.active_children())
    source = ZephonSource(text_pipeline(jsonl_sources, tokenizer_dir))
    next(source)
    assert threading.active_count() > baseline_threads  # Zephon's runner threads are up
    source.close()
    assert wait_for_threads(baseline_threads) == baseline_threads
    assert len(multiprocessing.active_children()) == baseline_children
    source.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        next(source)
    with pytest.raises(RuntimeError, match="closed"):
        source.reset(None)


def test_exhausted_source_leaves_no_threads(jsonl_sources, tokenizer_dir):
    baseline = wait_for_threads(threading.active_count())
    with ZephonSource(text_pipeline(jsonl_sources, tokenizer_dir)) as source:
        for _ in source:
            pass
        with pytest.raises(StopIteration):
            next(source)
    assert wait_for_threads(baseline) == baseline


def test_node_rejects_non_pipeline():
    with pytest.raises(TypeError, match="zephon.Pipeline"):
        ZephonSource([1, 2, 3])


# ----------------------------------------------------------------------------- refusals
#
# Types, ranges and combinations of keys are refused by the config (the error names
# ``dataloader.<key>``); what needs the data or the tokenizer by build_pipeline. Both
# come fast and before any Zephon worker starts.


def _refuses(exc: type[Exception], match: str, build: Callable[[], Any]) -> None:
    before = threading.active_count()
    start = time.monotonic()
    with pytest.raises(exc, match=match):
        build()
    assert time.monotonic() - start < 5, "refusal must be fast (no retry loop)"
    assert threading.active_count() <= before, "refusal must come before any worker starts"


def _with(keys: dict[str, Any], **changes: Any) -> dict[str, Any]:
    """``keys`` with ``changes``; a mapping given for a section (``tokenizer``, ``packing``, ...) merges into it."""
    out = dict(keys)
    for key, value in changes.items():
        out[key] = {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _config_refuses(exc: type[Exception], match: str, keys: dict[str, Any]) -> None:
    _refuses(exc, match, lambda: text_loader_config(**keys))


def _pipeline_refuses(exc: type[Exception], match: str, keys: dict[str, Any], work_dir: Path, **kwargs: Any) -> None:
    config = text_loader_config(**keys)  # the config is valid: the refusal is build_pipeline's
    _refuses(exc, match, lambda: zephon_pipeline(config, work_dir=work_dir, **kwargs))


@pytest.fixture()
def base_keys(jsonl_sources, tokenizer_dir) -> dict[str, Any]:
    return {
        "sources": [{"name": "a", "path": str(jsonl_sources["a"]), "weight": 1.0},
                    {"name": "b", "path": str(jsonl_sources["b"]), "weight": 1.0}],
        "sequence_length": L,
        "micro_batch_size": B,
        "tokenizer": {"path": str(tokenizer_dir)},
    }


# --- refused by build_pipeline: the data and the tokenizer


def test_refuses_missing_tokenizer(base_keys, tmp_path):
    _pipeline_refuses(ValueError, r"tokenizer\.path: got None, expected a local tokenizer folder for text input.*"
                                  r"save_pretrained", _with(base_keys, tokenizer={"path": None}), tmp_path)


def test_refuses_hub_tokenizer_id(base_keys, tmp_path):
    _pipeline_refuses(ValueError, r"tokenizer\.path: got '[^']*someorg/some-model'.*hub id cannot resolve offline",
                      _with(base_keys, tokenizer={"path": "someorg/some-model"}), tmp_path)


def test_refuses_tokenizer_dir_without_files(base_keys, tmp_path):
    empty = tmp_path / "no_tokenizer"
    empty.mkdir()
    _pipeline_refuses(ValueError, r"tokenizer\.path: .*tokenizer\.json",
                      _with(base_keys, tokenizer={"path": str(empty)}), tmp_path)


def test_refuses_special_tokens_the_tokenizer_lacks(base_keys, tokenizer, tmp_path):
    import copy

    no_bos = copy.deepcopy(tokenizer)
    no_bos.bos_token = None
    no_bos.save_pretrained(tmp_path / "no_bos")
    keys = _with(base_keys, tokenizer={"path": str(tmp_path / "no_bos")})
    _pipeline_refuses(ValueError, r"tokenizer\.special_tokens: got 'bos_eos', expected a mode this tokenizer can "
                                  r"serve \(it has no bos_token\)", keys, tmp_path)
    assert zephon_pipeline(_with(keys, tokenizer={"special_tokens": "eos"}), work_dir=tmp_path) is not None


def test_refuses_chunk_size_larger_than_data(base_keys, tmp_path):
    _pipeline_refuses(ValueError, r"chunk_size: got 16384, expected at most \d+ .*'a' has 100 records",
                      _with(base_keys, chunk_size=16384), tmp_path)


def test_refuses_bad_source_dirs(base_keys, tmp_path):
    first = base_keys["sources"][0]

    def sources(*specs: tuple[str, Any]) -> dict[str, Any]:
        return _with(base_keys, sources=[{"name": name, "path": str(path)} for name, path in specs])

    _pipeline_refuses(ValueError, r"sources\[0\].path \('x'\).*existing directory",
                      sources(("x", tmp_path / "missing")), tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    _pipeline_refuses(ValueError, r"sources\[0\].path \('x'\).*none found", sources(("x", empty)), tmp_path)
    (tmp_path / "file.jsonl").write_text("")
    _pipeline_refuses(ValueError, r"a directory \(not a file\)", sources(("x", tmp_path / "file.jsonl")), tmp_path)
    blank = tmp_path / "blank"
    blank.mkdir()
    (blank / "part-0.jsonl").write_text("")
    _pipeline_refuses(ValueError, r"sources\[1\].path \('blank'\).*at least one record",
                      sources((first["name"], first["path"]), ("blank", blank)), tmp_path)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_text('{"text": "x"}\n')
    (mixed / "b.parquet").write_bytes(b"")
    _pipeline_refuses(ValueError, r"holding the files of 2 formats: jsonl \(a\.jsonl\); parquet \(b\.parquet\), "
                                  r"expected one format per folder", sources(("m", mixed)), tmp_path)
    # object storage is read (tests/test_object_storage.py); a scheme the loader does not read is refused by name
    _pipeline_refuses(ValueError, r"sources\[0\].path \('r'\): got 'ftp://bucket/x', expected a local directory "
                      r"or a URL of object storage", sources(("r", "ftp://bucket/x")), tmp_path)


@pytest.mark.parametrize(
    ("keys", "kwargs", "exc", "match"),
    [
        ({"pad_token_id": 10_000}, {}, ValueError, r"pad_token_id: got 10000, expected an id in \[0, 400\)"),
        ({"eos_token_id": 10_000}, {}, ValueError, r"eos_token_id: got 10000, expected an id in \[0, 400\)"),
        ({}, {"transform": 5}, TypeError, r"transform: got 'int'"),
        ({}, {"dp": DataParallel(0, 2)}, ValueError, r"distributed\.aggregate_dir: got None.*2 data-parallel ranks"),
        ({"distributed": {"canonical_replicas": 3, "aggregate_store": "torch://"}}, {"dp": DataParallel(0, 2)},
         ValueError, r"distributed\.canonical_replicas: got 3, expected a multiple of the data-parallel size 2"),
        ({"distributed": {"aggregate_dir": "/tmp/agg", "aggregate_store": "torch://"}}, {}, ValueError,
         r"distributed\.aggregate_dir/aggregate_store: .*expected at most one"),
    ],
)
def test_refuses_bad_arguments(base_keys, tmp_path, keys, kwargs, exc, match):
    _pipeline_refuses(exc, match, _with(base_keys, **keys), tmp_path, **kwargs)


@pytest.mark.parametrize(
    ("rank", "size", "match"),
    [(1, 1, r"dp_rank: got 1, expected < dp_world_size \(1\)"), (-1, 2, r"dp_rank: got -1"),
     (True, 2, r"dp_rank: got True"), (0, 0, r"dp_world_size: got 0, expected an int >= 1")],
)
def test_refuses_bad_data_parallel_coordinates(rank, size, match):
    _refuses(ValueError, match, lambda: DataParallel(rank, size))


def test_refuses_mode_conflicts(base_keys, pretokenized_parquet_source, tmp_path):
    pretokenized = _with(base_keys, sources=[{"name": "t", "path": str(pretokenized_parquet_source)}],
                         tokenizer={"path": None, "pretokenized_field": "tokens"})
    _pipeline_refuses(ValueError, r"pad_token_id: got None", pretokenized, tmp_path)
    _pipeline_refuses(ValueError, r"tokenizer\.chat_template: got None",
                      _with(base_keys, tokenizer={"chat_field": "messages"}), tmp_path)


# --- refused by the config: types, ranges and combinations of keys


def test_refuses_bad_sources_shape(base_keys):
    first = base_keys["sources"][0]
    _config_refuses(ValueError, r"dataloader\.sources: got an empty list", _with(base_keys, sources=[]))
    _config_refuses(TypeError, r"dataloader\.sources: got str", _with(base_keys, sources="a"))
    _config_refuses(ValueError, r"dataloader\.sources: duplicate names in \['a', 'a'\]",
                    _with(base_keys, sources=[first, {**base_keys["sources"][1], "name": "a"}]))
    _config_refuses(ValueError, r"dataloader\.sources\[0\]\.path: missing", _with(base_keys, sources=[{"name": "a"}]))


@pytest.mark.parametrize(
    ("weight", "exc"),
    [(0, ValueError), (-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
     (True, TypeError), ("1", TypeError)],
)
def test_refuses_bad_weight(base_keys, weight, exc):
    sources = [base_keys["sources"][0], {**base_keys["sources"][1], "weight": weight}]
    _config_refuses(exc, r"dataloader\.sources\[1\]\.weight: got", _with(base_keys, sources=sources))


def test_sources_as_mappings(base_keys, tmp_path):
    sources = [{**base_keys["sources"][0], "weight": 2}]  # an int weight is a number
    assert zephon_pipeline(_with(base_keys, sources=sources), work_dir=tmp_path) is not None


@pytest.mark.parametrize(
    ("changes", "exc", "match"),
    [
        ({"sequence_length": 0}, ValueError, r"dataloader\.sequence_length: got 0, expected an int > 0"),
        ({"sequence_length": -5}, ValueError, r"dataloader\.sequence_length: got -5"),
        ({"sequence_length": 3.5}, TypeError, r"dataloader\.sequence_length: got float 3\.5"),
        ({"micro_batch_size": 0}, ValueError, r"dataloader\.micro_batch_size: got 0"),
        ({"packing": {"algorithm": "greedy"}}, ValueError, r"dataloader\.packing\.algorithm: got 'greedy'"),
        ({"packing": {"num_bins": 0}}, ValueError, r"dataloader\.packing\.num_bins: got 0"),
        ({"packing": {"algorithm": "wrap", "num_bins": 4}}, ValueError,
         r"dataloader\.packing\.num_bins: got 4 with algorithm 'wrap', expected null"),
        ({"tokenizer": {"special_tokens": "both"}}, ValueError, r"dataloader\.tokenizer\.special_tokens: got 'both'"),
        ({"tokenizer": {"text_field": ""}}, ValueError, r"dataloader\.tokenizer\.text_field: got ''"),
        ({"tokenizer": {"path": {}}}, TypeError, r"dataloader\.tokenizer\.path: got dict"),
        ({"tokenizer": {"pretokenized_field": "tokens", "chat_field": "messages"}}, ValueError,
         r"dataloader\.tokenizer: got both \['pretokenized_field', 'chat_field'\]"),
        ({"tokenizer": {"path": None, "chat_field": "messages"}}, ValueError,
         r"dataloader\.tokenizer\.path: chat_field needs a local tokenizer folder"),
        ({"seed": -1}, ValueError, r"dataloader\.seed: got -1, expected an int >= 0"),
        ({"seed": "x"}, TypeError, r"dataloader\.seed: got str 'x'"),
        ({"distributed": {"canonical_replicas": 0}}, ValueError, r"dataloader\.distributed\.canonical_replicas: got 0"),
        ({"runtime": {"max_worker": 2}}, ValueError, r"dataloader\.runtime\.max_worker: unknown key"),
        ({"runtime": {"world_size": 2}}, ValueError, r"dataloader\.runtime\.world_size: unknown key"),
        ({"runtime": {"max_workers": 0}}, ValueError, r"dataloader\.runtime\.max_workers: got 0, expected an int > 0"),
        ({"runtime": {"prefetch_batches": 0}}, ValueError, r"dataloader\.runtime\.prefetch_batches: got 0"),
        ({"runtime": {"tokenize_parallelism": 0}}, ValueError, r"dataloader\.runtime\.tokenize_parallelism: got 0"),
        ({"eligibility_field": "elig"}, ValueError, r"dataloader\.eligibility_field: got 'elig' with text input.*"
                                                    r"pretokenized_field"),
        ({"pad_token_id": -1}, ValueError, r"dataloader\.pad_token_id: got -1, expected an int >= 0"),
        ({"eos_token_id": -1}, ValueError, r"dataloader\.eos_token_id: got -1, expected an int >= 0"),
        ({"eos_token_id": 1.0}, TypeError, r"dataloader\.eos_token_id: got float 1\.0"),
    ],
)
def test_config_refuses_bad_keys(base_keys, changes, exc, match):
    _config_refuses(exc, match, _with(base_keys, **changes))


def test_a_local_position_does_not_change_as_the_engine_moves_on(jsonl_sources, tokenizer_dir):
    """``zephon_compat.local_position`` keeps Zephon's shard without a copy: Zephon must build it afresh."""
    from zephon_loader.zephon_compat import local_position

    pipeline = text_pipeline(jsonl_sources, tokenizer_dir)
    source = ZephonSource(pipeline)
    source.reset(None)
    next(source)
    shards = []
    for _ in range(6):
        local = local_position(pipeline)
        shards.append((local, json.dumps(local, sort_keys=True, default=repr)))
        try:
            next(source)
        except StopIteration:
            break
    assert len(shards) > 2
    assert [json.dumps(local, sort_keys=True, default=repr) for local, _ in shards] == [text for _, text in shards]
    assert len({text for _, text in shards}) == len(shards), "the shard moves with the stream"
    source.close()


@pytest.mark.parametrize(("cores", "runner", "calls"), [(1, "inline", 1), (2, "inline", 1), (4, "threads", 2),
                                                         (16, "threads", 4)])
def test_defaults_follow_the_cores_this_process_may_use(monkeypatch, cores, runner, calls):
    """runner: auto and tokenize_parallelism unset are chosen from the affinity mask (not os.cpu_count)."""
    from zephon_loader.config.schema import RuntimeConfig

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    runtime = RuntimeConfig()
    assert runtime.options()["runner"] == runner and runtime.tokenize_calls() == calls
    assert RuntimeConfig(runner="threads", tokenize_parallelism=3).options()["runner"] == "threads"
    assert RuntimeConfig(tokenize_parallelism=3).tokenize_calls() == 3
