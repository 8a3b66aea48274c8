"""The ``hf`` contract's flash kwargs against transformers' own ``DataCollatorWithFlattening`` (the oracle).

For every batch of the bundled demo, the same documents (read back from the batch: real tokens, split where
positions restart) go through ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``; the loader's
``cu_seq_lens_q/k`` over real tokens, ``max_length_q/k`` and positions must equal the collator's, and
(``contract.seq_idx``) its ``seq_idx`` the collator's ``return_seq_idx=True`` output.
"""

from __future__ import annotations

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")

from zephon_loader import build_text_loader  # noqa: E402
from zephon_loader import fields as F  # noqa: E402
from zephon_loader.config import default_config_path  # noqa: E402


def _documents(batch):
    """The documents of a batch in flattened order: real tokens of each row, cut where positions restart."""
    docs = []
    for row in range(batch[F.INPUT_IDS].shape[0]):
        real = ~batch[F.PADDING_MASK][row]
        ids, pos = batch[F.INPUT_IDS][row][real], batch[F.POSITION_IDS][row][real]
        starts = torch.nonzero(pos == 0).flatten().tolist() + [len(ids)]
        docs += [ids[a:b].tolist() for a, b in zip(starts, starts[1:])]
    return docs


def _demo_batches(contract):
    node = yaml.safe_load(default_config_path().read_text())["dataloader"]
    node.pop("_target_", None)
    node.update(base_dir=str(default_config_path().parent), contract=contract, runtime={"runner": "threads"})
    with build_text_loader(node) as loader:
        return list(loader)


@pytest.fixture(scope="module")
def hf_demo_batches():
    """Every batch of the demo under the ``hf`` contract, with ``seq_idx`` requested (one run for both tests)."""
    return _demo_batches({"attn_implementation": "hf", "seq_idx": True})


def test_flash_kwargs_equal_transformers_flattening_collator_on_every_demo_batch(hf_demo_batches):
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    padded = 0
    batches = hf_demo_batches
    assert len(batches) > 50
    for index, batch in enumerate(batches):
        docs = _documents(batch)
        oracle = collator([{"input_ids": doc} for doc in docs])
        cu = batch[F.CU_SEQ_LENS_Q]
        starts, lengths = cu[:-1].long(), (cu[1:] - cu[:-1]).long()
        real = ~batch[F.PADDING_MASK].flatten()[starts]
        assert lengths[real].tolist() == oracle[F.CU_SEQ_LENS_Q].diff().tolist(), index
        assert torch.equal(batch[F.CU_SEQ_LENS_K], cu)
        assert batch[F.MAX_LENGTH_Q] == batch[F.MAX_LENGTH_K] == int(oracle[F.MAX_LENGTH_Q]), index
        positions = batch[F.POSITION_IDS].flatten()[~batch[F.PADDING_MASK].flatten()]
        assert positions.tolist() == oracle[F.POSITION_IDS].flatten().tolist(), index
        assert int(lengths.max()) <= batch[F.MAX_LENGTH_Q]  # no segment, padding included, beyond the kernel's size
        padded += bool(batch[F.PADDING_MASK].any())
    assert padded >= 1  # the last batch is padded: the case the loader used to size for the padding


def test_seq_idx_equals_transformers_flattening_collator_on_every_demo_batch(hf_demo_batches):
    """``seq_idx`` [B, S] int32: on the real tokens, flattened, exactly the collator's; -1 at padding."""
    collator = transformers.DataCollatorWithFlattening(return_seq_idx=True)
    padded = 0
    for index, batch in enumerate(hf_demo_batches):
        seq_idx = batch[F.SEQ_IDX]
        assert seq_idx.dtype == torch.int32 and seq_idx.shape == batch[F.INPUT_IDS].shape, index
        oracle = collator([{"input_ids": doc} for doc in _documents(batch)])["seq_idx"]
        assert oracle.dtype == torch.int32
        real = ~batch[F.PADDING_MASK]
        assert torch.equal(seq_idx[real], oracle.flatten()), index
        assert bool((seq_idx[~real] == -1).all()), index
        padded += bool((~real).any())
    assert padded >= 1


def test_seq_idx_only_on_request_and_under_other_contracts():
    """Off by default; under fa4 (document_ids + metadata) it is the same numbering as under hf."""
    fa4 = _demo_batches({"attn_implementation": "fa4", "seq_idx": True})
    plain = _demo_batches({"attn_implementation": "fa4"})
    assert all(F.SEQ_IDX not in batch for batch in plain)
    for with_idx, without in zip(fa4, plain):
        assert torch.equal(with_idx[F.INPUT_IDS], without[F.INPUT_IDS])
        ids = with_idx[F.ATTENTION_MASK]
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        expected = (starts & ids.bool()).flatten().cumsum(0).view(ids.shape) - 1
        assert torch.equal(with_idx[F.SEQ_IDX].long(), expected.masked_fill(~ids.bool(), -1))
