"""The final map stage: yielded fields per contract (docs/contract.md §7), against the rules and AutoModel 0.7.0."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packed_batches import assert_unchanged, clone_batch, packed_batches, reference_metadata
from zephon_loader import fields as F
from zephon_loader.finalize.final_map import FinalizeSettings, block_causal_mask, finalize_batch, finalize_collated
from zephon_loader.contract import PackingContract

CONTRACTS = [
    PackingContract("document_ids"),
    PackingContract("document_ids", True),
    PackingContract("block_causal"),
    PackingContract("block_causal", True),
    PackingContract("flash_varlen"),
    PackingContract("flash_varlen", True),
    PackingContract("document_ids", True, "thd"),
    PackingContract("block_causal", False, "thd"),
]


def _settings(contract, xdoc, eligibility):
    return FinalizeSettings.from_contract(contract, xdoc=xdoc, attention_eligibility=eligibility)


def _servable(contract, eligibility):
    return not eligibility or (contract.packed_mask_type != "flash_varlen" and contract.qkv_format != "thd")


def _expected_ids(batch, xdoc):
    ids = batch[F.DOCUMENT_IDS]
    if F.ATTENTION_ELIGIBILITY in batch:
        ids = ids.masked_fill(~batch[F.ATTENTION_ELIGIBILITY], 0)
    return (ids != 0).long() if xdoc else ids


@settings(max_examples=60, deadline=None)
@given(packed_batches(), st.sampled_from(CONTRACTS), st.booleans())
def test_yielded_batch_follows_spec_table(batch, contract, xdoc):
    has_eligibility = F.ATTENTION_ELIGIBILITY in batch
    if not _servable(contract, has_eligibility):
        with pytest.raises(ValueError):
            _settings(contract, xdoc, has_eligibility)
        return
    config = _settings(contract, xdoc, has_eligibility)
    ids = _expected_ids(batch, xdoc)
    if config.metadata and not bool((ids != 0).any()):
        with pytest.raises(ValueError, match="no valid"):
            finalize_batch(batch, config)
        return
    snapshot = clone_batch(batch)
    out = finalize_batch(batch, config)
    assert_unchanged(snapshot, batch)
    # The loader's trusting path is the same transform as the validating one.
    trusted = finalize_collated(batch, config)
    assert_unchanged(snapshot, batch)
    assert trusted.keys() == out.keys()
    for name, value in out.items():
        assert torch.equal(trusted[name], value) if isinstance(value, torch.Tensor) else trusted[name] == value, name

    for name in config.yielded_fields:
        assert name in out, name
    for name in (F.DOCUMENT_IDS, F.ATTENTION_DOCUMENT_IDS, F.ATTENTION_ELIGIBILITY):
        assert name not in out
    assert torch.equal(out[F.INPUT_IDS], batch[F.INPUT_IDS])
    assert torch.equal(out[F.LABELS], batch[F.LABELS])
    assert torch.equal(out[F.PADDING_MASK], batch[F.PADDING_MASK])
    batch_size, sequence_length = ids.shape

    if contract.packed_mask_type == "document_ids":
        assert torch.equal(out[F.ATTENTION_MASK], ids)
    elif contract.packed_mask_type == "block_causal":
        mask = out[F.ATTENTION_MASK]
        assert mask.dtype == torch.bool and mask.shape == (batch_size, 1, sequence_length, sequence_length)
        for b in range(batch_size):
            for i in range(sequence_length):
                for j in range(sequence_length):
                    allowed = bool(ids[b, i] != 0 and ids[b, i] == ids[b, j] and j <= i)
                    assert bool(mask[b, 0, i, j]) == allowed
    else:
        assert F.ATTENTION_MASK not in out
        flat = ids.flatten().tolist()
        starts = [p for p in range(len(flat)) if p % sequence_length == 0 or flat[p] != flat[p - 1]]
        assert out[F.CU_SEQ_LENS_Q].tolist() == starts + [len(flat)]
        assert out[F.CU_SEQ_LENS_Q].dtype == torch.int32
        assert out[F.CU_SEQ_LENS_K] is out[F.CU_SEQ_LENS_Q]
        lengths = [b - a for a, b in zip(starts, starts[1:] + [len(flat)])]
        assert out[F.MAX_LENGTH_Q] == out[F.MAX_LENGTH_K] == max(lengths)

    if config.metadata:
        ref = reference_metadata(ids)
        assert torch.equal(out[F.PACKED_TOKEN_INDICES], ref[F.PACKED_TOKEN_INDICES])
        assert torch.equal(out[F.CU_SEQLENS], ref[F.CU_SEQLENS])
        assert out[F.MAX_SEQLEN] == ref[F.MAX_SEQLEN]
    else:
        assert F.CU_SEQLENS not in out and F.PACKED_TOKEN_INDICES not in out

    if config.thd:
        assert out[F.QKV_FORMAT] == "thd"
        seq_lens, padded = out[F.SEQ_LENS], out[F.SEQ_LENS_PADDED]
        assert seq_lens.dtype == padded.dtype == torch.int64
        for b in range(batch_size):
            present = [d for d in range(1, int(ids[b].max()) + 1) if (ids[b] == d).any()]
            real = [int((ids[b] == d).sum()) for d in present] or [0]
            width = seq_lens.shape[1]
            assert seq_lens[b].tolist() == real + [F.THD_SENTINEL] * (width - len(real))
            row = padded[b][padded[b] != F.THD_SENTINEL]
            assert int(row.sum()) == sequence_length
            assert row[:-1].tolist() == real[:-1]

    multi = bool((ids > 1).any())
    assert (F.PACKED_SEQ_IDS in out) == (multi or config.metadata)
    if F.PACKED_SEQ_IDS in out:
        assert torch.equal(out[F.PACKED_SEQ_IDS], ids)


def test_extra_fields_pass_through_and_physical_offsets_are_replaced():
    ids = torch.tensor([[1, 1, 2, 0]])
    batch = {
        F.INPUT_IDS: torch.tensor([[5, 6, 7, 0]]),
        F.LABELS: torch.tensor([[6, -100, -100, -100]]),
        F.PADDING_MASK: ids == 0,
        F.POSITION_IDS: torch.tensor([[0, 1, 0, 0]]),
        F.DOCUMENT_IDS: ids,
        F.CU_SEQLENS: torch.tensor([[0, 2, 3, 4]], dtype=torch.int32),  # Zephon's physical offsets
        "pixel_values": torch.ones(1, 3),
    }
    no_meta = finalize_batch(batch, FinalizeSettings.from_contract(PackingContract("document_ids")))
    assert F.CU_SEQLENS not in no_meta
    assert no_meta["pixel_values"] is batch["pixel_values"]
    meta = finalize_batch(batch, FinalizeSettings.from_contract(PackingContract("document_ids", True)))
    assert meta[F.CU_SEQLENS].tolist() == [[0, 2, 3]]


def test_requested_metadata_without_contract_requirement():
    config = FinalizeSettings.from_contract(PackingContract("block_causal"), return_packed_sequence_metadata=True)
    assert config.metadata
    assert set(F.METADATA) <= set(config.yielded_fields)


def test_worked_example_flash_varlen():
    """docs/contract.md §9: the eligibility hole splits row 1's first document."""
    ids = torch.tensor([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 2, 2, 2, 2]])
    eligibility = torch.ones(2, 8, dtype=torch.bool)
    eligibility[1, 2] = False
    from zephon_loader.finalize.final_map import flash_varlen_kwargs

    kwargs = flash_varlen_kwargs(ids.masked_fill(~eligibility, 0))
    assert kwargs[F.CU_SEQ_LENS_Q].tolist() == [0, 3, 5, 8, 10, 11, 12, 16]
    assert kwargs[F.MAX_LENGTH_Q] == 4


