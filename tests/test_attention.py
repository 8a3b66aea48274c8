"""adapt_model_inputs, enable_xdoc_attention, require_supported_packing_contract (docs/contract.md §6, §9)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packed_batches import assert_unchanged, clone_batch, packed_batches, reference_xdoc_positions
from zephon_loader import fields as F
from zephon_loader.attention import (
    adapt_model_inputs,
    check_training_batch,
    enable_xdoc_attention,
    joined_positions,
    joined_positions_of_runs,
    padding_is_trailing,
    require_supported_packing_contract,
)
from zephon_loader.collate.text import document_ids_from_positions
from zephon_loader.contract import PackingContract

DOCS = PackingContract("document_ids", True)


def spec_batch():
    """docs/contract.md §9: S=8, B=2; row 1 column 2 is ineligible."""
    ids = torch.tensor([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 1, 1, 2, 2, 2, 2]])
    batch = {
        F.INPUT_IDS: torch.arange(16).view(2, 8),
        F.LABELS: torch.arange(16).view(2, 8),
        F.PADDING_MASK: ids == 0,
        F.POSITION_IDS: torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3]]),
        F.DOCUMENT_IDS: ids,
    }
    eligibility = torch.ones(2, 8, dtype=torch.bool)
    eligibility[1, 2] = False
    return batch, eligibility


def test_worked_example_adapt_and_xdoc():
    batch, eligibility = spec_batch()
    before = clone_batch(batch)
    out = adapt_model_inputs(batch, eligibility)
    assert out[F.ATTENTION_DOCUMENT_IDS].tolist() == [[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 0, 1, 2, 2, 2, 2]]
    out = enable_xdoc_attention(out, DOCS)
    assert out[F.ATTENTION_DOCUMENT_IDS].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 1, 1, 1, 1, 1]]
    assert out[F.POSITION_IDS].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert out[F.DOCUMENT_IDS].tolist() == before[F.DOCUMENT_IDS].tolist()  # membership preserved


def test_adapt_never_modifies_input_tensors():
    batch, eligibility = spec_batch()
    tensors = dict(batch)
    snapshot = clone_batch(batch)
    eligibility_before = eligibility.clone()
    enable_xdoc_attention(adapt_model_inputs(batch, eligibility), DOCS)
    assert_unchanged(snapshot, tensors)
    assert torch.equal(eligibility, eligibility_before)


def test_adapt_without_eligibility_keeps_ids():
    batch, _ = spec_batch()
    out = adapt_model_inputs(batch)
    assert torch.equal(out[F.ATTENTION_DOCUMENT_IDS], out[F.DOCUMENT_IDS])


@settings(max_examples=150, deadline=None)
@given(packed_batches())
def test_xdoc_properties(batch):
    eligibility = batch.pop(F.ATTENTION_ELIGIBILITY, None)
    original = dict(batch)
    snapshot = clone_batch(batch)
    out = enable_xdoc_attention(adapt_model_inputs(batch, eligibility), DOCS)
    assert_unchanged(snapshot, original)

    ids, padding = snapshot[F.DOCUMENT_IDS], snapshot[F.PADDING_MASK]
    excluded = padding if eligibility is None else padding | ~eligibility
    assert torch.equal(out[F.ATTENTION_DOCUMENT_IDS], (~excluded).long())
    expected = reference_xdoc_positions(ids, snapshot[F.POSITION_IDS])
    assert torch.equal(out[F.POSITION_IDS], expected)
    positions = out[F.POSITION_IDS]
    if positions.ndim == 2:  # plain text: 0..n-1 across each row, padding untouched
        for b in range(ids.shape[0]):
            n = int((~padding[b]).sum())
            assert positions[b, :n].tolist() == list(range(n))
            assert torch.equal(positions[b, n:], snapshot[F.POSITION_IDS][b, n:])
    else:  # every axis shifted by the same per-subdocument offset
        shift = positions - snapshot[F.POSITION_IDS]
        assert torch.equal(shift, shift[:1].expand_as(shift))


def test_xdoc_three_axis_offsets_use_max_over_axes():
    ids = torch.tensor([[1, 1, 1, 2, 2]])
    positions = torch.tensor([[[0, 1, 2, 0, 1]], [[0, 5, 5, 0, 0]], [[0, 3, 7, 0, 1]]])
    batch = {
        F.INPUT_IDS: torch.zeros(1, 5, dtype=torch.long),
        F.LABELS: torch.zeros(1, 5, dtype=torch.long),
        F.PADDING_MASK: torch.zeros(1, 5, dtype=torch.bool),
        F.POSITION_IDS: positions,
        F.DOCUMENT_IDS: ids,
    }
    out = enable_xdoc_attention(adapt_model_inputs(batch), DOCS)
    # max_coord(doc 1) = 7, so doc 2 shifts by 8 on every axis.
    assert out[F.POSITION_IDS][:, 0, 3:].tolist() == [[8, 9], [8, 8], [8, 9]]


@settings(max_examples=100, deadline=None)
@given(packed_batches(), st.sampled_from([0, 2**24 - 40, 2**24 - 1, 2**24, 2**31, 2**53 + 1]))
def test_joined_positions_exact_at_any_magnitude(batch, base):
    """joined_positions works in float32 below 2**24 and falls back to int64 at or past it: both exact.

    Shifting every subdocument's positions by ``base`` puts the row totals just below, at and far past
    float32's exact range (2**53 + 1 is not even a float64).
    """
    ids = batch[F.DOCUMENT_IDS]
    positions = batch[F.POSITION_IDS] + base * (ids != 0)
    snapshot = positions.clone()
    out = joined_positions(ids, positions)
    assert torch.equal(positions, snapshot)
    assert out.dtype == positions.dtype and out.shape == positions.shape
    assert torch.equal(out, reference_xdoc_positions(ids, positions))


@settings(max_examples=150, deadline=None)
@given(packed_batches(axes=(1,), eligibility=False), st.sampled_from([0, 9, 2**24, 2**31 - 60, 2**31]))
def test_joined_positions_of_runs_equals_the_general_join(batch, base):
    """collate's ids with text positions (each subdocument counting up from 0, the row's first one from ``base``:
    a wrap continuation): one pass equals the per-subdocument maxima, or declines at 2**31 and past."""
    padding = batch[F.PADDING_MASK]
    positions = batch[F.POSITION_IDS].clone()
    first = batch[F.DOCUMENT_IDS] == 1
    positions[first] += base
    ids = document_ids_from_positions(positions, padding)
    snapshot = positions.clone()
    fast = joined_positions_of_runs(ids, positions)
    assert torch.equal(positions, snapshot)
    if int(positions.max()) >= 2**31:
        assert fast is None
        return
    assert fast is not None, "rows that count up must take the one-pass join"
    assert fast.dtype == torch.int64 and fast.shape == positions.shape
    assert torch.equal(fast, joined_positions(ids, positions))
    assert torch.equal(fast, reference_xdoc_positions(ids, positions))


@pytest.mark.parametrize("positions, padded, reason", [
    ([[0, 1, 3, 0, 1]], 0, "a position that skips one"),
    ([[0, 1, 1, 0, 1]], 0, "a position that repeats"),
    ([[5, 4, 0, 1, 0]], 0, "a position that counts down"),
    ([[0, 1, 2, 7, 9]], 2, "padding not numbered as a run"),
])
def test_joined_positions_of_runs_declines_other_rows(positions, padded, reason):
    positions = torch.tensor(positions)
    padding = torch.zeros(1, 5, dtype=torch.bool)
    padding[:, 5 - padded:] = True
    ids = document_ids_from_positions(positions, padding)
    assert joined_positions_of_runs(ids, positions) is None, reason
    assert joined_positions_of_runs(ids, positions.unsqueeze(0).expand(3, 1, 5)) is None  # multi-axis
    assert joined_positions_of_runs(ids[:, :1], positions[:, :1]) is None  # one column


def test_joined_positions_of_runs_keeps_padding_positions():
    positions = torch.tensor([[3, 4, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5]])
    padding = torch.tensor([[False] * 4 + [True] * 2, [False] * 6])
    ids = document_ids_from_positions(positions, padding)
    assert joined_positions_of_runs(ids, positions).tolist() == [[3, 4, 5, 6, 0, 1], [0, 1, 2, 3, 4, 5]]


def test_joined_positions_falls_back_exactly_where_float32_rounds():
    # 2**24 + 1 is the first integer float32 cannot hold: it rounds to 2**24.
    ids = torch.tensor([[1, 1, 2, 2, 0]])
    positions = torch.tensor([[2**24 - 1, 2**24, 0, 1, 0]])
    assert joined_positions(ids, positions).tolist() == [[2**24 - 1, 2**24, 2**24 + 1, 2**24 + 2, 0]]
    # A row total of exactly 2**24 (two spans of 2**23) already takes the int64 path; one below, float32.
    for first in (2**23 - 1, 2**23 - 2):
        positions = torch.tensor([[first - 1, first, 0, 2**23 - 1, 0]])
        expected = [[first - 1, first, first + 1, first + 2**23, 0]]
        assert joined_positions(ids, positions).tolist() == expected
    # Spans 2**23, 2**23, 1: the true total 2**24 + 1 rounds to 2**24 in float32 (where the third offset,
    # 2**24, would come out as 2**24 - 1): the int64 path, exact.
    ids = torch.tensor([[1, 1, 2, 2, 3]])
    positions = torch.tensor([[0, 2**23 - 1, 0, 2**23 - 1, 0]])
    assert joined_positions(ids, positions).tolist() == [[0, 2**23 - 1, 2**23, 2**24 - 1, 2**24]]


def test_require_contract_accepts_automodel_capabilities():
    pytest.importorskip("nemo_automodel", reason="nemo-automodel 0.7.0 not installed (pip install --no-deps)")
    from nemo_automodel.components.models.common.packing import PackingCapabilities

    assert require_supported_packing_contract(
        PackingCapabilities("document_ids", True, uses_native_fa4=True)
    ) == PackingContract("document_ids", True)
    assert require_supported_packing_contract(PackingCapabilities("flash_varlen")) == PackingContract("flash_varlen")


def test_require_contract_refuses_holes_in_physical_offsets():
    with pytest.raises(ValueError, match="flash_varlen.*document_ids"):
        require_supported_packing_contract(PackingContract("flash_varlen"), attention_eligibility=True)
    with pytest.raises(ValueError, match="thd"):
        require_supported_packing_contract(PackingContract("block_causal", False, "thd"), attention_eligibility=True)
    require_supported_packing_contract(PackingContract("document_ids", True), attention_eligibility=True)
    require_supported_packing_contract(PackingContract("block_causal"), attention_eligibility=True)


def test_require_contract_block_mask_budget():
    contract = PackingContract("block_causal")
    require_supported_packing_contract(contract, micro_batch_size=16, sequence_length=8192)  # exactly 1 GiB: allowed
    with pytest.raises(ValueError, match="2,147,483,648 bytes per batch, over the budget of 1,073,741,824"):
        require_supported_packing_contract(contract, micro_batch_size=32, sequence_length=8192)
    with pytest.raises(ValueError, match="budget"):
        require_supported_packing_contract(contract, micro_batch_size=1, sequence_length=64, block_mask_budget_bytes=4095)
    # Not a block-causal contract: no mask, no budget.
    require_supported_packing_contract(PackingContract("document_ids"), micro_batch_size=64, sequence_length=131072)


def test_require_contract_returns_the_frozen_contract():
    contract = PackingContract("document_ids", True)
    assert require_supported_packing_contract(contract) is contract  # validated when built: passed through
    require_supported_packing_contract(PackingContract("position_ids"))  # attn_implementation 'hf'


@pytest.mark.parametrize(
    ("rows", "trailing"),
    [
        ([[False, False, True, True]], True),
        ([[True, True, True, True]], True),
        ([[False] * 4], True),
        ([[False, True, False, True]], False),
        ([[True, False, False, False]], False),
        ([[False, False, False, True], [False, True, True, False]], False),
        ([[True]], True),
    ],
)
def test_padding_is_trailing(rows, trailing):
    padding = torch.tensor(rows)
    assert padding_is_trailing(padding) is trailing
    reference = all(not (a and not b) for row in rows for a, b in zip(row, row[1:]))
    assert reference is trailing


@settings(max_examples=40, deadline=None)
@given(packed_batches())
def test_check_training_batch_accepts_collated_batches_and_modifies_nothing(batch):
    snapshot = clone_batch(batch)
    check_training_batch(batch, batch.get(F.ATTENTION_ELIGIBILITY))
    assert_unchanged(snapshot, batch)
    assert set(batch) == set(snapshot)
