"""zephon_loader.source: pipeline construction, refusals, the torchdata node, resume."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torchdata.nodes import Loader

from zephon_loader import fields as F
from zephon_loader.source import (
    DEFAULT_CHUNK_SIZE,
    SourceSpec,
    ZephonKeys,
    ZephonSource,
    build_pipeline,
    choose_chunk_size,
)

L = 32
B = 4

def text_pipeline(jsonl_sources: dict[str, Path], tokenizer_dir: Path, algorithm: str = "first_fit", **kw: Any):
    return build_pipeline(
        [SourceSpec("a", jsonl_sources["a"], 1.0), SourceSpec("b", jsonl_sources["b"], 2.0)],
        seq_len=L,
        micro_batch_size=B,
        tokenizer=tokenizer_dir,
        packing_algorithm=algorithm,
        seed=3,
        **kw,
    )


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
    pipeline = build_pipeline(
        [SourceSpec("pq", parquet_text_source)], seq_len=L, micro_batch_size=B, tokenizer=tokenizer_dir,
        packing_algorithm="wrap",
    )
    with ZephonSource(pipeline) as source:
        batch = next(source)
    assert set(batch.records[0].payload) == {ZephonKeys.TOKENS, ZephonKeys.POSITIONS}


@pytest.mark.parametrize("algorithm", ["first_fit", "wrap"])
def test_pretokenized_parquet_drops_side_columns_and_carries_eligibility(pretokenized_parquet_source, algorithm):
    pipeline = build_pipeline(
        [SourceSpec("tok", pretokenized_parquet_source)], seq_len=L, micro_batch_size=B,
        pretokenized_field="tokens", eligibility_field="elig", pad_token_id=0, packing_algorithm=algorithm,
    )
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

    pipeline = build_pipeline(
        [SourceSpec("chat", chat_source)], seq_len=64, micro_batch_size=2, tokenizer=tokenizer_dir,
        chat_field="messages", chat_template=CHAT_TEMPLATE,
    )
    with ZephonSource(pipeline) as source:
        batch = next(source)
    payload = batch.records[0].payload
    assert ZephonKeys.LOSS_MASK in payload
    mask = np.asarray(payload[ZephonKeys.LOSS_MASK])
    assert mask.shape == (65,) and 0 < mask.sum() < 65


def test_options_are_passed(jsonl_sources, tokenizer_dir):
    pipeline = text_pipeline(
        jsonl_sources, tokenizer_dir, canonical_replicas=2, run_id="r1",
        runtime_options={"max_workers": 2, "prefetch_batches": 2},
    )
    opts = pipeline._options
    assert (opts.world_size, opts.global_rank, opts.dp_degree, opts.dp_group_id, opts.canonical_replicas) == (1, 0, 1, 0, 2)
    assert opts.run_id == "r1" and opts.max_workers == 2 and opts.prefetch_batches == 2


def test_multi_rank_options_are_passed(jsonl_sources, tokenizer_dir, tmp_path):
    pipeline = text_pipeline(
        jsonl_sources, tokenizer_dir, world_size=4, global_rank=3, dp_degree=2, dp_group_id=1,
        canonical_replicas=4, aggregate_dir=tmp_path, run_id="r2",
    )
    opts = pipeline._options
    assert (opts.world_size, opts.global_rank, opts.dp_degree, opts.dp_group_id, opts.canonical_replicas) == (4, 3, 2, 1, 4)
    assert opts.aggregate_dir == str(tmp_path) and opts.run_id == "r2"


def test_transform_feeds_pretokenized_mode(jsonl_sources):
    def to_bytes(payload):
        data = list(payload["text"].encode())[:20]
        return {"ids": data, "ok": [b != 32 for b in data]}

    pipeline = build_pipeline(
        [SourceSpec("a", jsonl_sources["a"])], seq_len=L, micro_batch_size=B, transform=to_bytes,
        pretokenized_field="ids", eligibility_field="ok", pad_token_id=0,
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
    pipeline = build_pipeline(
        [SourceSpec("small", small, 1.0), SourceSpec("big", big, 1.0)], seq_len=L, micro_batch_size=1,
        tokenizer=tokenizer_dir, packing_algorithm="wrap",
    )
    assert sum(1 for _ in ZephonSource(pipeline)) > 0
    assert choose_chunk_size([5, 50], [1.0, 1.0]) == 10  # 5 per source per chunk: both passes read whole
    assert choose_chunk_size([10**9], [1.0]) == 16000  # the largest size <= 16384 that divides the source
    assert choose_chunk_size([0, 10], [1.0, 1.0]) == 0


# ----------------------------------------------------------------------------- node contract


def test_checkpoint_only_when_state_is_asked(jsonl_sources, tokenizer_dir, reference):
    pipeline = text_pipeline(jsonl_sources, tokenizer_dir)
    calls = []
    real = pipeline.checkpoint

    def spy():
        calls.append(1)
        return real()

    pipeline.checkpoint = spy  # instance attribute shadows the method
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


def _refuses(exc: type[Exception], match: str, **kwargs: Any) -> None:
    before = threading.active_count()
    start = time.monotonic()
    with pytest.raises(exc, match=match):
        build_pipeline(**kwargs)
    assert time.monotonic() - start < 5, "refusal must be fast (no retry loop)"
    assert threading.active_count() <= before, "refusal must come before any worker starts"


@pytest.fixture()
def base_kwargs(jsonl_sources, tokenizer_dir) -> dict[str, Any]:
    return dict(
        sources=[SourceSpec("a", jsonl_sources["a"], 1.0), SourceSpec("b", jsonl_sources["b"], 1.0)],
        seq_len=L, micro_batch_size=B, tokenizer=tokenizer_dir,
    )


def test_refuses_missing_tokenizer(base_kwargs):
    _refuses(ValueError, r"tokenizer: got None.*save_pretrained", **{**base_kwargs, "tokenizer": None})


def test_refuses_hub_tokenizer_id(base_kwargs):
    _refuses(ValueError, r"tokenizer: got 'someorg/some-model'.*hub id cannot resolve offline",
             **{**base_kwargs, "tokenizer": "someorg/some-model"})


def test_refuses_tokenizer_dir_without_files(base_kwargs, tmp_path):
    _refuses(ValueError, r"tokenizer: .*tokenizer\.json", **{**base_kwargs, "tokenizer": tmp_path})


def test_refuses_non_path_tokenizer(base_kwargs):
    _refuses(TypeError, r"tokenizer: got 'dict'", **{**base_kwargs, "tokenizer": {}})


def test_refuses_chunk_size_larger_than_data(base_kwargs):
    _refuses(ValueError, r"chunk_size: got 16384, expected at most \d+ .*'a' has 100 records",
             **{**base_kwargs, "chunk_size": 16384})


def test_refuses_bad_source_dirs(base_kwargs, tmp_path):
    src = base_kwargs["sources"]
    _refuses(ValueError, r"sources\[0\].path \('x'\).*existing directory",
             **{**base_kwargs, "sources": [SourceSpec("x", tmp_path / "missing")]})
    empty = tmp_path / "empty"
    empty.mkdir()
    _refuses(ValueError, r"sources\[0\].path \('x'\).*none found", **{**base_kwargs, "sources": [SourceSpec("x", empty)]})
    (tmp_path / "file.jsonl").write_text("")
    _refuses(ValueError, r"a directory \(not a file\)",
             **{**base_kwargs, "sources": [SourceSpec("x", tmp_path / "file.jsonl")]})
    blank = tmp_path / "blank"
    blank.mkdir()
    (blank / "part-0.jsonl").write_text("")
    _refuses(ValueError, r"sources\[1\].path \('blank'\).*at least one record",
             **{**base_kwargs, "sources": [src[0], SourceSpec("blank", blank)]})
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_text('{"text": "x"}\n')
    (mixed / "b.parquet").write_bytes(b"")
    _refuses(ValueError, r"one shard format per directory", **{**base_kwargs, "sources": [SourceSpec("m", mixed)]})
    _refuses(ValueError, r"local directory", **{**base_kwargs, "sources": [SourceSpec("r", "s3://bucket/x")]})


@pytest.mark.parametrize("weight", [0, -1.0, float("nan"), float("inf"), True, "1"])
def test_refuses_bad_weight(base_kwargs, weight):
    src = base_kwargs["sources"]
    _refuses(ValueError, r"sources\[1\].weight \('b'\)",
             **{**base_kwargs, "sources": [src[0], SourceSpec("b", src[1].path, weight)]})


def test_refuses_bad_sources_shape(base_kwargs):
    src = base_kwargs["sources"]
    _refuses(ValueError, r"sources: got \[\]", **{**base_kwargs, "sources": []})
    _refuses(TypeError, r"sources: got 'str'", **{**base_kwargs, "sources": "a"})
    _refuses(ValueError, r"unique name", **{**base_kwargs, "sources": [src[0], SourceSpec("a", src[1].path)]})
    _refuses(ValueError, r"sources\[0\]", **{**base_kwargs, "sources": [{"name": "a"}]})


def test_sources_as_mappings(base_kwargs, jsonl_sources):
    pipeline = build_pipeline(**{**base_kwargs, "sources": [{"name": "a", "path": str(jsonl_sources["a"]), "weight": 2}]})
    assert pipeline is not None


@pytest.mark.parametrize(
    ("key", "value", "exc", "match"),
    [
        ("seq_len", 0, ValueError, r"seq_len: got 0, expected a positive int"),
        ("seq_len", -5, ValueError, r"seq_len"),
        ("seq_len", 3.5, TypeError, r"seq_len"),
        ("micro_batch_size", 0, ValueError, r"micro_batch_size"),
        ("packing_algorithm", "greedy", ValueError, r"packing_algorithm: got 'greedy'"),
        ("num_bins", 0, ValueError, r"num_bins"),
        ("special_tokens", "both", ValueError, r"special_tokens"),
        ("seed", -1, ValueError, r"seed"),
        ("seed", "x", TypeError, r"seed"),
        ("stop_after_passes", 0, ValueError, r"stop_after_passes"),
        ("world_size", 2, ValueError, r"aggregate_dir: got None.*world_size=2"),
        ("global_rank", 1, ValueError, r"global_rank: got 1"),
        ("canonical_replicas", 0, ValueError, r"canonical_replicas"),
        ("dp_degree", 2, ValueError, r"dp_degree: got 2, expected a divisor"),
        ("runtime_options", {"max_worker": 2}, ValueError, r"runtime_options: got \['max_worker'\]"),
        ("runtime_options", {"world_size": 2}, ValueError, r"no data-parallel keys"),
        ("eligibility_field", "elig", ValueError, r"eligibility_field: got 'elig'.*pretokenized"),
        ("pad_token_id", 10_000, ValueError, r"pad_token_id: got 10000"),
        ("eos_token_id", -1, ValueError, r"eos_token_id"),
        ("eos_token_id", 1.0, TypeError, r"eos_token_id"),
        ("transform", 5, TypeError, r"transform"),
    ],
)
def test_refuses_bad_arguments(base_kwargs, key, value, exc, match):
    _refuses(exc, match, **{**base_kwargs, key: value})


def test_refuses_num_bins_for_wrap(base_kwargs):
    _refuses(ValueError, r"num_bins: got 4, expected None for packing_algorithm='wrap'",
             **{**base_kwargs, "packing_algorithm": "wrap", "num_bins": 4})


def test_refuses_mode_conflicts(base_kwargs, pretokenized_parquet_source):
    _refuses(ValueError, r"pretokenized_field/chat_field",
             **{**base_kwargs, "pretokenized_field": "tokens", "chat_field": "messages"})
    _refuses(ValueError, r"pad_token_id: got None",
             **{**base_kwargs, "tokenizer": None, "sources": [SourceSpec("t", pretokenized_parquet_source)],
                "pretokenized_field": "tokens"})
    _refuses(ValueError, r"chat_template: got None",
             **{**base_kwargs, "chat_field": "messages"})
    _refuses(ValueError, r"eos_token_id: got 1, expected unset outside text mode",
             **{**base_kwargs, "sources": [SourceSpec("t", pretokenized_parquet_source)],
                "pretokenized_field": "tokens", "eos_token_id": 1})
