"""A tiny random Qwen2-VL (local config) runs forward on yielded batches, and computes every record as if alone.

For each packed record, the logits at its tokens equal the logits of the
model run on that record alone (its own pixels, its own positions, no mask):
packing, positions, pixel order and the attention mask are all right. With
``image_token_alignment`` the eligible tokens equal the record run alone
*without* its fillers: fillers neither attend nor are attended, and positions
skip them.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from conftest import collect
from image_data import LAYOUTS, MARKER, PROCESSOR_DIR, alone, image_config, make_record, tiny_qwen2_vl, unpack
from image_data import write_jsonl_images
from zephon_loader import build_image_loader
from zephon_loader import fields as F
from zephon_loader.finalize.final_map import block_causal_mask
from zephon_loader.processors import ImageTextRecord, Qwen2VLRecordProcessor


@pytest.fixture(scope="module")
def processor():
    return Qwen2VLRecordProcessor(PROCESSOR_DIR)


@pytest.fixture(scope="module")
def model(processor):
    return tiny_qwen2_vl(processor)


@pytest.fixture(scope="module")
def records():
    rng = random.Random(5)
    return [make_record(rng, i, LAYOUTS[i % len(LAYOUTS)]) for i in range(12)]


@pytest.fixture(scope="module")
def source(tmp_path_factory, records):
    return write_jsonl_images(tmp_path_factory.mktemp("model_source"), records)


def forward(model, batch, mask):
    with torch.no_grad():
        return model(
            input_ids=batch[F.INPUT_IDS], attention_mask=mask, position_ids=batch[F.POSITION_IDS],
            pixel_values=batch.get(F.PIXEL_VALUES), image_grid_thw=batch.get(F.IMAGE_GRID_THW),
            mm_token_type_ids=batch[F.MM_TOKEN_TYPE_IDS], use_cache=False,
        ).logits


@pytest.mark.parametrize("alignment", [None, 4])
def test_packed_records_compute_as_if_alone(model, processor, records, source, alignment):
    config = image_config({"src": source}, processor={"image_token_alignment": alignment}, sequence_length=96,
                          micro_batch_size=2)
    by_tokens = {}
    for text, images in records:
        plain = processor(ImageTextRecord(text, tuple(images), MARKER))
        by_tokens.setdefault(tuple(plain.input_ids.tolist()), []).append(plain)
    checked = 0
    with build_image_loader(config) as loader:
        for batch in collect(loader):
            # The yielded document ids become the block-causal mask the model consumes.
            logits = forward(model, batch, block_causal_mask(batch[F.ATTENTION_MASK]))
            assert torch.isfinite(logits[~batch[F.PADDING_MASK]]).all()
            for record in unpack(batch):
                eligible = record["eligible"]
                tokens = tuple(record["tokens"][eligible].tolist())  # without the fillers
                candidates = by_tokens[tokens]
                got = logits[record["row"], record["columns"][eligible]]
                assert any(torch.allclose(got, alone(model, c), atol=2e-5, rtol=1e-4) for c in candidates)
                checked += 1
    assert checked == len(records)


def test_forward_with_xdoc_and_metadata_contract(model, source):
    config = image_config({"src": source}, xdoc=True, processor={"image_token_alignment": 3}, sequence_length=96)
    with build_image_loader(config) as loader:
        batch = collect(loader, 1)[0]
    ids = batch[F.ATTENTION_MASK]
    assert set(ids.unique().tolist()) <= {0, 1}
    logits = forward(model, batch, block_causal_mask(ids))
    assert torch.isfinite(logits[ids != 0]).all()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[F.LABELS].flatten(),
                                             ignore_index=F.IGNORE_INDEX)
    assert torch.isfinite(loss)


def test_forward_with_the_block_causal_contract(model, source):
    config = image_config({"src": source}, contract={"packed_mask_type": "block_causal"}, sequence_length=96)
    with build_image_loader(config) as loader:
        batch = collect(loader, 1)[0]
    assert batch[F.ATTENTION_MASK].shape == (2, 1, 96, 96)
    logits = forward(model, batch, batch[F.ATTENTION_MASK])
    assert torch.isfinite(logits[~batch[F.PADDING_MASK]]).all()
    np.testing.assert_array_equal(batch[F.MM_TOKEN_TYPE_IDS].numpy(),
                                  (batch[F.INPUT_IDS] == model.config.image_token_id).numpy())
