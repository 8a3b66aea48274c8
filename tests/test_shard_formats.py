"""Sources in the formats users already have: LitData (``litdata.optimize``), Lance and Vortex read like JSONL.

For each format the same documents are written once in that format and once as
JSONL shards of the same sizes; the text loader on each must deliver the same
batches bit for bit, resume exactly, refuse a state saved before a data file
was edited, and locate a bad record by source, file and row. A Mosaic MDS and
a Hugging Face ``save_to_disk`` folder are recognised and refused with the
reason (see :mod:`zephon_loader.pipeline.formats`). Before this module every
such folder was refused as "a directory containing *.jsonl or *.parquet shards
(none found)", and ``format`` was an unknown key.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import collect, make_texts, text_config, write_jsonl_shards
from zephon_loader import build_text_loader
from zephon_loader.errors import BadRecordError

#: The documents every format holds: 3 shards of 16, 16 and 8 (LitData's chunks of 16).
TEXTS = make_texts(40, seed=7, max_words=20, prefix="fmt")
SPLITS = (16, 16, 8)
#: Per format: the modules its writer and Zephon's reader need (the test is skipped without them).
MODULES = {"litdata": ("litdata",), "lance": ("lance", "pyarrow"), "vortex": ("vortex", "pyarrow")}


def _parts(records):
    out, start = [], 0
    for size in SPLITS:
        out.append(records[start:start + size])
        start += size
    return out


def _litdata_item(record):
    return record


def write_litdata(folder: Path, records) -> tuple[Path, str]:
    import litdata

    litdata.optimize(fn=_litdata_item, inputs=list(records), output_dir=str(folder), chunk_size=SPLITS[0],
                     num_workers=1, mode="overwrite" if folder.exists() else None)
    return folder, "chunk-0-{}.bin"


def write_lance(folder: Path, records) -> tuple[Path, str]:
    import lance
    import pyarrow as pa

    for index, part in enumerate(_parts(records)):
        table = pa.table({"text": pa.array([r["text"] for r in part], type=pa.string())})
        lance.write_dataset(table, str(folder), mode="append" if index else "overwrite")
    return folder, "data/{}"


def write_vortex(folder: Path, records) -> tuple[Path, str]:
    import pyarrow as pa
    import vortex

    folder.mkdir(parents=True, exist_ok=True)
    for index, part in enumerate(_parts(records)):
        table = pa.table({"text": pa.array([r["text"] for r in part], type=pa.string())})
        vortex.io.write(table, str(folder / f"part-{index:05d}.vortex"))
    return folder, "part-{:05d}.vortex"


WRITERS = {"litdata": write_litdata, "lance": write_lance, "vortex": write_vortex}


def _installed(fmt: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in MODULES[fmt])


FORMATS = [pytest.param(fmt, marks=pytest.mark.skipif(not _installed(fmt), reason=(
    f"{', '.join(MODULES[fmt])} not installed (pip install 'zephon-loader[{fmt}]', or bash scripts/dev.sh env)")))
    for fmt in WRITERS]


@pytest.fixture(scope="module")
def jsonl_copy(tmp_path_factory):
    folder = tmp_path_factory.mktemp("jsonl_copy")
    for index, part in enumerate(_parts([{"text": t} for t in TEXTS])):
        write_jsonl_shards(folder / f"p{index}", part, shards=1)
        os.replace(folder / f"p{index}" / "part-00000.jsonl", folder / f"part-{index:05d}.jsonl")
        (folder / f"p{index}").rmdir()
    return folder


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """Per format, a folder holding :data:`TEXTS` (written once per module, on first use)."""
    made: dict[str, Path] = {}

    def get(fmt: str) -> Path:
        if fmt not in made:
            made[fmt] = WRITERS[fmt](tmp_path_factory.mktemp(fmt) / "data", [{"text": t} for t in TEXTS])[0]
        return made[fmt]

    return get


def batches(folder, tokenizer_dir, limit=None, state=None, **extra):
    with build_text_loader(text_config(folder, tokenizer_dir, **extra)) as loader:
        if state is not None:
            loader.load_state_dict(state)
        return collect(loader, limit)


def saved_state(folder, tokenizer_dir, steps=2, **extra):
    with build_text_loader(text_config(folder, tokenizer_dir, **extra)) as loader:
        collect(loader, steps)
        return json.loads(json.dumps(loader.state_dict()))


def assert_same_batches(got, want):
    assert len(got) == len(want) and len(want) > 2
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys() == b.keys(), index
        for key in b:
            if isinstance(b[key], torch.Tensor):
                assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (index, key)
            else:
                assert a[key] == b[key], (index, key)


def with_format(fmt, **extra):
    return {"sources": [{"name": "web", "path": extra.pop("path"), "format": fmt}], **extra}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("given", [True, False], ids=["format-given", "format-detected"])
def test_batches_equal_the_jsonl_copy(fmt, given, copies, jsonl_copy, tokenizer_dir):
    folder = copies(fmt)
    extra = with_format(fmt if given else None, path=str(folder))
    assert_same_batches(batches(folder, tokenizer_dir, **extra), batches(jsonl_copy, tokenizer_dir))


@pytest.mark.parametrize("fmt", FORMATS)
def test_resume_from_a_mid_run_state_is_exact(fmt, copies, tokenizer_dir):
    folder = copies(fmt)
    full = batches(folder, tokenizer_dir)
    state = saved_state(folder, tokenizer_dir, steps=3)
    assert_same_batches(batches(folder, tokenizer_dir, state=state), full[3:])


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_edited_data_file_refuses_the_old_state(fmt, tmp_path, tokenizer_dir):
    records = [{"text": t} for t in TEXTS]
    folder, shard = WRITERS[fmt](tmp_path / "data", records)
    state = saved_state(folder, tokenizer_dir)
    hashed = [name for name, _size, _digest in state["fingerprint"]["shards"]["web"]]
    assert len([n for n in hashed if n.endswith((".bin", ".lance", ".vortex"))]) == len(SPLITS), hashed
    records[20] = {"text": records[20]["text"].upper()}  # one document of the second shard changed
    if fmt == "vortex":
        write_vortex(tmp_path / "new", records)
        os.replace(tmp_path / "new" / "part-00001.vortex", folder / "part-00001.vortex")
    else:
        WRITERS[fmt](folder, records)
    with build_text_loader(text_config(folder, tokenizer_dir)) as loader:
        with pytest.raises(ValueError, match="state_dict.fingerprint") as info:
            loader.load_state_dict(state)
    message = str(info.value)
    assert "source 'web'" in message, message
    if fmt != "lance":  # a Lance rewrite is a new version: new manifest and data files, named as added
        assert f"{shard.format(1)} changed" in message, message


def _bad_records(fmt):
    """:data:`TEXTS` with record 21 (the second shard's row 5) not a string."""
    records = [{"text": t} for t in TEXTS]
    records[21] = {"text": None}
    return records


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_bad_record_is_located_by_source_file_and_row(fmt, tmp_path, tokenizer_dir):
    records = _bad_records(fmt)
    if fmt == "litdata":  # LitData writes one type per field (a number or None there fails to optimize)
        records[21] = {"text": ""}
    folder, shard = WRITERS[fmt](tmp_path / "data", records)
    if fmt == "lance":
        import lance

        shard = shard.format(os.path.basename(lance.dataset(str(folder)).get_fragments()[1].data_files()[0].path))
    else:
        shard = shard.format(1)
    with pytest.raises(BadRecordError) as info:
        batches(folder, tokenizer_dir)
    message = str(info.value)
    assert f"source 'web', shard {os.path.realpath(folder / shard)}, row 5 (0-based)" in message, message
    assert "field 'text'" in message, message


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_missing_package_names_the_extra_to_install(fmt, copies, tokenizer_dir, monkeypatch):
    folder = copies(fmt)
    monkeypatch.setitem(sys.modules, MODULES[fmt][0], None)  # import raises ImportError
    with pytest.raises(ImportError) as info:
        build_text_loader(text_config(folder, tokenizer_dir, **with_format(fmt, path=str(folder))))
    message = str(info.value)
    assert f"pip install 'zephon-loader[{fmt}]'" in message and "dataloader.sources[0]" in message, message
    assert "\n" not in message


def test_the_schema_and_the_format_table_agree():
    from zephon_loader.config.schema import SOURCE_FORMATS, UNREAD_FORMATS
    from zephon_loader.pipeline.formats import FORMATS

    assert SOURCE_FORMATS == tuple(n for n, f in FORMATS.items() if f.unsupported is None)
    assert {n: f.unsupported for n, f in FORMATS.items() if f.unsupported} == UNREAD_FORMATS
    assert all(FORMATS[n].extra == n for n in WRITERS)  # the extras are named like the formats


def test_an_unknown_or_unread_format_is_refused_by_the_schema(jsonl_copy, tokenizer_dir):
    for value, expected in [("jsnl", "Set one of them, or null"), ("mds", "mosaicml-streaming"),
                            ("hf", "to_parquet")]:
        with pytest.raises(ValueError) as info:
            build_text_loader(text_config(jsonl_copy, tokenizer_dir, **with_format(value, path=str(jsonl_copy))))
        message = str(info.value)
        assert message.startswith(f"dataloader.sources[0].format: got {value!r}, expected one of 'jsonl', "
                                  "'parquet', 'litdata', 'lance', 'vortex' or null"), message
        assert expected in message, message


@pytest.mark.parametrize("fmt", ["parquet", "lance", "litdata", "vortex"])
def test_a_format_that_is_not_the_folders_is_refused(fmt, jsonl_copy, tokenizer_dir):
    with pytest.raises(ValueError) as info:
        build_text_loader(text_config(jsonl_copy, tokenizer_dir, **with_format(fmt, path=str(jsonl_copy))))
    message = str(info.value)
    assert message.startswith("dataloader.sources[0].path ('web'): got "), message
    assert "format" in message, message


def test_jsonl_given_as_its_format_reads_as_before(jsonl_copy, tokenizer_dir):
    assert_same_batches(batches(jsonl_copy, tokenizer_dir, **with_format("jsonl", path=str(jsonl_copy))),
                        batches(jsonl_copy, tokenizer_dir))


def test_mds_and_hugging_face_folders_are_recognised_and_refused_with_the_reason(tmp_path, tokenizer_dir):
    mds = tmp_path / "mds"
    mds.mkdir()
    (mds / "index.json").write_text(json.dumps({"version": 2, "shards": [
        {"column_names": ["text"], "column_encodings": ["str"], "samples": 3, "format": "mds",
         "raw_data": {"basename": "shard.00000.mds", "bytes": 10}}]}))
    (mds / "shard.00000.mds").write_bytes(b"0123456789")
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ("state.json", "dataset_info.json"):
        (hf / name).write_text("{}")
    (hf / "data-00000-of-00001.arrow").write_bytes(b"")
    for folder, title, fix in [(mds, "a Mosaic Streaming (MDS) dataset", "mosaicml-streaming"),
                               (hf, "a Hugging Face datasets folder (save_to_disk)", "to_parquet")]:
        with pytest.raises(ValueError) as info:
            build_text_loader(text_config(folder, tokenizer_dir))
        message = str(info.value)
        assert message.startswith(f"dataloader.sources[0].path ('web'): got {title}"), message
        assert fix in message, message


@pytest.mark.parametrize("fmt", [p for p in FORMATS if p.values[0] == "lance"])
def test_a_lance_dataset_written_anew_at_the_same_path_is_read_anew(fmt, tmp_path, tokenizer_dir):
    """Zephon keys its cached shard catalog of a Lance dataset by the manifest path alone: a dataset deleted and
    written again at the same path (same versions, other fragment files) was read through the old catalog
    ("Shard raw file missing"). The loader drops that catalog when the files changed."""
    import shutil

    folder = tmp_path / "data"
    write_lance(folder, [{"text": t} for t in TEXTS])
    batches(folder, tokenizer_dir)
    shutil.rmtree(folder)
    other = [{"text": t.upper()} for t in TEXTS]
    write_lance(folder, other)
    copy = tmp_path / "copy"
    for index, part in enumerate(_parts(other)):
        write_jsonl_shards(copy / f"p{index}", part, shards=1)
        os.replace(copy / f"p{index}" / "part-00000.jsonl", copy / f"part-{index:05d}.jsonl")
    assert_same_batches(batches(folder, tokenizer_dir), batches(copy, tokenizer_dir))


def _stray(folder: Path, kind: str) -> str:
    """A stray file of ``kind`` in ``folder`` (a JSONL shard, or a Parquet shard), its name returned."""
    if kind == "jsonl":
        write_jsonl_shards(folder / "stray", [{"text": "a stray document"}], shards=1)
        os.replace(folder / "stray" / "part-00000.jsonl", folder / "stray.jsonl")
        (folder / "stray").rmdir()
        return "stray.jsonl"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a stray document"]}), folder / "stray.parquet")
    return "stray.parquet"


@pytest.mark.parametrize(("fmt", "stray", "marker"), [
    pytest.param(*case, marks=pytest.mark.skipif(not _installed(case[0]), reason=f"{case[0]} not installed"))
    for case in [("lance", "jsonl", "_versions/"), ("lance", "parquet", "_versions/"),
                 ("litdata", "jsonl", "index.json"), ("vortex", "parquet", ".vortex")]])
@pytest.mark.parametrize("given", [True, False], ids=["format-given", "format-detected"])
def test_a_folder_holding_a_stray_file_of_another_format_is_refused_naming_both(fmt, stray, marker, given,
                                                                                   tmp_path, tokenizer_dir):
    """A Lance folder with a stray ``.jsonl``/``.parquet`` was fingerprinted as Lance while Zephon read the stray
    file (0 of 40 rows delivered, no error); a LitData folder with a JSONL file silently skipped the JSONL."""
    folder = WRITERS[fmt](tmp_path / "data", [{"text": t} for t in TEXTS])[0]
    name = _stray(folder, stray)
    with pytest.raises(ValueError) as info:
        build_text_loader(text_config(folder, tokenizer_dir, **with_format(fmt if given else None, path=str(folder))))
    message = str(info.value)
    assert message.startswith(f"dataloader.sources[0].path ('web'): got {folder} holding the files of 2 formats: "
                              ), message
    assert f"{fmt} (" in message and marker in message and f"{stray} ({name})" in message, message
    assert "expected one format per folder" in message and "give each format its own folder" in message, message
    read = "litdata" if fmt == "litdata" else stray if fmt == "lance" else "vortex"
    assert f"Zephon reads only the {read} files" in message, message
    os.remove(folder / name)
    assert len(batches(folder, tokenizer_dir)) > 2  # the folder alone reads as before


def test_jsonl_and_parquet_in_one_folder_name_the_folder_and_the_files(jsonl_copy, tmp_path, tokenizer_dir):
    folder = tmp_path / "mixed"
    folder.mkdir()
    for path in sorted(jsonl_copy.iterdir()):
        os.symlink(path, folder / path.name)
    _stray(folder, "parquet")
    with pytest.raises(ValueError) as info:
        build_text_loader(text_config(folder, tokenizer_dir))
    message = str(info.value)
    assert (f"got {folder} holding the files of 2 formats: jsonl (part-00000.jsonl, part-00001.jsonl, "
            "part-00002.jsonl); parquet (stray.parquet), expected one format per folder. Zephon reads only the "
            "jsonl files of such a folder, none of the parquet records") in message, message
