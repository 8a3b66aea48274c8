"""Image-text records: the accepted format, Pillow decoding, bad records named by source/shard/line or row.

Every case goes through a real loader (Zephon's workers run the check), so the
location in each message is the one Zephon's sample ids give.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from conftest import collect
from image_data import (
    MARKER, PROCESSOR_DIR, draw_image, image_config, png, write_jsonl_images, write_parquet_images,
)
from zephon_loader import build_image_loader
from zephon_loader.errors import BadRecordError
from zephon_loader.processors import ProcessedRecord, Qwen2VLRecordProcessor


def good_records(count: int, seed: int = 0) -> list[tuple[str, list]]:
    rng = random.Random(seed)
    return [(f"rec{i} a {MARKER} b", [draw_image(rng)]) for i in range(count)]


def run(folder: Path, **overrides) -> tuple[list, dict]:
    with build_image_loader(image_config({"src": folder}, **overrides)) as loader:
        batches = collect(loader)
        return batches, loader.stats()


def jsonl_with_line(tmp_path: Path, line: int, bad: dict) -> Path:
    """Eight good records in one shard, the one on ``line`` (1-based) replaced by ``bad``."""
    folder = write_jsonl_images(tmp_path / "src", good_records(8), shards=1)
    shard = folder / "part-00000.jsonl"
    lines = shard.read_text().splitlines()
    lines[line - 1] = json.dumps(bad)
    shard.write_text("\n".join(lines) + "\n")
    return shard


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"text": f"a {MARKER}", "images": ["img/nowhere.png"]},
         r"line 3: field 'images\[0\]' got '.*img/nowhere.png', expected an existing image file"),
        ({"text": f"a {MARKER} b {MARKER}", "images": ["img/0_0.png"]},
         r"line 3: field 'images' got 1 images for 2 '<image>' markers in 'text', expected one image per marker"),
        ({"text": "no marker", "images": ["img/0_0.png"]},
         r"line 3: field 'images' got 1 images for 0 '<image>' markers"),
        ({"text": 42, "images": []}, r"line 3: field 'text' got 42 \(int\), expected a string"),
        ({"text": f"a {MARKER}", "images": "img/0_0.png"},
         r"line 3: field 'images' got \"img/0_0.png\" \(str\), expected a list"),
        ({"text": f"a {MARKER}", "images": [7]},
         r"line 3: field 'images\[0\]' got 7 \(int\), expected an image file path \(JSONL shards\)"),
        ({"caption": "x"}, r"line 3: field 'text' got a record with keys \['caption'\]"),
        ({"text": "   ", "images": []}, r"line 3: field 'text' got .* expected text or at least one image"),
    ],
)
def test_bad_jsonl_record_names_source_shard_and_line(tmp_path, bad, message):
    shard = jsonl_with_line(tmp_path, 3, bad)
    with pytest.raises(BadRecordError, match=rf"source 'src', shard {shard}, {message}"):
        run(shard.parent, shuffle=False)


def test_corrupt_image_file_names_the_path(tmp_path):
    shard = jsonl_with_line(tmp_path, 5, {"text": f"x {MARKER}", "images": ["img/broken.png"]})
    (shard.parent / "img" / "broken.png").write_bytes(png(draw_image(random.Random(1)))[:60])  # truncated PNG
    with pytest.raises(BadRecordError, match=r"line 5: field 'images\[0\]' got '.*broken.png' that Pillow cannot "
                                             r"decode .* expected an image Pillow can decode"):
        run(shard.parent, shuffle=False)


def test_corrupt_parquet_bytes_name_the_row(tmp_path):
    records = good_records(6)
    blobs = [[png(image) for image in images] for _, images in records]
    blobs[4] = [b"\x89PNG not really an image"]
    folder = write_parquet_images(tmp_path / "pq", records, raw_images=blobs)
    with pytest.raises(BadRecordError, match=rf"source 'src', shard {folder / 'part-00000.parquet'}, row 4 \(0-based\): "
                                             r"field 'images\[0\]' got b'\\x89PNG not rea'... \(24 bytes\) that Pillow"):
        run(folder, shuffle=False)


def test_parquet_images_must_be_bytes(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(pa.table({"text": [f"a {MARKER}"] * 3, "images": [["img/a.png"]] * 3}), folder / "part-0.parquet")
    with pytest.raises(BadRecordError, match=r"row 0 \(0-based\): field 'images\[0\]' got \"img/a.png\" \(str\), "
                                             r"expected the encoded image bytes \(Parquet shards\)"):
        run(folder, shuffle=False)


def test_skip_leaves_bad_records_out_and_counts_them_by_reason(tmp_path):
    records = good_records(10)
    folder = write_jsonl_images(tmp_path / "src", records, shards=1)
    shard = folder / "part-00000.jsonl"
    lines = shard.read_text().splitlines()
    lines[1] = json.dumps({"text": f"a {MARKER}", "images": ["img/missing.png"]})
    lines[6] = json.dumps({"text": "two markers " + MARKER * 2, "images": ["img/0_0.png"]})
    shard.write_text("\n".join(lines) + "\n")
    batches, stats = run(folder, on_bad_record="skip", shuffle=False)
    assert stats["sources"]["src"]["delivered"]["documents"] == 8
    dropped = stats["dropped"]
    assert {reason: entry["documents"] for reason, entry in dropped.items()} == {"image_missing": 1, "marker_mismatch": 1}
    assert dropped["image_missing"]["first"] == f"source 'src', shard {shard}, line 2"
    assert dropped["marker_mismatch"]["first"] == f"source 'src', shard {shard}, line 7"
    assert "image marker" in stats["reasons"]["marker_mismatch"] and "Pillow" in stats["reasons"]["image_unreadable"]
    delivered = sum(int(b["n_images_per_sample"].sum()) for b in batches)
    assert delivered == 8


def test_oversized_records_drop_counted_or_error(tmp_path, caplog):
    rng = random.Random(2)
    records = good_records(6) + [(f"big {MARKER}", [draw_image(rng, low=200, high=220)])]  # 25 image tokens: 37 in all
    folder = write_jsonl_images(tmp_path / "src", records, shards=1)
    with caplog.at_level("WARNING", logger="zephon_loader.pipeline.records"):
        batches, stats = run(folder, sequence_length=32, shuffle=False)
    entry = stats["dropped"]["longer_than_row"]
    assert entry["documents"] == 1 and entry["tokens"] > 32
    assert entry["first"] == f"source 'src', shard {folder / 'part-00000.jsonl'}, line 7"
    assert "dropping image-text records (longer_than_row)" in caplog.text
    assert stats["sources"]["src"]["delivered"]["documents"] == 6
    with pytest.raises(BadRecordError, match=r"line 7: field '<record>' got \d+ tokens \(1 images\), expected at most "
                                             r"sequence_length=32 \(one row; images are never split\)"):
        run(folder, sequence_length=32, shuffle=False, packing={"oversized": "error"})


def test_max_record_tokens_is_a_bad_record(tmp_path):
    folder = write_jsonl_images(tmp_path / "src", good_records(4), shards=1)
    with pytest.raises(BadRecordError, match=r"line 1: field '<record>' got \d+ tokens, expected at most "
                                             r"max_record_tokens=5"):
        run(folder, max_record_tokens=5, shuffle=False)


class Refusing(Qwen2VLRecordProcessor):
    """Refuses records whose text mentions 'refuse' (a ValueError: a bad record)."""

    def __call__(self, record):
        if "refuse" in record.text:
            raise ValueError("this processor refuses it")
        return super().__call__(record)


class Broken(Qwen2VLRecordProcessor):
    """Returns a loss mask of the wrong length: a processor bug."""

    def __call__(self, record):
        out = super().__call__(record)
        return ProcessedRecord(**{**out.__dict__, "loss_mask": np.ones(1, bool)})


@pytest.mark.filterwarnings("ignore:ValidationReport")  # Zephon's validator also meets the broken processor
def test_processor_errors_name_the_record(tmp_path):
    shard = jsonl_with_line(tmp_path, 4, {"text": "please refuse", "images": []})
    config = image_config({"src": shard.parent}, shuffle=False)
    config.pop("processor")
    with pytest.raises(BadRecordError, match=r"line 4: field '<record>' got ValueError: this processor refuses it, "
                                             r"expected a record Refusing accepts"):
        with build_image_loader(config, processor=Refusing(PROCESSOR_DIR)) as loader:
            collect(loader)
    with pytest.raises(ValueError, match=r"line 1: Broken: ProcessedRecord.loss_mask got shape \(1,\)"):
        with build_image_loader(config, processor=Broken(PROCESSOR_DIR)) as loader:
            collect(loader)
