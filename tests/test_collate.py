"""zephon_loader.collate: to_training -> TrainingBatch, document ids, label masking."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest
import torch
from zephon import SampleBatch, SampleMeta, SampleRecord

from conftest import zephon_pipeline
from zephon_loader import fields as F
from zephon_loader.collate.text import TextCollate, collate, document_ids_from_positions, next_token_starts_document
from zephon_loader.nodes.source import ZephonSource
from zephon_loader.zephon_compat import ZephonKeys

L = 32
B = 4
IGN = F.IGNORE_INDEX

# ----------------------------------------------------------------------------- helpers


def hand_batch(rows: list[dict[str, Any]]) -> SampleBatch:
    """A SampleBatch like pack_flat(S + 1).batch(B) emits.

    Each row: ``tokens`` (S + 1 ints), ``positions`` (S + 1 ints), ``pad`` (trailing
    pad count), optional ``loss_mask`` / ``elig`` (S + 1 values).
    """
    records = []
    for i, row in enumerate(rows):
        payload: dict[str, Any] = {
            ZephonKeys.TOKENS: np.asarray(row["tokens"], dtype=np.int64),
            ZephonKeys.POSITIONS: np.asarray(row["positions"], dtype=np.int32),
        }
        if "loss_mask" in row:
            payload[ZephonKeys.LOSS_MASK] = np.asarray(row["loss_mask"], dtype=np.uint8)
        if "elig" in row:
            payload[F.ATTENTION_ELIGIBILITY] = np.asarray(row["elig"], dtype=np.bool_)
        meta = SampleMeta(
            sample_id=(0, 0, i), lane_id=0, chunk_id=0, chunk_offset=i,
            tags={"_packing_metadata": {"padding_length": row.get("pad", 0)}},
        )
        records.append(SampleRecord(meta=meta, payload=payload))
    return SampleBatch(tuple(records))


def reference_document_ids(positions: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    """Slow, obviously-correct docs/contract.md §4 rule (loops on purpose)."""
    pos = positions if positions.dim() == 3 else positions[None]
    _, rows, cols = pos.shape
    out = torch.zeros(rows, cols, dtype=torch.int64)
    for b in range(rows):
        doc = 0
        for s in range(cols):
            if s == 0 or all(int(pos[a, b, s]) == 0 for a in range(pos.shape[0])):
                doc += 1
            out[b, s] = 0 if bool(padding[b, s]) else doc
    return out


def snapshot(batch: SampleBatch) -> list[dict[str, np.ndarray]]:
    return [{k: np.array(v, copy=True) for k, v in r.payload.items()} for r in batch.records]


def assert_payload_unchanged(batch: SampleBatch, before: list[dict[str, np.ndarray]]) -> None:
    for record, saved in zip(batch.records, before, strict=True):
        assert set(record.payload) == set(saved)
        for key, value in saved.items():
            np.testing.assert_array_equal(np.asarray(record.payload[key]), value)


# ----------------------------------------------------------------------------- real Zephon batches


@pytest.fixture(scope="module")
def real_batches(jsonl_sources, tokenizer_dir, pretokenized_parquet_source) -> dict[str, list[SampleBatch]]:
    out = {}
    for alg in ("first_fit", "wrap"):
        pipeline = zephon_pipeline({
            "sources": [{"name": "a", "path": str(jsonl_sources["a"]), "weight": 1.0},
                        {"name": "b", "path": str(jsonl_sources["b"]), "weight": 2.0}],
            "sequence_length": L, "micro_batch_size": B, "tokenizer": {"path": str(tokenizer_dir)},
            "packing": {"algorithm": alg}, "seed": 5,
        })
        out[alg] = list(ZephonSource(pipeline))
    pipeline = zephon_pipeline({
        "sources": [{"name": "tok", "path": str(pretokenized_parquet_source)}],
        "sequence_length": L, "micro_batch_size": B, "tokenizer": {"pretokenized_field": "tokens"},
        "eligibility_field": "elig", "pad_token_id": 0,
    })
    out["eligibility"] = list(ZephonSource(pipeline))
    return out


@pytest.mark.parametrize("kind", ["first_fit", "wrap", "eligibility"])
def test_real_batches_shapes_dtypes_and_document_ids(real_batches, kind):
    assert real_batches[kind]
    for batch in real_batches[kind]:
        before = snapshot(batch)
        out = collate(batch, mask_cross_document_labels=True, micro_batch_size=B, pad_token_id=0)
        expected_keys = {F.INPUT_IDS, F.LABELS, F.PADDING_MASK, F.POSITION_IDS, F.DOCUMENT_IDS, F.CU_SEQLENS}
        if kind == "eligibility":
            expected_keys.add(F.ATTENTION_ELIGIBILITY)
        assert set(out) == expected_keys
        for key in (F.INPUT_IDS, F.LABELS, F.POSITION_IDS, F.DOCUMENT_IDS):
            assert out[key].dtype == torch.int64 and out[key].shape == (B, L), key
        assert out[F.PADDING_MASK].dtype == torch.bool and out[F.PADDING_MASK].shape == (B, L)
        assert out[F.CU_SEQLENS].dtype == torch.int32 and out[F.CU_SEQLENS].shape[0] == B
        ids, pad = out[F.DOCUMENT_IDS], out[F.PADDING_MASK]
        assert torch.equal(ids, reference_document_ids(out[F.POSITION_IDS], pad))
        assert torch.equal(ids == 0, pad)  # 0 exactly at padding
        assert bool(((ids[:, 0] == 1) | pad[:, 0]).all())  # 1-based, first column starts a document (or is a padding row)
        diffs = ids[:, 1:] - ids[:, :-1]
        assert bool(((diffs == 0) | (diffs == 1) | pad[:, 1:]).all())  # increasing left to right by steps of 1
        assert bool((out[F.LABELS][pad] == IGN).all())
        assert_payload_unchanged(batch, before)


@pytest.mark.parametrize("kind", ["first_fit", "wrap", "eligibility"])
def test_every_real_token_appears_unchanged_in_order(real_batches, kind):
    for batch in real_batches[kind]:
        out = collate(batch, mask_cross_document_labels=False)
        for b, record in enumerate(batch.records):
            tokens = np.asarray(record.payload[ZephonKeys.TOKENS])
            pad = record.meta.padding_length or 0
            real = tokens[: min(L, L + 1 - pad)]
            got = out[F.INPUT_IDS][b][~out[F.PADDING_MASK][b]]
            np.testing.assert_array_equal(got.numpy(), real)
            # Unmasked labels are the next tokens, except chat/padding masking (none here).
            labels = out[F.LABELS][b]
            n_real_labels = L - pad if pad else L
            np.testing.assert_array_equal(labels[:n_real_labels].numpy(), tokens[1 : n_real_labels + 1])


def test_real_eligibility_is_input_aligned(real_batches):
    for batch in real_batches["eligibility"]:
        out = collate(batch, mask_cross_document_labels=True, micro_batch_size=B, pad_token_id=0)
        elig = out[F.ATTENTION_ELIGIBILITY]
        assert elig.dtype == torch.bool and elig.shape == (B, L)
        for b, record in enumerate(batch.records):
            np.testing.assert_array_equal(elig[b].numpy(), np.asarray(record.payload[F.ATTENTION_ELIGIBILITY])[:L])
        assert not bool(elig[out[F.PADDING_MASK]].any())
        assert collate(batch, mask_cross_document_labels=True, eligibility=False).keys() == out.keys() - {
            F.ATTENTION_ELIGIBILITY
        }


def test_real_cross_document_labels(real_batches, tokenizer):
    """With Zephon's BOS ... EOS bracketing, the cross-document labels are the EOS -> BOS ones."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    for batch in real_batches["wrap"]:
        plain = collate(batch, mask_cross_document_labels=False)
        masked = collate(batch, mask_cross_document_labels=True)
        by_eos = collate(batch, mask_cross_document_labels=False, eos_mask_loss=True, eos_token_id=eos)
        changed = plain[F.LABELS] != masked[F.LABELS]
        assert bool((masked[F.LABELS][changed] == IGN).all())
        assert bool((plain[F.LABELS][changed] == bos).all())
        assert bool((plain[F.INPUT_IDS][changed] == eos).all())
        assert torch.equal(masked[F.LABELS], by_eos[F.LABELS])
        for key in (F.INPUT_IDS, F.POSITION_IDS, F.DOCUMENT_IDS, F.PADDING_MASK, F.CU_SEQLENS):
            assert torch.equal(plain[key], masked[key])


