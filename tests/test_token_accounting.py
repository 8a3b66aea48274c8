"""Where every token of a pass goes (issue 21, item 6): none is dropped, and the S + 1 shift's cost is counted.

Zephon packs rows of ``S + 1`` tokens and ``to_training`` shifts them: a row's
tokens ``t_0 .. t_S`` give inputs ``t_0 .. t_(S-1)`` and labels ``t_1 .. t_S``.
So the last token of a *full* row reaches the model only as a label (the pair
``t_S -> first token of the next row`` is trained by nobody), while a row that
ends in padding keeps all its real tokens as inputs. ``loader.stats()`` counts
the packed tokens (Zephon's ``component_token_counts``) and, since issue 21,
the label-only ones (until then they went uncounted), so over a pass:

    stats tokens == sum over documents of (tokens + BOS + EOS)
    stats label_only_tokens == full rows
    input tokens == stats tokens - stats label_only_tokens

TorchTitan 0.3.0's ``HuggingFaceTextDataLoader`` and AutoModel 0.7.0 shift per
document instead (``tokens[:-1]``/``tokens[1:]`` before packing: one input less
per document, none per row; TorchTitan also drops its last partial buffer).
At S = 2048 on the standard library's sources that per-row token is the
0.04-0.05 % by which this loader's input tokens fall short of theirs
(``benchmarks/bench_peers.py``).
"""

from __future__ import annotations

import pytest

from conftest import make_texts, text_config, write_jsonl_shards
from zephon_loader import build_text_loader


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_packed_token_is_delivered_and_only_the_last_of_each_full_row_is_label_only(
    tmp_path, tokenizer_dir, tokenizer, shuffle
):
    # Documents from 1 to ~300 words: many longer than a row, split by wrap across rows.
    texts = make_texts(60, seed=3, min_words=1, max_words=300)
    source = write_jsonl_shards(tmp_path / "docs", [{"text": t} for t in texts], shards=3)
    expected = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 2 for t in texts)  # BOS ... EOS
    config = text_config(source, tokenizer_dir, micro_batch_size=4, shuffle=shuffle,
                         mask_cross_document_labels=False,  # the last label of a row is then -100 only at padding
                         runtime={"runner": "threads"})
    inputs = full_rows = 0
    with build_text_loader(config) as loader:
        for batch in loader:
            padding = batch["padding_mask"]
            inputs += int((~padding).sum())
            full_rows += int((~padding.any(dim=1) & (batch["labels"][:, -1] != -100)).sum())
        stats = loader.stats()
    delivered = stats["sources"]["web"]["delivered"]
    assert stats["dropped"] == {}
    assert delivered["documents"] == len(texts)
    assert delivered["tokens"] == expected, "a packed token went missing between the tokenizer and the yield"
    assert full_rows > 0
    assert inputs == expected - full_rows
    assert stats.get("label_only_tokens") == full_rows, "the tokens the S + 1 shift makes labels only are not counted"


@pytest.mark.parametrize("read_ahead", [0, 2])
def test_label_only_tokens_continue_exactly_across_a_resume(tmp_path, tokenizer_dir, read_ahead):
    texts = make_texts(40, seed=5, min_words=1, max_words=200)
    source = write_jsonl_shards(tmp_path / "docs", [{"text": t} for t in texts], shards=2)
    config = text_config(source, tokenizer_dir, shuffle=True, read_ahead=read_ahead, runtime={"runner": "threads"})
    with build_text_loader(config) as loader:
        for _ in loader:
            pass
        whole = loader.stats()
    with build_text_loader(config) as loader:
        iterator = iter(loader)
        for _ in range(5):
            next(iterator)
        state = loader.state_dict()
    with build_text_loader(config) as loader:
        loader.load_state_dict(state)
        for _ in loader:
            pass
        resumed = loader.stats()
    assert whole["label_only_tokens"] > 0
    assert resumed["label_only_tokens"] == whole["label_only_tokens"]
    assert resumed["sources"] == whole["sources"]
