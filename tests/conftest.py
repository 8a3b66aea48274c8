"""Shared fixtures: a tiny local tokenizer and JSONL / Parquet shards in tmp dirs.

Nothing here touches the network: the tokenizer is a byte-level BPE trained
locally with ``tokenizers`` and saved with ``transformers``'
``save_pretrained``; Hugging Face offline mode is forced for the session.

The builder functions are plain module-level helpers so other tests and
scripts can reuse them (``from conftest import write_jsonl_shards`` works
inside ``tests/`` because pytest puts the rootdir-relative test folder on
``sys.path``):

* :func:`make_texts` — deterministic documents of varied length
* :func:`train_tokenizer` — tiny BPE saved to a directory
* :func:`write_jsonl_shards` / :func:`write_parquet_shards` — records -> shard files
* :func:`zephon_pipeline` — a ``zephon.Pipeline`` from loader-config keys (``build_pipeline``)
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The loader's cache (shard digests, decoded views of compressed shards): one per test session, never the
# user's ~/.cache (subprocesses of a test inherit it).
if "ZEPHON_LOADER_CACHE" not in os.environ:
    import tempfile as _tempfile

    os.environ["ZEPHON_LOADER_CACHE"] = _tempfile.mkdtemp(prefix="zephon_loader_test_cache_")

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
BOS_TOKEN = "<bos>"

_WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
    "upsilon phi chi psi omega packed rows tokens shards loader resume"
).split()

#: A chat template with generation tags (assistant turns + EOS are the supervised span).
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}"
    "{% endif %}{% endfor %}"
)


def make_texts(n: int, *, seed: int = 0, min_words: int = 1, max_words: int = 30, prefix: str = "doc") -> list[str]:
    """``n`` deterministic short documents of varied length (``min_words..max_words`` words)."""
    rng = random.Random(seed)
    return [
        f"{prefix}{i} " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words)))
        for i in range(n)
    ]


def train_tokenizer(texts: Iterable[str], out_dir: str | os.PathLike[str], *, vocab_size: int = 400) -> Path:
    """Train a byte-level BPE on ``texts`` and save it with pad/eos/bos tokens; returns ``out_dir``.

    Special ids: ``<pad>`` = 0, ``<eos>`` = 1, ``<bos>`` = 2.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, EOS_TOKEN, BOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, bos_token=BOS_TOKEN
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


def zephon_pipeline(config: Mapping[str, Any] | Any, *, work_dir: str | os.PathLike[str] | None = None,
                    **kwargs: Any) -> Any:
    """The ``zephon.Pipeline`` :func:`zephon_loader.pipeline.text.build_pipeline` builds for loader-config keys.

    Args:
        config: A ``TextLoaderConfig`` or its keys as plain values, e.g.
            ``{"sources": [{"name": "a", "path": p}], "sequence_length": 32,
            "micro_batch_size": 4, "tokenizer": {"path": tok}}``.
        work_dir: Folder for the drop log and saved tokenizer (default: a new temporary folder).
        kwargs: Further ``build_pipeline`` keywords (``dp``, ``seed``, ``transform``).
    """
    import tempfile

    from zephon_loader.config import TextLoaderConfig, text_loader_config
    from zephon_loader.pipeline.text import build_pipeline

    cfg = config if isinstance(config, TextLoaderConfig) else text_loader_config(**config)
    work_dir = work_dir if work_dir is not None else tempfile.mkdtemp(prefix="zephon_loader_test_")
    return build_pipeline(cfg, work_dir=work_dir, **kwargs).pipeline


def text_config(folder: str | os.PathLike[str], tokenizer_dir: str | os.PathLike[str], **extra: Any) -> dict[str, Any]:
    """A small text-loader config over one source ``web`` (wrap packing, S=32, B=2, in file order, inline)."""
    config = {
        "sources": [{"name": "web", "path": str(folder)}],
        "tokenizer": {"path": str(tokenizer_dir)},
        "sequence_length": 32,
        "micro_batch_size": 2,
        "packing": {"algorithm": "wrap"},
        "shuffle": False,
        "read_ahead": 0,
    }
    config.update(extra)
    return config


def resealed(state: Mapping[str, Any]) -> dict[str, Any]:
    """A hand-edited loader state with its checksum made again (to test the checks behind the checksum)."""
    from zephon_loader.state import content_checksum

    return {**state, "checksum": content_checksum(state)}


def collect(loader: Iterable[Any], limit: int | None = None) -> list[Any]:
    """The batches of one pass of ``loader`` (at most ``limit``)."""
    out = []
    for batch in loader:
        out.append(batch)
        if limit is not None and len(out) >= limit:
            break
    return out