def test_real_chat_loss_mask(chat_source, tokenizer_dir):
    from conftest import CHAT_TEMPLATE

    pipeline = zephon_pipeline({
        "sources": [{"name": "chat", "path": str(chat_source)}], "sequence_length": 64, "micro_batch_size": 2,
        "tokenizer": {"path": str(tokenizer_dir), "chat_field": "messages", "chat_template": CHAT_TEMPLATE},
        "packing": {"algorithm": "first_fit"},
    })
    with ZephonSource(pipeline) as source:
        batch = next(source)
    out = collate(batch, mask_cross_document_labels=True)
    for b, record in enumerate(batch.records):
        mask = np.asarray(record.payload[ZephonKeys.LOSS_MASK])[1:]
        tokens = np.asarray(record.payload[ZephonKeys.TOKENS])[1:]
        labels = out[F.LABELS][b].numpy()
        np.testing.assert_array_equal(labels[mask == 0], IGN)
        supervised = (mask == 1) & (labels != IGN)
        np.testing.assert_array_equal(labels[supervised], tokens[supervised])
        assert supervised.any()


# ----------------------------------------------------------------------------- hand-made batches


def spec_example() -> SampleBatch:
    """docs/contract.md §9: S = 8, row 0 = docs of 3 and 2 then 3 padding; row 1 = docs of 4 and 4 (+ the next token)."""
    return hand_batch(
        [
            {"tokens": [11, 12, 13, 21, 22, 0, 0, 0, 0], "positions": [0, 1, 2, 0, 1, 0, 1, 2, 3], "pad": 4,
             "elig": [1, 1, 1, 1, 1, 0, 0, 0, 0]},
            {"tokens": [31, 32, 33, 34, 41, 42, 43, 44, 45], "positions": [0, 1, 2, 3, 0, 1, 2, 3, 4], "pad": 0,
             "elig": [1, 1, 0, 1, 1, 1, 1, 1, 1]},
        ]
    )


