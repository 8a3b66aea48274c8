"""Bad records: refused with source, shard file and line/row, or skipped and counted; never trained on silently.

Each case here was trained on silently (or crashed inside the tokenizer without
a location) before the record checks existed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import collect, make_texts, text_config, write_jsonl_shards, write_parquet_shards
from zephon_loader import build_text_loader
from zephon_loader.errors import BadRecordError

GOOD = make_texts(12, seed=3, min_words=2, max_words=6)


def write_lines(folder: Path, lines: list[str]) -> Path:
    """One shard of raw JSONL lines plus a clean second shard (so shard names matter)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "part-00000.jsonl").write_text("".join(line + "\n" for line in lines))
    (folder / "part-00001.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in GOOD[8:]))
    return folder


def good_lines() -> list[str]:
    return [json.dumps({"text": t}) for t in GOOD[:8]]


BAD_TEXT_RECORDS = {
    "null": ("null", "not_an_object", "got null"),
    "number": ("42", "not_an_object", "got 42 (int)"),
    "list": ('["a", "b"]', "not_an_object", "(list)"),
    "text_list": ('{"text": ["x", "y"]}', "wrong_type", "field 'text' got [\"x\", \"y\"] (list), expected a string"),
    "text_null": ('{"text": null}', "wrong_type", "field 'text' got null, expected a string"),
    "text_number": ('{"text": 7}', "wrong_type", "field 'text' got 7 (int)"),
    "text_dict": ('{"text": {"a": 1}}', "wrong_type", "(dict)"),
    "missing": ('{"body": "x"}', "missing_field", "field 'text'"),
    "blank": ('{"text": "   "}', "empty", "non-blank text"),
}


@pytest.mark.parametrize("case", sorted(BAD_TEXT_RECORDS))
def test_bad_text_record_is_refused_with_its_location(case, tmp_path, tokenizer_dir):
    line, _, message = BAD_TEXT_RECORDS[case]
    lines = good_lines()
    lines.insert(3, "")  # a blank line: Zephon does not count it, the physical line number does
    lines.insert(5, line)  # physical line 6
    folder = write_lines(tmp_path / "web", lines)
    with build_text_loader(text_config(folder, tokenizer_dir)) as loader:
        with pytest.raises(BadRecordError) as info:
            collect(loader)
    text = str(info.value)
    assert f"source 'web', shard {folder / 'part-00000.jsonl'}, line 6" in text
    assert message in text
    assert "on_bad_record: skip" in text


def test_skip_leaves_bad_records_out_and_counts_them(tmp_path, tokenizer_dir, tokenizer):
    lines = good_lines()
    for offset, case in enumerate(sorted(BAD_TEXT_RECORDS)):
        lines.insert(2 * offset + 1, BAD_TEXT_RECORDS[case][0])
    folder = write_lines(tmp_path / "web", lines)
    with build_text_loader(text_config(folder, tokenizer_dir, on_bad_record="skip")) as loader:
        batches = collect(loader)
        report = loader.stats()
    expected_reasons: dict[str, int] = {}
    for _, reason, _ in BAD_TEXT_RECORDS.values():
        expected_reasons[reason] = expected_reasons.get(reason, 0) + 1
    assert {reason: entry["documents"] for reason, entry in report["dropped"].items()} == expected_reasons
    assert {reason: entry["documents"] for reason, entry in report["sources"]["web"]["dropped"].items()} == expected_reasons
    assert all("part-00000.jsonl, line " in entry["first"] for entry in report["dropped"].values())
    assert report["sources"]["web"]["delivered"]["documents"] >= len(GOOD) - 1
    # The delivered tokens are exactly the good documents, BOS ... EOS each, in order: wrap cuts the
    # stream into rows of S + 1 = 33 tokens, and each row's input_ids are its first 32.
    expected = []
    for text in GOOD[:8] + GOOD[8:]:
        expected += [tokenizer.bos_token_id] + tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    rows = [row[~pad].tolist() for b in batches for row, pad in zip(b["input_ids"], b["padding_mask"])]
    assert rows and rows == [expected[33 * r : 33 * r + 32][: len(row)] for r, row in enumerate(rows)]
    assert sum(len(row) + 1 for row in rows) >= len(expected) - 1


def test_special_token_strings_in_text_stay_text(tmp_path, tokenizer_dir, tokenizer):
    text = "alpha <pad> beta <bos> gamma <eos> delta"
    folder = write_lines(tmp_path / "web", [json.dumps({"text": text})] + good_lines())
    with build_text_loader(text_config(folder, tokenizer_dir)) as loader:
        first = collect(loader, limit=1)[0]
    row = first["input_ids"][0].tolist()
    specials = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}
    # BOS at 0, then the document's text as ordinary tokens, EOS at its end: no control id from the data.
    doc_end = row.index(tokenizer.eos_token_id)
    assert row[0] == tokenizer.bos_token_id
    assert not specials & set(row[1:doc_end])
    assert tokenizer.decode(row[1:doc_end]) == text


