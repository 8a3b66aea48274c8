"""Validation loaders (``ZephonDataloaderConfig`` with ``packing=None``): every token of every document once.

AutoModel 0.7.0's recipe asks for an unpacked validation loader with
``dataclasses.replace(config, packing=None)``. Zephon's loader only packs, and
before this it packed that copy with ``first_fit``, which skips documents longer
than a row. Now such a copy is one unshuffled ``wrap`` pass, read whole on every
DP rank (see ``zephon_loader/recipe.py``). The corpora here are pretokenized
with ids unique across the corpus, so each yielded token names its place.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
import torch

from conftest import collect, write_jsonl_shards
from zephon_loader import ZephonDataloaderConfig
from zephon_loader import fields as F

S, B = 16, 3
PAD = 0
#: Documents of 1 to 4 rows' worth of tokens: about half are longer than a row of S + 1 = 17.
LENGTHS = (1, 2, 5, 9, 16, 17, 18, 23, 40, 51, 70)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, list[list[int]]]:
    """One pretokenized JSONL source of 60 documents whose token ids are unique (1, 2, 3, ...)."""
    rng = random.Random(5)
    documents, next_id = [], 1
    for _ in range(60):
        length = rng.choice(LENGTHS)
        documents.append(list(range(next_id, next_id + length)))
        next_id += length
    folder = write_jsonl_shards(tmp_path_factory.mktemp("validation"), [{"ids": d} for d in documents], shards=3)
    return str(folder), documents


def training_config(path: str, **overrides) -> ZephonDataloaderConfig:
    """A training block as a user writes it (shuffled, first_fit, DP settings), before AutoModel's replace."""
    keys = {
        "sources": [{"name": "val", "path": path, "weight": 2.0}],
        "sequence_length": S,
        "micro_batch_size": B,
        "tokenizer": {"pretokenized_field": "ids"},
        "pad_token_id": PAD,
        "seed": 3,
        "shuffle": True,
        "packing": {"algorithm": "first_fit"},
        "distributed": {"canonical_replicas": 4},
        "read_ahead": 1,
        "runtime": {"runner": "threads"},
    }
    keys.update(overrides)
    return ZephonDataloaderConfig(**keys)


def validation_loader(config: ZephonDataloaderConfig, **build):
    """What AutoModel's recipe does for a validation block: ``replace(config, packing=None)``, then build."""
    kwargs = {"dp_rank": 0, "dp_world_size": 1, "tokenizer": None, "packing_contract": None}
    kwargs.update(build)
    return dataclasses.replace(config, packing=None).build(**kwargs)


def row_tokens(batches) -> list[list[int]]:
    """Each packed row's real tokens: its non-padding ``input_ids``, then its last column's label target.

    Zephon packs ``S + 1`` tokens per row and the next-token shift keeps the
    last one only as the target of the last label; a row with padding ends
    inside its inputs.
    """
    rows = []
    for batch in batches:
        for ids, pad, labels in zip(batch[F.INPUT_IDS], batch[F.PADDING_MASK], batch[F.LABELS]):
            tokens = ids[~pad].tolist()
            if not bool(pad.any()):
                assert int(labels[-1]) != -100, "a full row's last label must show its last token"
                tokens.append(int(labels[-1]))
            if tokens:
                rows.append(tokens)
    return rows


def test_every_token_of_every_document_exactly_once(corpus):
    """Documents longer than a row are split across consecutive rows, never skipped; nothing repeats.

    Cross-document label masking is off here only so that a row's last token
    is visible even when it starts the next document (its label is masked
    otherwise); the packing is the same either way.
    """
    path, documents = corpus
    assert max(map(len, documents)) > 3 * (S + 1)
    with validation_loader(training_config(path, mask_cross_document_labels=False)) as loader:
        batches = collect(loader, 10_000)
        stats = loader.stats()
    assert 0 < len(batches) < 10_000

    tokens = [t for row in row_tokens(batches) for t in row]
    corpus_tokens = [t for document in documents for t in document]
    assert Counter(tokens) == Counter(corpus_tokens)
    # Unshuffled wrap: the rows are the corpus in order (shard order, record order), cut every S + 1 tokens.
    assert tokens == corpus_tokens

    # The stats say so: every record delivered, with all its tokens, and nothing dropped.
    assert stats["dropped"] == {}
    assert stats["sources"]["val"]["dropped"] == {}
    assert stats["sources"]["val"]["delivered"] == {"documents": len(documents), "tokens": len(corpus_tokens)}


