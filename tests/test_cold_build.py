"""A node that has never seen the corpus builds and delivers the first batch without reading the corpus (issue 38).

Before: the build hashed every shard whole (SHA-256, the resume fingerprint) before anything else, so a
fresh cache folder meant reading every byte before the first batch (4.45 s at 3.14 GiB). Now the digests
come from the machine's cache or the folder's manifest (``zephon-loader index``), else they are hashed in
the background after the first batch, and ``state_dict()``/``load_state_dict()`` wait for them: a resume
still refuses any changed shard, a same-size edit in the middle included.

The loader's own reads are counted by wrapping ``open`` in the modules of the loader that read shard files
(Zephon's reads are its own). Reads from a thread other than the test's are held until the first batch was
counted: a loader that needed them for the first batch would show them as read before it.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import collect, write_jsonl_shards
from zephon_loader import build_text_loader

SHARDS = 8
#: Bytes per shard the loader may read itself before the first batch (it reads none today).
PER_SHARD_BUDGET = 4096
_MODULES = ("zephon_loader.pipeline.shards", "zephon_loader.pipeline.formats", "zephon_loader.pipeline.digests")


def corpus(folder: Path, scale: int, texts) -> Path:
    """``scale`` x ~1 MiB of JSONL in 8 shards, with Zephon's index.json."""
    records = [{"text": f"{i} " + (texts[i % len(texts)] + " ") * 12} for i in range(1000 * scale)]
    write_jsonl_shards(folder, records, shards=SHARDS)
    subprocess.run([sys.executable, "-m", "zephon.build_index", "jsonl", str(folder)], check=True,
                   capture_output=True, timeout=300)
    return folder


def config(folder: Path, tokenizer_dir: Path, **extra):
    out = {"sources": [{"name": "web", "path": str(folder)}], "tokenizer": {"path": str(tokenizer_dir)},
           "sequence_length": 64, "micro_batch_size": 2, "read_ahead": 2, "runtime": {"runner": "threads"}}
    out.update(extra)
    return out


class _Counted:
    """A file object whose reads are added to its :class:`ReadCounter`."""

    def __init__(self, handle, counter: "ReadCounter") -> None:
        self._handle, self._counter = handle, counter

    def readinto(self, buffer):
        count = self._handle.readinto(buffer)
        self._counter.add(count or 0)
        return count

    def read(self, *args):
        data = self._handle.read(*args)
        self._counter.add(len(data))
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._handle.close()

    def __getattr__(self, name):
        return getattr(self._handle, name)


class ReadCounter:
    """Bytes the loader's modules read from files under ``folder``; other threads' opens wait for :meth:`release`."""

    def __init__(self, folder: Path) -> None:
        self.folder = str(folder.resolve())
        self.bytes = 0
        self.opened: list[str] = []
        self.gate = threading.Event()
        self.main = threading.current_thread()
        self._lock = threading.Lock()

    def add(self, count: int) -> None:
        with self._lock:
            self.bytes += count

    def open(self, path, mode="r", *args, **kwargs):
        handle = open(path, mode, *args, **kwargs)
        if not str(path).startswith(self.folder):
            return handle
        if threading.current_thread() is not self.main:
            self.gate.wait(60)  # held until the first batch was counted (then it is a read after it)
        self.opened.append(str(path))
        return _Counted(handle, self)

    def release(self) -> None:
        self.gate.set()

    def install(self, monkeypatch) -> None:
        for name in _MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            monkeypatch.setattr(module, "open", self.open, raising=False)


def fresh_cache(monkeypatch, tmp_path: Path, name: str) -> Path:
    cache = tmp_path / name
    monkeypatch.setenv("ZEPHON_LOADER_CACHE", str(cache))
    return cache


