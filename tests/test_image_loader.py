"""End-to-end image-text loader: every record once, exact resume, lanes, contract refusals, the demo YAML."""

from __future__ import annotations

import io
import json
import pickle
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import collect
from image_data import (
    LAYOUTS,
    MARKER,
    PROCESSOR_DIR,
    image_config,
    make_record,
    record_key,
    tiny_qwen2_vl,
    unpack,
    write_jsonl_images,
    write_parquet_images,
)
from zephon_loader import ImageLoader, ZephonLoader, build_image_loader
from zephon_loader import fields as F
from zephon_loader.config.image import default_image_config_path
from zephon_loader.processors import ImageTextRecord, Qwen2VLRecordProcessor

COUNT = 24  # records per source: both sources are read exactly once per pass (weights 1:1)


@pytest.fixture(scope="module")
def raw_records():
    rng = random.Random(11)
    jsonl = [make_record(rng, i, LAYOUTS[i % len(LAYOUTS)]) for i in range(COUNT)]
    parquet = [make_record(rng, 100 + i, LAYOUTS[(i + 2) % len(LAYOUTS)]) for i in range(COUNT)]
    return jsonl, parquet


@pytest.fixture(scope="module")
def sources(tmp_path_factory, raw_records):
    root = tmp_path_factory.mktemp("image_sources")
    jsonl, parquet = raw_records
    return {"shapes": write_jsonl_images(root / "shapes", jsonl), "scenes": write_parquet_images(root / "scenes", parquet)}


def reference(records, processor) -> dict[tuple[int, ...], object]:
    """Each record processed alone, keyed by its tokens and pixels."""
    out = {}
    for text, images in records:
        processed = processor(ImageTextRecord(text, tuple(images), MARKER))
        out[record_key(processed.input_ids, processed.pixel_values)] = processed
    assert len(out) == len(records)
    return out


def same_batches(got, want):
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want)):
        assert set(a) == set(b), index
        for name in b:
            if isinstance(b[name], torch.Tensor):
                assert torch.equal(a[name], b[name]), (index, name)
            else:
                assert a[name] == b[name], (index, name)


@pytest.mark.parametrize("alignment", [None, 4])
def test_one_pass_delivers_every_record_exactly_once(sources, raw_records, alignment):
    processor = Qwen2VLRecordProcessor(PROCESSOR_DIR, image_token_alignment=alignment)
    want = reference(raw_records[0] + raw_records[1], processor)
    with build_image_loader(image_config(sources, processor={"image_token_alignment": alignment})) as loader:
        assert isinstance(loader, ImageLoader) and isinstance(loader, ZephonLoader)
        assert loader.processor.image_token_alignment == alignment
        batches = collect(loader)
        stats = loader.stats()
    seen = []
    for batch in batches:
        assert set(loader.yielded_fields) <= set(batch)
        assert batch[F.POSITION_IDS].shape == (3, 2, 160) and batch[F.POSITION_IDS].dtype == torch.int64
        assert batch[F.MM_TOKEN_TYPE_IDS].dtype == torch.int64
        for record in unpack(batch):
            key = record_key(record["tokens"], record["pixels"])
            assert key in want, "a delivered record is not one of the sources'"
            expected = want[key]
            np.testing.assert_array_equal(record["positions"].numpy(), expected.position_ids)
            np.testing.assert_array_equal(record["grid"].numpy(), expected.image_grid_thw)
            if len(expected.image_grid_thw):
                np.testing.assert_array_equal(record["pixels"].numpy(), expected.pixel_values)
            eligible = expected.attention_eligibility
            np.testing.assert_array_equal(record["eligible"].numpy(),
                                          eligible if eligible is not None else np.ones(len(key[0]), bool))
            seen.append(key)
    assert sorted(seen) == sorted(want)  # every record once, none twice
    assert {name: entry["delivered"]["documents"] for name, entry in stats["sources"].items()} == \
        {"shapes": COUNT, "scenes": COUNT}
    assert stats["dropped"] == {}


def resume_config(sources):
    return image_config(sources, processor={"image_token_alignment": 3}, xdoc=True, sequence_length=96,
                        micro_batch_size=1)


@pytest.fixture(scope="module")
def uninterrupted(sources):
    with build_image_loader(resume_config(sources)) as loader:
        full = collect(loader)
    assert len(full) >= 12
    return full


def round_trip(state, codec):
    if codec == "json":
        return json.loads(json.dumps(state))
    if codec == "pickle":
        return pickle.loads(pickle.dumps(state))
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # AutoModel loads loader states with weights_only


@pytest.mark.parametrize(
    ("save_ahead", "resume_ahead", "codec", "where"),
    [(0, 0, "json", "first"), (2, 2, "pickle", "middle"), (2, 0, "torch", "last"), (0, 2, "json", "middle"),
     (2, 2, "torch", "first"), (0, 0, "pickle", "last")],
)
def test_resume_is_exact(sources, uninterrupted, save_ahead, resume_ahead, codec, where):
    full = uninterrupted
    k = {"first": 1, "middle": len(full) // 2, "last": len(full) - 1}[where]
    with build_image_loader({**resume_config(sources), "read_ahead": save_ahead}) as loader:
        iterator = iter(loader)
        head = [next(iterator) for _ in range(k)]
        state = round_trip(loader.state_dict(), codec)
    same_batches(head, full[:k])
    with build_image_loader({**resume_config(sources), "read_ahead": resume_ahead}) as resumed:
        resumed.load_state_dict(state)
        same_batches(collect(resumed), full[k:])


def test_state_of_another_configuration_is_refused(sources):
    with build_image_loader(image_config(sources)) as loader:
        state = loader.state_dict()
    with build_image_loader(image_config(sources, processor={"image_token_alignment": 4})) as other:
        with pytest.raises(ValueError, match="state_dict.fingerprint: .*processor"):
            other.load_state_dict(state)


def test_close_stops_every_thread(sources):
    before = {t for t in threading.enumerate() if t.is_alive()}
    loader = build_image_loader(image_config(sources, read_ahead=2))
    next(iter(loader))
    loader.close()
    assert {t for t in threading.enumerate() if t.is_alive()} - before == set()
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)