@settings(max_examples=60, deadline=None)
@given(packed_batches(axes=(1,), eligibility=False), st.booleans())
def test_hf_contract_yields_positions_transformers_segments_as_documents(batch, xdoc):
    """``position_ids`` (``attn_implementation: hf``): no mask; transformers' own segmentation of the yielded
    positions is exactly the documents (joined under xdoc) at every non-padding token."""
    from transformers.masking_utils import find_packed_sequence_indices

    config = _settings(PackingContract("position_ids"), xdoc, False)
    snapshot = clone_batch(batch)
    out = finalize_batch(batch, config)
    assert_unchanged(snapshot, batch)
    assert set(config.yielded_fields) <= set(out)
    assert F.ATTENTION_MASK not in out and F.CU_SEQLENS not in out
    assert out[F.SHIFT_LABELS] is out[F.LABELS] and out[F.USE_CACHE] is False
    if not xdoc:
        assert out[F.POSITION_IDS] is batch[F.POSITION_IDS]
    ids = _expected_ids(batch, xdoc)
    padding = batch[F.PADDING_MASK]
    segments = find_packed_sequence_indices(out[F.POSITION_IDS])
    if segments is None:  # transformers saw one sequence per row
        segments = torch.zeros_like(ids)
    for b in range(ids.shape[0]):
        real = ~padding[b]
        # Same partition: a segment boundary exactly where the id changes.
        assert torch.equal(segments[b][real].diff() != 0, ids[b][real].diff() != 0)


