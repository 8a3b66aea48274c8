"""Image-text loader throughput vs running the processor alone over the same records.

    python benchmarks/bench_image_loader.py [CONFIG] [--scale 8] [--rounds 3]

Same records for both sides, one pass over every source, one process,
alternating rounds so machine noise hits both sides alike; the median round
of each side is reported. Without CONFIG: the bundled ``image_demo.yaml``
with its data regenerated ``--scale`` times larger in a temporary folder (the
same generator, ``scripts/make_image_demo_data.py``), so that start-up (worker
threads, Zephon's first chunk) does not dominate a sub-second pass.

* "processor alone": read every record of the sources (JSONL lines with image
  paths, Parquet rows with image bytes), decode its images with Pillow and
  call the processor, in a thread pool of the same size as the loader's
  ``runtime.processor_parallelism``: the least any pipeline must do (reading
  the shards is timed too, as the loader's side reads them).
* "loader": ``build_image_loader`` iterated to exhaustion (built before timing
  starts; worker start-up included): record checks, the processor, Zephon's
  packing, collate, the final map and read-ahead.

Prints images/s and tokens/s of each side and the ratio loader / processor
(goal: >= 0.9), and the median of the rounds' paired ratios (the sides of a
round run next to each other, in alternating order). Both sides run under the
loader's tokenizer-thread default for the machine (``fit_tokenizer_threads``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from zephon_loader import fields as F
from zephon_loader.build import build_image_loader
from zephon_loader.stages import resolve_processor
from zephon_loader.config import read_loader_config
from zephon_loader.config.image import DEFAULT_PROCESSOR_PARALLELISM, ImageLoaderConfig, default_image_config_path
from zephon_loader.pipeline.image_records import decode_image
from zephon_loader.processors import ImageTextRecord
from zephon_loader.tokenizing import fit_tokenizer_threads


def read_records(config: Any) -> list[tuple[str, list[bytes | str]]]:
    """Every record of the configured sources: ``(text, [image bytes or absolute path])``."""
    import pyarrow.parquet as pq

    fields = config.records
    out = []
    for source in config.sources:
        folder = config.resolve_path(source.path)
        for shard in sorted(p for p in folder.iterdir() if p.is_file()):
            if shard.suffix == ".jsonl":
                for line in shard.read_text().splitlines():
                    if line.strip():
                        row = json.loads(line)
                        out.append((row[fields.text_field],
                                    [os.path.join(folder, p) for p in row.get(fields.images_field) or []]))
            elif shard.suffix == ".parquet":
                table = pq.read_table(shard, columns=[fields.text_field, fields.images_field]).to_pylist()
                out += [(row[fields.text_field], list(row[fields.images_field] or [])) for row in table]
    return out


def processor_alone(config: Any, workers: int) -> tuple[float, int, int]:
    """``(seconds, images, tokens)`` of reading, decoding and processing every record."""
    processor = resolve_processor(config, None, None)
    marker = config.records.image_marker

    def one(record: tuple[str, list]) -> tuple[int, int]:
        text, entries = record
        images = tuple(decode_image(entry, "image")[0] for entry in entries)
        out = processor(ImageTextRecord(text, images, marker))
        return len(out.image_grid_thw), len(out.input_ids)

    start = time.perf_counter()
    records = read_records(config)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        counts = list(pool.map(one, records))
    seconds = time.perf_counter() - start
    return seconds, sum(c[0] for c in counts), sum(c[1] for c in counts)


def loader_pass(config: Any) -> tuple[float, int, int]:
    """``(seconds, images, tokens)`` of one loader pass (non-padding tokens)."""
    with build_image_loader(config) as loader:
        start = time.perf_counter()
        images = tokens = 0
        for batch in loader:
            images += int(batch[F.N_IMAGES_PER_SAMPLE].sum())
            tokens += int((~batch[F.PADDING_MASK]).sum())
        return time.perf_counter() - start, images, tokens


def scaled_demo(scale: int, folder: Path) -> Any:
    """The bundled demo config over ``scale`` times as many records, written to ``folder``."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "make_image_demo_data.py"
    spec = importlib.util.spec_from_file_location("make_image_demo_data", script)
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    rng = random.Random(20261201)
    demo.write_jsonl_source(folder / "shapes", rng, 240 * scale, shards=2)
    demo.write_parquet_source(folder / "scenes", rng, 120 * scale, shards=2)
    config = read_loader_config(default_image_config_path(), ImageLoaderConfig)
    sources = tuple(dataclasses.replace(source, path=str(folder / Path(source.path).name)) for source in config.sources)
    return dataclasses.replace(config, sources=sources)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", type=Path, default=None)
    parser.add_argument("--scale", type=int, default=8, help="without CONFIG: demo records x this")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runner", choices=("config", "threads", "inline", "process"), default="config",
                        help="the loader's runtime.runner (default: the config's)")
    parser.add_argument("--read-ahead", type=int, default=None, help="the loader's read_ahead (default: the config's)")
    args = parser.parse_args()
    scratch = tempfile.TemporaryDirectory(prefix="bench_image_loader_")
    if args.config is None:
        config = scaled_demo(args.scale, Path(scratch.name))
        args.config = Path(f"{default_image_config_path()} x{args.scale}")
    else:
        config = read_loader_config(args.config, ImageLoaderConfig)
    if args.runner != "config":
        config = dataclasses.replace(config, runtime=dataclasses.replace(config.runtime, runner=args.runner))
    if args.read_ahead is not None:
        config = dataclasses.replace(config, read_ahead=args.read_ahead)
    records = len(read_records(config))
    workers = config.runtime.processor_parallelism or DEFAULT_PROCESSOR_PARALLELISM
    fit_tokenizer_threads()  # the loader's default for the machine, for both sides from the first round
    alone, loader = [], []
    for round_index in range(args.rounds):
        # Alternate which side goes first, so that warm caches and machine noise favour neither.
        if round_index % 2:
            loader.append(loader_pass(config))
            alone.append(processor_alone(config, workers))
        else:
            alone.append(processor_alone(config, workers))
            loader.append(loader_pass(config))
    a = sorted(alone)[len(alone) // 2]
    b = sorted(loader)[len(loader) // 2]
    if (a[1], a[2]) != (b[1], b[2]):
        print(f"note: the loader delivered {b[1]} images / {b[2]} tokens, the records hold {a[1]} / {a[2]} "
              "(mixture repeats or drops; rates are compared per image and per token)")
    rows = [("processor alone", a), ("loader", b)]
    print(f"{args.config}: {records} records, {workers} processor threads, runner {config.runtime.runner}, "
          f"read_ahead {config.read_ahead}, {args.rounds} rounds (median)")
    for name, (seconds, images, tokens) in rows:
        print(f"  {name:16s} {images / seconds:10,.0f} images/s {tokens / seconds:12,.0f} tokens/s  ({seconds:.3f} s)")
    ratio = (b[1] / b[0]) / (a[1] / a[0])
    print(f"  ratio loader / processor alone: {ratio:.2f} images/s, {(b[2] / b[0]) / (a[2] / a[0]):.2f} tokens/s "
          f"(goal >= 0.9)")
    # Each round's two sides ran next to each other: the median of their ratios is what noise disturbs least.
    paired = [(lb[1] / lb[0]) / (al[1] / al[0]) for al, lb in zip(alone, loader)]
    print(f"  paired rounds, loader / processor alone images/s: median {statistics.median(paired):.2f} "
          f"(rounds {min(paired):.2f}-{max(paired):.2f})")
    spread = statistics.pstdev([r[0] for r in loader]) / statistics.mean([r[0] for r in loader])
    print(f"  loader round-to-round spread: {spread:.1%}")
    scratch.cleanup()


if __name__ == "__main__":
    main()
