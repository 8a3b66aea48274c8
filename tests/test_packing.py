"""Packed metadata, flattening and contracts (docs/contract.md §6, §9)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packed_batches import packed_batches, reference_metadata
from zephon_loader import fields as F
from zephon_loader.packing import (build_packed_sequence_metadata, flatten_packed_sequence_metadata,
                                   packed_sequence_metadata_of)
from zephon_loader.contract import DEFAULT_PACKED_SEQUENCE_CONTRACT, PackingContract, contract_for_attention

SPEC_IDS = torch.tensor([[1, 1, 1, 2, 2, 0, 0, 0], [1, 1, 0, 1, 2, 2, 2, 2]])


def test_worked_example_metadata():
    meta = build_packed_sequence_metadata(SPEC_IDS)
    assert meta[F.PACKED_TOKEN_INDICES].tolist() == [[0, 1, 2, 3, 4, -1, -1, -1], [0, 1, -1, 3, 4, 5, 6, 7]]
    assert meta[F.PACKED_TOKEN_INDICES].dtype == torch.int64
    assert meta[F.CU_SEQLENS].tolist() == [[0, 3, 5], [0, 3, 7]]
    assert meta[F.CU_SEQLENS].dtype == torch.int32
    assert meta[F.MAX_SEQLEN] == 4 and isinstance(meta[F.MAX_SEQLEN], int)
    indices, cu = flatten_packed_sequence_metadata(
        meta[F.PACKED_TOKEN_INDICES], meta[F.CU_SEQLENS], batch_size=2, sequence_length=8
    )
    assert indices.tolist() == [0, 1, 2, 3, 4, 8, 9, 11, 12, 13, 14, 15]
    assert cu.tolist() == [0, 3, 5, 8, 12]


def test_absent_ids_and_empty_rows_are_skipped():
    ids = torch.tensor([[0, 0, 0, 0], [1, 3, 3, 0]])
    meta = build_packed_sequence_metadata(ids)
    assert meta[F.CU_SEQLENS].tolist() == [[0, -1, -1, -1], [0, 1, 3, -1]]
    assert meta[F.MAX_SEQLEN] == 2


@settings(max_examples=150, deadline=None)
@given(packed_batches())
def test_metadata_equals_reference(batch):
    ids = batch[F.DOCUMENT_IDS]
    if F.ATTENTION_ELIGIBILITY in batch:
        ids = ids.masked_fill(~batch[F.ATTENTION_ELIGIBILITY], 0)
    if not bool((ids != 0).any()):
        with pytest.raises(ValueError, match="attention_document_ids"):
            build_packed_sequence_metadata(ids)
        return
    ours, ref = build_packed_sequence_metadata(ids), reference_metadata(ids)
    for name in F.METADATA:
        if isinstance(ref[name], torch.Tensor):
            assert torch.equal(ours[name], ref[name]), name
            assert ours[name].dtype == ref[name].dtype, name
        else:
            assert ours[name] == ref[name]


@settings(max_examples=150, deadline=None)
@given(packed_batches(eligibility=False))
def test_contiguous_fast_path_equals_reference(batch):
    """The final map's path for collate's ids (1 .. n per row, none absent) = AutoModel's reference."""
    ids = batch[F.DOCUMENT_IDS]
    ours, ref = packed_sequence_metadata_of(ids, int(ids.max()), contiguous=True), reference_metadata(ids)
    for name in F.METADATA:
        if isinstance(ref[name], torch.Tensor):
            assert torch.equal(ours[name], ref[name]) and ours[name].dtype == ref[name].dtype, name
        else:
            assert ours[name] == ref[name]