def sha16(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def rewrite_middle_same_size(path: Path) -> None:
    data = bytearray(path.read_bytes())
    at = data.index(b'"text": "', data.rindex(b"\n", 0, len(data) // 2)) + len(b'"text": "')
    data[at] = ord("Z") if data[at] != ord("Z") else ord("Y")
    path.write_bytes(bytes(data))


def no_hashing_thread() -> bool:
    return not any(t.name == "zephon-loader-digests" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("scale", [1, 8])
def test_a_cold_build_reads_no_shard_byte_before_the_first_batch(scale, tmp_path, monkeypatch, tokenizer_dir,
                                                                 corpus_texts):
    """Before: 1x read 1,106,610 bytes and 8x 8,860,650 (every byte) before the first batch. Now 0 at both; the
    state after it still carries every shard's SHA-256."""
    folder = corpus(tmp_path / f"x{scale}", scale, corpus_texts)
    total = sum(p.stat().st_size for p in folder.glob("*.jsonl"))
    fresh_cache(monkeypatch, tmp_path, "cache")
    counter = ReadCounter(folder)
    counter.install(monkeypatch)
    try:
        with build_text_loader(config(folder, tokenizer_dir)) as loader:
            next(iter(loader))
            before_first = counter.bytes
            counter.release()
            state = loader.state_dict()
    finally:
        counter.release()
    assert before_first <= PER_SHARD_BUDGET * SHARDS, (
        f"the loader read {before_first} of the corpus' {total} bytes itself before the first batch")
    assert no_hashing_thread()
    assert state["fingerprint"]["shards"]["web"] == [
        [p.name, p.stat().st_size, sha16(p)] for p in sorted(folder.glob("*.jsonl"))]


def test_a_state_saved_while_the_digests_are_hashed_waits_and_a_same_size_edit_is_refused(
        tmp_path, monkeypatch, tokenizer_dir, corpus_texts):
    """The hashing is held back while the state is taken: ``state_dict()`` waits for it. On a fresh machine the
    unchanged corpus resumes at the next batch; a same-size edit in the middle of a shard is refused."""
    folder = corpus(tmp_path / "c", 2, corpus_texts)
    cfg = config(folder, tokenizer_dir)
    fresh_cache(monkeypatch, tmp_path, "node-a")
    counter = ReadCounter(folder)
    counter.install(monkeypatch)
    timer = threading.Timer(0.5, counter.release)  # the hashing thread waits at its first open until then
    try:
        with build_text_loader(cfg) as loader:
            iterator = iter(loader)
            next(iterator)
            timer.start()
            assert counter.bytes == 0
            state = loader.state_dict()  # waits for the held hashing
            following = next(iterator)
    finally:
        timer.cancel()
        counter.release()
    assert counter.bytes >= sum(p.stat().st_size for p in folder.glob("*.jsonl"))  # hashed after the first batch
    assert [entry[2] for entry in state["fingerprint"]["shards"]["web"]] == [
        sha16(p) for p in sorted(folder.glob("*.jsonl"))]

    fresh_cache(monkeypatch, tmp_path, "node-b")  # resumed on another new machine: unchanged data resumes
    with build_text_loader(cfg) as loader:
        loader.load_state_dict(state)
        resumed = next(iter(loader))
    assert all(bool((resumed[k] == following[k]).all()) for k in ("input_ids", "labels"))

    rewrite_middle_same_size(folder / "part-00003.jsonl")
    subprocess.run([sys.executable, "-m", "zephon.build_index", "jsonl", str(folder)], check=True,
                   capture_output=True, timeout=300)
    fresh_cache(monkeypatch, tmp_path, "node-c")
    with build_text_loader(cfg) as loader:
        with pytest.raises(ValueError, match=r"state_dict\.fingerprint: .*\(shards: source 'web': "
                                             r"part-00003\.jsonl changed\)"):
            loader.load_state_dict(state)


def test_a_cold_build_delivers_the_batches_a_warm_one_does(tmp_path, monkeypatch, tokenizer_dir, corpus_texts):
    """Deferring the digests changes no batch."""
    folder = corpus(tmp_path / "c", 1, corpus_texts)
    cfg = config(folder, tokenizer_dir)
    fresh_cache(monkeypatch, tmp_path, "cold")
    with build_text_loader(cfg) as loader:
        cold = collect(loader, limit=6)
        loader.state_dict()  # the digests are in the cache now
    with build_text_loader(cfg) as loader:
        assert loader._shard_digests is None  # warm: known at build
        warm = collect(loader, limit=6)
    assert len(cold) == len(warm) == 6
    assert all(bool((a[k] == b[k]).all()) for a, b in zip(cold, warm) for k in ("input_ids", "labels"))


def test_a_shard_changed_before_it_was_hashed_is_named_by_state_dict(tmp_path, monkeypatch, tokenizer_dir,
                                                                    corpus_texts):
    folder = corpus(tmp_path / "c", 1, corpus_texts)
    fresh_cache(monkeypatch, tmp_path, "cache")
    counter = ReadCounter(folder)  # the hashing thread waits at its first open until the shard was rewritten
    counter.install(monkeypatch)
    with build_text_loader(config(folder, tokenizer_dir, read_ahead=0)) as loader:
        next(iter(loader))
        rewrite_middle_same_size(folder / "part-00005.jsonl")
        counter.release()
        with pytest.raises(ValueError, match=r"shard changed while the loader ran \(.*part-00005\.jsonl: rewritten "
                                             r"\(same size, modified\)\) before its SHA-256 was computed"):
            loader.state_dict()


def test_closing_the_loader_stops_the_hashing(tmp_path, monkeypatch, tokenizer_dir, corpus_texts):
    """The hashing thread is held at its first open until the loader's close cancels it: it stops within one
    read, and no thread is left."""
    from zephon_loader.pipeline import digests

    folder = corpus(tmp_path / "c", 4, corpus_texts)
    sizes = sorted(p.stat().st_size for p in folder.glob("*.jsonl"))
    fresh_cache(monkeypatch, tmp_path, "cache")
    counter = ReadCounter(folder)
    counter.install(monkeypatch)
    timer = threading.Timer(0.3, counter.release)
    cancel = digests.Digests.cancel

    def cancel_then_release(self):
        timer.start()  # the held open goes on while cancel() waits for the thread
        cancel(self)

    monkeypatch.setattr(digests.Digests, "cancel", cancel_then_release)
    loader = build_text_loader(config(folder, tokenizer_dir))
    try:
        next(iter(loader))
        started = time.monotonic()
        loader.close()
        assert time.monotonic() - started < 60
    finally:
        timer.cancel()
        counter.release()
        loader.close()
    assert no_hashing_thread()
    assert counter.bytes <= sizes[-1], "it went on past the file it had open"
    assert not list((tmp_path / "cache").glob("digests/*.json")), "no digest was recorded"


# ----------------------------------------------------------------------------- the manifest


def test_with_a_manifest_nothing_is_hashed_and_a_changed_file_is_hashed_again_with_a_warning(
        tmp_path, monkeypatch, capsys, tokenizer_dir, corpus_texts):
    from zephon_loader.cli import main
    from zephon_loader.pipeline import digests

    folder = corpus(tmp_path / "c", 1, corpus_texts)
    assert main(["index", str(folder)]) == 0
    assert f"wrote {folder.resolve() / digests.MANIFEST_NAME}: {SHARDS} files" in capsys.readouterr().out
    cfg = config(folder, tokenizer_dir)

    def refuse(*args, **kwargs):
        raise AssertionError("a digest was computed although the manifest holds it")

    monkeypatch.setattr(digests, "file_sha256", refuse)
    fresh_cache(monkeypatch, tmp_path, "node-a")
    with build_text_loader(cfg) as loader:
        assert loader._shard_digests is None  # known at build
        next(iter(loader))
        state = loader.state_dict()
    fresh_cache(monkeypatch, tmp_path, "node-b")
    with build_text_loader(cfg) as loader:
        loader.load_state_dict(state)
        next(iter(loader))
    monkeypatch.undo()

    rewrite_middle_same_size(folder / "part-00002.jsonl")  # same size: its mtime and ctime changed
    subprocess.run([sys.executable, "-m", "zephon.build_index", "jsonl", str(folder)], check=True,
                   capture_output=True, timeout=300)
    fresh_cache(monkeypatch, tmp_path, "node-c")
    with pytest.warns(RuntimeWarning, match=r"zephon_loader\.digests\.json does not describe 1 of 8 files as they "
                                            r"are \(part-00002\.jsonl was modified.*zephon-loader index "):
        loader = build_text_loader(cfg)
    with loader:
        with pytest.raises(ValueError, match=r"\(shards: source 'web': part-00002\.jsonl changed\)"):
            loader.load_state_dict(state)


def test_a_malformed_manifest_stops_the_build_naming_the_command(tmp_path, monkeypatch, tokenizer_dir,
                                                                 corpus_texts):
    folder = corpus(tmp_path / "c", 1, corpus_texts)
    (folder / "zephon_loader.digests.json").write_text(json.dumps({"files": []}), encoding="utf-8")
    fresh_cache(monkeypatch, tmp_path, "cache")
    with pytest.raises(ValueError, match=r"zephon_loader\.digests\.json: got a file that is not a zephon_loader "
                                         r"digest manifest .*zephon-loader index .*, or delete it"):
        build_text_loader(config(folder, tokenizer_dir))


def test_the_index_command_refuses_a_url_and_a_missing_folder(tmp_path, capsys):
    from zephon_loader.cli import main

    assert main(["index", "s3://bucket/prefix"]) == 2
    assert "objects on storage are identified by their ETags" in capsys.readouterr().err
    assert main(["index", str(tmp_path / "missing")]) == 2
    assert "an existing directory of .jsonl or .parquet shards" in capsys.readouterr().err
