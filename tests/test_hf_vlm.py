"""Unmodified Hugging Face VLMs (tiny random Qwen2-VL and Qwen2.5-VL from local configs) on the ``hf`` contract:
``loss = model(**batch).loss`` as the README writes it, every packed record's logits equal to the record run
alone, and the loss the mean next-token loss of the batch (labels are not shifted twice)."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from conftest import collect  # noqa: E402
from image_data import LAYOUTS, MARKER, PROCESSOR_DIR, image_config, make_record, tiny_qwen2_vl, unpack  # noqa: E402
from image_data import write_jsonl_images  # noqa: E402
from zephon_loader import build_image_loader  # noqa: E402
from zephon_loader import fields as F  # noqa: E402
from zephon_loader.processors import ImageTextRecord, Qwen2VLRecordProcessor  # noqa: E402


@pytest.fixture(scope="module")
def processor():
    return Qwen2VLRecordProcessor(PROCESSOR_DIR)


@pytest.fixture(scope="module")
def records():
    rng = random.Random(11)
    return [make_record(rng, i, LAYOUTS[i % len(LAYOUTS)]) for i in range(10)]


@pytest.fixture(scope="module")
def source(tmp_path_factory, records):
    return write_jsonl_images(tmp_path_factory.mktemp("hf_vlm_source"), records)


def tiny_qwen2_5_vl(processor, *, attn_implementation: str):
    """A randomly initialized 2-layer Qwen2.5-VL whose token ids match ``processor``'s tokenizer (eval, fp32)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    reference = tiny_qwen2_vl(processor).config
    config = Qwen2_5_VLConfig(
        text_config=reference.text_config.to_dict(),
        vision_config=dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                           patch_size=processor.image_processor.patch_size,
                           spatial_merge_size=processor.spatial_merge_size,
                           temporal_patch_size=processor.image_processor.temporal_patch_size, in_channels=3,
                           window_size=112, fullatt_block_indexes=[1]),
        image_token_id=reference.image_token_id, video_token_id=reference.video_token_id,
        vision_start_token_id=reference.vision_start_token_id, vision_end_token_id=reference.vision_end_token_id,
    )
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def model_for(family, processor, attn):
    return tiny_qwen2_vl(processor, attn_implementation=attn) if family == "qwen2_vl" else \
        tiny_qwen2_5_vl(processor, attn_implementation=attn)


def alone(model, processed):
    """Logits of one processed record by itself (plain 3-axis positions, its own pixels, no mask)."""
    has_images = len(processed.image_grid_thw) > 0
    with torch.no_grad():
        return model(
            input_ids=torch.from_numpy(processed.input_ids)[None],
            position_ids=torch.from_numpy(processed.position_ids)[:, None],
            pixel_values=torch.from_numpy(processed.pixel_values) if has_images else None,
            image_grid_thw=torch.from_numpy(processed.image_grid_thw) if has_images else None,
            mm_token_type_ids=torch.from_numpy(processed.mm_token_type_ids)[None], use_cache=False,
        ).logits[0]


def records_of(batch):
    """The records of an ``hf`` batch: text positions (row 0 of ``position_ids``) restart at each record."""
    text, padding = batch[F.POSITION_IDS][0], batch[F.PADDING_MASK]
    ids = ((text == 0) & ~padding).long().cumsum(dim=1).masked_fill(padding, 0)
    return unpack({**batch, F.DOCUMENT_IDS: ids, F.POSITION_IDS: batch[F.POSITION_IDS][1:]})


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_model_call_on_a_batch_computes_each_record_alone_with_the_right_loss(processor, records, source, family,
                                                                              attn):
    model = model_for(family, processor, attn)
    config = image_config({"src": source}, sequence_length=96, micro_batch_size=2)
    config["contract"] = {"attn_implementation": "hf"}
    by_tokens = {}
    for text, images in records:
        plain = processor(ImageTextRecord(text, tuple(images), MARKER))
        by_tokens.setdefault(tuple(plain.input_ids.tolist()), []).append(plain)
    checked = packed_rows = 0
    with build_image_loader(config) as loader:
        batches = collect(loader)
        assert set(batches[0]) <= set(loader.yielded_fields) | {F.PACKED_SEQ_IDS, F.PIXEL_VALUES, F.IMAGE_GRID_THW}
    for batch in batches:
        assert F.ATTENTION_MASK not in batch and batch[F.POSITION_IDS].shape[0] == 4
        with torch.no_grad():
            out = model(**batch)
        logits = out.logits
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[F.LABELS].flatten(),
                                                     ignore_index=F.IGNORE_INDEX)
        torch.testing.assert_close(out.loss, expected)
        for record in records_of(batch):
            got = logits[record["row"], record["columns"]]
            candidates = by_tokens[tuple(record["tokens"].tolist())]
            assert any(torch.allclose(got, alone(model, c), atol=2e-5, rtol=1e-4) for c in candidates)
            checked += 1
        packed_rows += int((batch[F.POSITION_IDS][0][~batch[F.PADDING_MASK]] == 0).sum()) > batch[F.INPUT_IDS].shape[0]
    assert checked == len(records)
    assert packed_rows >= 1  # some row holds several records: the mask really separates them


def test_the_readme_image_example_runs_as_written(processor):
    """README "Images": ``build_image_loader("configs/image_demo_hf.yaml")`` then ``model(**batch).loss``."""
    from pathlib import Path

    config = Path(__file__).resolve().parents[1] / "configs" / "image_demo_hf.yaml"
    with build_image_loader(config) as loader:
        model = tiny_qwen2_vl(loader.processor)
        batch = collect(loader, 1)[0]
    with torch.no_grad():
        loss = model(**batch).loss
    assert torch.isfinite(loss) and batch[F.PIXEL_VALUES].shape[0] > 0
