"""Per-token source ids (``return_source_ids``, issue 39 item 1) against a record-by-record reference.

Three sources whose records are told apart by their text alone: source 0 writes lowercase words, source 1 the
same words in capitals, source 2 digits. A token of the byte-level tokenizer holds characters of one class, so
every piece of a record in a row (a run of positions from 0: a whole document, a piece of a wrapped one, a
document with its context-parallel padding) names its source by the tokens it holds; the reference gives every
token of the piece that source, and ``-1`` to the row's padding. Checked on every text contract (document ids,
block-causal, flash varlen, FA4, TE BSHD/THD, Hugging Face position ids, xdoc, seq_idx, TE THD + CP), with
``best_fit`` and ``wrap``, a padded last batch, after a resume (also of a state saved without source ids), and
with every other field of each contract equal to the run without source ids. Image-text: each record's text
carries its source's tag, every contract of the image loader, and a resume.
"""

from __future__ import annotations

import random
import re
import string

import pytest
import torch
from transformers import AutoTokenizer

from conftest import _WORDS, collect, write_jsonl_shards
from image_data import LAYOUTS, MARKER, PROCESSOR_DIR, image_config, make_record, unpack, write_jsonl_images
from zephon_loader import build_image_loader, build_text_loader
from zephon_loader import fields as F
from zephon_loader.finalize import FinalizeSettings, finalize_batch, finalize_collated
from zephon_loader.stats import batch_source_counts  # noqa: F401  (documents what the packer carries per row)

NAMES = ("lower", "upper", "digits")
CLASSES = (set(string.ascii_lowercase), set(string.ascii_uppercase), set(string.digits))


def _word(rng: random.Random, source: int) -> str:
    word = rng.choice(_WORDS)
    if source == 1:
        return word.upper()
    if source == 2:
        return "".join(str(ord(c) % 10) for c in word)
    return word


