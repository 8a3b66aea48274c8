"""Every record of a pass is delivered exactly once (issue 9, "end of a pass").

Records are pretokenized and self-describing: token ``k`` of record ``j`` of
source ``s`` is ``10 + (1000 * s + j) * MAX_LEN + k`` (pad id 0), so the
yielded batches alone say which records arrived, how often and whether every
piece of a wrapped record did. Three losses are covered:

* Zephon's mixture skipped the end of a source's pass whenever a chunk's
  quota for it did not fit (``choose_chunk_size`` now picks whole-pass sizes);
* ``batch(B)`` dropped the final partial batch (now delivered, padded to B);
* uncapped ``wrap`` dropped the partial row left at each flush (now padded).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import collect, write_jsonl_shards, zephon_pipeline
from zephon_loader import build_text_loader
from zephon_loader import fields as F

S = 16  # rows pack S + 1 = 17 tokens; every record is shorter
B = 3
PAD = 0
MAX_LEN = 16
ALGORITHMS = ("first_fit", "best_fit", "wrap", "best_fit_wrap")
#: (record counts, weights): counts that divide neither each other nor the chunk sizes Zephon liked.
MIXTURES = {
    "one": ((101,), (1.0,)),
    "two_1:1": ((150, 70), (1.0, 1.0)),  # the case measured on zephon 0.2.0 (a source whose count is not a multiple of the chunk)
    "two_3:1": ((151, 71), (3.0, 1.0)),
    "three_1:2:5": ((37, 53, 61), (1.0, 2.0, 5.0)),
}


def length(source: int, index: int) -> int:
    """1..12 tokens: every record fits in a row, so no algorithm drops one."""
    return 1 + (7 * index + 3 * source) % 12


def token(source: int, index: int, k: int) -> int:
    return 10 + (1000 * source + index) * MAX_LEN + k


def write_sources(root: Path, counts: tuple[int, ...]) -> list[Path]:
    return [
        write_jsonl_shards(
            root / f"s{s}", [{"ids": [token(s, j, k) for k in range(length(s, j))]} for j in range(n)], shards=3
        )
        for s, n in enumerate(counts)
    ]


def config(paths: list[Path], weights: tuple[float, ...], algorithm: str, shuffle: bool, **extra: Any) -> dict:
    return {
        "sources": [{"name": f"s{i}", "path": str(p), "weight": w} for i, (p, w) in enumerate(zip(paths, weights))],
        "tokenizer": {"pretokenized_field": "ids"},
        "pad_token_id": PAD,
        "sequence_length": S,
        "micro_batch_size": B,
        "packing": {"algorithm": algorithm},
        "shuffle": shuffle,
        "seed": 11,
        "mask_cross_document_labels": False,  # labels then carry each row's last (S + 1-th) token
        "runtime": {"runner": "threads"},
        **extra,
    }


def row_tokens(batch: dict[str, torch.Tensor]) -> list[list[int]]:
    """The packed tokens of each row: the non-padding inputs, then the last label (the S + 1-th token)."""
    ids, labels, pad = batch[F.INPUT_IDS], batch[F.LABELS], batch[F.PADDING_MASK]
    rows = []
    for r in range(ids.shape[0]):
        tokens = ids[r][~pad[r]].tolist()
        if int(labels[r, -1]) != F.IGNORE_INDEX:
            tokens.append(int(labels[r, -1]))
        rows.append(tokens)
    return rows


def deliveries(batches: list[dict[str, torch.Tensor]], counts: tuple[int, ...]) -> list[list[int]]:
    """How often each record of each source was delivered; fails on a partial delivery or a stray token."""
    seen = Counter(t for batch in batches for row in row_tokens(batch) for t in row)
    out: list[list[int]] = []
    expected_tokens = set()
    for s, n in enumerate(counts):
        per_record = []
        for j in range(n):
            tokens = [token(s, j, k) for k in range(length(s, j))]
            expected_tokens.update(tokens)
            times = {seen[t] for t in tokens}
            assert len(times) == 1, f"source {s} record {j}: its {len(tokens)} tokens arrived {sorted(times)} times"
            per_record.append(times.pop())
        out.append(per_record)
    stray = set(seen) - expected_tokens
    assert not stray, f"tokens that belong to no record: {sorted(stray)[:10]}"
    return out


def check_whole_passes(
    times: list[list[int]], counts: tuple[int, ...], weights: tuple[float, ...], shuffle: bool
) -> None:
    """The slowest source (largest count / weight) is read exactly once; the others repeat whole passes."""
    shares = [w / sum(weights) for w in weights]
    slowest = max(range(len(counts)), key=lambda s: counts[s] / shares[s])
    missing = {f"s{s}": sum(1 for t in per if t == 0) for s, per in enumerate(times)}
    assert all(t == 1 for t in times[slowest]), (
        f"slowest source s{slowest} must be read exactly once; records never delivered per source: {missing}"
    )
    for s, per in enumerate(times):
        delivered, n = sum(per), counts[s]
        passes, extra = divmod(delivered, n)
        assert sorted(per) == [passes] * (n - extra) + [passes + 1] * extra, (
            f"source s{s}: every record read {passes} or {passes + 1} times expected, got {Counter(per)}; "
            f"records never delivered per source: {missing}"
        )
        if not shuffle and extra:  # unshuffled passes are in record order: the last, cut pass is a prefix
            assert per[:extra] == [passes + 1] * extra
        # The mixture weights hold: each source's share of the records is its weight's, to one draw.
        ideal = counts[slowest] * shares[s] / shares[slowest]
        assert abs(delivered - ideal) <= shares[s] / shares[slowest] + 1, (s, delivered, ideal)


def check_batches(batches: list[dict[str, torch.Tensor]], algorithm: str, tokens_delivered: int) -> None:
    """B rows each; the padding rows that complete the last batch are the only empty rows."""
    assert batches
    for batch in batches:
        assert batch[F.INPUT_IDS].shape == (B, S)
    real = [bool((~batch[F.PADDING_MASK][r]).any()) for batch in batches for r in range(B)]
    real_rows = sum(real)
    assert real == [True] * real_rows + [False] * (len(real) - real_rows), "empty rows only at the very end"
    assert len(batches) == math.ceil(real_rows / B)
    if algorithm in ("wrap", "best_fit_wrap"):  # every row but the last is full
        assert real_rows == math.ceil(tokens_delivered / (S + 1))
    last = batches[-1]
    empty = ~(~last[F.PADDING_MASK]).any(dim=1)
    assert bool(empty.any()) == (real_rows % B != 0)
    assert bool((last[F.INPUT_IDS][empty] == PAD).all())
    assert bool((last[F.LABELS][empty] == F.IGNORE_INDEX).all())
    assert bool(last[F.PADDING_MASK][empty].all())
    assert bool((last[F.POSITION_IDS][empty] == torch.arange(S)).all())
    assert not bool(last[F.ATTENTION_MASK][empty].any())  # block-causal: a padding row attends nothing


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, list[Path]]:
    root = tmp_path_factory.mktemp("pass")
    return {name: write_sources(root / name, counts) for name, (counts, _) in MIXTURES.items()}


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("mixture", list(MIXTURES))
def test_every_record_of_a_pass_is_delivered_once(corpora, mixture, algorithm, shuffle):
    counts, weights = MIXTURES[mixture]
    with build_text_loader(config(corpora[mixture], weights, algorithm, shuffle, read_ahead=0)) as loader:
        batches = collect(loader)
    times = deliveries(batches, counts)
    check_whole_passes(times, counts, weights, shuffle)
    delivered = sum(t * length(s, j) for s, per in enumerate(times) for j, t in enumerate(per))
    check_batches(batches, algorithm, delivered)


# ----------------------------------------------------------------------------- resume around the short batch


def same_batch(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return set(a) == set(b) and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


@pytest.mark.parametrize("read_ahead", [0, 2])
def test_resume_around_the_final_short_batch_is_exact(corpora, read_ahead):
    counts, weights = MIXTURES["two_3:1"]
    cfg = config(corpora["two_3:1"], weights, "wrap", True, read_ahead=read_ahead)
    with build_text_loader(cfg) as loader:
        reference = collect(loader)
    assert bool(reference[-1][F.PADDING_MASK].all(dim=1).any()), "the case must end with a padded short batch"
    for consumed in (len(reference) - 1, len(reference)):
        with build_text_loader(cfg) as loader:
            iterator = iter(loader)
            for _ in range(consumed):
                next(iterator)
            state = json.loads(json.dumps(loader.state_dict()))
        with build_text_loader(cfg) as loader:
            loader.load_state_dict(state)
            rest = collect(loader)
        assert len(rest) == len(reference) - consumed
        assert all(same_batch(x, y) for x, y in zip(rest, reference[consumed:], strict=True))


# ----------------------------------------------------------------------------- every contract takes padding rows


@pytest.mark.parametrize(
    "contract, xdoc",
    [
        ({"attn_implementation": "sdpa"}, False),
        ({"attn_implementation": "sdpa"}, True),
        ({"attn_implementation": "fa4"}, False),
        ({"attn_implementation": "flash_attention_2"}, False),
        ({"packed_mask_type": "document_ids", "requires_packed_sequence_metadata": False, "qkv_format": "thd"}, False),
    ],
    ids=["block_causal", "block_causal_xdoc", "metadata", "flash_varlen", "thd"],
)
def test_padding_rows_pass_every_contract(corpora, contract, xdoc):
    counts, weights = MIXTURES["two_1:1"]
    cfg = config(corpora["two_1:1"], weights, "first_fit", False, read_ahead=0, contract=contract, xdoc=xdoc)
    with build_text_loader(cfg) as loader:
        batches = collect(loader)
    last = batches[-1]
    empty = last[F.PADDING_MASK].all(dim=1)
    assert bool(empty.any()) and not bool(empty.all())
    assert last[F.INPUT_IDS].shape == (B, S)
    if F.PACKED_TOKEN_INDICES in last:
        assert bool((last[F.PACKED_TOKEN_INDICES][empty] == -1).all())
        assert bool((last[F.CU_SEQLENS][empty][:, 1:] == -1).all())
    if F.SEQ_LENS in last:
        assert bool((last[F.SEQ_LENS][empty][:, 0] == 0).all())
        assert bool((last[F.SEQ_LENS_PADDED][empty][:, 0] == S).all())
    if F.CU_SEQ_LENS_Q in last:
        assert int(last[F.CU_SEQ_LENS_Q][-1]) == B * S
    deliveries(batches, counts)


# ----------------------------------------------------------------------------- chunk sizes, checked on Zephon itself


def drawn_ids(paths: list[Path], weights: tuple[float, ...], chunk_size: int, shuffle: bool) -> list[list[tuple]]:
    """The sample ids Zephon's own work source draws per source, in order, for one run (stop_after_passes=1)."""
    import zephon

    datasets = [zephon.Dataset.from_path(f"s{i}", str(p)) for i, p in enumerate(paths)]
    source = zephon.StaticMixtureWorkSource(
        datasets, zephon.MixtureSpec({f"s{i}": w for i, w in enumerate(weights)}), chunk_size=chunk_size, seed=3,
        shuffle_shards=shuffle, shuffle_within_shard=shuffle, stop_after_passes=1,
    ).clone_for_lane(0, 1)
    out: list[list[tuple]] = [[] for _ in paths]
    while (chunk := source.next_chunk()) is not None:
        for name, ids in chunk.components.items():
            out[int(name[1:])].extend(tuple(int(x) for x in sample) for sample in ids)
    return out


