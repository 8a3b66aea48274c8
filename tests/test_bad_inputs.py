"""Malformed batches and contracts: each raises ValueError/TypeError naming the field and what was expected."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from zephon_loader import fields as F
from zephon_loader.attention import (
    adapt_model_inputs,
    enable_xdoc_attention,
    require_supported_packing_contract,
)
from zephon_loader.finalize.final_map import FinalizeSettings, finalize_batch
from zephon_loader.packing import build_packed_sequence_metadata
from zephon_loader.contract import PackingContract


def good():
    ids = torch.tensor([[1, 1, 2, 2, 0], [1, 1, 1, 1, 1]])
    return {
        F.INPUT_IDS: torch.ones(2, 5, dtype=torch.int64),
        F.LABELS: torch.ones(2, 5, dtype=torch.int64),
        F.PADDING_MASK: ids == 0,
        F.POSITION_IDS: torch.tensor([[0, 1, 0, 1, 0], [0, 1, 2, 3, 4]]),
        F.DOCUMENT_IDS: ids,
    }


def with_(**changes):
    batch = good()
    for name, value in changes.items():
        if value is None:
            del batch[name]
        else:
            batch[name] = value
    return batch


BAD_BATCHES = [
    ("input_ids rank", with_(input_ids=torch.ones(10, dtype=torch.int64)), ValueError, r"input_ids: got shape \(10,\), expected rank 2"),
    ("input_ids dtype", with_(input_ids=torch.ones(2, 5, dtype=torch.int32)), TypeError, r"input_ids: got dtype torch.int32, expected torch.int64"),
    ("input_ids not a tensor", with_(input_ids=[[1, 2]]), TypeError, r"input_ids: got list, expected a torch.Tensor"),
    ("missing labels", with_(labels=None), ValueError, r"labels: missing from the batch"),
    ("labels shape", with_(labels=torch.ones(2, 4, dtype=torch.int64)), ValueError, r"labels: got shape \(2, 4\), expected"),
    ("labels dtype", with_(labels=torch.ones(2, 5)), TypeError, r"labels: got dtype torch.float32"),
    ("padding_mask dtype", with_(padding_mask=torch.zeros(2, 5, dtype=torch.int64)), TypeError, r"padding_mask: got dtype torch.int64, expected torch.bool"),
    ("padding_mask shape", with_(padding_mask=torch.zeros(2, 6, dtype=torch.bool)), ValueError, r"padding_mask: got shape \(2, 6\)"),
    (
        "padding not trailing",
        with_(
            padding_mask=torch.tensor([[False, True, False, False, False], [False] * 5]),
            document_ids=torch.tensor([[1, 0, 1, 1, 1], [1] * 5]),
        ),
        ValueError,
        r"padding_mask: row 0 has padding at column 1 followed by a token",
    ),
    ("position rank 4", with_(position_ids=torch.zeros(1, 1, 2, 5, dtype=torch.int64)), ValueError, r"position_ids: got rank 4"),
    ("position 3-axis shape", with_(position_ids=torch.zeros(3, 2, 4, dtype=torch.int64)), ValueError, r"position_ids: got shape \(3, 2, 4\), expected \[axes, batch, sequence\]"),
    ("position dtype", with_(position_ids=torch.zeros(2, 5)), TypeError, r"position_ids: got dtype torch.float32"),
    ("negative position", with_(position_ids=torch.tensor([[0, -1, 0, 1, 0], [0, 1, 2, 3, 4]])), ValueError, r"position_ids: got minimum -1, expected nonnegative"),
    ("document_ids dtype", with_(document_ids=torch.ones(2, 5, dtype=torch.bool)), TypeError, r"document_ids: got dtype torch.bool, expected torch.int64"),
    ("document_ids shape", with_(document_ids=torch.ones(2, 4, dtype=torch.int64)), ValueError, r"document_ids: got shape \(2, 4\)"),
    ("missing document_ids", with_(document_ids=None), ValueError, r"document_ids: missing"),
    ("negative ids", with_(document_ids=torch.tensor([[1, 1, -2, 2, 0], [1] * 5])), ValueError, r"document_ids: got minimum -2, expected nonnegative"),
    ("id at padding", with_(document_ids=torch.tensor([[1, 1, 2, 2, 2], [1] * 5])), ValueError, r"document_ids: got id 2 at row 0, column 4 where padding_mask is True"),
    ("zero id on a token", with_(document_ids=torch.tensor([[1, 0, 2, 2, 0], [1] * 5])), ValueError, r"document_ids: got id 0 at row 0, column 1 where padding_mask is False"),
    ("decreasing ids", with_(document_ids=torch.tensor([[2, 2, 1, 1, 0], [1] * 5])), ValueError, r"document_ids: row 0 decreases at column 2 \(id 1 after 2\)"),
]


@pytest.mark.parametrize(("case", "batch", "error", "message"), BAD_BATCHES, ids=[c[0] for c in BAD_BATCHES])
def test_bad_batch_is_refused(case, batch, error, message):
    with pytest.raises(error, match=message):
        adapt_model_inputs(batch)
    with pytest.raises(error, match=message):
        finalize_batch(batch, FinalizeSettings.from_contract(PackingContract("document_ids")))


BAD_ELIGIBILITY = [
    ("eligibility shape", torch.ones(2, 4, dtype=torch.bool), ValueError, r"attention_eligibility: got shape \(2, 4\)"),
    ("eligibility dtype", torch.ones(2, 5, dtype=torch.int64), TypeError, r"attention_eligibility: got dtype torch.int64, expected torch.bool"),
    ("eligibility type", [[True] * 5] * 2, TypeError, r"attention_eligibility: got list"),
]


@pytest.mark.parametrize(("case", "eligibility", "error", "message"), BAD_ELIGIBILITY, ids=[c[0] for c in BAD_ELIGIBILITY])
def test_bad_eligibility_is_refused(case, eligibility, error, message):
    with pytest.raises(error, match=message):
        adapt_model_inputs(good(), eligibility)


BAD_CONTRACTS = [
    ("unknown mask type", SimpleNamespace(packed_mask_type="causal", requires_packed_sequence_metadata=False), ValueError, r"packed_mask_type: got 'causal', expected one of"),
    ("mask type not str", SimpleNamespace(packed_mask_type=1, requires_packed_sequence_metadata=False), ValueError, r"packed_mask_type: got 1"),
    ("missing mask type", SimpleNamespace(requires_packed_sequence_metadata=False), TypeError, r"has no attribute 'packed_mask_type'"),
    ("missing metadata flag", SimpleNamespace(packed_mask_type="document_ids"), TypeError, r"has no attribute 'requires_packed_sequence_metadata'"),
    ("metadata flag not bool", SimpleNamespace(packed_mask_type="document_ids", requires_packed_sequence_metadata=1), TypeError, r"requires_packed_sequence_metadata: got int 1, expected bool"),
    ("unknown qkv format", SimpleNamespace(packed_mask_type="document_ids", requires_packed_sequence_metadata=False, qkv_format="sbhd"), ValueError, r"qkv_format: got 'sbhd'"),
    ("hf with metadata", SimpleNamespace(packed_mask_type="position_ids", requires_packed_sequence_metadata=True), ValueError, r"requires_packed_sequence_metadata: got True with packed_mask_type 'position_ids'"),
    ("hf with thd", SimpleNamespace(packed_mask_type="position_ids", requires_packed_sequence_metadata=False, qkv_format="thd"), ValueError, r"qkv_format: got 'thd' with packed_mask_type 'position_ids'"),
]


@pytest.mark.parametrize(("case", "contract", "error", "message"), BAD_CONTRACTS, ids=[c[0] for c in BAD_CONTRACTS])
def test_bad_contract_is_refused(case, contract, error, message):
    with pytest.raises(error, match=message):
        require_supported_packing_contract(contract)
    with pytest.raises(error, match=message):
        enable_xdoc_attention(adapt_model_inputs(good()), contract)


def test_bad_combinations_are_refused():
    with pytest.raises(ValueError, match=r"costs 1,280 bytes per batch, over the budget of 1,000"):
        FinalizeSettings.from_contract(PackingContract("block_causal"), micro_batch_size=5, sequence_length=16, block_mask_budget_bytes=1000)
    with pytest.raises(ValueError, match="flash_varlen.*eligibility"):
        FinalizeSettings.from_contract(PackingContract("flash_varlen"), attention_eligibility=True)
    with pytest.raises(TypeError, match="xdoc: got str"):
        FinalizeSettings.from_contract(PackingContract("document_ids"), xdoc="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="return_packed_sequence_metadata: got int"):
        require_supported_packing_contract(PackingContract("document_ids"), return_packed_sequence_metadata=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="micro_batch_size: got 0"):
        require_supported_packing_contract(PackingContract("block_causal"), micro_batch_size=0, sequence_length=8)
    with pytest.raises(ValueError, match=r"'position_ids' \(attn_implementation 'hf'\).*eligibility field is configured"):
        FinalizeSettings.from_contract(PackingContract("position_ids"), attention_eligibility=True)
    with pytest.raises(ValueError, match=r"return_packed_sequence_metadata: got True with packed_mask_type 'position_ids'"):
        FinalizeSettings.from_contract(PackingContract("position_ids"), return_packed_sequence_metadata=True)


HF_SETTINGS = FinalizeSettings.from_contract(PackingContract("position_ids"))

BAD_HF_POSITIONS = [
    # good(): row 0 ids [1, 1, 2, 2, 0], row 1 one document of 5 tokens.
    ("documents joined", torch.tensor([[0, 1, 2, 3, 0], [0, 1, 2, 3, 4]]), r"position_ids: row 0, column 2: positions 1 -> 2 with attention document ids 1 -> 2; .* joins documents"),
    ("document split", torch.tensor([[0, 1, 0, 1, 0], [0, 1, 2, 4, 5]]), r"position_ids: row 1, column 3: positions 2 -> 4 with attention document ids 1 -> 1; .* splits document"),
    ("two axes", torch.tensor([[0, 1, 0, 1, 0], [0, 1, 2, 3, 4]]).expand(2, 2, 5), r"position_ids: got shape \(2, 2, 5\) with packed_mask_type 'position_ids'"),
]


@pytest.mark.parametrize(("case", "positions", "message"), BAD_HF_POSITIONS, ids=[c[0] for c in BAD_HF_POSITIONS])
def test_hf_contract_refuses_positions_that_do_not_delimit_documents(case, positions, message):
    """transformers segments a row where positions do not step by 1; that must be exactly the documents."""
    with pytest.raises(ValueError, match=message):
        finalize_batch(with_(position_ids=positions), HF_SETTINGS)


def test_hf_contract_puts_text_positions_before_mrope_positions():
    """[3, B, S] mRoPE positions (image-text) are yielded as [4, B, S]: row 0 restarts at each document."""
    mrope = torch.tensor([[0, 1, 0, 1, 0], [0, 1, 2, 3, 4]]).expand(3, 2, 5) * 10
    out = finalize_batch(with_(position_ids=mrope), HF_SETTINGS)
    assert out[F.POSITION_IDS].shape == (4, 2, 5)
    assert out[F.POSITION_IDS][0].tolist() == [[0, 1, 0, 1, 0], [0, 1, 2, 3, 4]]
    assert torch.equal(out[F.POSITION_IDS][1:], mrope)
    assert F.CU_SEQ_LENS_Q not in out and out[F.SHIFT_LABELS] is not None


def test_hf_contract_ignores_padding_positions():
    """A pad tail numbered on from the last document cannot change a document (causal mask, trailing padding)."""
    out = finalize_batch(with_(position_ids=torch.tensor([[0, 1, 0, 1, 2], [0, 1, 2, 3, 4]])), HF_SETTINGS)
    assert out[F.USE_CACHE] is False and F.ATTENTION_MASK not in out


def test_metadata_inputs_are_refused():
    with pytest.raises(ValueError, match=r"attention_document_ids: no valid \(nonzero\) token"):
        build_packed_sequence_metadata(torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"attention_document_ids: got shape \(4,\), expected rank 2"):
        build_packed_sequence_metadata(torch.ones(4, dtype=torch.int64))
    with pytest.raises(TypeError, match="attention_document_ids: got dtype torch.float32"):
        build_packed_sequence_metadata(torch.ones(2, 4))
    with pytest.raises(ValueError, match="attention_document_ids: got minimum -1"):
        build_packed_sequence_metadata(torch.tensor([[1, -1]]))
    all_ineligible = torch.zeros(2, 5, dtype=torch.bool)
    config = FinalizeSettings.from_contract(PackingContract("document_ids", True), attention_eligibility=True)
    with pytest.raises(ValueError, match="no valid"):
        finalize_batch({**good(), F.ATTENTION_ELIGIBILITY: all_ineligible}, config)


def test_xdoc_requires_adapt_first():
    with pytest.raises(ValueError, match="attention_document_ids: missing; expected adapt_model_inputs"):
        enable_xdoc_attention(good(), PackingContract("document_ids"))


def test_xdoc_refuses_padding_inside_a_row():
    ids = torch.tensor([[2, 0, 1]])
    batch = {
        F.INPUT_IDS: torch.ones(1, 3, dtype=torch.int64),
        F.LABELS: torch.ones(1, 3, dtype=torch.int64),
        F.PADDING_MASK: ids == 0,
        F.POSITION_IDS: torch.zeros(1, 3, dtype=torch.int64),
        F.DOCUMENT_IDS: ids,
        F.ATTENTION_DOCUMENT_IDS: ids,
    }
    with pytest.raises(ValueError, match="padding_mask: row 0 has padding at column 1 followed by a token"):
        enable_xdoc_attention(batch, PackingContract("document_ids"))
