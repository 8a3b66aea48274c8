"""What the loader reads is what the shards hold: no stale decoded copy, index or catalog, no change unnamed.

Each test names what happened before (zephon_loader 0.x up to the state format 3) and what must happen now.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import collect, write_jsonl_shards
from zephon_loader import build_text_loader
from zephon_loader.errors import BadRecordError


def config(*sources, tokenizer_dir, **extra):
    out = {
        "sources": [{"name": f"s{i}", "path": str(path)} for i, path in enumerate(sources)],
        "tokenizer": {"path": str(tokenizer_dir)},
        "sequence_length": 64,
        "micro_batch_size": 2,
        "read_ahead": 0,
        "runtime": {"runner": "threads"},
    }
    out.update(extra)
    return out


def delivered_documents(cfg) -> int:
    with build_text_loader(cfg) as loader:
        collect(loader)
        return sum(s["delivered"]["documents"] for s in loader.stats()["sources"].values())


def write_gz(path: Path, texts) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"text": t}) + "\n" for t in texts)


def listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


# ----------------------------------------------------------------------------- compressed shards


def test_a_replaced_gz_shard_is_read_anew_and_nothing_is_written_beside_it(tmp_path, corpus_texts, tokenizer_dir):
    """Before: Zephon decoded ``a.jsonl.gz`` into ``a.jsonl.gz.raw`` beside it and, after the .gz was replaced,
    a fresh run delivered the old records (50 of 50 old). Now the decoded copy lives in the loader's cache,
    keyed by content: the new records arrive, and the data folder is never written to."""
    folder = tmp_path / "gz"
    write_gz(folder / "a.jsonl.gz", corpus_texts[:50])
    cfg = config(folder, tokenizer_dir=tokenizer_dir)
    assert delivered_documents(cfg) == 50
    write_gz(folder / "a.jsonl.gz", corpus_texts[100:160])
    assert delivered_documents(cfg) == 60
    assert listing(folder) == ["a.jsonl.gz"], "nothing may be written into the data folder"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders; the test above checks no write")
def test_a_gz_source_on_a_read_only_folder(tmp_path, corpus_texts, tokenizer_dir):
    folder = tmp_path / "ro"
    write_gz(folder / "a.jsonl.gz", corpus_texts[:30])
    folder.chmod(0o555)
    try:
        assert delivered_documents(config(folder, tokenizer_dir=tokenizer_dir)) == 30
    finally:
        folder.chmod(0o755)


def test_malformed_json_in_a_gz_shard_names_the_shard_and_line(tmp_path, corpus_texts, tokenizer_dir):
    """Before: "none found on re-reading the shards: were they changed while the loader ran?". Now the line."""
    folder = tmp_path / "gzbad"
    lines = [json.dumps({"text": t}) for t in corpus_texts[:20]]
    lines[6] = '{"text": "unterminated'
    folder.mkdir()
    with gzip.open(folder / "a.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
    with build_text_loader(config(folder, tokenizer_dir=tokenizer_dir)) as loader:
        with pytest.raises(BadRecordError, match=r"a\.jsonl\.gz, line 7: not valid JSON"):
            collect(loader)


# ----------------------------------------------------------------------------- shard content on resume


def _rewrite_middle_same_size(path: Path) -> None:
    """One character of a record in the middle of the file changed: same size, same record count."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    at = data.index(b'"text": "', data.rindex(b"\n", 0, middle)) + len(b'"text": "')
    data[at] = ord("Z") if data[at] != ord("Z") else ord("Y")
    path.write_bytes(bytes(data))


def test_a_same_size_edit_in_the_middle_of_a_shard_is_refused_on_resume(tmp_path, corpus_texts, tokenizer_dir):
    """Before: the fingerprint hashed the first and last 64 KiB: an edit in the middle of a large shard that
    kept its size was accepted and the changed documents arrived. Now every byte counts; the message names
    the one shard."""
    texts = [(t + " ") * 8 for t in corpus_texts * 6]
    folder = write_jsonl_shards(tmp_path / "big", [{"text": t} for t in texts], shards=2)
    shard = folder / "part-00001.jsonl"
    assert shard.stat().st_size > 3 * 64 * 1024, "the edit must be outside the first and last 64 KiB"
    cfg = config(folder, tokenizer_dir=tokenizer_dir)
    with build_text_loader(cfg) as loader:
        collect(loader, limit=2)
        state = loader.state_dict()
    _rewrite_middle_same_size(shard)
    with build_text_loader(cfg) as loader:
        with pytest.raises(ValueError, match=r"state_dict\.fingerprint: .*\(shards: source 's0': "
                                             r"part-00001\.jsonl changed\)") as caught:
            loader.load_state_dict(state)
    assert "part-00000" not in str(caught.value)