def passes_are_whole(drawn: list[tuple], count: int) -> bool:
    """Each run of ``count`` draws is one whole pass; the last, cut run holds no repeat."""
    runs = [drawn[i : i + count] for i in range(0, len(drawn), count)]
    return all(len(set(run)) == len(run) for run in runs) and all(len(run) == count for run in runs[:-1])


@pytest.mark.parametrize("mixture", list(MIXTURES))
def test_accepted_chunk_sizes_read_every_pass_whole_in_zephon(corpora, mixture):
    from zephon_loader.pipeline.work_source import _largest_servable_chunk_size, _shares, _whole_passes, choose_chunk_size

    counts, weights = MIXTURES[mixture]
    shares = _shares(weights)
    largest = _largest_servable_chunk_size(counts, shares, 10**6)
    slowest = max(range(len(counts)), key=lambda s: counts[s] / shares[s])
    accepted = [c for c in range(1, largest + 1) if _whole_passes(counts, shares, c)]
    assert choose_chunk_size(counts, weights) == max(accepted)
    for chunk in accepted:
        drawn = drawn_ids(corpora[mixture], weights, chunk, shuffle=chunk % 2 == 0)
        assert len(drawn[slowest]) == counts[slowest], chunk
        assert all(passes_are_whole(d, n) for d, n in zip(drawn, counts)), chunk
    # The size chosen before (the largest Zephon accepts) skips records in every mixture but the single source.
    drawn = drawn_ids(corpora[mixture], weights, largest, shuffle=False)
    whole = len(drawn[slowest]) == counts[slowest] and all(passes_are_whole(d, n) for d, n in zip(drawn, counts))
    assert whole == (largest in accepted)
    assert whole == (mixture == "one")


