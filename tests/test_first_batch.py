"""The first batch at the defaults: how few documents and how little import it waits for.

* A generic fast tokenizer folder (``tokenizer_class: TokenizersBackend``, what ``save_pretrained`` writes for a
  ``tokenizers`` tokenizer) loads as that class without AutoTokenizer, whose model registry import costs ~1 s per
  process; the result equals AutoTokenizer's. Other folders still go through AutoTokenizer.
* Zephon reads 8 records per call: the first batch waits for far fewer documents than with its 64.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import text_config, write_jsonl_shards
from zephon_loader import build_text_loader
from zephon_loader.pipeline import text as text_pipeline
from zephon_loader.tokenizing import load_tokenizer

SAMPLE = "def f(x):\n    return x  # <|eos|> stays text\n"


def test_a_generic_fast_folder_loads_without_autotokenizer_and_equals_it(tokenizer_dir, tmp_path):
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] in ("TokenizersBackend", "PreTrainedTokenizerFast")
    code = textwrap.dedent(f"""
        import sys, json
        from pathlib import Path
        from zephon_loader.tokenizing import load_tokenizer
        tok = load_tokenizer(Path({str(tokenizer_dir)!r}), split_special_tokens=True)
        print(json.dumps({{"registry": "transformers.models.auto" in sys.modules, "cls": type(tok).__name__,
                          "ids": tok({SAMPLE!r}, add_special_tokens=False)["input_ids"]}}))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    fast = json.loads(done.stdout.strip().splitlines()[-1])
    assert fast["registry"] is False, "the generic folder went through AutoTokenizer's model registry"
    assert fast["cls"] == "TokenizersBackend"

    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True, split_special_tokens=True)
    assert type(auto).__name__ == fast["cls"]
    assert auto(SAMPLE, add_special_tokens=False)["input_ids"] == fast["ids"]
    loaded = load_tokenizer(tokenizer_dir, split_special_tokens=True)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id, len(loaded)) == (
        auto.bos_token_id, auto.eos_token_id, auto.pad_token_id, len(auto))


@pytest.mark.parametrize("edit", ["other_class", "auto_map", "no_config"])
def test_other_folders_go_through_autotokenizer(tokenizer_dir, tmp_path, monkeypatch, edit):
    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if edit == "other_class":
        config["tokenizer_class"] = "GPT2Tokenizer"
    elif edit == "auto_map":
        config["auto_map"] = {"AutoTokenizer": [None, "my_module.MyTokenizer"]}
    if edit == "no_config":
        config_file.unlink()
    else:
        config_file.write_text(json.dumps(config))
    import transformers

    calls = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    try:
        load_tokenizer(folder)
    except ValueError:
        pass  # an auto_map to a module that is not there: AutoTokenizer's refusal, carried in the message
    assert calls, f"{edit}: the folder was loaded without AutoTokenizer"


def _read_calls_before_first_batch(config, monkeypatch) -> list[int]:
    """The documents in each of Zephon's read calls up to the first batch (calls on Zephon's validation samples,
    at the build and at the first ``iter``, left out: they hold none of the corpus' ``word0 doc`` texts)."""
    seen = []
    check = text_pipeline.CheckRawRecords.__call__

    def recording(self, elems):
        if elems and "word0 doc" in repr(elems[0]):
            seen.append(len(elems))
        return check(self, elems)

    monkeypatch.setattr(text_pipeline.CheckRawRecords, "__call__", recording)
    with build_text_loader(config) as loader:
        next(iter(loader))
        return list(seen)


def test_the_first_batch_waits_for_fewer_documents_than_zephons_default_call(tokenizer_dir, tmp_path, monkeypatch):
    # 600 documents of ~40 tokens in one shard: a batch of 2 rows of S=64 needs four of them.
    texts = [" ".join(f"word{i % 37} doc{n}" for i in range(20)) for n in range(600)]
    folder = tmp_path / "corpus"
    write_jsonl_shards(folder, [{"text": t} for t in texts], shards=1)
    config = text_config(folder, tokenizer_dir, sequence_length=64, micro_batch_size=2)
    ours = _read_calls_before_first_batch(config, monkeypatch)
    monkeypatch.setattr(text_pipeline, "FETCH_RECORDS_PER_CALL", 64)  # Zephon's default
    zephons = _read_calls_before_first_batch(config, monkeypatch)
    # How many calls Zephon's read-ahead has made by the time the first batch arrives depends on thread timing
    # (sums measured 92 vs 164 on an idle machine, 108 vs 100 on a loaded one), so only what every run shares is
    # asserted: the first batch waits for the first read call, which holds 8 documents here and 64 at Zephon's default.
    assert ours and max(ours) <= 8 and ours[0] == 8, f"read calls before the first batch: {ours}"
    assert zephons and zephons[0] == 64, f"read calls at Zephon's default: {zephons}"