def test_special_token_strings_in_chat_are_refused(tmp_path, tokenizer_dir):
    from conftest import CHAT_TEMPLATE

    records = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}] * 4
    records.insert(2, {"messages": [{"role": "user", "content": "x <eos> y"}, {"role": "assistant", "content": "z"}]})
    folder = write_jsonl_shards(tmp_path / "chat", records, shards=1)
    config = text_config(folder, tokenizer_dir, tokenizer={"path": str(tokenizer_dir), "chat_field": "messages",
                                                           "chat_template": CHAT_TEMPLATE})
    with build_text_loader(config) as loader:
        with pytest.raises(BadRecordError, match=r"line 3: field 'messages\[0\].content' got text containing '<eos>'"):
            collect(loader)


def pretokenized_config(folder: Path, **extra):
    config = {
        "sources": [{"name": "tok", "path": str(folder)}],
        "tokenizer": {"pretokenized_field": "ids"},
        "pad_token_id": 0,
        "sequence_length": 16,
        "micro_batch_size": 2,
        "packing": {"algorithm": "wrap"},
        "shuffle": False,
        "read_ahead": 0,
    }
    config.update(extra)
    return config


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([5, 400, 6], "field 'ids' got id 400, expected ids in [0, 400)"),
        ([5, -1, 6], "field 'ids' got id -1, expected ids in [0, 400)"),
        ([], "field 'ids' got [], expected at least one token id"),
        (["a", "b"], "expected a list of integer token ids"),
        ([[1, 2], [3, 4]], "expected a list of integer token ids"),
    ],
)
def test_bad_pretokenized_record_is_refused_with_its_row(ids, message, tmp_path, tokenizer_dir):
    records = [{"ids": [3, 4, 5, 6]} for _ in range(6)]
    records[4] = {"ids": ids}
    as_parquet = all(isinstance(x, int) for x in ids)  # Parquet needs a list<int> column; the others as JSONL
    write = write_parquet_shards if as_parquet else write_jsonl_shards
    folder = write(tmp_path / "tok", records, shards=2)
    config = pretokenized_config(folder, tokenizer={"path": str(tokenizer_dir), "pretokenized_field": "ids"})
    with build_text_loader(config) as loader:
        with pytest.raises(BadRecordError) as info:
            collect(loader)
    text = str(info.value)
    assert message in text
    shard = sorted(p.name for p in folder.iterdir())[1]
    assert f"source 'tok', shard {folder / shard}, " + ("row 1 (0-based)" if shard.endswith(".parquet") else "line 2") in text