def test_choose_chunk_size():
    from zephon_loader.pipeline.work_source import DEFAULT_CHUNK_SIZE, choose_chunk_size

    assert choose_chunk_size([150, 70], [1.0, 1.0]) == 20  # 10 of each per chunk; 10 divides 150 and 70
    assert choose_chunk_size([150, 70], [1.0, 1.0], upper=19) == 10
    assert choose_chunk_size([5, 50], [1.0, 1.0]) == 10
    assert choose_chunk_size([151, 71], [3.0, 1.0]) == 1  # 3 does not divide 151: only one record per chunk
    assert choose_chunk_size([600, 300], [2.0, 1.0]) == 900
    assert choose_chunk_size([10**9], [1.0]) == 16000  # the largest divisor <= DEFAULT_CHUNK_SIZE
    assert choose_chunk_size([2**20], [1.0]) == DEFAULT_CHUNK_SIZE
    assert choose_chunk_size([0, 10], [1.0, 1.0]) == 0


def test_explicit_chunk_size_that_skips_records_is_refused(corpora):
    counts, weights = MIXTURES["two_1:1"]
    cfg = config(corpora["two_1:1"], weights, "first_fit", False, chunk_size=138)
    with pytest.raises(ValueError, match=r"chunk_size: got 138.*sources\[0\] \('s0'\): it draws 69 records per chunk, "
                                         r"so the last 12 of its 150 records would be skipped in every pass.*"
                                         r"Set chunk_size: null \(picks 20 here\)\.$"):
        build_text_loader(cfg)
    with build_text_loader(config(corpora["two_1:1"], weights, "first_fit", False, chunk_size=10)) as loader:
        deliveries(collect(loader), counts)


