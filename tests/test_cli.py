"""The ``zephon-loader`` command line: ``run`` and ``inspect`` (in process, and as ``python -m``)."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from zephon_loader import cli
from zephon_loader import fields as F

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: What the bundled default (fa4 contract) yields.
DEMO_FIELDS = (
    F.INPUT_IDS, F.LABELS, F.POSITION_IDS, F.PADDING_MASK, F.ATTENTION_MASK,
    F.PACKED_TOKEN_INDICES, F.CU_SEQLENS, F.MAX_SEQLEN, F.PACKED_SEQ_IDS,
)


@pytest.fixture
def loader_yaml(tmp_path, jsonl_sources, tokenizer_dir):
    """A tmp YAML with paths relative to its own folder (so base_dir handling is exercised)."""

    def write(name="loader.yaml", **overrides):
        folder = tmp_path / "configs"
        folder.mkdir(exist_ok=True)
        block = {
            "_target_": "zephon_loader.ZephonDataloaderConfig",
            "sources": [
                {"name": key, "path": os.path.relpath(path, folder), "weight": 1.0}
                for key, path in sorted(jsonl_sources.items())
            ],
            "tokenizer": {"path": os.path.relpath(tokenizer_dir, folder)},
            "sequence_length": 48,
            "micro_batch_size": 3,
            "contract": {"attn_implementation": "fa4"},
            "seed": 3,
            "runtime": {"runner": "threads"},
        }
        block.update(overrides)
        path = folder / name
        path.write_text(yaml.safe_dump({"dataloader": block}))
        return path

    return write


def _value(out: str, label: str) -> str:
    match = re.search(rf"^\s*{re.escape(label)}\s+(\S+)", out, re.MULTILINE)
    assert match, f"{label!r} missing from:\n{out}"
    return match.group(1)


def _stats(batches) -> dict[str, float]:
    """The report's statistics, computed independently from the yielded batches."""
    positions = sum(b[F.PADDING_MASK].numel() for b in batches)
    padding = sum(int(b[F.PADDING_MASK].sum()) for b in batches)
    supervised = sum(int((b[F.LABELS] != F.IGNORE_INDEX).sum()) for b in batches)
    rows = sum(b[F.PADDING_MASK].shape[0] for b in batches)
    documents = sum(int(b[F.ATTENTION_MASK].max(dim=1).values.sum()) for b in batches)  # fa4: ids [B, S]
    return {
        "padding_fraction": round(padding / positions, 4),
        "label_supervised_fraction": round(supervised / positions, 4),
        "documents_per_row": round(documents / rows, 2),
    }


# ----------------------------------------------------------------------------- run