def _tokenizer_calls(monkeypatch) -> dict:
    """Records every fast-tokenizer call of this process: ``objects`` (the ids of the tokenizers called) and
    ``texts`` (how many texts they were given)."""
    import transformers

    calls = {"objects": set(), "texts": 0}
    original = transformers.TokenizersBackend.__call__

    def recording(self, *args, **kwargs):
        texts = args[0] if args else kwargs.get("text")
        calls["objects"].add(id(self))
        calls["texts"] += len(texts) if isinstance(texts, list) else 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(transformers.TokenizersBackend, "__call__", recording)
    return calls


@pytest.mark.parametrize("runner", ["inline", "threads"])
def test_every_epoch_tokenizes_with_the_one_loaded_tokenizer(jsonl_sources, tokenizer_dir, monkeypatch, runner):
    """Zephon deep-copies its tokenize operator at each engine start; a copied (or reloaded) fast tokenizer keeps
    native memory and tokenizes slower pass after pass. The copies must share the loaded one."""
    calls = _tokenizer_calls(monkeypatch)
    config = text_config(jsonl_sources["a"], tokenizer_dir, runtime={"runner": runner, "tokenize_parallelism": 2})
    with build_text_loader(config) as loader:
        passes = [[batch["input_ids"].tolist() for batch in loader] for _ in range(3)]
    assert passes[0] and all(len(p) == len(passes[0]) for p in passes)
    called = calls["objects"]
    assert len(called) == 1, f"{len(called)} tokenizer objects tokenized 3 epochs; expected the one loaded"


def test_shared_tokenizer_is_never_copied_and_pickles_whole(tokenizer_dir):
    import copy
    import pickle

    from zephon_loader.tokenizing import SharedTokenizer

    tokenizer = load_tokenizer(tokenizer_dir, split_special_tokens=True)
    tokenizer.backend_tokenizer.enable_truncation(max_length=4)
    shared = SharedTokenizer(tokenizer)
    assert tokenizer.backend_tokenizer.truncation is None, "threads sharing it would race to switch it off"
    held = copy.deepcopy({"op": [shared]})
    assert held["op"][0] is shared and shared.tokenizer is tokenizer
    expected = tokenizer([SAMPLE], add_special_tokens=False)["input_ids"]
    assert shared([SAMPLE], add_special_tokens=False)["input_ids"] == expected
    assert (shared.eos_token_id, shared.name_or_path, len(shared)) == (
        tokenizer.eos_token_id, tokenizer.name_or_path, len(tokenizer))
    restored = pickle.loads(pickle.dumps(shared))  # the process and ray runners' workers
    assert isinstance(restored, SharedTokenizer) and restored.tokenizer is not tokenizer
    assert restored([SAMPLE], add_special_tokens=False)["input_ids"] == expected