def test_spec_worked_example():
    batch = spec_example()
    before = snapshot(batch)
    out = collate(batch, mask_cross_document_labels=True)
    assert out[F.DOCUMENT_IDS].tolist() == [[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 2, 2, 2, 2]]
    assert out[F.POSITION_IDS].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3]]
    assert out[F.PADDING_MASK].tolist() == [[False] * 5 + [True] * 3, [False] * 8]
    assert out[F.INPUT_IDS].tolist() == [[11, 12, 13, 21, 22, 0, 0, 0], [31, 32, 33, 34, 41, 42, 43, 44]]
    # Cross-document labels masked: row 0 col 2 (13 -> 21), row 1 col 3 (34 -> 41); col 4 of row 0 targets padding.
    assert out[F.LABELS].tolist() == [
        [12, 13, IGN, 22, IGN, IGN, IGN, IGN],
        [32, 33, 34, IGN, 42, 43, 44, 45],
    ]
    assert out[F.ATTENTION_ELIGIBILITY].tolist() == [
        [True] * 5 + [False] * 3,
        [True, True, False, True, True, True, True, True],
    ]
    assert out[F.CU_SEQLENS].dtype == torch.int32
    assert out[F.CU_SEQLENS].tolist() == [[0, 3, 5, 8], [0, 4, 8, 8]]
    assert_payload_unchanged(batch, before)


def test_labels_without_cross_document_masking():
    out = collate(spec_example(), mask_cross_document_labels=False)
    assert out[F.LABELS].tolist() == [
        [12, 13, 21, 22, IGN, IGN, IGN, IGN],
        [32, 33, 34, 41, 42, 43, 44, 45],
    ]


