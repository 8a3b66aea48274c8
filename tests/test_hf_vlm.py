"""Unmodified Hugging Face VLMs (tiny random Qwen2-VL and Qwen2.5-VL from local configs) on the ``hf`` contract:
``loss = model(**batch).loss`` as the README writes it, every packed record's logits equal to the record run
alone, and the loss the mean next-token loss of the batch (labels are not shifted twice)."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from conftest import collect  # noqa: E402
from image_data import LAYOUTS, MARKER, PROCESSOR_DIR, alone, image_config, make_record, tiny_qwen2_5_vl  # noqa: E402
from image_data import tiny_qwen2_vl, unpack  # noqa: E402
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


def model_for(family, processor, attn):
    return tiny_qwen2_vl(processor, attn_implementation=attn) if family == "qwen2_vl" else \
        tiny_qwen2_5_vl(processor, attn_implementation=attn)


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
