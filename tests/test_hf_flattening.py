"""The ``hf`` contract's flash kwargs against transformers' own ``DataCollatorWithFlattening`` (the oracle).

For every batch of the bundled demo, the same documents (read back from the batch: real tokens, split where
positions restart) go through ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``; the loader's
``cu_seq_lens_q/k`` over real tokens, ``max_length_q/k`` and positions must equal the collator's.
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


def test_flash_kwargs_equal_transformers_flattening_collator_on_every_demo_batch():
    collator = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)
    padded = 0
    node = yaml.safe_load(default_config_path().read_text())["dataloader"]
    node.pop("_target_", None)
    node.update(base_dir=str(default_config_path().parent), contract={"attn_implementation": "hf"},
                runtime={"runner": "threads"})
    with build_text_loader(node) as loader:
        batches = list(loader)
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
