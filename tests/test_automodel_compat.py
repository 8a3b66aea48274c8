"""Compatibility with the real consumer, NeMo AutoModel 0.7.0 (installed with --no-deps).

Its own functions are the oracle: our metadata must equal theirs, their model
entry must accept ours, and our yielded fields must equal what their
``neat_packed_collater`` yields for the same document ids.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packed_batches import packed_batches
from zephon_loader import fields as F
from zephon_loader.finalize.final_map import FinalizeSettings, finalize_batch
from zephon_loader.packing import build_packed_sequence_metadata
from zephon_loader.contract import PackingContract, contract_for_attention

am_packing = pytest.importorskip(
    "nemo_automodel.components.datasets.packing",
    reason="nemo-automodel==0.7.0 is not importable: install it with `pip install --no-deps nemo-automodel==0.7.0`",
)
from nemo_automodel.components.datasets.utils import neat_packed_collater  # noqa: E402
from nemo_automodel.components.models.common import packing as am_model_packing  # noqa: E402

pytestmark = pytest.mark.automodel


def _attention_ids(batch):
    ids = batch[F.DOCUMENT_IDS]
    if F.ATTENTION_ELIGIBILITY in batch:
        ids = ids.masked_fill(~batch[F.ATTENTION_ELIGIBILITY], 0)
    return ids


@settings(max_examples=200, deadline=None)
@given(packed_batches(max_rows=6, max_len=64))
def test_metadata_equals_automodel(batch):
    ids = _attention_ids(batch)
    if not bool((ids != 0).any()):
        with pytest.raises(ValueError):
            am_packing.build_packed_sequence_metadata(ids)
        with pytest.raises(ValueError):
            build_packed_sequence_metadata(ids)
        return
    ours, theirs = build_packed_sequence_metadata(ids), am_packing.build_packed_sequence_metadata(ids)
    assert set(ours) == set(theirs)
    for name in theirs:
        if isinstance(theirs[name], torch.Tensor):
            assert ours[name].dtype == theirs[name].dtype, name
            assert torch.equal(ours[name], theirs[name]), name
        else:
            assert ours[name] == theirs[name] and type(ours[name]) is type(theirs[name]), name
    batch_size, sequence_length = ids.shape
    their_flat = am_model_packing.flatten_packed_sequence_metadata(
        ours[F.PACKED_TOKEN_INDICES], ours[F.CU_SEQLENS], batch_size=batch_size, sequence_length=sequence_length
    )
    from zephon_loader.packing import flatten_packed_sequence_metadata

    our_flat = flatten_packed_sequence_metadata(
        ours[F.PACKED_TOKEN_INDICES], ours[F.CU_SEQLENS], batch_size=batch_size, sequence_length=sequence_length
    )
    for a, b in zip(our_flat, their_flat):
        assert a.dtype == b.dtype and torch.equal(a, b)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5), st.integers(1, 40), st.integers(0, 60), st.integers(0, 2**31 - 1))
def test_metadata_equals_automodel_on_arbitrary_ids(rows, columns, largest, seed):
    """Any nonnegative ids, not only collate's: unsorted, with gaps, zeros anywhere, larger than S."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, largest + 1, (rows, columns), generator=generator)
    ids[torch.rand(rows, columns, generator=generator) < 0.3] = 0
    if not bool(ids.any()):
        with pytest.raises(ValueError, match="no valid"):
            build_packed_sequence_metadata(ids)
        return
    ours, theirs = build_packed_sequence_metadata(ids), am_packing.build_packed_sequence_metadata(ids)
    for name in theirs:
        if isinstance(theirs[name], torch.Tensor):
            assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name
        else:
            assert ours[name] == theirs[name] and type(ours[name]) is type(theirs[name]), name


@settings(max_examples=80, deadline=None)
@given(
    packed_batches(max_rows=4, max_len=32, axes=(1,), eligibility=False),
    st.sampled_from(["document_ids", "block_causal", "flash_varlen"]),
    st.booleans(),
)
def test_yielded_fields_equal_neat_packed_collater(batch, mask_type, metadata):
    contract = PackingContract(mask_type, metadata)
    ours = finalize_batch(batch, FinalizeSettings.from_contract(contract))
    samples = [
        {
            F.INPUT_IDS: batch[F.INPUT_IDS][b],
            F.LABELS: batch[F.LABELS][b],
            F.POSITION_IDS: batch[F.POSITION_IDS][b],
            F.ATTENTION_MASK: batch[F.DOCUMENT_IDS][b],
        }
        for b in range(batch[F.INPUT_IDS].shape[0])
    ]
    theirs = neat_packed_collater(samples, packing=contract)
    assert set(theirs) <= set(ours), set(theirs) - set(ours)
    assert set(ours) - set(theirs) == {F.PADDING_MASK}
    for name, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert ours[name].dtype == value.dtype, name
            assert torch.equal(ours[name], value), name
        else:
            assert ours[name] == value, name


@pytest.mark.parametrize(
    "name", ["sdpa", "eager", "flex", "te", "flash_attention_2", "flash_attention_3", "flash_attention_4", "fa4"]
)
@pytest.mark.parametrize("requires_metadata", [False, True])
def test_contract_mapping_equals_get_packing_capabilities(name, requires_metadata):
    class Model(torch.nn.Module):
        _uses_native_fa4 = True

    model = Model()
    model.requires_packed_sequence_metadata = requires_metadata
    theirs = am_model_packing.get_packing_capabilities(name, model=model)
    ours = contract_for_attention(name, requires_packed_sequence_metadata=requires_metadata)
    assert ours.packed_mask_type == theirs.packed_mask_type
    assert ours.requires_packed_sequence_metadata == theirs.requires_packed_sequence_metadata