def test_cross_document_label_at_last_column():
    """The last input column's target is the dropped (S+1)-th token; mask it when it starts a document."""
    rows = [
        {"tokens": [1, 2, 3, 4, 9], "positions": [0, 1, 2, 3, 0], "pad": 0},  # token 9 starts a new doc
        {"tokens": [1, 2, 3, 4, 5], "positions": [0, 1, 2, 3, 4], "pad": 0},
    ]
    masked = collate(hand_batch(rows), mask_cross_document_labels=True)
    plain = collate(hand_batch(rows), mask_cross_document_labels=False)
    assert masked[F.LABELS].tolist() == [[2, 3, 4, IGN], [2, 3, 4, 5]]
    assert plain[F.LABELS].tolist() == [[2, 3, 4, 9], [2, 3, 4, 5]]
    assert masked[F.DOCUMENT_IDS].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]


def test_wrap_continuation_starts_new_subdocument_at_column_zero():
    # A wrapped piece continues at column 0 with position 0 (Zephon) — and even if a
    # producer kept counting, column 0 starts a subdocument.
    rows = [{"tokens": [5, 6, 7, 8, 9], "positions": [0, 1, 2, 3, 4], "pad": 0}]
    out = collate(hand_batch(rows), mask_cross_document_labels=True)
    assert out[F.DOCUMENT_IDS].tolist() == [[1, 1, 1, 1]]
    ids = document_ids_from_positions(torch.tensor([[7, 8, 0, 1]]), torch.zeros(1, 4, dtype=torch.bool))
    assert ids.tolist() == [[1, 1, 2, 2]]


def test_eos_mask_loss_masks_predictions_from_eos():
    eos = 99
    rows = [{"tokens": [7, 8, eos, 5, 6, eos, 0, 0, 0], "positions": [0, 1, 2, 0, 1, 2, 0, 1, 2], "pad": 3}]
    out = collate(hand_batch(rows), mask_cross_document_labels=False, eos_mask_loss=True, eos_token_id=eos)
    # input 7 8 EOS 5 6 EOS 0 0 ; the EOS -> 5 label is masked, 8 -> EOS and 6 -> EOS stay.
    assert out[F.LABELS].tolist() == [[8, eos, IGN, 6, eos, IGN, IGN, IGN]]
    plain = collate(hand_batch(rows), mask_cross_document_labels=False)
    assert plain[F.LABELS].tolist() == [[8, eos, 5, 6, eos, IGN, IGN, IGN]]


def test_loss_mask_is_applied_to_labels():
    rows = [{"tokens": [1, 2, 3, 4, 5, 6], "positions": [0, 1, 2, 3, 4, 5], "pad": 0,
             "loss_mask": [0, 0, 1, 1, 0, 1]}]
    out = collate(hand_batch(rows), mask_cross_document_labels=True)
    # label j supervises token j + 1: kept where loss_mask[j + 1] == 1
    assert out[F.LABELS].tolist() == [[IGN, 3, 4, IGN, 6]]


def test_outputs_do_not_alias_zephon_arrays():
    batch = spec_example()
    before = snapshot(batch)
    out = collate(batch, mask_cross_document_labels=True)
    for value in out.values():
        value.fill_(7) if value.dtype != torch.bool else value.fill_(True)
    assert_payload_unchanged(batch, before)


# ----------------------------------------------------------------------------- document_ids_from_positions


