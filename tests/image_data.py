"""Helpers of the image-text tests: drawn images, shards, a tiny Qwen2-VL, and unpacking batches per record.

Everything is local: images are drawn with Pillow, the processor folder is the
bundled ``zephon_loader/data/image_processor``, the model is a randomly
initialized Qwen2-VL built from a config written here.
"""

from __future__ import annotations

import io
import json
import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zephon_loader import fields as F
from zephon_loader.config import package_data_dir

#: The bundled processor folder (tokenizer with the vision tokens + Qwen2-VL preprocessor_config.json).
PROCESSOR_DIR = package_data_dir() / "image_processor"
MARKER = "<image>"
_WORDS = "red green blue circle square triangle left right small large picture shows a the".split()


def draw_image(rng: random.Random, *, low: int = 40, high: int = 120) -> Any:
    """A small RGB image with a coloured rectangle (sizes vary, so grids vary)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (rng.randint(low, high), rng.randint(low, high)),
                      tuple(rng.randint(0, 255) for _ in range(3)))
    ImageDraw.Draw(image).rectangle((2, 2, 20, 20), fill=tuple(rng.randint(0, 255) for _ in range(3)))
    return image


def png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def words(rng: random.Random, low: int = 1, high: int = 8) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high)))


def make_record(rng: random.Random, index: int, layout: str) -> tuple[str, list[Any]]:
    """``(text with markers, images)`` for a layout: start, end, several, only_image, no_image, middle."""
    if layout == "no_image":
        return f"rec{index} {words(rng)}", []
    if layout == "only_image":
        return MARKER, [draw_image(rng)]
    if layout == "start":
        return f"{MARKER} rec{index} {words(rng)}", [draw_image(rng)]
    if layout == "end":
        return f"rec{index} {words(rng)} {MARKER}", [draw_image(rng)]
    if layout == "several":
        count = rng.randint(2, 3)
        return f"rec{index} " + " ".join(f"{words(rng, 0, 3)} {MARKER}" for _ in range(count)), \
            [draw_image(rng) for _ in range(count)]
    return f"rec{index} {words(rng)} {MARKER} {words(rng)}", [draw_image(rng)]


LAYOUTS = ("start", "end", "several", "only_image", "no_image", "middle")


def write_jsonl_images(folder: Path, records: Sequence[tuple[str, Sequence[Any]]], *, shards: int = 2,
                       extra: Sequence[Mapping[str, Any]] | None = None) -> Path:
    """JSONL shards whose records name PNG files under ``folder/img`` (paths relative to the shard)."""
    (folder / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for index, (text, images) in enumerate(records):
        names = []
        for position, image in enumerate(images):
            name = f"img/{index}_{position}.png"
            image.save(folder / name)
            names.append(name)
        rows.append({"text": text, "images": names, **(dict(extra[index]) if extra else {})})
    size = -(-len(rows) // shards)
    for shard in range(shards):
        with (folder / f"part-{shard:05d}.jsonl").open("w") as handle:
            for row in rows[shard * size:(shard + 1) * size]:
                handle.write(json.dumps(row) + "\n")
    return folder


def write_parquet_images(folder: Path, records: Sequence[tuple[str, Sequence[Any]]], *, shards: int = 1,
                         raw_images: Sequence[Sequence[bytes]] | None = None) -> Path:
    """Parquet shards with ``text`` and a ``list<binary>`` ``images`` column of PNG bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    blobs = raw_images if raw_images is not None else [[png(image) for image in images] for _, images in records]
    schema = pa.schema([("text", pa.string()), ("images", pa.list_(pa.binary()))])
    size = -(-len(records) // shards)
    for shard in range(shards):
        part = slice(shard * size, (shard + 1) * size)
        table = pa.table({"text": [text for text, _ in records[part]], "images": list(blobs[part])}, schema=schema)
        pq.write_table(table, folder / f"part-{shard:05d}.parquet")
    return folder


def image_config(sources: Mapping[str, os.PathLike[str] | str], **overrides: Any) -> dict[str, Any]:
    """An image loader ``dataloader`` mapping over the bundled processor (threads runner)."""
    config: dict[str, Any] = {
        "sources": [{"name": name, "path": str(path), "weight": 1.0} for name, path in sources.items()],
        "sequence_length": 160,
        "micro_batch_size": 2,
        "processor": {"path": str(PROCESSOR_DIR)},
        "contract": {"packed_mask_type": "document_ids", "requires_packed_sequence_metadata": True},
        "shuffle": True,
        "seed": 3,
        "read_ahead": 0,
        "runtime": {"runner": "threads", "processor_parallelism": 2},
    }
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(config.get(key), Mapping):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


# ----------------------------------------------------------------------------- unpacking


def unpack(batch: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Split a batch back into its records by document ids, in row then position order.

    Works on a collated batch (``document_ids``) and on a yielded one without
    xdoc (attention ids of ``_packed_seq_ids`` or a ``[B, S]`` attention mask;
    an ineligible filler, id 0 inside a row, belongs to the record before it).
    Each record: ``tokens`` (int64 [n]), ``positions`` ([3, n], as in the
    batch), ``labels``, ``mm`` (types), ``eligible`` (bool [n]), ``grid``
    ([images, 3]) and ``pixels`` (its images' patch rows, taken in the
    documented order: records in row order, then position order), ``row`` and
    ``columns`` (where its tokens are in the row).
    """
    padding = batch[F.PADDING_MASK]
    if F.DOCUMENT_IDS in batch:
        ids = batch[F.DOCUMENT_IDS]
        eligible = batch.get(F.ATTENTION_ELIGIBILITY, ~padding)
    else:
        attention = batch.get(F.PACKED_SEQ_IDS, batch.get(F.ATTENTION_MASK))
        assert attention is not None and attention.ndim == 2, "unpack needs document ids, not a 4D mask"
        eligible = (attention != 0) & ~padding
        ids = attention.cummax(dim=1).values.masked_fill(padding, 0)
    grid = batch.get(F.IMAGE_GRID_THW, torch.zeros(0, 3, dtype=torch.int64))
    pixels = batch.get(F.PIXEL_VALUES)
    patch_counts = grid.prod(dim=1).tolist()
    image_cursor = patch_cursor = 0
    out = []
    for row in range(ids.shape[0]):
        for document in range(1, int(ids[row].max()) + 1):
            where = (ids[row] == document).nonzero().flatten()
            mm = batch[F.MM_TOKEN_TYPE_IDS][row, where]
            runs = int(((mm[1:] == 1) & (mm[:-1] == 0)).sum()) + int(mm[0] == 1) if len(mm) else 0
            patches = int(sum(patch_counts[image_cursor:image_cursor + runs]))
            out.append({
                "row": row,
                "columns": where,
                "tokens": batch[F.INPUT_IDS][row, where],
                "positions": batch[F.POSITION_IDS][:, row, where],
                "labels": batch[F.LABELS][row, where],
                "mm": mm,
                "eligible": eligible[row, where],
                "grid": grid[image_cursor:image_cursor + runs],
                "pixels": pixels[patch_cursor:patch_cursor + patches] if patches else None,
            })
            image_cursor += runs
            patch_cursor += patches
    assert image_cursor == len(grid) and (pixels is None or patch_cursor == len(pixels))
    return out


# ----------------------------------------------------------------------------- a tiny Qwen2-VL


def tiny_qwen2_vl(processor: Any, *, seed: int = 0, attn_implementation: str = "sdpa") -> Any:
    """A randomly initialized 2-layer Qwen2-VL whose token ids match ``processor``'s tokenizer (eval mode, fp32)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    vocab = len(processor.tokenizer)
    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=processor.pad_token_id,
            eos_token_id=processor.pad_token_id, pad_token_id=processor.pad_token_id,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
        ),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2,
                           patch_size=processor.image_processor.patch_size,
                           spatial_merge_size=processor.spatial_merge_size,
                           temporal_patch_size=processor.image_processor.temporal_patch_size, in_chans=3),
        image_token_id=processor.image_token_id, video_token_id=processor.tokenizer.convert_tokens_to_ids(
            "<|video_pad|>"), vision_start_token_id=processor.vision_start_token_id,
        vision_end_token_id=processor.vision_end_token_id,
    )
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config).eval()


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


def alone(model, processed):
    """Logits of one processed record run by itself (positions [3, 1, n], its own pixels, no mask)."""
    has_images = len(processed.image_grid_thw) > 0
    with torch.no_grad():
        return model(
            input_ids=torch.from_numpy(processed.input_ids)[None],
            position_ids=torch.from_numpy(processed.position_ids)[:, None],
            pixel_values=torch.from_numpy(processed.pixel_values) if has_images else None,
            image_grid_thw=torch.from_numpy(processed.image_grid_thw) if has_images else None,
            mm_token_type_ids=torch.from_numpy(processed.mm_token_type_ids)[None], use_cache=False,
        ).logits[0]


def record_key(tokens: Any, pixels: Any) -> tuple:
    """Identity of a record: its tokens and a digest of its pixels (image-only records share their tokens)."""
    import hashlib

    tokens = tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)
    if pixels is None or len(pixels) == 0:
        return tuple(tokens), None
    data = pixels.numpy() if isinstance(pixels, torch.Tensor) else np.asarray(pixels)
    return tuple(tokens), hashlib.sha1(np.ascontiguousarray(data).tobytes()).hexdigest()