def test_small_chunks_keep_rows_packed(corpora):
    """Chunk size 1 (3:1 over 151 / 71 records) must not make Zephon flush, and pad out, every 8 records."""
    counts, weights = MIXTURES["two_3:1"]
    with build_text_loader(config(corpora["two_3:1"], weights, "first_fit", True, read_ahead=0)) as loader:
        batches = collect(loader)
    tokens = sum(len(row) for batch in batches for row in row_tokens(batch))
    rows = sum(1 for batch in batches for row in row_tokens(batch) if row)
    assert rows <= 1.1 * math.ceil(tokens / (S + 1))  # a flush every 8 chunks gives ~1.24x here


# ----------------------------------------------------------------------------- flushes inside a pass


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_flushes_inside_a_pass_lose_nothing(corpora, algorithm):
    """Zephon flushes packing and batching every ``flush_every_k_chunks`` chunks: the partial row and the
    short batch each flush leaves are delivered (the batch padded to B rows by collate)."""
    from zephon_loader.collate.text import collate
    from zephon_loader.nodes.source import ZephonSource

    counts, weights = MIXTURES["two_1:1"]
    pipeline = zephon_pipeline(config(corpora["two_1:1"], weights, algorithm, True, chunk_size=4, seed=5))
    pipeline.options(flush_every_k_chunks=1)  # Zephon's own option: flush after every chunk
    with ZephonSource(pipeline) as source:
        raw = list(source)
    assert sum(len(batch.records) < B for batch in raw) > 1, "flushes must leave short batches inside the pass"
    batches = [
        collate(batch, mask_cross_document_labels=False, micro_batch_size=B, pad_token_id=PAD) for batch in raw
    ]
    assert all(batch[F.INPUT_IDS].shape == (B, S) for batch in batches)
    check_whole_passes(deliveries(batches, counts), counts, weights, shuffle=True)