def test_document_ids_hand_made_rows():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3], [0, 0, 0, 1, 0, 1, 2, 3]])
    padding = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1], [0] * 8, [0, 0, 0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    ids = document_ids_from_positions(positions, padding)
    assert ids.tolist() == [[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 2, 2, 2, 2], [1, 2, 3, 3, 4, 4, 4, 0]]
    assert torch.equal(ids, reference_document_ids(positions, padding))


def test_document_ids_multi_axis_positions():
    # mRoPE [A=3, B=1, S=6]: axes 1-2 may be 0 mid-document; a start needs 0 on every axis.
    positions = torch.tensor(
        [
            [[0, 1, 2, 0, 1, 2]],
            [[0, 0, 1, 0, 0, 3]],
            [[0, 0, 0, 0, 1, 0]],
        ]
    )
    padding = torch.zeros(1, 6, dtype=torch.bool)
    ids = document_ids_from_positions(positions, padding)
    assert ids.tolist() == [[1, 1, 1, 2, 2, 2]]
    assert torch.equal(ids, reference_document_ids(positions, padding))
    nxt = next_token_starts_document(positions, torch.tensor([True]))
    assert nxt.tolist() == [[False, False, True, False, False, True]]


def test_document_ids_random_against_reference():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        rows, cols = int(torch.randint(1, 5, (1,), generator=gen)), int(torch.randint(1, 20, (1,), generator=gen))
        positions = torch.randint(0, 3, (rows, cols), generator=gen)
        pad_len = torch.randint(0, cols + 1, (rows,), generator=gen)
        padding = torch.arange(cols)[None, :] >= (cols - pad_len)[:, None]
        before = (positions.clone(), padding.clone())
        ids = document_ids_from_positions(positions, padding)
        assert torch.equal(ids, reference_document_ids(positions, padding))
        assert torch.equal(positions, before[0]) and torch.equal(padding, before[1])


@pytest.mark.parametrize(
    ("positions", "padding", "exc", "match"),
    [
        (torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.bool), TypeError, "position_ids.*int64"),
        (torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.bool), ValueError, r"position_ids.*\[B, S\]"),
        (torch.full((1, 3), -1), torch.zeros(1, 3, dtype=torch.bool), ValueError, "nonnegative"),
        (torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64), TypeError, "padding_mask.*bool"),
        (torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.bool), ValueError, r"padding_mask.*shape \(2, 4\)"),
        (torch.zeros(1, 4, dtype=torch.int64), torch.tensor([[False, True, False, False]]), ValueError, "trailing padding"),
        ([[0, 1]], torch.zeros(1, 2, dtype=torch.bool), TypeError, "position_ids.*torch.Tensor"),
    ],
)
def test_document_ids_bad_input(positions, padding, exc, match):
    with pytest.raises(exc, match=match):
        document_ids_from_positions(positions, padding)


# ----------------------------------------------------------------------------- errors


class FakeBatch:
    """Duck-typed batch whose to_training output can be corrupted."""

    def __init__(self, inner: SampleBatch, corrupt):
        self.records = inner.records
        self._inner = inner
        self._corrupt = corrupt

    def to_training(self, **kw):
        out = self._inner.to_training(**kw)
        self._corrupt(out)
        return out


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (lambda o: o.__setitem__(ZephonKeys.POSITIONS, o[ZephonKeys.POSITIONS].int()), r"'positions'.*torch.int64"),
        (lambda o: o.__setitem__(ZephonKeys.TOKENS, o[ZephonKeys.TOKENS][0]), r"'input_ids'.*int64 \[B, S\]"),
        (lambda o: o.__setitem__(ZephonKeys.LABELS, o[ZephonKeys.LABELS].clamp(min=0)), "supervised label at padding"),
        (lambda o: o.pop(ZephonKeys.CU_SEQLENS), "'cu_seqlens'"),
        (lambda o: o.__setitem__(ZephonKeys.PADDING_MASK, o[ZephonKeys.PADDING_MASK].flip(1)), "trailing padding"),
    ],
)
def test_unexpected_zephon_output_is_refused(corrupt, match):
    with pytest.raises((ValueError, TypeError), match=match):
        collate(FakeBatch(spec_example(), corrupt), mask_cross_document_labels=True)


def test_bad_arguments():
    batch = spec_example()
    with pytest.raises(TypeError, match="zephon.SampleBatch"):
        collate({"input_ids": torch.zeros(1, 2)}, mask_cross_document_labels=True)
    with pytest.raises(TypeError, match="mask_cross_document_labels"):
        collate(batch, mask_cross_document_labels=None)
    with pytest.raises(TypeError):
        collate(batch)  # the caller must decide
    with pytest.raises(ValueError, match="eos_token_id: got None"):
        collate(batch, mask_cross_document_labels=True, eos_mask_loss=True)
    with pytest.raises(ValueError, match="eos_token_id: got -3"):
        collate(batch, mask_cross_document_labels=True, eos_mask_loss=True, eos_token_id=-3)
    with pytest.raises(ValueError, match="empty batch"):
        collate(SampleBatch(()), mask_cross_document_labels=True)
    no_positions = hand_batch([{"tokens": [1, 2, 3], "positions": [0, 1, 2]}])
    del no_positions.records[0].payload[ZephonKeys.POSITIONS]
    with pytest.raises(ValueError, match="emit_positions=True"):
        collate(no_positions, mask_cross_document_labels=True)
    no_elig = hand_batch([{"tokens": [1, 2, 3], "positions": [0, 1, 2]}])
    with pytest.raises(ValueError, match="eligibility"):
        collate(no_elig, mask_cross_document_labels=True, eligibility=True)
    assert F.ATTENTION_ELIGIBILITY not in collate(no_elig, mask_cross_document_labels=True)