def test_one_changed_shard_of_400_is_named_in_a_short_message(tmp_path, corpus_texts, tokenizer_dir):
    """Before: the refusal printed both shard lists (39,378 characters for 400 shards)."""
    folder = write_jsonl_shards(tmp_path / "many", [{"text": t} for t in corpus_texts[:800]], shards=400)
    cfg = config(folder, tokenizer_dir=tokenizer_dir)
    with build_text_loader(cfg) as loader:
        collect(loader, limit=1)
        state = loader.state_dict()
    with open(folder / "part-00123.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"text": "one more"}) + "\n")
    with build_text_loader(cfg) as loader:
        with pytest.raises(ValueError) as caught:
            loader.load_state_dict(state)
    message = str(caught.value)
    assert "part-00123.jsonl changed" in message and len(message) < 400, message


# ----------------------------------------------------------------------------- shards changing during a run


def test_a_shard_added_during_a_run_is_not_read_and_a_changed_one_is_named(tmp_path, corpus_texts, tokenizer_dir):
    """Before: the next epoch's pipeline rediscovered the folder and read a shard added mid-run, while the
    state's fingerprint listed the old shard set. Now every epoch reads the shards fixed at the build, and a
    shard changed since then stops the next epoch with its name."""
    folder = write_jsonl_shards(tmp_path / "grow", [{"text": t} for t in corpus_texts[:40]], shards=2)
    with build_text_loader(config(folder, tokenizer_dir=tokenizer_dir)) as loader:
        collect(loader)
        first = loader.stats()["sources"]["s0"]["delivered"]["documents"]
        write_jsonl_shards(tmp_path / "extra", [{"text": t} for t in corpus_texts[200:230]], shards=1)
        os.replace(tmp_path / "extra" / "part-00000.jsonl", folder / "part-00009.jsonl")
        collect(loader)
        assert loader.stats()["sources"]["s0"]["delivered"]["documents"] == first == 40
        with open(folder / "part-00000.jsonl", "r+", encoding="utf-8") as handle:
            handle.truncate(10)
        with pytest.raises(ValueError, match=r"shards changed while the loader ran \(source 's0', "
                                             r".*part-00000\.jsonl: \d+ -> 10 bytes\).*build a new loader"):
            collect(loader)


@pytest.mark.parametrize("change", ["removed", "truncated"])
def test_a_shard_removed_or_truncated_before_it_is_read_is_named(tmp_path, corpus_texts, tokenizer_dir, change):
    """Before: ``FileNotFoundError: Shard raw file missing: dataset=a shard=2`` / ``ValueError: Raw shard
    truncated: expected >= 82331 bytes, got 41230``: no source, no path. Now both are named."""
    folder = write_jsonl_shards(tmp_path / "gone", [{"text": t} for t in corpus_texts[:60]], shards=3)
    with build_text_loader(config(folder, tokenizer_dir=tokenizer_dir)) as loader:
        shard = folder / "part-00001.jsonl"
        if change == "removed":
            shard.unlink()
        else:
            with open(shard, "r+", encoding="utf-8") as handle:
                handle.truncate(shard.stat().st_size // 2)
        with pytest.raises(ValueError, match=r"shards changed while the loader ran \(source 's0', "
                                             r".*part-00001\.jsonl: (removed|\d+ -> \d+ bytes)\)"):
            collect(loader)


# ----------------------------------------------------------------------------- Zephon's index and catalog


def build_index(folder: Path) -> None:
    subprocess.run([sys.executable, "-m", "zephon.build_index", "jsonl", str(folder)], check=True,
                   capture_output=True, timeout=300)


def test_a_stale_zephon_index_is_refused_and_a_fresh_one_is_used(tmp_path, corpus_texts, tokenizer_dir):
    """Before: with an index.json in the folder, 25 records appended afterwards were never read (0 of 25, no
    drop counted). Now a stale index stops the build, naming the file and the rebuild command."""
    folder = write_jsonl_shards(tmp_path / "indexed", [{"text": t} for t in corpus_texts[:50]], shards=2)
    build_index(folder)
    cfg = config(folder, tokenizer_dir=tokenizer_dir)
    assert delivered_documents(cfg) == 50
    with open(folder / "part-00000.jsonl", "a", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"text": f"appended record {i}"}) + "\n" for i in range(25))
    with pytest.raises(ValueError, match=r"index\.json.*stale \(part-00000\.jsonl has \d+ bytes, the index says \d+\)"
                                         r".*python -m zephon\.build_index jsonl "):
        build_text_loader(cfg)
    build_index(folder)
    assert delivered_documents(cfg) == 75