def test_run_bundled_default_prints_the_report(capsys):
    assert cli.main(["run", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "demo.yaml" in out
    assert _value(out, "batches") == "3"
    assert int(_value(out, "tokens/s (non-padding)").replace(",", "")) > 0
    assert 0.0 <= float(_value(out, "padding fraction")) <= 1.0
    assert float(_value(out, "documents per row")) >= 1.0
    assert 0.0 < float(_value(out, "label-supervised frac.")) <= 1.0
    assert "yielded fields:" in out
    listed = out.split("yielded fields:", 1)[1]
    for name in DEMO_FIELDS:
        assert re.search(rf"^\s+{re.escape(name)}\s+\S", listed, re.MULTILINE), name
    assert re.search(rf"^\s+{F.INPUT_IDS}\s+int64\s+\[4, 256\]", listed, re.MULTILINE)


def test_run_config_reports_what_the_loader_yields(capsys, loader_yaml, tmp_path):
    path = loader_yaml()
    report_path = tmp_path / "report.json"
    assert cli.main(["run", str(path), "--json", str(report_path)]) == 0  # no --steps: one full pass
    out = capsys.readouterr().out
    report = json.loads(report_path.read_text())

    with cli.build_from_yaml(path) as loader:
        batches = list(loader)
    assert report["batches"] == len(batches) > 5
    assert report["config"] == str(path.resolve())
    for key, value in _stats(batches).items():
        assert report[key] == value, key
    assert report["tokens_per_s"] > 0 and report["build_s"] >= 0 and report["iterate_s"] > 0
    assert list(report["fields"]) == list(batches[0])
    assert report["fields"][F.INPUT_IDS].split() == ["int64", "[3,", "48]"]
    assert _value(out, "padding fraction") == f"{report['padding_fraction']:.4f}"
    assert _value(out, "label-supervised frac.") == f"{report['label_supervised_fraction']:.4f}"


def test_run_steps_and_json(capsys, loader_yaml, tmp_path):
    report_path = tmp_path / "out" / "r.json"
    report_path.parent.mkdir()
    assert cli.main(["run", str(loader_yaml()), "--steps", "2", "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["batches"] == 2
    assert set(report) >= {
        "config", "batches", "tokens_per_s", "padding_fraction", "documents_per_row",
        "label_supervised_fraction", "fields",
    }
    assert set(DEMO_FIELDS) <= set(report["fields"])
    capsys.readouterr()


def test_cli_and_build_text_loader_read_yaml_the_same_way(capsys, jsonl_sources, tokenizer_dir, tmp_path):
    """One reader: ``_target_`` optional for both, relative paths against the file, foreign targets refused."""
    from zephon_loader import build_text_loader

    folder = tmp_path / "alt"
    folder.mkdir()
    node = {
        "sources": [{"name": "a", "path": os.path.relpath(jsonl_sources["a"], folder)}],
        "tokenizer": {"path": os.path.relpath(tokenizer_dir, folder)},
        "sequence_length": 32,
        "micro_batch_size": 2,
        "runtime": {"runner": "threads"},
    }
    path = folder / "no_target.yaml"
    path.write_text(yaml.safe_dump({"dataloader": node}))
    assert cli.main(["run", str(path), "--steps", "2"]) == 0
    assert _value(capsys.readouterr().out, "batches") == "2"
    with build_text_loader(path) as loader:
        assert next(iter(loader))["input_ids"].shape == (2, 32)
    foreign = folder / "foreign.yaml"
    foreign.write_text(yaml.safe_dump({"dataloader": {"_target_": "zephon_loader.build_text_loader", **node}}))
    assert cli.main(["run", str(foreign)]) == 2
    err = capsys.readouterr().err
    assert "_target_: got 'zephon_loader.build_text_loader'" in err and str(foreign) in err
    with pytest.raises(ValueError, match=r"_target_: got 'zephon_loader.build_text_loader'"):
        build_text_loader(foreign)


@pytest.mark.parametrize("command", ["run", "inspect"])
def test_missing_config_exits_2_with_a_clear_message(capsys, tmp_path, command):
    missing = tmp_path / "nope.yaml"
    extra = ["--out", str(tmp_path / "x.png")] if command == "inspect" else []
    assert cli.main([command, str(missing), *extra]) == 2
    err = capsys.readouterr().err
    assert "zephon-loader: error:" in err and str(missing) in err and "does not exist" in err
    assert "Traceback" not in err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("- just\n- a list\n", "expected a mapping"),
        (yaml.safe_dump({"loader": {"sequence_length": 8}}), "expected a 'dataloader' mapping"),
        ("dataloader:\n  seed: 1\n  x: y: z\n", "bad.yaml:3:"),
    ],
)
def test_malformed_config_exits_2(capsys, tmp_path, content, match):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    assert cli.main(["run", str(path)]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"shuffel": True}, r"dataloader\.shuffel: unknown key"),
        ({"sequence_length": "48"}, "expected an int"),
        # an empty stream is a config problem, not a crash
        ({"on_bad_record": "skip", "max_record_tokens": 1}, "yielded no batch.*every record was dropped"),
    ],
)
def test_bad_config_values_exit_2(capsys, loader_yaml, overrides, match):
    assert cli.main(["run", str(loader_yaml(**overrides))]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err
    assert "Traceback" not in err


def test_nonpositive_steps_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as error:
        cli.main(["run", "--steps", "0"])
    assert error.value.code == 2
    assert "--steps" in capsys.readouterr().err


# ----------------------------------------------------------------------------- inspect


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_inspect_bundled_default_writes_a_png(capsys, tmp_path):
    out = tmp_path / "sub" / "batch.png"
    assert cli.main(["inspect", "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    data = out.read_bytes()
    width, height = _png_size(data)
    assert width > 500 and height > 500
    assert len(data) > 20_000  # four drawn panels, not an empty canvas


def test_inspect_config_and_row(capsys, loader_yaml, tmp_path):
    out = tmp_path / "b.png"
    assert cli.main(["inspect", str(loader_yaml()), "--out", str(out), "--row", "99"]) == 0  # row is clamped
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000
    capsys.readouterr()


# ----------------------------------------------------------------------------- entry points


def test_console_script_is_declared():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    target = pyproject["project"]["scripts"]["zephon-loader"]
    assert target == "zephon_loader.cli:main"
    module, _, attribute = target.partition(":")
    assert getattr(__import__(module, fromlist=[attribute]), attribute) is cli.main

    from importlib.metadata import PackageNotFoundError, entry_points, version

    try:
        version("zephon-loader")
    except PackageNotFoundError:
        return  # not installed: the declaration is what ships
    (entry,) = entry_points(group="console_scripts", name="zephon-loader")
    assert entry.value == target


def test_python_dash_m_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    result = subprocess.run(
        [sys.executable, "-m", "zephon_loader.cli", "run", "--steps", "2"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stderr
    assert _value(result.stdout, "batches") == "2"
    assert "tokens/s" in result.stdout and "yielded fields:" in result.stdout
    assert result.stdout.count(F.INPUT_IDS) == 1


def test_run_reports_deliveries_and_drops(capsys, loader_yaml, tmp_path):
    """first_fit with rows shorter than some documents: the drops are in the printed report and in --json."""
    report_path = tmp_path / "drops.json"
    path = loader_yaml(sequence_length=16, packing={"algorithm": "first_fit"})
    assert cli.main(["run", str(path), "--json", str(report_path)]) == 0
    out = capsys.readouterr().out
    report = json.loads(report_path.read_text())
    longer = report["dropped"]["longer_than_row"]
    assert longer["documents"] > 0 and longer["tokens"] > 17 * longer["documents"]
    assert re.search(rf"^\s+longer_than_row\s+{longer['documents']:,} documents, {longer['tokens']:,} tokens; "
                     r"first at source '[ab]', shard .*part-0000[01]\.jsonl, line \d+$", out, re.MULTILINE)
    for name in ("a", "b"):
        delivered = report["sources"][name]["delivered"]
        dropped = report["sources"][name]["dropped"].get("longer_than_row", {"documents": 0})["documents"]
        assert delivered["documents"] > 0
        assert delivered["documents"] + dropped == 100  # every record of the pass: delivered once, or counted
        assert re.search(rf"source '{name}'\s+{delivered['documents']:,} documents", out)