# ----------------------------------------------------------------------------- collate's padding rows


def short_batch(rows: int, padding_rows: int = 0) -> Any:
    """``rows`` packed rows of S + 1 tokens as pack_flat emits them (two documents, then 3 pad tokens),
    then ``padding_rows`` rows that are all pad tail."""
    import numpy as np
    from zephon import SampleBatch, SampleMeta, SampleRecord

    records = []
    for i in range(rows + padding_rows):
        real = i < rows
        payload = {
            "input_ids": np.asarray([5 + i] * 8 + [7] * 6 + [PAD] * 3 if real else [PAD] * (S + 1), dtype=np.int64),
            "positions": np.asarray(list(range(8)) + list(range(6)) + list(range(3)) if real else range(S + 1),
                                    dtype=np.int32),
            F.ATTENTION_ELIGIBILITY: np.asarray([1] * 14 + [0] * 3 if real else [0] * (S + 1), dtype=np.bool_),
        }
        meta = SampleMeta(sample_id=(0, 0, i), lane_id=0, chunk_id=0, chunk_offset=i,
                          tags={"_packing_metadata": {"padding_length": 3 if real else S + 1}})
        records.append(SampleRecord(meta=meta, payload=payload))
    return SampleBatch(tuple(records))


def test_collate_completes_a_short_batch_with_padding_rows():
    from zephon_loader.collate.text import collate

    batch = short_batch(2)
    plain = collate(batch, mask_cross_document_labels=True, physical_cu_seqlens=True)
    out = collate(batch, mask_cross_document_labels=True, physical_cu_seqlens=True,
                  micro_batch_size=4, pad_token_id=PAD)
    assert set(out) == set(plain)
    for key, value in out.items():
        assert value.shape[0] == 4 and value.dtype == plain[key].dtype, key
        assert torch.equal(value[:2], plain[key]), key  # the real rows are unchanged
    assert bool((out[F.INPUT_IDS][2:] == PAD).all())
    assert bool((out[F.LABELS][2:] == F.IGNORE_INDEX).all())
    assert bool(out[F.PADDING_MASK][2:].all())
    assert bool((out[F.POSITION_IDS][2:] == torch.arange(S)).all())
    assert bool((out[F.DOCUMENT_IDS][2:] == 0).all())
    assert not bool(out[F.ATTENTION_ELIGIBILITY][2:].any())
    assert out[F.CU_SEQLENS][2:].tolist() == [[0] + [S] * (out[F.CU_SEQLENS].shape[1] - 1)] * 2
    # A padding row is exactly what Zephon's to_training makes of a packed row that is all pad tail.
    zephon_made = collate(short_batch(2, padding_rows=2), mask_cross_document_labels=True, physical_cu_seqlens=True)
    assert set(zephon_made) == set(out)
    assert all(torch.equal(out[key], zephon_made[key]) for key in out)

    full = collate(short_batch(4), mask_cross_document_labels=True, micro_batch_size=4, pad_token_id=PAD)
    assert not bool(full[F.PADDING_MASK].all(dim=1).any())
    with pytest.raises(ValueError, match=r"zephon_batch: got 4 records, expected at most micro_batch_size=3"):
        collate(short_batch(4), mask_cross_document_labels=True, micro_batch_size=3, pad_token_id=PAD)
    with pytest.raises(ValueError, match=r"pad_token_id: got None, expected an int >= 0"):
        collate(batch, mask_cross_document_labels=True, micro_batch_size=4)


