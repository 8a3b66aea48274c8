"""The processor interface, the built-in Qwen2-VL processor, and mRoPE positions equal to transformers'.

Oracles: ``transformers``' ``Qwen2VLModel.get_rope_index`` (a tiny model built
from a local config), its Qwen2-VL image processor, and its tokenizer reading
the expanded vision tokens (what ``Qwen2VLProcessor`` does; that class itself
needs torchvision for its video half).
"""

from __future__ import annotations

import copy
import pickle
import random
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from image_data import LAYOUTS, MARKER, PROCESSOR_DIR, draw_image, make_record, tiny_qwen2_vl
from zephon_loader.processors import (
    ImageTextRecord,
    ProcessedRecord,
    Qwen2VLRecordProcessor,
    check_processed,
    qwen2_vl_positions,
)
from zephon_loader.processors.qwen2_vl import IMAGE_PAD, VISION_END, VISION_START


@pytest.fixture(scope="module")
def processor() -> Qwen2VLRecordProcessor:
    return Qwen2VLRecordProcessor(PROCESSOR_DIR)


@pytest.fixture(scope="module")
def model(processor):
    return tiny_qwen2_vl(processor)


@pytest.fixture(scope="module")
def plain_tokenizer():
    """The same tokenizer, reading special-token strings as control tokens (how HF's processor tokenizes)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(PROCESSOR_DIR), local_files_only=True)


def hf_rope(model, mm: np.ndarray, grid: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    ids = torch.where(torch.from_numpy(mm) == 1, model.config.image_token_id, 7)[None]
    positions, _ = model.model.get_rope_index(
        ids, mm_token_type_ids=torch.from_numpy(mm)[None],
        image_grid_thw=torch.from_numpy(grid) if len(grid) else None,
        attention_mask=torch.from_numpy(mask.astype(np.int64))[None] if mask is not None else None)
    return positions[:, 0].numpy()


# A record's layout: text runs (>= 1 token between images, as vision_start/end are) and image grids.
layouts = st.lists(
    st.tuples(st.integers(1, 6), st.integers(1, 2), st.integers(1, 4), st.integers(1, 4)), min_size=0, max_size=4,
).flatmap(lambda images: st.tuples(st.just(images), st.integers(0, 5), st.integers(0, 5)))


def build(layout) -> tuple[np.ndarray, np.ndarray]:
    images, lead, tail = layout
    types, grid = [0] * lead, []
    for text, t, h, w in images:
        types += [1] * (t * h * w) + [0] * text
        grid.append([t, 2 * h, 2 * w])
    types += [0] * tail
    if not types:
        types = [0]
    return np.asarray(types, dtype=np.int64), np.asarray(grid, dtype=np.int64).reshape(-1, 3)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts)
def test_rule_equals_transformers_get_rope_index(model, layout):
    mm, grid = build(layout)
    np.testing.assert_array_equal(qwen2_vl_positions(mm, grid, 2), hf_rope(model, mm, grid))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts, holes=st.lists(st.integers(1, 200), max_size=6))
def test_ineligible_tokens_do_not_count(model, layout, holes):
    mm, grid = build(layout)
    eligible = np.ones(len(mm), dtype=bool)
    # Holes at text tokens, never the first token nor the one right after an image (<|vision_end|> is eligible,
    # so images always stay separated by an eligible token).
    after_image = np.concatenate([[True], mm[:-1] == 1])
    text = np.flatnonzero((mm == 0) & ~after_image)
    if len(text):
        eligible[text[np.asarray(holes, dtype=np.int64) % len(text)]] = False
    got = qwen2_vl_positions(mm, grid, 2, eligible)
    # Eligible tokens: transformers' positions with the holes masked out, and the record without them.
    np.testing.assert_array_equal(got[:, eligible], hf_rope(model, mm, grid, eligible)[:, eligible])
    np.testing.assert_array_equal(got[:, eligible], qwen2_vl_positions(mm[eligible], grid, 2))
    # A hole repeats the position before it.
    before = np.flatnonzero(~eligible)
    np.testing.assert_array_equal(got[:, before], got[:, before - 1])


def test_rule_refuses_image_runs_that_do_not_match_the_grid():
    with pytest.raises(ValueError, match="image 0 has 3 tokens, expected"):
        qwen2_vl_positions(np.array([0, 1, 1, 1, 0]), np.array([[1, 4, 4]]), 2)
    with pytest.raises(ValueError, match="2 image runs, expected one per image_grid_thw row"):
        qwen2_vl_positions(np.array([1, 0, 1]), np.array([[1, 2, 2]]), 2)


# ----------------------------------------------------------------------------- the built-in processor


def expected_with_transformers(processor, plain_tokenizer, model, text, images):
    """What HF's Qwen2-VL processing gives: expanded vision tokens read by the tokenizer, + EOS."""
    merge = processor.spatial_merge_size
    if images:
        features = processor.image_processor(images=images, return_tensors="np")
        grid, pixels = features["image_grid_thw"], features["pixel_values"]
    else:
        grid, pixels = np.zeros((0, 3), np.int64), np.zeros((0, processor.patch_dim), np.float32)
    pieces = text.split(MARKER)
    expanded = pieces[0]
    for index, piece in enumerate(pieces[1:]):
        expanded += VISION_START + IMAGE_PAD * int(np.prod(grid[index]) // merge**2) + VISION_END + piece
    ids = np.asarray(plain_tokenizer(expanded, add_special_tokens=False)["input_ids"] + [processor.eos_token_id])
    mm = (ids == processor.image_token_id).astype(np.int64)
    return ids, mm, grid, pixels, hf_rope(model, mm, grid)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_processor_matches_transformers(processor, plain_tokenizer, model, layout):
    rng = random.Random(LAYOUTS.index(layout))
    for index in range(3):
        text, images = make_record(rng, index, layout)
        got = processor(ImageTextRecord(text, tuple(images), MARKER))
        ids, mm, grid, pixels, positions = expected_with_transformers(processor, plain_tokenizer, model, text, images)
        np.testing.assert_array_equal(got.input_ids, ids)
        np.testing.assert_array_equal(got.mm_token_type_ids, mm)
        np.testing.assert_array_equal(got.image_grid_thw, grid)
        np.testing.assert_array_equal(got.pixel_values, pixels)
        np.testing.assert_array_equal(got.position_ids, positions)
        assert got.attention_eligibility is None
        vision = np.isin(ids, [processor.vision_start_token_id, processor.vision_end_token_id, processor.image_token_id])
        np.testing.assert_array_equal(got.loss_mask, ~vision)  # text and EOS are targets, vision tokens are not
        assert got.input_ids.dtype == np.int64 and got.pixel_values.dtype == np.float32


@pytest.mark.parametrize("k", [3, 5, 8])
def test_image_token_alignment_pads_each_span_with_ineligible_fillers(processor, model, k):
    aligned = Qwen2VLRecordProcessor(PROCESSOR_DIR, image_token_alignment=k)
    assert aligned.attention_eligibility is True
    rng = random.Random(k)
    saw_fillers = False
    for index, layout in enumerate(LAYOUTS * 2):
        record = ImageTextRecord(*((lambda t, i: (t, tuple(i)))(*make_record(rng, index, layout))), MARKER)
        got, plain = aligned(record), processor(record)
        eligible = got.attention_eligibility
        fillers = ~eligible
        saw_fillers |= bool(fillers.any())
        # Removing the fillers gives the unaligned record exactly, positions included.
        np.testing.assert_array_equal(got.input_ids[eligible], plain.input_ids)
        np.testing.assert_array_equal(got.position_ids[:, eligible], plain.position_ids)
        np.testing.assert_array_equal(got.loss_mask[eligible], plain.loss_mask)
        np.testing.assert_array_equal(got.pixel_values, plain.pixel_values)
        # Fillers: pad id, never targets, text type, positions of the token before.
        assert (got.input_ids[fillers] == aligned.pad_token_id).all()
        assert not got.loss_mask[fillers].any() and not got.mm_token_type_ids[fillers].any()
        np.testing.assert_array_equal(got.position_ids[:, fillers], got.position_ids[:, np.flatnonzero(fillers) - 1])
        # Every span <|vision_start|> ... <|vision_end|> + fillers is a multiple of k.
        starts = np.flatnonzero(got.input_ids == aligned.vision_start_token_id)
        ends = np.flatnonzero(got.input_ids == aligned.vision_end_token_id)
        for start, end in zip(starts, ends):
            span_end = end + 1
            while span_end < len(fillers) and fillers[span_end]:
                span_end += 1
            assert (span_end - start) % k == 0
        # transformers' get_rope_index with the fillers masked agrees at every eligible token.
        np.testing.assert_array_equal(
            got.position_ids[:, eligible],
            hf_rope(model, got.mm_token_type_ids, got.image_grid_thw, eligible)[:, eligible])
    assert saw_fillers


def test_positions_from_the_models_get_rope_index(processor, model):
    bound = processor.bind_get_rope_index(model.model.get_rope_index)
    aligned = Qwen2VLRecordProcessor(PROCESSOR_DIR, image_token_alignment=5)
    bound_aligned = aligned.bind_get_rope_index(model.model.get_rope_index)
    assert bound.uses_get_rope_index and not processor.uses_get_rope_index
    rng = random.Random(1)
    calls = []
    original = model.model.get_rope_index

    def spy(input_ids, mm_token_type_ids, image_grid_thw=None, video_grid_thw=None, attention_mask=None):
        calls.append(tuple(input_ids.shape))
        return original(input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask)

    spied = processor.bind_get_rope_index(spy)
    for index, layout in enumerate(LAYOUTS):
        text, images = make_record(rng, index, layout)
        record = ImageTextRecord(text, tuple(images), MARKER)
        np.testing.assert_array_equal(bound(record).position_ids, processor(record).position_ids)
        np.testing.assert_array_equal(bound_aligned(record).position_ids, aligned(record).position_ids)
        spied(record)
    assert len(calls) == len(LAYOUTS) and all(shape[0] == 1 for shape in calls)  # once per record, alone


def test_bound_get_rope_index_is_shared_by_worker_copies_and_never_pickled(processor, model):
    bound = processor.bind_get_rope_index(model.model.get_rope_index)
    copied = copy.deepcopy(bound)  # what Zephon does per worker thread
    assert copied._rope is bound._rope and copied._rope.function.__self__ is model.model
    with pytest.raises(TypeError, match="cannot be sent to worker processes"):
        pickle.dumps(bound)
    pickle.loads(pickle.dumps(processor))  # the unbound processor travels to worker processes


def test_special_token_strings_in_text_stay_text(processor):
    text = f"look {IMAGE_PAD} and {VISION_START} here {MARKER} done"
    got = processor(ImageTextRecord(text, (draw_image(random.Random(0)),), MARKER))
    assert int((got.input_ids == processor.vision_start_token_id).sum()) == 1
    assert int(got.mm_token_type_ids.sum()) == int(got.image_grid_thw.prod() // 4)


def test_marker_and_image_counts_must_match(processor):
    with pytest.raises(ValueError, match="1 '<image>' markers but the record has 2 images"):
        processor(ImageTextRecord(f"a {MARKER}", (draw_image(random.Random(0)),) * 2, MARKER))


def test_check_processed_names_the_field(processor):
    good = processor(ImageTextRecord(f"a {MARKER} b", (draw_image(random.Random(0)),), MARKER))
    assert isinstance(check_processed(good, owner="P", eligibility=False), ProcessedRecord)
    bad = {
        "loss_mask": (np.ones(3, bool), ValueError, r"P: ProcessedRecord.loss_mask got shape \(3,\), expected one value"),
        "pixel_values": (good.pixel_values[1:], ValueError, r"ProcessedRecord.pixel_values got float32 shape"),
        "image_grid_thw": (good.image_grid_thw.astype(float), ValueError, "ProcessedRecord.image_grid_thw"),
        "mm_token_type_ids": (good.mm_token_type_ids * 2, ValueError, "0 \\(text\\) or 1 \\(image\\)"),
        "position_ids": (good.position_ids[:2], ValueError, r"ProcessedRecord.position_ids got int64 shape \(2,"),
        "input_ids": ([1, 2], TypeError, "ProcessedRecord.input_ids got list, expected a numpy array"),
    }
    for name, (value, error, message) in bad.items():
        with pytest.raises(error, match=message):
            check_processed(ProcessedRecord(**{**good.__dict__, name: value}), owner="P", eligibility=False)
    # The dtype and value checks each refuse what they must (bools are not integers, nor ints floats).
    bad_values = [
        ("input_ids", good.input_ids.astype(bool), r"input_ids got bool shape .*, expected a non-empty 1-D integer"),
        ("input_ids", good.input_ids[:0], r"input_ids got int64 shape \(0,\)"),
        ("image_grid_thw", good.image_grid_thw * 0, r"image_grid_thw got int64 shape \(1, 3\), expected a positive"),
        ("pixel_values", good.pixel_values.astype(np.int32), r"pixel_values got int32 shape .*, expected a float array"),
        ("position_ids", good.position_ids.astype(np.float32), r"position_ids got float32 shape \(3,"),
        ("position_ids", good.position_ids - 1, r"position_ids got minimum -1, expected nonnegative"),
        ("mm_token_type_ids", good.mm_token_type_ids - 1, r"got values \[-1, 0\], expected 0 \(text\) or 1"),
        ("attention_eligibility", np.ones(len(good.input_ids), bool),
         "attention_eligibility got an array, expected None: the processor declares attention_eligibility=False"),
    ]
    for name, value, message in bad_values:
        with pytest.raises(ValueError, match=message):
            check_processed(ProcessedRecord(**{**good.__dict__, name: value}), owner="P", eligibility=False)
    with pytest.raises(ValueError, match="attention_eligibility got no eligible token"):
        no_token = np.zeros(len(good.input_ids), bool)
        check_processed(ProcessedRecord(**{**good.__dict__, "attention_eligibility": no_token}), owner="P",
                        eligibility=True)
    unsigned = ProcessedRecord(**{**good.__dict__, "input_ids": good.input_ids.astype(np.uint32)})
    assert check_processed(unsigned, owner="P", eligibility=False).input_ids.dtype == np.int64
    with pytest.raises(ValueError, match="attention_eligibility got None"):
        check_processed(good, owner="P", eligibility=True)
    with pytest.raises(TypeError, match="expected a zephon_loader.processors.ProcessedRecord"):
        check_processed({"input_ids": good.input_ids}, owner="P", eligibility=False)


def test_processor_folder_must_be_local_and_complete(tmp_path):
    with pytest.raises(ValueError, match="hub id cannot resolve offline"):
        Qwen2VLRecordProcessor("Qwen/Qwen2-VL-2B-Instruct")
    tokenizer_only = tmp_path / "tokenizer_only"
    shutil.copytree(PROCESSOR_DIR, tokenizer_only)
    (tokenizer_only / "preprocessor_config.json").unlink()
    with pytest.raises(ValueError, match="a folder with preprocessor_config.json"):
        Qwen2VLRecordProcessor(tokenizer_only)
    no_vision = tmp_path / "no_vision"
    shutil.copytree(PROCESSOR_DIR, no_vision)
    from conftest import train_tokenizer

    train_tokenizer(["plain text only"] * 4, no_vision, vocab_size=300)
    with pytest.raises(ValueError, match="a tokenizer with the token '<\\|vision_start\\|>'"):
        Qwen2VLRecordProcessor(no_vision)
    with pytest.raises(ValueError, match="processor.image_token_alignment: got 0"):
        Qwen2VLRecordProcessor(PROCESSOR_DIR, image_token_alignment=0)


def test_resize_bounds_override_the_folder(processor):
    small = Qwen2VLRecordProcessor(PROCESSOR_DIR, max_pixels=56 * 56)
    image = draw_image(random.Random(0), low=150, high=160)
    record = ImageTextRecord(MARKER, (image,), MARKER)
    assert processor(record).image_grid_thw.prod() > small(record).image_grid_thw.prod() == 16
