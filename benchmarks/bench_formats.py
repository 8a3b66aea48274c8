"""What reading a source costs in each shard format, relative to a JSONL copy of the same documents.

The same documents are written as JSONL shards and as each installed format of
``zephon_loader.pipeline.formats`` (LitData ``litdata.optimize``, Lance, Vortex; Parquet too), in shards of
the same sizes; then, side by side in one run, for each:

* **open**: ``open_sources`` cold (list, hash every data file, Zephon's discovery) — every build's first cost;
* **read**: one pass of Zephon's records over the opened dataset (no tokenizing), the format's own reading cost;
* **loader**: one pass of the text loader (tokenize, pack, batch, collate) over the source.

Each time is the best of ``--repeats`` runs (the loader pass: one fewer, after a warm-up); the ratio is to
the JSONL copy's.

    python benchmarks/bench_formats.py [--docs 20000] [--shards 5] [--repeats 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda packed rows tokens shards loader "
         "resume").split()


def documents(count: int) -> list[str]:
    rng = random.Random(0)
    return [f"doc{i} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200))) for i in range(count)]


def parts(texts: list[str], shards: int) -> list[list[str]]:
    size = -(-len(texts) // shards)
    return [texts[i:i + size] for i in range(0, len(texts), size)]


def _item(text: str) -> dict[str, str]:
    return {"text": text}


def write(fmt: str, folder: Path, texts: list[str], shards: int) -> None:
    """``texts`` as ``fmt`` in ``folder``, ``shards`` shards of equal size."""
    import pyarrow as pa

    chunks = parts(texts, shards)
    if fmt == "jsonl":
        folder.mkdir(parents=True)
        for i, chunk in enumerate(chunks):
            (folder / f"part-{i:05d}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in chunk))
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        folder.mkdir(parents=True)
        for i, chunk in enumerate(chunks):
            pq.write_table(pa.table({"text": chunk}), folder / f"part-{i:05d}.parquet")
    elif fmt == "vortex":
        import vortex

        folder.mkdir(parents=True)
        for i, chunk in enumerate(chunks):
            vortex.io.write(pa.table({"text": chunk}), str(folder / f"part-{i:05d}.vortex"))
    elif fmt == "lance":
        import lance

        for i, chunk in enumerate(chunks):
            lance.write_dataset(pa.table({"text": chunk}), str(folder), mode="append" if i else "create")
    elif fmt == "litdata":
        import litdata

        litdata.optimize(fn=_item, inputs=texts, output_dir=str(folder), chunk_size=len(chunks[0]), num_workers=1)
    else:
        raise ValueError(fmt)


NEEDS = {"jsonl": (), "parquet": ("pyarrow",), "vortex": ("vortex",), "lance": ("lance",), "litdata": ("litdata",)}


def best(repeats: int, run) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=20000)
    parser.add_argument("--shards", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import train_tokenizer

    import zephon
    from zephon_loader import build_text_loader
    from zephon_loader.config import text_loader_config
    from zephon_loader.pipeline.work_source import open_sources

    texts = documents(args.docs)
    formats = [f for f, needs in NEEDS.items() if all(importlib.util.find_spec(m) for m in needs)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tokenizer = train_tokenizer(texts[:2000], root / "tokenizer")
        results = {}
        for fmt in formats:
            folder = root / fmt
            write(fmt, folder, texts, args.shards)
            config = {"sources": [{"name": "web", "path": str(folder)}], "tokenizer": {"path": str(tokenizer)},
                      "sequence_length": 512, "micro_batch_size": 8, "shuffle": False, "read_ahead": 0}
            cfg = text_loader_config(**config)
            counter = iter(range(1 << 30))

            def cold_open() -> None:
                os.environ["ZEPHON_LOADER_CACHE"] = str(root / f"cache-{fmt}-{next(counter)}")  # hash anew
                open_sources(cfg)

            opened = open_sources(cfg)
            assert opened.counts == (len(texts),), (fmt, opened.counts)

            def read() -> None:
                source = zephon.StaticMixtureWorkSource(
                    list(opened.datasets), zephon.MixtureSpec({"web": 1.0}), chunk_size=len(texts) // args.shards,
                    shuffle_shards=False, shuffle_within_shard=False, stop_after_passes=1)
                count = sum(1 for _ in zephon.Pipeline(source))
                assert count == len(texts), (fmt, count)

            def loader() -> None:
                with build_text_loader(config) as built:
                    for _ in built:
                        pass

            if not results:
                loader()  # warm-up (imports, tokenizer load, thread pools) before the first measured pass
            results[fmt] = (best(args.repeats, cold_open), best(args.repeats, read),
                            best(max(1, args.repeats - 1), loader))
            print(f"  measured {fmt}", file=sys.stderr)
        base = results["jsonl"]
        size = sum(len(t) for t in texts) / 2**20
        print(f"{args.docs} documents ({size:.1f} MiB of text) in {args.shards} shards; best of {args.repeats} "
              f"(loader pass: best of {max(1, args.repeats - 1)}); ratio = time / the JSONL copy's time")
        print(f"{'format':<10}{'open (s)':>10}{'ratio':>7}{'read (s)':>10}{'ratio':>7}{'loader (s)':>12}{'ratio':>7}")
        for fmt, (opened_s, read_s, loader_s) in results.items():
            print(f"{fmt:<10}{opened_s:>10.3f}{opened_s / base[0]:>7.2f}{read_s:>10.3f}{read_s / base[1]:>7.2f}"
                  f"{loader_s:>12.3f}{loader_s / base[2]:>7.2f}")


if __name__ == "__main__":
    main()