def test_final_map_trusts_collate_and_finalize_batch_validates(monkeypatch):
    """Issue 11: each property is validated once between Zephon and the yield (by collate); the loader's
    final map does not check the batch again, while finalize_batch on a caller's batch still does."""
    from zephon_loader.finalize import final_map as finalize
    from zephon_loader.finalize.final_map import FinalMap

    calls = []
    check = finalize.check_training_batch
    monkeypatch.setattr(finalize, "check_training_batch", lambda *a: calls.append(a) or check(*a))
    ids = torch.tensor([[1, 1, 2, 0]])
    batch = {
        F.INPUT_IDS: torch.tensor([[5, 6, 7, 0]]),
        F.LABELS: torch.tensor([[6, -100, -100, -100]]),
        F.PADDING_MASK: ids == 0,
        F.POSITION_IDS: torch.tensor([[0, 1, 0, 0]]),
        F.DOCUMENT_IDS: ids,
    }
    settings_ = FinalizeSettings.from_contract(PackingContract("document_ids", True))
    by_loader = FinalMap(settings_)(batch)
    assert calls == []
    assert by_loader[F.CU_SEQLENS].tolist() == [[0, 2, 3]]
    finalize_batch(batch, settings_)
    assert len(calls) == 1


@pytest.mark.parametrize("high", [3, 2**15 - 1, 2**15, 2**16 + 1, 2**31 - 1, 2**31, 2**40])
def test_block_causal_mask_is_exact_at_every_id_width(high):
    """The mask compares ids in the narrowest integers that hold them (int16 / int32 / int64): ids at each
    width's edge, and ids that would wrap onto one another in a narrower type (``high`` and ``high - 2**16``),
    give exactly the int64 definition: same nonzero id and key column <= query column."""
    row = [high, high, 0, max(1, high - 2**16), max(1, high - 2**16), high - 1 or 1, high]
    ids = torch.tensor([row, [1, 1, 2, 2, 0, 0, 0]], dtype=torch.int64)
    length = ids.shape[1]
    expected = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] != 0)
    expected &= torch.ones(length, length, dtype=torch.bool).tril()
    mask = block_causal_mask(ids)
    assert mask.dtype == torch.bool and mask.shape == (2, 1, length, length)
    assert torch.equal(mask[:, 0], expected)
    assert torch.equal(block_causal_mask(ids.to(torch.int32) if high < 2**31 else ids), mask)


@settings(max_examples=40, deadline=None)
@given(packed_batches(), st.booleans())
def test_seq_idx_numbers_documents_over_the_batch(batch, xdoc):
    """``contract.seq_idx``: documents (membership, eligibility ignored) numbered 0, 1, ... row-major; -1 at
    padding; the caller's tensors untouched; the same on the trusting and the validating path."""
    contract = PackingContract("document_ids", seq_idx=True)
    config = _settings(contract, xdoc, F.ATTENTION_ELIGIBILITY in batch)
    snapshot = clone_batch(batch)
    out = finalize_batch(batch, config)
    assert_unchanged(snapshot, batch)
    assert torch.equal(finalize_collated(batch, config)[F.SEQ_IDX], out[F.SEQ_IDX])
    seq_idx = out[F.SEQ_IDX]
    assert seq_idx.dtype == torch.int32 and seq_idx.shape == batch[F.DOCUMENT_IDS].shape
    expected, next_index = [], 0
    for row in batch[F.DOCUMENT_IDS].tolist():
        numbered, last = [], None
        for token_id in row:
            if token_id == 0:
                numbered.append(-1)
                continue
            key = 1 if xdoc else token_id
            if key != last:
                next_index, last = next_index + 1, key
            numbered.append(next_index - 1)
        expected.append(numbered)
    assert seq_idx.tolist() == expected
    assert F.SEQ_IDX not in finalize_batch(batch, _settings(PackingContract("document_ids"), xdoc,
                                                             F.ATTENTION_ELIGIBILITY in batch))


def test_seq_idx_contract_field_is_checked_once():
    with pytest.raises(TypeError, match="packing_contract.seq_idx: got str 'yes', expected bool"):
        PackingContract("document_ids", seq_idx="yes")  # type: ignore[arg-type]
    assert _settings(PackingContract("position_ids", seq_idx=True), False, False).yielded_fields[-1] == F.SEQ_IDX