def _texts(source: int, n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed * 7 + source)
    return [{"text": " ".join(_word(rng, source) for _ in range(rng.randint(1, 7)))} for _ in range(n)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("source_ids")
    return [write_jsonl_shards(root / name, _texts(index, 36 + 6 * index, 1), shards=2)
            for index, name in enumerate(NAMES)]


def _config(sources, tokenizer_dir, **overrides):
    config = {
        "sources": [{"name": name, "path": str(path), "weight": weight}
                    for name, path, weight in zip(NAMES, sources, (1.0, 2.0, 3.0))],
        "tokenizer": {"path": str(tokenizer_dir)},
        "sequence_length": 64,
        "micro_batch_size": 3,
        "packing": {"algorithm": "best_fit"},
        "read_ahead": 0,
        "seed": 5,
        "runtime": {"runner": "threads"},
        "return_source_ids": True,
    }
    config.update(overrides)
    return config


def _token_classes(tokenizer) -> dict[int, int]:
    """Token id -> source class (-1: a token with no letter or digit, or a special token)."""
    special = set(tokenizer.all_special_ids)
    out = {}
    for token, index in tokenizer.get_vocab().items():
        chars = set(token)
        found = [k for k, cls in enumerate(CLASSES) if chars & cls]
        assert len(found) <= 1 or index in special, token
        out[index] = found[0] if found and index not in special else -1
    return out


def text_reference(batch, classes, positions=None):
    """Per token, the source of its piece (a run of positions from 0) by the tokens it holds; -1 at padding.

    Returns ``(reference, checked)``: ``checked`` is False at the tokens of pieces without a classifiable token
    (a lone EOS piece of a wrapped document, say), which the comparison leaves out.
    """
    positions = batch[F.POSITION_IDS] if positions is None else positions
    tokens, padding = batch[F.INPUT_IDS], batch[F.PADDING_MASK]
    reference = torch.full_like(tokens, -1)
    checked = torch.ones_like(tokens, dtype=torch.bool)
    for row in range(tokens.shape[0]):
        starts = [j for j in range(tokens.shape[1]) if positions[row, j] == 0] + [tokens.shape[1]]
        for start, end in zip(starts[:-1], starts[1:]):
            if bool(padding[row, start]):
                continue
            found = {classes[int(t)] for t in tokens[row, start:end]} - {-1}
            assert len(found) <= 1, (row, start, found)  # one record's piece: one source
            if found:
                reference[row, start:end] = found.pop()
            else:
                checked[row, start:end] = False
    return reference, checked


CONTRACTS = {
    "document_ids": ({"attn_implementation": "sdpa", "packed_mask_type": "document_ids"}, {}),
    "block_causal": ({"attn_implementation": "sdpa"}, {}),
    "flash_varlen": ({"attn_implementation": "flash_attention_2"}, {}),
    "fa4": ({"attn_implementation": "fa4"}, {}),
    "te_bshd": ({"attn_implementation": "te", "packed_mask_type": "document_ids"}, {}),
    "te_thd": ({"attn_implementation": "te", "packed_mask_type": "document_ids", "qkv_format": "thd"}, {}),
    "hf": ({"attn_implementation": "hf"}, {}),
    "xdoc_fa4": ({"attn_implementation": "fa4"}, {"xdoc": True}),
    "xdoc_block_causal": ({"attn_implementation": "sdpa"}, {"xdoc": True}),
    "seq_idx_metadata": ({"attn_implementation": "sdpa", "packed_mask_type": "document_ids", "seq_idx": True},
                         {"return_packed_sequence_metadata": True}),
    "te_thd_cp2": ({"attn_implementation": "te", "packed_mask_type": "document_ids", "qkv_format": "thd",
                    "cp_size": 2}, {}),
}


def _resumed_half(build, saved_config, config, k):
    """The batches after the state taken after ``k`` batches of ``build(saved_config)``, resumed by ``build(config)``."""
    with build(saved_config) as loader:
        iterator = iter(loader)
        for _ in range(k):
            next(iterator)
        state = loader.state_dict()
    with build(config) as resumed:
        resumed.load_state_dict(state)
        return collect(resumed)


def _run(config, limit=None):
    with build_text_loader(config) as loader:
        return collect(loader, limit)


@pytest.fixture(scope="module")
def classes(tokenizer):
    return _token_classes(tokenizer)


@pytest.fixture(scope="module")
def base(sources, tokenizer_dir):
    """The document-ids run whose positions the non-CP contracts' references are read from (same stream)."""
    return _run(_config(sources, tokenizer_dir, contract=CONTRACTS["document_ids"][0]))


@pytest.mark.parametrize("algorithm", ["best_fit", "wrap"])
@pytest.mark.parametrize("name", sorted(CONTRACTS))
def test_source_ids_equal_the_record_reference(sources, tokenizer_dir, classes, base, name, algorithm):
    contract, extra = CONTRACTS[name]
    if algorithm == "wrap" and contract.get("cp_size", 1) > 1:
        pytest.skip("context-parallel padding packs whole documents only (first_fit/best_fit)")
    packing = {"packing": {"algorithm": algorithm}}
    config = _config(sources, tokenizer_dir, contract=contract, **extra, **packing)
    got = _run(config)
    without = _run({**config, "return_source_ids": False})
    # The stream whose positions delimit the pieces: this run's own unless xdoc joined them (or the stream
    # differs from the base's: wrap, context-parallel padding).
    reference_run = base if (algorithm == "best_fit" and "cp_size" not in contract) else \
        _run(_config(sources, tokenizer_dir, contract=contract if "cp_size" in contract else
                     CONTRACTS["document_ids"][0], **packing))
    assert len(got) == len(without) == len(reference_run) > 10
    checked_tokens = total = 0
    seen = set()
    for index, (batch, plain, ref_batch) in enumerate(zip(got, without, reference_run)):
        assert set(batch) == set(plain) | {F.SOURCE_IDS}
        for key, value in plain.items():  # every other field of the contract is unchanged
            assert type(batch[key]) is type(value), (index, key)
            assert (torch.equal(batch[key], value) if isinstance(value, torch.Tensor) else batch[key] == value), \
                (index, key)
        assert torch.equal(batch[F.INPUT_IDS], ref_batch[F.INPUT_IDS]), index
        source_ids = batch[F.SOURCE_IDS]
        assert source_ids.dtype == torch.int64 and source_ids.shape == batch[F.INPUT_IDS].shape
        reference, checked = text_reference(ref_batch, classes)
        assert torch.equal(source_ids[checked], reference[checked]), index
        assert torch.equal(source_ids == -1, batch[F.PADDING_MASK]), index
        checked_tokens += int(checked.sum())
        total += checked.numel()
        seen |= set(source_ids.unique().tolist())
    assert checked_tokens / total > 0.97
    assert seen == {-1, 0, 1, 2}  # every source, and padding (the last batch of the pass is padded)
    if algorithm == "best_fit":  # its short last batch is completed with padding rows: all -1
        assert any(bool(b[F.PADDING_MASK].all(dim=1).any()) for b in got)


def test_per_source_tokens_match_the_packers_totals(sources, tokenizer_dir):
    """The packer's per-row totals per component (what ``stats()`` counts) equal the source ids' count per source
    plus the label-only last token of each full row."""
    config = _config(sources, tokenizer_dir, packing={"algorithm": "wrap"})
    with build_text_loader(config) as loader:
        batches = collect(loader)
        stats = loader.stats()
    ids = torch.stack([b[F.SOURCE_IDS] for b in batches])
    counted = {name: int((ids == k).sum()) for k, name in enumerate(NAMES)}
    delivered = {name: entry["delivered"]["tokens"] for name, entry in stats["sources"].items()}
    label_only = {name: delivered[name] - counted[name] for name in NAMES}
    assert all(0 <= value for value in label_only.values()), label_only
    assert sum(label_only.values()) == stats["label_only_tokens"]


@pytest.mark.parametrize("name", ["fa4", "te_thd_cp2", "hf"])
def test_source_ids_after_a_resume(sources, tokenizer_dir, name):
    contract, extra = CONTRACTS[name]
    config = _config(sources, tokenizer_dir, contract=contract, **extra)
    full = _run(config)
    k = len(full) // 2
    for saved_with in (True, False):  # a state saved without source ids resumes with them (same stream)
        rest = _resumed_half(build_text_loader, {**config, "return_source_ids": saved_with}, config, k)
        assert len(rest) == len(full) - k
        for a, b in zip(rest, full[k:]):
            assert torch.equal(a[F.SOURCE_IDS], b[F.SOURCE_IDS])
            assert torch.equal(a[F.INPUT_IDS], b[F.INPUT_IDS])


def test_finalize_batch_checks_a_callers_source_ids(base):
    batch = base[0]
    collated = {F.INPUT_IDS: batch[F.INPUT_IDS], F.LABELS: batch[F.LABELS], F.POSITION_IDS: batch[F.POSITION_IDS],
                F.PADDING_MASK: batch[F.PADDING_MASK], F.DOCUMENT_IDS: batch[F.ATTENTION_MASK],
                F.SOURCE_IDS: batch[F.SOURCE_IDS]}
    settings = FinalizeSettings.from_contract(return_source_ids=True)
    out = finalize_batch(collated, settings)
    assert out[F.SOURCE_IDS] is batch[F.SOURCE_IDS]
    assert F.SOURCE_IDS in settings.yielded_fields
    assert F.SOURCE_IDS not in finalize_batch(collated, FinalizeSettings.from_contract())
    with pytest.raises(ValueError, match="source_ids: got torch.int32"):
        finalize_batch({**collated, F.SOURCE_IDS: batch[F.SOURCE_IDS].int()}, settings)
    wrong = batch[F.SOURCE_IDS].clone()
    wrong[0, 0] = -1
    with pytest.raises(ValueError, match="row 0, column 0"):
        finalize_batch({**collated, F.SOURCE_IDS: wrong}, settings)
    missing = {k: v for k, v in collated.items() if k != F.SOURCE_IDS}
    with pytest.raises(ValueError, match="source_ids: got NoneType"):
        finalize_batch(missing, settings)
    with pytest.raises(ValueError, match="missing from the batch"):  # the loader's path names the setting
        finalize_collated(missing, settings)
    with pytest.raises(TypeError, match="return_source_ids"):
        FinalizeSettings.from_contract(return_source_ids=1)


# ----------------------------------------------------------------------------- image-text

IMAGE_TAG = re.compile(r"qq(\d)zz")
IMAGE_CONTRACTS = {
    "document_ids_metadata": ({"packed_mask_type": "document_ids", "requires_packed_sequence_metadata": True}, {}),
    "block_causal": ({"packed_mask_type": "block_causal", "requires_packed_sequence_metadata": False}, {}),
    "flash_varlen": ({"packed_mask_type": "flash_varlen", "requires_packed_sequence_metadata": False}, {}),
    "hf": ({"attn_implementation": "hf", "packed_mask_type": None, "requires_packed_sequence_metadata": False}, {}),
    "xdoc": ({"packed_mask_type": "document_ids", "requires_packed_sequence_metadata": True}, {"xdoc": True}),
}


@pytest.fixture(scope="module")
def image_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("image_source_ids")
    rng = random.Random(4)
    out = {}
    for source, name in enumerate(NAMES):
        records = []
        for i in range(8 + 2 * source):
            text, images = make_record(rng, i, LAYOUTS[(i + source) % len(LAYOUTS)])
            records.append((f"qq{source}zz {text}", images))
        out[name] = write_jsonl_images(root / name, records)
    return out


def _image_config(image_sources, contract, **extra):
    config = image_config(image_sources, contract=contract, return_source_ids=True, sequence_length=128,
                          micro_batch_size=1, **extra)
    if contract.get("attn_implementation") is not None:
        config["contract"] = {k: v for k, v in contract.items() if v is not None}
    return config


def _image_run(config, **kwargs):
    with build_image_loader(config, **kwargs) as loader:
        return collect(loader)


@pytest.fixture(scope="module")
def image_base(image_sources):
    return _image_run(_image_config(image_sources, IMAGE_CONTRACTS["document_ids_metadata"][0]))


def image_reference(batch, decode):
    """Per token, the source tagged in its record's text (records are whole in image rows); -1 at padding."""
    reference = torch.full_like(batch[F.INPUT_IDS], -1)
    for record in unpack(batch):
        tags = set(IMAGE_TAG.findall(decode(record["tokens"].tolist())))
        assert len(tags) == 1, tags
        reference[record["row"], record["columns"]] = int(tags.pop())
    # An ineligible filler inside a record belongs to it (unpack gives it to the record before it).
    return reference


@pytest.mark.parametrize("name", sorted(IMAGE_CONTRACTS))
def test_image_source_ids_equal_the_record_reference(image_sources, image_base, name):
    contract, extra = IMAGE_CONTRACTS[name]
    tokenizer = AutoTokenizer.from_pretrained(str(PROCESSOR_DIR))
    got = _image_run(_image_config(image_sources, contract, **extra))
    without = _image_run({**_image_config(image_sources, contract, **extra), "return_source_ids": False})
    assert len(got) == len(image_base) == len(without) > 4
    seen = set()
    for index, (batch, plain, ref_batch) in enumerate(zip(got, without, image_base)):
        for key, value in plain.items():
            assert (torch.equal(batch[key], value) if isinstance(value, torch.Tensor) else batch[key] == value), \
                (index, key)
        assert torch.equal(batch[F.INPUT_IDS], ref_batch[F.INPUT_IDS])
        reference = image_reference(ref_batch, tokenizer.decode)
        assert torch.equal(batch[F.SOURCE_IDS], reference), index
        assert torch.equal(batch[F.SOURCE_IDS] == -1, batch[F.PADDING_MASK])
        seen |= set(batch[F.SOURCE_IDS].unique().tolist())
    assert seen == {-1, 0, 1, 2}


def test_image_source_ids_after_a_resume(image_sources, image_base):
    config = _image_config(image_sources, IMAGE_CONTRACTS["document_ids_metadata"][0])
    k = len(image_base) // 2
    rest = _resumed_half(build_image_loader, config, config, k)
    assert len(rest) == len(image_base) - k
    for a, b in zip(rest, image_base[k:]):
        assert torch.equal(a[F.SOURCE_IDS], b[F.SOURCE_IDS])


def test_source_ids_under_a_mixture_schedule(sources, tokenizer_dir, classes):
    """Each phase its own pipeline over the same sources: indices stay those of ``sources``; the phases' weights
    show in the source ids' counts."""
    schedule = {"schedule": [{"until_steps": 6, "weights": {"lower": 20.0, "upper": 1.0, "digits": 1.0}},
                             {"weights": {"lower": 1.0, "upper": 1.0, "digits": 20.0}}]}
    config = _config(sources, tokenizer_dir, contract=CONTRACTS["fa4"][0], mixture=schedule, passes=None,
                     packing={"algorithm": "wrap"})
    batches = _run(config, limit=12)
    counts = []
    for batch in batches:
        reference, checked = text_reference(batch, classes)
        assert torch.equal(batch[F.SOURCE_IDS][checked], reference[checked])
        counts.append(torch.bincount(batch[F.SOURCE_IDS][batch[F.SOURCE_IDS] >= 0], minlength=3))
    first, second = sum(counts[:6]), sum(counts[6:])
    assert first[0] > first[2] and second[2] > second[0], (first, second)
