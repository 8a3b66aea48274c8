"""Where every token of a pass goes (issue 21, item 6): none is dropped; the S + 1 shift is the only gap.

Zephon packs rows of ``S + 1`` tokens and ``to_training`` shifts them: a row's
tokens ``t_0 .. t_S`` give inputs ``t_0 .. t_(S-1)`` and labels ``t_1 .. t_S``.
So the last token of a *full* row reaches the model only as a label (the pair
``t_S -> first token of the next row`` is trained by nobody), while a row that
ends in padding keeps all its real tokens as inputs. ``loader.stats()`` counts
the packed tokens (Zephon's ``component_token_counts``), so over a pass:

    stats tokens == sum over documents of (tokens + BOS + EOS)
    input tokens == stats tokens - full rows

TorchTitan's ``HuggingFaceTextDataLoader`` slices its token buffer the same
way (``S + 1`` tokens per sample, ``x[:-1]``/``x[1:]``) and, unlike this
loader, drops the last partial buffer; AutoModel shifts per document instead
(one token per document). That per-row token is the 0.04-0.05 % the peers'
counts differ by at S = 2048 (``benchmarks/bench_peers.py``).
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import make_texts, write_jsonl_shards
from zephon_loader import build_text_loader


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_packed_token_is_delivered_and_only_the_last_of_each_full_row_is_label_only(
    tmp_path, tokenizer_dir, tokenizer, shuffle
):
    # Documents from 1 to ~300 words: many longer than a row, split by wrap across rows.
    texts = make_texts(60, seed=3, min_words=1, max_words=300)
    source = write_jsonl_shards(tmp_path / "docs", [{"text": t} for t in texts], shards=3)
    expected = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 2 for t in texts)  # BOS ... EOS
    config: dict[str, Any] = {
        "sources": [{"name": "docs", "path": str(source)}],
        "tokenizer": {"path": str(tokenizer_dir)},
        "sequence_length": 32,
        "micro_batch_size": 4,
        "packing": {"algorithm": "wrap"},
        "shuffle": shuffle,
        "read_ahead": 0,
        "mask_cross_document_labels": False,  # the last label of a row is then -100 only at padding
        "runtime": {"runner": "threads"},
    }
    inputs = full_rows = 0
    with build_text_loader(config) as loader:
        for batch in loader:
            padding = batch["padding_mask"]
            inputs += int((~padding).sum())
            full_rows += int((~padding.any(dim=1) & (batch["labels"][:, -1] != -100)).sum())
        stats = loader.stats()
    delivered = stats["sources"]["docs"]["delivered"]
    assert stats["dropped"] == {}
    assert delivered["documents"] == len(texts)
    assert delivered["tokens"] == expected, "a packed token went missing between the tokenizer and the yield"
    assert full_rows > 0
    assert inputs == expected - full_rows