def test_dp_ranks_read_disjoint_lanes_covering_every_record(sources, tmp_path):
    common = {"chunk_size": 4, "distributed": {"aggregate_dir": str(tmp_path / "agg"), "run_id": "image"}}
    lanes = []
    for rank in (0, 1):
        with build_image_loader(image_config(sources, **common), dp_rank=rank, dp_world_size=2) as loader:
            lanes.append([record_key(r["tokens"], r["pixels"]) for batch in collect(loader) for r in unpack(batch)])
    assert lanes[0] and lanes[1]
    assert not set(lanes[0]) & set(lanes[1])
    assert len(lanes[0]) + len(lanes[1]) == 2 * COUNT


def test_get_rope_index_gives_the_same_stream(sources):
    processor = Qwen2VLRecordProcessor(PROCESSOR_DIR)
    model = tiny_qwen2_vl(processor)
    config = image_config(sources, processor={"image_token_alignment": 3})
    with build_image_loader(config) as loader:
        rule = collect(loader)
    with build_image_loader(config, get_rope_index=model.model.get_rope_index) as loader:
        assert loader.processor.uses_get_rope_index
        assert loader.fingerprint["get_rope_index"] is True
        same_batches(collect(loader), rule)


def test_contracts_the_image_loader_cannot_serve_are_refused_before_workers(sources):
    before = {t for t in threading.enumerate() if t.is_alive()}
    with pytest.raises(ValueError, match="'flash_varlen' describes physical segments"):
        build_image_loader(image_config(sources, processor={"image_token_alignment": 4},
                                        contract={"packed_mask_type": "flash_varlen",
                                                  "requires_packed_sequence_metadata": False}))
    with pytest.raises(ValueError, match="'thd'"):
        build_image_loader(image_config(sources, processor={"image_token_alignment": 4},
                                        contract={"attn_implementation": "te", "packed_mask_type": "document_ids",
                                                  "qkv_format": "thd"}))
    model = tiny_qwen2_vl(Qwen2VLRecordProcessor(PROCESSOR_DIR))
    with pytest.raises(ValueError, match="runtime.runner: got 'process' with a model get_rope_index"):
        build_image_loader(image_config(sources, runtime={"runner": "process"}),
                           get_rope_index=model.model.get_rope_index)
    assert {t for t in threading.enumerate() if t.is_alive()} - before == set()
    # Without eligibility, flash_varlen is served (HF varlen kwargs over the flattened rows).
    with build_image_loader(image_config(sources, contract={"packed_mask_type": "flash_varlen",
                                                            "requires_packed_sequence_metadata": False})) as loader:
        batch = next(iter(loader))
        assert F.CU_SEQ_LENS_Q in batch and F.ATTENTION_MASK not in batch


def test_config_errors_name_the_key(sources, tmp_path):
    with pytest.raises(ValueError, match=r"dataloader.packing.oversized: got 'keep', expected one of 'drop', 'error'"):
        build_image_loader(image_config(sources, packing={"oversized": "keep"}))
    with pytest.raises(ValueError, match=r"dataloader.packing.algorithm: got 'wrap'"):
        build_image_loader(image_config(sources, packing={"algorithm": "wrap"}))
    with pytest.raises(ValueError, match=r"dataloader.processor.alignment: unknown key.*or name a processor factory"):
        build_image_loader(image_config(sources, processor={"alignment": 4}))
    with pytest.raises(ValueError, match=r"dataloader.records.colour: unknown key"):
        build_image_loader(image_config(sources, records={"colour": "x"}))
    with pytest.raises(ValueError, match="dataloader.micro_batch_size: missing"):
        build_image_loader({k: v for k, v in image_config(sources).items() if k != "micro_batch_size"})
    with pytest.raises(ValueError, match="got both a processor object and dataloader.processor"):
        build_image_loader(image_config(sources), processor=Qwen2VLRecordProcessor(PROCESSOR_DIR))
    path = tmp_path / "bad.yaml"
    path.write_text("dataloader:\n  _target_: zephon_loader.ZephonDataloaderConfig\n  sources: []\n")
    with pytest.raises(ValueError, match=rf"{path}: .*_target_: got 'zephon_loader.ZephonDataloaderConfig'"):
        build_image_loader(path)


def test_processor_target_from_yaml(sources):
    config = image_config(sources, processor={"_target_": "zephon_loader.Qwen2VLRecordProcessor",
                                              "path": str(PROCESSOR_DIR), "image_token_alignment": 2})
    with build_image_loader(config) as loader:
        assert isinstance(loader.processor, Qwen2VLRecordProcessor)
        assert loader.processor.image_token_alignment == 2
        assert len(collect(loader, 2)) == 2


@pytest.mark.parametrize("name", ["image_demo.yaml", "image_demo_aligned.yaml"])
def test_bundled_demo_configs(name):
    path = default_image_config_path().parent / name
    with build_image_loader(path) as loader:
        batches = collect(loader, 3)
        assert batches and F.PIXEL_VALUES in batches[0]
        aligned = loader.processor.image_token_alignment
    assert (aligned is not None) == (name == "image_demo_aligned.yaml")
    repo_config = Path(__file__).resolve().parents[1] / "configs" / name
    assert repo_config.resolve() == path.resolve()