def test_contiguous_fast_path_with_padding_rows():
    ids = torch.tensor([[1, 1, 2, 3, 3, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    meta = packed_sequence_metadata_of(ids, 3, contiguous=True)
    assert meta[F.CU_SEQLENS].tolist() == [[0, 2, 3, 5], [0, -1, -1, -1], [0, 6, -1, -1]]
    assert meta[F.CU_SEQLENS].dtype == torch.int32 and meta[F.MAX_SEQLEN] == 6
    assert meta[F.CU_SEQLENS].tolist() == build_packed_sequence_metadata(ids)[F.CU_SEQLENS].tolist()


def _flat(meta, batch_size, sequence_length):
    return flatten_packed_sequence_metadata(
        meta[F.PACKED_TOKEN_INDICES], meta[F.CU_SEQLENS], batch_size=batch_size, sequence_length=sequence_length
    )


@settings(max_examples=100, deadline=None)
@given(packed_batches(max_rows=6), st.data())
def test_flatten_of_microbatches_equals_flatten_of_whole(batch, data):
    ids = batch[F.DOCUMENT_IDS]
    batch_size, sequence_length = ids.shape
    whole_indices, whole_cu = _flat(build_packed_sequence_metadata(ids), batch_size, sequence_length)
    split = data.draw(st.integers(1, batch_size))
    meta = build_packed_sequence_metadata(ids)
    parts_indices, parts_cu = [], [torch.zeros(1, dtype=torch.int32)]
    for start in range(0, batch_size, split):
        rows = slice(start, start + split)
        n = ids[rows].shape[0]
        sub = {
            F.PACKED_TOKEN_INDICES: meta[F.PACKED_TOKEN_INDICES][rows],
            F.CU_SEQLENS: meta[F.CU_SEQLENS][rows],
        }
        indices, cu = _flat(sub, n, sequence_length)
        parts_indices.append(indices + start * sequence_length)
        parts_cu.append(cu[1:] + parts_cu[-1][-1])
    assert torch.equal(torch.cat(parts_indices), whole_indices)
    assert torch.equal(torch.cat(parts_cu), whole_cu)
    # The gathered stream covers exactly the nonzero ids, in order.
    assert torch.equal(whole_indices, torch.nonzero(ids.flatten()).flatten())


def test_flatten_accepts_already_flat_and_rejects_bad_rows():
    indices = torch.tensor([0, 1, 2])
    cu = torch.tensor([0, 2, 3], dtype=torch.int32)
    out_indices, out_cu = flatten_packed_sequence_metadata(indices, cu, batch_size=1, sequence_length=3)
    assert torch.equal(out_indices, indices) and torch.equal(out_cu, cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        flatten_packed_sequence_metadata(indices, torch.tensor([0, 2], dtype=torch.int32), batch_size=1, sequence_length=3)
    meta = build_packed_sequence_metadata(SPEC_IDS)
    bad = meta[F.CU_SEQLENS].clone()
    bad[1, 2] = 6  # does not cover the row's 7 tokens
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        flatten_packed_sequence_metadata(meta[F.PACKED_TOKEN_INDICES], bad, batch_size=2, sequence_length=8)
    with pytest.raises(ValueError, match="shapes"):
        flatten_packed_sequence_metadata(meta[F.PACKED_TOKEN_INDICES], meta[F.CU_SEQLENS], batch_size=1, sequence_length=8)


def test_contract_defaults_and_validation():
    assert DEFAULT_PACKED_SEQUENCE_CONTRACT.packed_mask_type == "block_causal"
    assert DEFAULT_PACKED_SEQUENCE_CONTRACT.requires_packed_sequence_metadata is False
    with pytest.raises(ValueError, match="packed_mask_type"):
        PackingContract("causal")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="requires_packed_sequence_metadata"):
        PackingContract("document_ids", "yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="qkv_format"):
        PackingContract("document_ids", False, "sbhd")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "mask_type", "metadata"),
    [
        ("sdpa", "block_causal", False),
        ("eager", "block_causal", False),
        ("flex", "block_causal", False),
        ("te", "block_causal", False),
        ("flash_attention_2", "flash_varlen", False),
        ("flash_attention_3", "flash_varlen", False),
        ("flash_attention_4", "flash_varlen", False),
        ("fa4", "document_ids", True),
        ("hf", "position_ids", False),
    ],
)
def test_contract_for_attention(name, mask_type, metadata):
    contract = contract_for_attention(name)
    assert (contract.packed_mask_type, contract.requires_packed_sequence_metadata) == (mask_type, metadata)


def test_contract_for_attention_model_overrides_and_errors():
    assert contract_for_attention("sdpa", packed_mask_type="document_ids").packed_mask_type == "document_ids"
    assert contract_for_attention("sdpa", requires_packed_sequence_metadata=True).requires_packed_sequence_metadata
    assert contract_for_attention("te", qkv_format="thd").qkv_format == "thd"
    with pytest.raises(ValueError, match="attn_implementation"):
        contract_for_attention("xformers")
    with pytest.raises(ValueError, match="qkv_format"):
        contract_for_attention("sdpa", qkv_format="thd")


def test_hf_contract_combinations_are_refused():
    """``hf`` (packed mask type ``position_ids``): a stock HF model reads neither metadata, THD nor another mask."""
    assert contract_for_attention("hf") == PackingContract("position_ids")
    assert contract_for_attention("hf", packed_mask_type="position_ids") == PackingContract("position_ids")
    with pytest.raises(ValueError, match="never reads the gathered-token bundle"):
        contract_for_attention("hf", requires_packed_sequence_metadata=True)
    with pytest.raises(ValueError, match=r"packed_mask_type: got 'block_causal' with attn_implementation 'hf'"):
        contract_for_attention("hf", packed_mask_type="block_causal")
    with pytest.raises(ValueError, match="qkv_format"):
        contract_for_attention("hf", qkv_format="thd")
    with pytest.raises(ValueError, match="never reads the gathered-token bundle"):
        PackingContract("position_ids", True)
    with pytest.raises(ValueError, match=r"qkv_format: got 'thd' with packed_mask_type 'position_ids'"):
        PackingContract("position_ids", False, "thd")


def test_packing_contract_of_normalizes_once():
    from types import SimpleNamespace

    contract = PackingContract("document_ids", True)
    assert PackingContract.of(contract) is contract
    duck = SimpleNamespace(packed_mask_type="flash_varlen", requires_packed_sequence_metadata=False, qkv_format=None)
    assert PackingContract.of(duck) == PackingContract("flash_varlen")
    with pytest.raises(TypeError, match="has no attribute 'packed_mask_type'"):
        PackingContract.of(SimpleNamespace(requires_packed_sequence_metadata=False))


@pytest.mark.parametrize("source", ["model", "yaml"])
def test_contract_is_validated_once_on_the_way_to_the_loader(monkeypatch, jsonl_sources, tokenizer_dir, source):
    """Issue 11: resolve_contract, FinalizeSettings.from_contract and require_supported_packing_contract
    used to check the same contract three times; now it is checked where it enters, once."""
    from types import SimpleNamespace

    from zephon_loader import contract as packing
    from zephon_loader.build import build_text_loader

    calls = []
    check = packing._check_contract
    monkeypatch.setattr(packing, "_check_contract", lambda contract: calls.append(contract) or check(contract))
    config = {
        "sources": [{"name": "a", "path": str(jsonl_sources["a"])}],
        "tokenizer": {"path": str(tokenizer_dir)},
        "sequence_length": 32,
        "micro_batch_size": 2,
        "runtime": {"runner": "threads"},
    }
    model_contract = None
    if source == "model":
        model_contract = SimpleNamespace(packed_mask_type="document_ids", requires_packed_sequence_metadata=True)
    else:
        config["contract"] = {"attn_implementation": "fa4"}
    with build_text_loader(config, packing_contract=model_contract) as loader:
        served = loader.settings.packing_contract
    assert len(calls) == 1, calls
    assert served == PackingContract("document_ids", True)
