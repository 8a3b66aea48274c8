"""Regenerate the bundled demo corpus and tokenizer (no network).

    python scripts/make_demo_data.py [--out zephon_loader/data]

Writes two sources of JSONL shards (``corpus/stories``, ``corpus/notes``),
generated from a seeded grammar over word lists written here, and a small
byte-level BPE tokenizer trained on them with ``tokenizers`` and saved with
``transformers.PreTrainedTokenizerFast.save_pretrained``. Output is
deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

SUBJECTS = [
    "the loader", "a packed row", "the tokenizer", "every worker", "the scheduler", "a small model",
    "the checkpoint", "our pipeline", "the gradient", "a training run", "the optimizer", "each document",
]
VERBS = [
    "reads", "packs", "shuffles", "restores", "counts", "streams", "masks", "joins", "splits", "delivers",
    "checks", "records",
]
OBJECTS = [
    "the next batch", "sixteen documents", "a shard of text", "every token once", "the padding tail",
    "its position ids", "the attention mask", "a stable order", "the saved state", "ten thousand rows",
]
ENDINGS = [
    "without losing a sample", "before the step begins", "on every rank", "in a fixed order",
    "after a restart", "while the model waits", "with no repeats", "across the whole epoch",
]
TOPICS = ["packing", "resumption", "attention", "tokenization", "sharding", "throughput", "masking"]


def sentence(rng: random.Random) -> str:
    words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
    if rng.random() < 0.6:
        words.append(rng.choice(ENDINGS))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "!", "?"])


def story(rng: random.Random) -> str:
    # Long-tailed lengths: most documents are short, a few span several rows.
    sentences = max(1, int(rng.lognormvariate(1.6, 0.9)))
    return " ".join(sentence(rng) for _ in range(sentences))


def note(rng: random.Random, index: int) -> str:
    topic = rng.choice(TOPICS)
    lines = [f"Note {index} on {topic}:"] + [f"- {sentence(rng)}" for _ in range(rng.randint(1, 6))]
    return "\n".join(lines)


def write_shards(folder: Path, texts: list[str], shards: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for shard in range(shards):
        with (folder / f"part-{shard:05d}.jsonl").open("w") as handle:
            for index in range(shard, len(texts), shards):
                handle.write(json.dumps({"id": index, "text": texts[index]}) + "\n")


def train_tokenizer(texts: list[str], out: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|pad|>", "<|eos|>", "<|bos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<|pad|>", eos_token="<|eos|>", bos_token="<|bos|>"
    )
    fast.save_pretrained(str(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "zephon_loader" / "data")
    parser.add_argument("--seed", type=int, default=20261129)
    parser.add_argument("--stories", type=int, default=1200)
    parser.add_argument("--notes", type=int, default=600)
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    stories = [story(rng) for _ in range(args.stories)]
    notes = [note(rng, i) for i in range(args.notes)]
    corpus = args.out / "corpus"
    if corpus.exists():
        shutil.rmtree(corpus)
    write_shards(corpus / "stories", stories, shards=2)
    write_shards(corpus / "notes", notes, shards=1)
    tokenizer_dir = args.out / "tokenizer"
    if tokenizer_dir.exists():
        shutil.rmtree(tokenizer_dir)
    train_tokenizer(stories + notes, tokenizer_dir, args.vocab_size)
    print(f"wrote {len(stories)} stories, {len(notes)} notes and a {args.vocab_size}-token tokenizer under {args.out}")


if __name__ == "__main__":
    main()