def test_empty_pretokenized_record_is_counted_under_skip(tmp_path):
    records = [{"ids": [3, 4, 5, 6]}, {"ids": []}, {"ids": [7, 8]}, {"ids": [9]}]
    folder = write_jsonl_shards(tmp_path / "tok", records, shards=1)
    with build_text_loader(pretokenized_config(folder, on_bad_record="skip", micro_batch_size=1,
                                               sequence_length=6)) as loader:
        batch = collect(loader)[0]
        report = loader.stats()
    assert batch["input_ids"][0].tolist()[:6] == [3, 4, 5, 6, 7, 8]
    assert report["dropped"] == {"empty": {"documents": 1, "tokens": 0, "first": f"source 'tok', shard {folder / 'part-00000.jsonl'}, line 2"}}


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_limits_smaller_than_zephons_validation_samples_refuse_no_valid_record(tmp_path, tokenizer_dir, policy):
    """Zephon runs each operator on its validation samples at the first iter(): a limit that refuses
    those (3 tokens, 16 bytes) must neither stop a stream of valid records nor count a phantom drop."""
    folder = write_jsonl_shards(tmp_path / "tok", [{"ids": [3, 4]}, {"ids": [5]}, {"ids": [6, 7]}], shards=1)
    config = pretokenized_config(folder, max_record_tokens=2, on_bad_record=policy, micro_batch_size=1,
                                 sequence_length=5)
    with build_text_loader(config) as loader:
        rows = [batch["input_ids"][0].tolist() for batch in loader]
        report = loader.stats()
    assert rows == [[3, 4, 5, 6, 7]]
    assert report["dropped"] == {}
    text_folder = write_jsonl_shards(tmp_path / "web", [{"text": "tiny"}, {"text": "ok"}], shards=1)
    with build_text_loader(text_config(text_folder, tokenizer_dir, max_record_bytes=8, on_bad_record=policy)) as loader:
        collect(loader)
        assert loader.stats()["dropped"] == {}


def test_record_limits(tmp_path, tokenizer_dir):
    lines = good_lines()
    lines.insert(1, json.dumps({"text": "x" * 300}))
    folder = write_lines(tmp_path / "web", lines)
    with build_text_loader(text_config(folder, tokenizer_dir, max_record_bytes=200)) as loader:
        with pytest.raises(BadRecordError, match=r"line 2: field 'text' got 300 bytes, expected at most max_record_bytes=200"):
            collect(loader)
    with build_text_loader(text_config(folder, tokenizer_dir, max_record_tokens=20)) as loader:
        with pytest.raises(BadRecordError, match=r"line 2: field 'input_ids' got \d+ tokens, expected at most max_record_tokens=20"):
            collect(loader)


def test_unparsable_json_line_names_shard_and_line(tmp_path, tokenizer_dir):
    lines = good_lines()
    lines.insert(4, '{"text": "unterminated')
    folder = write_lines(tmp_path / "web", lines)
    for policy in ("error", "skip"):
        with build_text_loader(text_config(folder, tokenizer_dir, on_bad_record=policy)) as loader:
            with pytest.raises(BadRecordError, match=rf"shard {folder / 'part-00000.jsonl'}, line 5: not valid JSON"):
                collect(loader)


def test_longer_than_row_is_counted_not_silent(tmp_path):
    records = [{"ids": [3] * 5}, {"ids": [4] * 40}, {"ids": [5] * 6}, {"ids": [6] * 3}]
    folder = write_jsonl_shards(tmp_path / "tok", records, shards=1)
    config = pretokenized_config(folder, packing={"algorithm": "first_fit"}, micro_batch_size=1)
    with build_text_loader(config) as loader:
        batches = collect(loader)
        report = loader.stats()
    delivered = np.concatenate([b["input_ids"][~b["padding_mask"]].numpy() for b in batches]).tolist()
    assert 4 not in delivered
    assert report["dropped"] == {"longer_than_row": {"documents": 1, "tokens": 40, "first": f"source 'tok', shard {folder / 'part-00000.jsonl'}, line 2"}}
    assert report["sources"]["tok"]["delivered"] == {"documents": 3, "tokens": 14}


def test_a_control_character_in_a_json_line_is_named_once(tmp_path, tokenizer_dir):
    """``json``'s own message ends in "at"; the location follows it without "at at"."""
    lines = good_lines()
    lines.insert(1, '{"text": "tab\tinside"}')
    folder = write_lines(tmp_path / "web", lines)
    with build_text_loader(text_config(folder, tokenizer_dir)) as loader:
        with pytest.raises(BadRecordError, match=r"line 2: not valid JSON \(Invalid control character, column 14\)") \
                as raised:
            collect(loader)
    assert "at at" not in str(raised.value)