@pytest.mark.parametrize("lanes", [1, 2, 4])
@pytest.mark.parametrize("mixture", ["two_3:1", "three_1:2:5"])
def test_mixture_once_reads_every_record_exactly_once_across_lanes(corpora, mixture, lanes):
    """``mixture: once`` (validation, exact epochs): the work source the builder makes, dealt to every lane,
    draws each record of each source exactly once, whatever the weights (the smaller sources do not repeat)."""
    from zephon_loader.config import text_loader_config
    from zephon_loader.pipeline.work_source import build_work_source

    counts, weights = MIXTURES[mixture]
    config = text_loader_config(
        sources=[{"name": f"s{i}", "path": str(p), "weight": w} for i, (p, w) in enumerate(zip(corpora[mixture], weights))],
        sequence_length=8, micro_batch_size=1, tokenizer={"pretokenized_field": "ids"}, pad_token_id=0,
        mixture="once", seed=3)
    work = build_work_source(config, lanes=lanes)
    drawn: list[list[tuple]] = [[] for _ in counts]
    for lane in range(lanes):
        source = work.source.clone_for_lane(lane, lanes)
        while (chunk := source.next_chunk()) is not None:
            for name, ids in chunk.components.items():
                drawn[int(name[1:])].extend(tuple(int(x) for x in sample) for sample in ids)
    for index, count in enumerate(counts):
        assert len(drawn[index]) == count and len(set(drawn[index])) == count, (index, len(drawn[index]), count)


@pytest.mark.parametrize("lanes", [1, 2])
def test_passes_reads_every_record_that_many_times(corpora, lanes):
    """``passes: 3``: one stream of three whole passes (each reshuffled by Zephon), dealt to every lane."""
    from collections import Counter

    from zephon_loader.config import text_loader_config
    from zephon_loader.pipeline.work_source import build_work_source

    config = text_loader_config(
        sources=[{"name": "s0", "path": str(corpora["one"][0])}], sequence_length=8, micro_batch_size=1,
        tokenizer={"pretokenized_field": "ids"}, pad_token_id=0, passes=3, seed=3)
    work = build_work_source(config, lanes=lanes)
    drawn: list[tuple] = []
    for lane in range(lanes):
        source = work.source.clone_for_lane(lane, lanes)
        while (chunk := source.next_chunk()) is not None:
            drawn.extend(tuple(int(x) for x in sample) for ids in chunk.components.values() for sample in ids)
    assert len(drawn) == 3 * MIXTURES["one"][0][0]
    assert set(Counter(drawn).values()) == {3}


def test_endless_passes_keep_every_lane_going_and_refuse_mixture_once(corpora, tokenizer_dir):
    """``passes: null``: the stream never ends (training by steps; no lane reaches a pass end before another)."""
    from zephon_loader import build_text_loader
    from zephon_loader.config import text_loader_config

    keys = dict(sources=[{"name": "s0", "path": str(corpora["one"][0])}], sequence_length=8, micro_batch_size=2,
                tokenizer={"pretokenized_field": "ids"}, pad_token_id=0, packing={"algorithm": "wrap"}, read_ahead=0)
    with build_text_loader(dict(keys, passes=1)) as one:
        per_pass = sum(1 for _ in one)
    with build_text_loader(dict(keys, passes=None)) as endless:
        iterator = iter(endless)
        for _ in range(3 * per_pass + 1):
            next(iterator)
        assert endless.stats()["sources"]["s0"]["delivered"]["documents"] > 3 * MIXTURES["one"][0][0]
        assert endless.fingerprint["passes"] is None
    with pytest.raises(ValueError, match=r"dataloader\.passes: got None with mixture: once, expected 1"):
        text_loader_config(**keys, passes=None, mixture="once")
    with pytest.raises(ValueError, match=r"dataloader\.passes: got 0, expected an int > 0 or null"):
        text_loader_config(**keys, passes=0)