def test_a_same_size_edit_that_changes_the_record_count_does_not_break_later_runs(tmp_path, tokenizer_dir):
    """Before: Zephon's catalog (cached by file names and sizes) kept the old count and every later fresh run
    on the machine failed with "Catalog for dataset 'a' disagrees with count-only discovery" until it was
    cleared by hand. Now the loader drops the catalog of a folder whose files changed."""
    folder = tmp_path / "recount"
    folder.mkdir()
    lines = [json.dumps({"text": f"record number {i} of the shard"}) for i in range(40)]
    (folder / "a.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = config(folder, tokenizer_dir=tokenizer_dir)
    assert delivered_documents(cfg) == 40
    merged = json.dumps({"text": "record number 0 of the shard and record number 1 of the shard"})
    pair = len(lines[0]) + 1 + len(lines[1])
    assert len(merged) <= pair
    edited = [merged + " " * (pair - len(merged))] + lines[2:]
    (folder / "a.jsonl").write_text("\n".join(edited) + "\n", encoding="utf-8")
    assert delivered_documents(cfg) == 39


# ----------------------------------------------------------------------------- two sources, one folder


def test_two_sources_on_one_folder_are_refused(tmp_path, corpus_texts, tokenizer_dir):
    """Before: two sources on one folder (directly or through a symlink) delivered every record twice."""
    folder = write_jsonl_shards(tmp_path / "one", [{"text": t} for t in corpus_texts[:20]], shards=2)
    (tmp_path / "link").symlink_to(folder)
    for other in (folder, tmp_path / "link"):
        with pytest.raises(ValueError, match=r"dataloader\.sources\[1\]\.path \('s1'\).*dataloader\.sources\[0\]"
                                             r"\.path \('s0'\) reads the folder .* too.*delivered\s+twice"):
            build_text_loader(config(folder, other, tokenizer_dir=tokenizer_dir))
    (tmp_path / "two").mkdir()
    os.link(folder / "part-00000.jsonl", tmp_path / "two" / "part-00000.jsonl")
    with pytest.raises(ValueError, match=r"reads a shard file \(the same inode\)"):
        build_text_loader(config(folder, tmp_path / "two", tokenizer_dir=tokenizer_dir))


# ----------------------------------------------------------------------------- object storage without its client


@pytest.mark.parametrize(("url", "extra"), [("s3://bucket/web", "s3"), ("gs://bucket/web", "gcs"),
                                            ("az://container/web", "azure")])
def test_a_url_without_the_object_store_client_names_the_pip_command(monkeypatch, tokenizer_dir, url, extra):
    """Before: every URL was refused ("expected a local directory"). Now a URL is read, and without Zephon's
    cloud client (obstore) the build says in one line which extra installs it."""
    monkeypatch.setitem(sys.modules, "obstore", None)  # import obstore -> ImportError
    with pytest.raises(ValueError) as missing:
        build_text_loader(config(url, tokenizer_dir=tokenizer_dir))
    assert f"pip install 'zephon-loader[{extra}]'" in str(missing.value) and url in str(missing.value)


def test_a_pkg_source_is_the_package_data_folder_not_a_url(tokenizer_dir):
    """``pkg://corpus/stories`` has ``://`` in it but is the package's own data folder (configs/bench.yaml):
    it is read as a local folder, never sent to the object-store branch."""
    with build_text_loader(config("pkg://corpus/stories", tokenizer_dir=tokenizer_dir)) as loader:
        assert collect(loader, 1)
    from zephon_loader.pipeline.object_store import is_url

    assert not is_url("pkg://corpus/stories") and is_url("s3://bucket/x")
