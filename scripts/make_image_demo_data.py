"""Regenerate the bundled image-text demo set and its processor folder (no network).

    python scripts/make_image_demo_data.py [--out zephon_loader/data]

Writes, under ``--out``:

* ``images/shapes/``: JSONL shards whose records name PNG files in
  ``images/shapes/png/`` (paths relative to the shard's folder);
* ``images/scenes/``: Parquet shards whose records hold the PNG bytes;
* ``image_processor/``: a byte-level BPE tokenizer trained on the captions,
  with Qwen2-VL's vision special tokens (``<|vision_start|>``,
  ``<|vision_end|>``, ``<|image_pad|>``; pad = eos = ``<|endoftext|>``), and a
  Qwen2-VL image processor config saved by ``transformers``.

Every image is drawn procedurally with Pillow (1 to 3 coloured shapes on a
background) and its caption says what is in it ("A red circle on the left and
a blue square on the right, on a white background."). Records put their
images anywhere: at the start, at the end, two of them, or none. Output is
deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import shutil
from pathlib import Path

COLORS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30),
    "purple": (140, 60, 170), "orange": (240, 140, 30), "black": (20, 20, 20),
}
BACKGROUNDS = {"white": (250, 250, 250), "grey": (170, 170, 170), "light blue": (190, 215, 240)}
SHAPES = ("circle", "square", "triangle")
PLACES = ("on the left", "in the middle", "on the right")
#: Resize bounds of the bundled image processor: 56x56 to about 168x168 pixels (4 to 36 image tokens).
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 36
SPECIAL_TOKENS = ["<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def draw(rng: random.Random) -> tuple[object, str]:
    """One image and the caption that describes it."""
    from PIL import Image, ImageDraw

    width, height = rng.randint(48, 176), rng.randint(48, 176)
    background = rng.choice(sorted(BACKGROUNDS))
    image = Image.new("RGB", (width, height), BACKGROUNDS[background])
    pen = ImageDraw.Draw(image)
    count = rng.randint(1, 3)
    slots = sorted(rng.sample(range(3), count))
    parts = []
    for slot in slots:
        shape, color = rng.choice(SHAPES), rng.choice(sorted(COLORS))
        cell = width / 3
        size = min(cell, height) * rng.uniform(0.5, 0.9)
        cx, cy = cell * (slot + 0.5), height * rng.uniform(0.35, 0.65)
        box = (cx - size / 2, cy - size / 2, cx + size / 2, cy + size / 2)
        if shape == "circle":
            pen.ellipse(box, fill=COLORS[color])
        elif shape == "square":
            pen.rectangle(box, fill=COLORS[color])
        else:
            pen.polygon([(cx, box[1]), (box[2], box[3]), (box[0], box[3])], fill=COLORS[color])
        article = "an" if color[0] in "aeiou" else "a"
        parts.append(f"{article} {color} {shape} {PLACES[slot]}" if count > 1 else f"{article} {color} {shape}")
    described = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return image, f"{described[0].upper()}{described[1:]}, on a {background} background."


def record(rng: random.Random, index: int) -> tuple[str, list[object]]:
    """Text with ``<image>`` markers and the images, in one of five layouts."""
    layout = rng.choices(["start", "end", "two", "none", "middle"], weights=[4, 3, 2, 1, 2])[0]
    if layout == "none":
        color, shape = rng.choice(sorted(COLORS)), rng.choice(SHAPES)
        return f"Note {index}: a {shape} can be {color}; there is no picture today.", []
    first, caption = draw(rng)
    if layout == "start":
        return f"<image> {caption}", [first]
    if layout == "end":
        return f"Picture {index} shows this. {caption} <image>", [first]
    if layout == "middle":
        return f"Look at picture {index}: <image> {caption} That is all.", [first]
    second, other = draw(rng)
    return f"Two pictures. <image> First: {caption} <image> Second: {other}", [first, second]


def png_bytes(image: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)  # type: ignore[attr-defined]
    return buffer.getvalue()


def write_jsonl_source(folder: Path, rng: random.Random, count: int, shards: int) -> list[str]:
    """JSONL shards with image paths relative to the shard's folder; returns the texts."""
    (folder / "png").mkdir(parents=True, exist_ok=True)
    rows, texts = [], []
    for index in range(count):
        text, images = record(rng, index)
        names = []
        for position, image in enumerate(images):
            name = f"png/{index:05d}_{position}.png"
            (folder / name).write_bytes(png_bytes(image))
            names.append(name)
        rows.append({"id": index, "text": text, "images": names})
        texts.append(text)
    for shard in range(shards):
        with (folder / f"part-{shard:05d}.jsonl").open("w") as handle:
            for row in rows[shard::shards]:
                handle.write(json.dumps(row) + "\n")
    return texts


def write_parquet_source(folder: Path, rng: random.Random, count: int, shards: int) -> list[str]:
    """Parquet shards with a ``list<binary>`` column of PNG bytes; returns the texts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for index in range(count):
        text, images = record(rng, index)
        rows.append({"id": index, "text": text, "images": [png_bytes(image) for image in images]})
    schema = pa.schema([("id", pa.int64()), ("text", pa.string()), ("images", pa.list_(pa.binary()))])
    for shard in range(shards):
        part = rows[shard::shards]
        table = pa.table({key: [row[key] for row in part] for key in ("id", "text", "images")}, schema=schema)
        pq.write_table(table, folder / f"part-{shard:05d}.parquet")
    return [row["text"] for row in rows]


def write_processor(folder: Path, texts: list[str], vocab_size: int) -> None:
    """Tokenizer (vision special tokens) + Qwen2-VL image processor config, both saved by transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([text.replace("<image>", " ") for text in texts], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|endoftext|>")
    fast.save_pretrained(str(folder))
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(str(folder))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "zephon_loader" / "data")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--shapes", type=int, default=240, help="JSONL records (image paths)")
    parser.add_argument("--scenes", type=int, default=120, help="Parquet records (image bytes)")
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    images = args.out / "images"
    if images.exists():
        shutil.rmtree(images)
    texts = write_jsonl_source(images / "shapes", rng, args.shapes, shards=2)
    texts += write_parquet_source(images / "scenes", rng, args.scenes, shards=1)
    processor = args.out / "image_processor"
    if processor.exists():
        shutil.rmtree(processor)
    write_processor(processor, texts, args.vocab_size)
    print(f"wrote {args.shapes} JSONL and {args.scenes} Parquet image-text records and a processor folder under "
          f"{args.out}")


if __name__ == "__main__":
    main()