def test_supervised_targets_with_default_masking(corpus):
    """With the default label masking, what the validation loss covers, exactly.

    Every corpus token is a target once, except each document's first token
    (nothing precedes it) and the first token of each row that continues a
    document split by ``wrap`` (rows do not overlap, so it is only an input).
    """
    path, documents = corpus
    with validation_loader(training_config(path)) as loader:
        batches = collect(loader, 10_000)
    targets = torch.cat([b[F.LABELS][b[F.LABELS] != -100] for b in batches]).tolist()
    firsts = {d[0] for d in documents}
    row_starts = [int(b[F.INPUT_IDS][r, 0]) for b in batches for r in range(B) if not bool(b[F.PADDING_MASK][r, 0])]
    continuations = [t for t in row_starts if t not in firsts]
    assert continuations  # documents longer than a row were split
    corpus_tokens = Counter(t for d in documents for t in d)
    assert Counter(targets) == corpus_tokens - Counter(firsts) - Counter(continuations)


def test_deterministic_unshuffled_and_finite(corpus):
    """Two passes give the same batches, whatever the training block's seed and shuffle."""
    path, _ = corpus
    with validation_loader(training_config(path, seed=3)) as loader:
        first, second = collect(loader, 10_000), collect(loader, 10_000)
    with validation_loader(training_config(path, seed=99, shuffle=False, read_ahead=0)) as loader:
        other_seed = collect(loader, 10_000)
    assert len(first) == len(second) == len(other_seed)
    for a, b, c in zip(first, second, other_seed):
        assert set(a) == set(b) == set(c)
        for name, value in a.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, b[name]) and torch.equal(value, c[name]), name


def test_every_dp_rank_reads_the_whole_set(corpus):
    """Equal batch counts on every rank (the model's forward is a collective); no aggregate store needed."""
    path, _ = corpus
    per_rank = []
    for rank in (0, 1):
        with validation_loader(training_config(path), dp_rank=rank, dp_world_size=2) as loader:
            per_rank.append(collect(loader, 10_000))
    assert len(per_rank[0]) == len(per_rank[1]) > 0
    for a, b in zip(*per_rank):
        assert torch.equal(a[F.INPUT_IDS], b[F.INPUT_IDS])


def test_text_documents_longer_than_a_row_are_delivered(tmp_path, tokenizer_dir):
    """Text input through the recipe tokenizer path: every record delivered, none dropped as longer than a row."""
    from conftest import make_texts

    texts = make_texts(40, seed=2, min_words=20, max_words=60)
    folder = write_jsonl_shards(tmp_path / "text", [{"text": t} for t in texts], shards=2)
    config = training_config(str(folder), tokenizer={"path": str(tokenizer_dir)}, pad_token_id=None)
    with validation_loader(config) as loader:
        collect(loader, 10_000)
        stats = loader.stats()
    assert stats["dropped"] == {}
    assert stats["sources"]["val"]["delivered"]["documents"] == len(texts)


def test_yaml_packing_null_is_a_validation_loader(corpus):
    path, _ = corpus
    config = training_config(path, packing=None)
    assert config.is_validation and not training_config(path).is_validation


def test_several_sources_are_each_read_exactly_once(corpus, tmp_path):
    """A validation mixture does not repeat its smaller source (``mixture: once``), whatever the weights.

    Before, several sources were refused: the training mixture repeats the
    smaller source until the larger one is read, which would have counted its
    documents several times in the validation loss.
    """
    path, documents = corpus
    first = max(t for document in documents for t in document) + 1
    small = [list(range(first + 10 * i, first + 10 * i + 7)) for i in range(5)]  # 5 documents, unique ids
    other = write_jsonl_shards(tmp_path / "other", [{"ids": d} for d in small], shards=1)
    two = [{"name": "val", "path": path, "weight": 1.0}, {"name": "other", "path": str(other), "weight": 3.0}]
    for config in (training_config(path, sources=two, packing=None, mask_cross_document_labels=False),
                   dataclasses.replace(training_config(path, sources=two, mask_cross_document_labels=False),
                                       packing=None)):
        with validation_loader(config) as loader:
            tokens = [t for row in row_tokens(collect(loader, 10_000)) for t in row]
            stats = loader.stats()
        assert Counter(tokens) == Counter(t for document in documents + small for t in document)
        assert stats["sources"]["other"]["delivered"]["documents"] == 5
        assert stats["sources"]["val"]["delivered"]["documents"] == len(documents)
    with training_config(path, sources=two, packing={"algorithm": "wrap"}).build(
            dp_rank=0, dp_world_size=1, tokenizer=None, packing_contract=None) as training:
        training.set_epoch(0)
        collect(training, 10_000)
        assert training.stats()["sources"]["other"]["delivered"]["documents"] > 5  # training repeats it