def _records_a_resume_re_reads(config: dict, calls: dict) -> tuple[int, dict]:
    """Records tokenized before the first batch of a resume from 3/4 of the pass (checked to continue the
    uninterrupted pass exactly), and the state's fingerprint."""
    with build_text_loader(config) as loader:
        batches = [batch["input_ids"] for batch in loader]
    with build_text_loader(config) as loader:
        iterator = iter(loader)
        for _ in range(len(batches) * 3 // 4):
            next(iterator)
        state = loader.state_dict()
    with build_text_loader(config) as loader:
        loader.load_state_dict(state)
        calls["texts"] = 0
        iterator = iter(loader)
        first = next(iterator)
        reads = calls["texts"]
        rest = [first["input_ids"]] + [batch["input_ids"] for batch in iterator]
    assert all(a.equal(b) for a, b in zip(rest, batches[len(batches) * 3 // 4:], strict=True)), config
    return reads, state["fingerprint"]


def test_a_resume_re_reads_at_most_the_flush_window(jsonl_sources, tokenizer_dir, monkeypatch):
    """Zephon rebuilds its packing on a restore by re-reading what came since its last flush:
    flush_every_records bounds that (and so the wait for the first resumed batch); the stream stays exact."""
    calls = _tokenizer_calls(monkeypatch)
    resumed_reads = {}
    for window in (None, 20):
        config = text_config(jsonl_sources["a"], tokenizer_dir, flush_every_records=window)
        resumed_reads[window], fingerprint = _records_a_resume_re_reads(config, calls)
        # This pass (100 records) is shorter than the default window: it is not shortened, nothing fingerprinted.
        assert "flush_window" not in fingerprint
    # 100 records in one pass, the state cut after ~75 of them. Before its first batch a resume reads
    # what Zephon re-reads plus what it reads ahead (at most the ~25 left). Without a window Zephon
    # re-reads from the pass' start; with 20, the chunks in flight since its last flush (at most two
    # windows, in whole calls of 8).
    assert resumed_reads[None] >= 75, resumed_reads
    assert resumed_reads[20] <= 2 * 20 + 25 + 8 < 75, resumed_reads


def test_the_default_window_is_shortened_to_the_batch_when_an_epoch_is_longer(jsonl_sources, tokenizer_dir,
                                                                            monkeypatch):
    """Unset flush_every_records flushes at least every DEFAULT_FLUSH_WINDOW_BATCHES batches of shard bytes
    (one token a byte) once an epoch is longer: a resume re-reads that much at most, exactly; the window is
    fingerprinted, and a state of Zephon's unshortened cadence is refused with the way to resume it."""
    from zephon_loader.pipeline import work_source

    calls = _tokenizer_calls(monkeypatch)
    files = sorted(p for p in jsonl_sources["a"].iterdir() if p.suffix == ".jsonl")
    mean_bytes = sum(p.stat().st_size for p in files) / 100
    batches = 20 * mean_bytes / (2 * 33)  # B=2 rows of S+1=33 tokens: a window of about 20 records
    monkeypatch.setattr(work_source, "DEFAULT_FLUSH_WINDOW_BATCHES", round(batches))
    window = int(round(batches) * 2 * 33 // mean_bytes)
    assert 15 <= window <= 25

    reads, fingerprint = _records_a_resume_re_reads(text_config(jsonl_sources["a"], tokenizer_dir), calls)
    assert fingerprint["flush_window"] <= window and reads <= 2 * window + 25 + 8 < 75, (fingerprint, reads)

    # flush_every_records: 0 is Zephon's cadence (the default before): the whole pass, no key, re-read from the start.
    legacy = text_config(jsonl_sources["a"], tokenizer_dir, flush_every_records=0)
    legacy_reads, legacy_fingerprint = _records_a_resume_re_reads(legacy, calls)
    assert legacy_reads >= 75 and "flush_window" not in legacy_fingerprint
    with build_text_loader(legacy) as loader:
        iterator = iter(loader)
        next(iterator)
        state, expected = loader.state_dict(), next(iterator)["input_ids"]
    with build_text_loader(text_config(jsonl_sources["a"], tokenizer_dir)) as loader:
        with pytest.raises(ValueError, match=r"flush_window: this loader flushes every \d+ records per lane .*"
                                             r"set flush_every_records: 0 to resume it"):
            loader.load_state_dict(state)
    with build_text_loader(legacy) as loader:
        loader.load_state_dict(state)
        assert next(iter(loader))["input_ids"].equal(expected)


def test_the_default_window_counts_each_source_at_its_share(jsonl_sources, tokenizer_dir, monkeypatch):
    from zephon_loader.config import text_loader_config
    from zephon_loader.pipeline import work_source

    def config(**extra):
        return text_loader_config(
            sources=[{"name": "a", "path": str(jsonl_sources["a"]), "weight": 3.0},
                     {"name": "b", "path": str(jsonl_sources["b"]), "weight": 1.0}],
            tokenizer={"path": str(tokenizer_dir)}, sequence_length=32, micro_batch_size=2, **extra)

    opened = work_source.open_sources(config())
    mean = [sum(int(i[0]) for i in files.identities) / count for files, count in zip(opened.files, opened.counts)]
    assert mean[0] != mean[1]
    expected = int(work_source.DEFAULT_FLUSH_WINDOW_BATCHES * 2 * 33 // (0.75 * mean[0] + 0.25 * mean[1]))
    assert work_source.default_flush_window(opened, [3.0, 1.0], 2, 33) == expected

    def work(**extra):
        return work_source.build_work_source(config(**extra), lanes=1, sources=opened, batch_shape=(2, 33))

    def cap_at(records):  # the constant that makes the default window about `records`
        monkeypatch.setattr(work_source, "DEFAULT_FLUSH_WINDOW_BATCHES",
                            round(records * (0.75 * mean[0] + 0.25 * mean[1]) / 66))
        return work_source.default_flush_window(opened, [3.0, 1.0], 2, 33)

    epoch = 400  # a pass ends when 'b' (share 1/4, 100 records) was read whole
    assert cap_at(2 * epoch) > epoch and work().flush_window is None  # never reached: Zephon's cadence
    endless = work(passes=None)  # no epoch end: shortened
    assert endless.flush_window is not None and endless.flush_window <= cap_at(2 * epoch)
    assert endless.flush_window == endless.chunk_size * endless.flush_every_k_chunks
    cap = cap_at(epoch // 4)
    short = work()
    assert short.flush_window is not None and short.chunk_size <= short.flush_window <= cap < epoch, (short, cap)
    assert work(flush_every_records=0).flush_window is None  # Zephon's cadence, never shortened
    # An explicit chunk size is kept: whole chunks between flushes, one when a chunk is larger than the window.
    alone = text_loader_config(sources=[{"name": "a", "path": str(jsonl_sources["a"])}], chunk_size=25,
                               tokenizer={"path": str(tokenizer_dir)}, sequence_length=32, micro_batch_size=2)
    for records, chunks in ((60, 2), (10, 1)):
        monkeypatch.setattr(work_source, "DEFAULT_FLUSH_WINDOW_BATCHES", round(records * mean[0] / 66))
        kept = work_source.build_work_source(alone, lanes=1, batch_shape=(2, 33))
        assert (kept.chunk_size, kept.flush_every_k_chunks, kept.flush_window) == (25, chunks, 25 * chunks), kept


def test_flush_every_records_is_checked_and_fingerprinted(jsonl_sources, tokenizer_dir):
    config = text_config(jsonl_sources["a"], tokenizer_dir, chunk_size=25, flush_every_records=10)
    with pytest.raises(ValueError, match=r"dataloader.flush_every_records: got 10, expected at least chunk_size=25"):
        build_text_loader(config)
    with pytest.raises(ValueError, match=r"dataloader.flush_every_records: got -1, expected an int > 0, 0 "):
        build_text_loader(text_config(jsonl_sources["a"], tokenizer_dir, flush_every_records=-1))
    with build_text_loader(text_config(jsonl_sources["a"], tokenizer_dir, flush_every_records=20)) as loader:
        next(iter(loader))
        state = loader.state_dict()
    with build_text_loader(text_config(jsonl_sources["a"], tokenizer_dir)) as loader:
        with pytest.raises(ValueError, match="flush_every_records"):
            loader.load_state_dict(state)



# ----------------------------------------------------------------------------- the tokenizer's own threads


@pytest.mark.parametrize("cores, env, switched_off", [
    (1, None, True), (2, None, True),            # few cores: the pool is switched off
    (3, None, False), (16, None, False),         # more: left alone
    (2, "true", False), (2, "false", False),     # the environment decides: untouched
])
def test_the_tokenizers_pool_is_switched_off_on_two_cores_unless_the_environment_decides(
        monkeypatch, cores, env, switched_off):
    from zephon_loader.tokenizing import TOKENIZERS_PARALLELISM, fit_tokenizer_threads

    if env is None:
        monkeypatch.delenv(TOKENIZERS_PARALLELISM, raising=False)
    else:
        monkeypatch.setenv(TOKENIZERS_PARALLELISM, env)
    assert fit_tokenizer_threads(cores) is switched_off
    import os

    expected = "false" if switched_off else env
    assert os.environ.get(TOKENIZERS_PARALLELISM) == expected


@pytest.mark.parametrize("cores", [2, 8])
def test_building_a_loader_fits_the_tokenizers_pool_to_the_cores(jsonl_sources, tokenizer_dir, monkeypatch, cores):
    import os

    from zephon_loader import tokenizing

    monkeypatch.delenv(tokenizing.TOKENIZERS_PARALLELISM, raising=False)
    monkeypatch.setattr(tokenizing, "available_cores", lambda: cores)
    with build_text_loader(text_config(jsonl_sources["a"], tokenizer_dir)) as loader:
        assert os.environ.get(tokenizing.TOKENIZERS_PARALLELISM) == ("false" if cores <= 2 else None)
        assert next(iter(loader))["input_ids"].shape[0] >= 1


def test_the_tokenizers_pool_changes_no_token(tokenizer_dir, monkeypatch):
    """What the loader switches off is only the library's threading: the same texts give the same ids."""
    import sysconfig
    from pathlib import Path

    from zephon_loader.tokenizing import TOKENIZERS_PARALLELISM

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [path.read_text(errors="replace") for path in sorted(stdlib.glob("*.py"))[:16]]
    tokenizer = load_tokenizer(tokenizer_dir)
    ids = {}
    for setting in ("true", "false"):  # the library reads the variable at every batch call
        monkeypatch.setenv(TOKENIZERS_PARALLELISM, setting)
        ids[setting] = tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert sum(map(len, ids["true"])) > 10_000 and ids["true"] == ids["false"]