def _split(records: Sequence[Any], shards: int) -> list[Sequence[Any]]:
    size = -(-len(records) // shards)
    return [records[i * size : (i + 1) * size] for i in range(shards)]


def write_jsonl_shards(
    folder: str | os.PathLike[str], records: Sequence[Mapping[str, Any]], *, shards: int = 2
) -> Path:
    """Write ``records`` as ``shards`` contiguous ``part-XXXXX.jsonl`` files in ``folder``."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for index, part in enumerate(_split(records, shards)):
        with (out / f"part-{index:05d}.jsonl").open("w") as handle:
            for record in part:
                handle.write(json.dumps(record) + "\n")
    return out


def write_parquet_shards(
    folder: str | os.PathLike[str], records: Sequence[Mapping[str, Any]], *, shards: int = 2
) -> Path:
    """Write ``records`` (same keys each) as ``shards`` ``part-XXXXX.parquet`` files in ``folder``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for index, part in enumerate(_split(records, shards)):
        columns = {key: [record[key] for record in part] for key in part[0]}
        pq.write_table(pa.table(columns), out / f"part-{index:05d}.parquet")
    return out


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def corpus_texts() -> list[str]:
    """200 documents, 1-30 words each (some longer than a 32-token row)."""
    return make_texts(200, seed=0)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, corpus_texts: list[str]) -> Path:
    """Local tokenizer directory (vocab 400; pad 0, eos 1, bos 2)."""
    return train_tokenizer(corpus_texts, tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)


@pytest.fixture(scope="session")
def jsonl_sources(tmp_path_factory: pytest.TempPathFactory, corpus_texts: list[str]) -> dict[str, Path]:
    """Two JSONL sources ``a`` and ``b`` of 100 docs each in 2 shards; records ``{"id", "text", "meta"}``."""
    root = tmp_path_factory.mktemp("jsonl")
    out = {}
    for index, name in enumerate(("a", "b")):
        records = [
            {"id": index * 100 + i, "text": text, "meta": {"n": i}}
            for i, text in enumerate(corpus_texts[index * 100 : (index + 1) * 100])
        ]
        out[name] = write_jsonl_shards(root / name, records, shards=2)
    return out


@pytest.fixture(scope="session")
def parquet_text_source(tmp_path_factory: pytest.TempPathFactory, corpus_texts: list[str]) -> Path:
    """Parquet text source with scalar and string side columns (the Parquet pitfall)."""
    records = [
        {"text": text, "score": float(i), "name": f"n{i}", "lang": "en"} for i, text in enumerate(corpus_texts[:120])
    ]
    return write_parquet_shards(tmp_path_factory.mktemp("parquet_text"), records, shards=3)


def eligibility_pattern(length: int) -> list[bool]:
    """Deterministic per-token eligibility used by the pretokenized fixture: every 5th token (j % 5 == 2) is False."""
    return [j % 5 != 2 for j in range(length)]


@pytest.fixture(scope="session")
def pretokenized_parquet_source(
    tmp_path_factory: pytest.TempPathFactory, corpus_texts: list[str], tokenizer: Any
) -> Path:
    """Parquet with ``tokens`` (ids + EOS), per-token ``elig`` bools and scalar/string side columns."""
    records = []
    for i, text in enumerate(corpus_texts[:120]):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        records.append({"tokens": ids, "elig": eligibility_pattern(len(ids)), "score": float(i), "name": f"n{i}"})
    return write_parquet_shards(tmp_path_factory.mktemp("parquet_tok"), records, shards=2)


@pytest.fixture(scope="session")
def chat_source(tmp_path_factory: pytest.TempPathFactory, corpus_texts: list[str]) -> Path:
    """JSONL chat source: 60 two-turn conversations under ``messages``."""
    records = [
        {
            "messages": [
                {"role": "user", "content": corpus_texts[i][:40]},
                {"role": "assistant", "content": corpus_texts[i + 1][:40]},
            ],
            "score": i,
        }
        for i in range(60)
    ]
    return write_jsonl_shards(tmp_path_factory.mktemp("chat"), records, shards=2)


#: Test files of the whole suite only (``dev.sh test``, CI): they start several processes, a trainer, a server
#: or Ray, or read whole passes of larger corpora. ``dev.sh quick`` (``-m "not slow"``) runs the rest.
SLOW_FILES = frozenset({
    "test_accelerate.py", "test_agreement_amortized.py", "test_crash_resume.py", "test_data_parallel.py",
    "test_distributed.py", "test_docs.py", "test_elastic_resume.py", "test_even_pass_edges.py",
    "test_even_passes.py", "test_examples.py", "test_hf_models.py", "test_hf_trainer.py",
    "test_hf_trainer_epochs.py", "test_hf_vlm.py", "test_image_model.py", "test_image_recipe.py",
    "test_lightning.py", "test_lightning_defaults.py", "test_mixture_schedule.py", "test_object_storage.py",
    "test_packaging.py", "test_process_runner.py", "test_provenance_skip.py", "test_ray_runner.py",
    "test_rank_state.py", "test_rank_state_trainers.py",
    "test_shard_formats.py", "test_signals.py", "test_validation_loader.py", "test_first_batch.py",
})


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
