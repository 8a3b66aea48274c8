"""Image collate and the final map: unpacking a batch by document ids recovers every record exactly.

Property test (hypothesis) over generated records — image at the start or
end, several images, image only, no image, oversized — processed by the
built-in processor through the record operator, packed first-fit into rows,
collated, then finalized (with and without xdoc): each record's tokens,
eligibility, positions, labels and image patches come back exactly, in row
order then position order; xdoc continues positions across records on all
three axes.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from image_data import LAYOUTS, MARKER, PROCESSOR_DIR, draw_image, make_record, png, unpack
from zephon_loader import fields as F
from zephon_loader.finalize.final_map import FinalizeSettings, finalize_batch
from zephon_loader.collate.image import PACKED_SAMPLES, collate_images
from zephon_loader.pipeline.image_records import ProcessImageRecords, RecordFormat
from zephon_loader.contract import PackingContract
from zephon_loader.processors import Qwen2VLRecordProcessor
from zephon_loader.pipeline.provenance import DropLog, ShardTable, SourceShards
from zephon_loader.zephon_compat import ZephonKeys

@pytest.fixture(scope="module")
def processors() -> dict:
    return {None: Qwen2VLRecordProcessor(PROCESSOR_DIR), 3: Qwen2VLRecordProcessor(PROCESSOR_DIR, image_token_alignment=3)}


def operator(processor, tmp_path, oversized="drop", capacity=10_000) -> ProcessImageRecords:
    shards = ShardTable((SourceShards("gen", str(tmp_path), ("part-0.parquet",), "parquet"),))
    return ProcessImageRecords(processor=processor, record_format=RecordFormat(), shards=shards, policy="error",
                               oversized=oversized, row_capacity=capacity, max_record_tokens=None,
                               log=DropLog(tmp_path / "drops.jsonl"))


def generate(seed: int, layouts: list[str]) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for index, layout in enumerate(layouts):
        if layout == "oversized":
            text, images = f"big {MARKER}", [draw_image(rng, low=200, high=220)]
        else:
            text, images = make_record(rng, index, layout)
        out.append({"text": text, "images": [png(image) for image in images]})
    return out


def first_fit(payloads: list[dict], capacity: int, rows: int) -> list[SimpleNamespace]:
    """Whole records into rows (first fit, Zephon's rule for one open bin per row), rows into batches."""
    bins: list[list[dict]] = []
    room: list[int] = []
    for payload in payloads:
        n = len(payload[ZephonKeys.TOKENS])
        slot = next((i for i, free in enumerate(room) if free >= n), None)
        if slot is None:
            bins.append([])
            room.append(capacity)
            slot = len(bins) - 1
        bins[slot].append(payload)
        room[slot] -= n
    records = [SimpleNamespace(payload={PACKED_SAMPLES: b}) for b in bins]
    return [SimpleNamespace(records=records[i:i + rows]) for i in range(0, len(records), rows)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    layouts=st.lists(st.sampled_from(LAYOUTS + ("oversized",)), min_size=1, max_size=9),
    capacity=st.sampled_from([40, 64, 120]),
    rows=st.integers(1, 3),
    alignment=st.sampled_from([None, 3]),
    xdoc=st.booleans(),
    mask_cross=st.booleans(),
)
def test_unpacking_recovers_every_record(processors, tmp_path, seed, layouts, capacity, rows, alignment, xdoc,
                                         mask_cross):
    processor = processors[alignment]
    op = operator(processor, tmp_path, capacity=capacity)
    raws = generate(seed, layouts)
    payloads = []
    for index, raw in enumerate(raws):
        payload, problem = op.process(raw, (0, 0, index))
        if problem is not None:  # oversized: the operator drops it (counted; see test_image_records)
            assert problem[0] == "longer_than_row" and len(payload[ZephonKeys.TOKENS]) > capacity
            continue
        payloads.append(payload)
    if not payloads:
        return
    eligibility = alignment is not None
    contract = PackingContract("document_ids", True)
    final = FinalizeSettings.from_contract(contract, xdoc=xdoc, attention_eligibility=eligibility,
                                           micro_batch_size=rows, sequence_length=capacity)
    recovered, packed = [], []
    for batch in first_fit(payloads, capacity, rows):
        packed += [p for r in batch.records for p in r.payload[PACKED_SAMPLES]]
        collated = collate_images(batch, sequence_length=capacity, micro_batch_size=rows,
                                  pad_token_id=processor.pad_token_id, mask_cross_document_labels=mask_cross,
                                  eligibility=eligibility)
        check_padding(collated, processor.pad_token_id, len(batch.records), rows)
        images_per_row = [sum(len(p[F.IMAGE_GRID_THW]) for p in r.payload[PACKED_SAMPLES]) for r in batch.records]
        assert collated[F.N_IMAGES_PER_SAMPLE].tolist() == images_per_row + [0] * (rows - len(batch.records))
        records = unpack(collated)
        check_labels(records, batch, mask_cross)
        yielded = finalize_batch(collated, final)
        check_final_map(collated, yielded, records, xdoc)
        recovered += records
    assert len(recovered) == len(packed) == len(payloads)
    for got, want in zip(recovered, packed):  # rows in order, records in position order within a row
        np.testing.assert_array_equal(got["tokens"].numpy(), want[ZephonKeys.TOKENS])
        np.testing.assert_array_equal(got["positions"].numpy(), want[F.POSITION_IDS])
        np.testing.assert_array_equal(got["mm"].numpy(), want[F.MM_TOKEN_TYPE_IDS])
        np.testing.assert_array_equal(got["grid"].numpy(), want[F.IMAGE_GRID_THW])
        if len(want[F.IMAGE_GRID_THW]):
            np.testing.assert_array_equal(got["pixels"].numpy(), want[F.PIXEL_VALUES])
        else:
            assert got["pixels"] is None
        expected_eligible = want.get(F.ATTENTION_ELIGIBILITY, np.ones(len(want[ZephonKeys.TOKENS]), bool))
        np.testing.assert_array_equal(got["eligible"].numpy(), expected_eligible)


def check_padding(collated, pad_id, present, rows):
    padding = collated[F.PADDING_MASK]
    assert padding.shape[0] == rows and padding[present:].all()  # the short batch is completed with padding rows
    assert (collated[F.INPUT_IDS][padding] == pad_id).all()
    assert (collated[F.LABELS][padding] == F.IGNORE_INDEX).all()
    assert (collated[F.DOCUMENT_IDS][padding] == 0).all() and (collated[F.DOCUMENT_IDS][~padding] > 0).all()
    assert (collated[F.MM_TOKEN_TYPE_IDS][padding] == 0).all()
    if F.ATTENTION_ELIGIBILITY in collated:
        assert not collated[F.ATTENTION_ELIGIBILITY][padding].any()
    used = (~padding).sum(dim=1)
    tail = torch.arange(padding.shape[1])[None, :] - used[:, None]
    for axis in range(3):
        assert torch.equal(collated[F.POSITION_IDS][axis][padding], tail[padding])  # the tail numbered 0, 1, ...


def check_labels(records, batch, mask_cross):
    """Label j = token j + 1 when it is a target of the same record (or the next record's, without masking)."""
    by_row: dict[int, list[dict]] = {}
    for record in records:
        by_row.setdefault(record["row"], []).append(record)
    for row, row_records in by_row.items():
        payloads = batch.records[row].payload[PACKED_SAMPLES]
        images = sum(len(p[F.IMAGE_GRID_THW]) for p in payloads)
        assert images == sum(len(r["grid"]) for r in row_records)
        for index, (record, payload) in enumerate(zip(row_records, payloads)):
            ids, loss = payload[ZephonKeys.TOKENS], payload[ZephonKeys.LOSS_MASK]
            want = np.where(loss[1:], ids[1:], F.IGNORE_INDEX).tolist()
            following = payloads[index + 1] if index + 1 < len(payloads) else None
            if following is not None and not mask_cross and following[ZephonKeys.LOSS_MASK][0]:
                want.append(int(following[ZephonKeys.TOKENS][0]))
            else:
                want.append(F.IGNORE_INDEX)
            assert record["labels"].tolist() == want


def check_final_map(collated, yielded, records, xdoc):
    ids, padding = collated[F.DOCUMENT_IDS], collated[F.PADDING_MASK]
    eligible = collated.get(F.ATTENTION_ELIGIBILITY, ~padding)
    attention = yielded[F.ATTENTION_MASK]
    assert torch.equal(attention == 0, ~eligible)  # 0 exactly at ineligible tokens and padding
    if not xdoc:
        assert torch.equal(attention[eligible], ids[eligible])
        assert torch.equal(yielded[F.POSITION_IDS], collated[F.POSITION_IDS])
    else:
        assert (attention[eligible] == 1).all()
        # Record k of a row continues where record k - 1 ended, on all three axes (docs/contract.md §6).
        offset, row, document = 0, -1, 0
        for record in records:
            if record["row"] != row:
                offset, row, document = 0, record["row"], 0
            document += 1
            local = record["positions"]
            shifted = yielded[F.POSITION_IDS][:, row][:, (ids[row] == document).nonzero().flatten()]
            assert torch.equal(shifted, local + offset)
            offset += int(local.max()) + 1
        assert torch.equal(yielded[F.POSITION_IDS][:, padding], collated[F.POSITION_IDS][:, padding])
    # Metadata gathers eligible tokens only.
    indices = yielded[F.PACKED_TOKEN_INDICES]
    assert torch.equal(indices >= 0, eligible)
    for name in (F.MM_TOKEN_TYPE_IDS, F.N_IMAGES_PER_SAMPLE, F.PIXEL_VALUES, F.IMAGE_GRID_THW):
        if name in collated:
            assert yielded[name] is collated[name]  # image fields pass through the final map untouched
    assert F.ATTENTION_ELIGIBILITY not in yielded and F.DOCUMENT_IDS not in yielded


def test_collate_refuses_what_the_image_pipeline_never_builds(processors, tmp_path):
    processor = processors[None]
    op = operator(processor, tmp_path)
    payload, _ = op.process({"text": "short text", "images": []}, (0, 0, 0))
    kwargs = dict(sequence_length=4, micro_batch_size=1, pad_token_id=0, mask_cross_document_labels=True,
                  eligibility=False)
    batch = SimpleNamespace(records=[SimpleNamespace(payload={PACKED_SAMPLES: [payload] * 3})])
    with pytest.raises(ValueError, match=r"zephon_batch row 0: got \d+ tokens, expected at most sequence_length=4"):
        collate_images(batch, **kwargs)
    with pytest.raises(ValueError, match="expected 1 to micro_batch_size=1"):
        collate_images(SimpleNamespace(records=batch.records * 2), **{**kwargs, "sequence_length": 100})
    flat = SimpleNamespace(records=[SimpleNamespace(payload={"input_ids": [1, 2]})])
    with pytest.raises(ValueError, match="Pack with pack_sequences"):
        collate_images(flat, **kwargs)