@pytest.mark.parametrize("kind", ["first_fit", "wrap"])
def test_text_collate_checks_its_arguments_once_and_equals_collate(real_batches, kind):
    arguments = dict(mask_cross_document_labels=True, eos_mask_loss=True, eos_token_id=2, physical_cu_seqlens=False,
                     micro_batch_size=len(real_batches[kind][0].records) + 1, pad_token_id=0)
    collator = TextCollate(**arguments)
    collator = pickle.loads(pickle.dumps(collator))  # the loader's stages are picklable
    for batch in real_batches[kind]:
        got, want = collator(batch), collate(batch, **arguments)
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key
    with pytest.raises(TypeError, match="zephon.SampleBatch"):
        collator({"input_ids": torch.zeros(1, 2)})
    # Bad fixed arguments are refused at construction, as collate refuses them.
    with pytest.raises(TypeError, match="mask_cross_document_labels"):
        TextCollate(mask_cross_document_labels=None)
    with pytest.raises(ValueError, match="eos_token_id: got None"):
        TextCollate(mask_cross_document_labels=True, eos_mask_loss=True)
    with pytest.raises(ValueError, match="pad_token_id: got None"):
        TextCollate(mask_cross_document_labels=True, micro_batch_size=4)
    with pytest.raises(TypeError, match="eligibility"):
        TextCollate(mask_cross_document_labels=True, eligibility="yes")


def test_physical_offsets_can_be_skipped(real_batches):
    batch = real_batches["first_fit"][0]
    full = collate(batch, mask_cross_document_labels=True)
    lean = collate(batch, mask_cross_document_labels=True, physical_cu_seqlens=False)
    assert F.CU_SEQLENS not in lean
    assert set(full) - set(lean) == {F.CU_SEQLENS}
    for key in lean:
        assert torch.equal(lean[key], full[key]), key


def _uneven_padding_batch() -> SampleBatch:
    """S + 1 = 9; input-aligned padding: row 0 columns 5-7, row 1 column 7, row 2 none."""
    return hand_batch([
        {"tokens": [1, 2, 3, 4, 5, 0, 0, 0, 0], "positions": [0, 1, 2, 3, 4, 0, 1, 2, 3], "pad": 4},
        {"tokens": [1, 2, 3, 4, 5, 6, 7, 0, 0], "positions": [0, 1, 2, 0, 1, 2, 3, 0, 1], "pad": 2},
        {"tokens": [1, 2, 3, 4, 5, 6, 7, 8, 9], "positions": list(range(9)), "pad": 0},
    ])


def test_padding_labels_check_reads_every_pad_tail():
    """The labels-at-padding check reads only the widest pad tail's columns: real labels there (rows with
    shorter tails) are fine, a supervised label at any padding position is named with its row and column."""
    out = collate(_uneven_padding_batch(), mask_cross_document_labels=False)
    assert out[F.PADDING_MASK][:, 5:].tolist() == [[True] * 3, [False, False, True], [False] * 3]
    assert out[F.LABELS][:, 5:].tolist() == [[IGN, IGN, IGN], [7, IGN, IGN], [7, 8, 9]]  # real labels in the window
    for row, column in ((0, 5), (0, 7), (1, 7)):
        def supervise(o, row=row, column=column):
            labels = o[ZephonKeys.LABELS].clone()
            labels[row, column] = 4
            o[ZephonKeys.LABELS] = labels

        with pytest.raises(ValueError, match=rf"supervised label at padding \(row {row}, column {column}: 4\)"):
            collate(FakeBatch(_uneven_padding_batch(), supervise), mask_cross_document_labels=False)
