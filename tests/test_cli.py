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

from zephon_loader.cli import commands as cli
from zephon_loader.cli.configs import build_from_yaml
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

    with build_from_yaml(path) as loader:
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
    assert cli.main(["inspect", str(loader_yaml()), "--out", str(out), "--row", "2"]) == 0  # B = 3: the last row
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 20_000
    capsys.readouterr()


@pytest.mark.parametrize("row", ["3", "99", "-1"])
def test_inspect_refuses_a_row_outside_the_batch(capsys, loader_yaml, tmp_path, row):
    """--row 99 with B=3 was silently clamped to the last row; now it is refused before anything is built."""
    out = tmp_path / "b.png"
    assert cli.main(["inspect", str(loader_yaml()), "--out", str(out), "--row", row]) == 2
    err = capsys.readouterr().err
    assert f"--row: got {row}, expected a row index in [0, 3) (micro_batch_size is 3" in err
    assert "Traceback" not in err and not out.exists()


def test_inspect_without_matplotlib_names_the_viz_extra(capsys, monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = tmp_path / "b.png"
    assert cli.main(["inspect", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "matplotlib is not installed" in err and "pip install 'zephon-loader[viz]'" in err
    assert "Traceback" not in err and not out.exists()


def test_id_colours_are_categorical_and_padding_is_distinct():
    """Padding was drawn with the colour of a document (tab20 at 0); every class now has its own colour."""
    import numpy as np
    import torch

    from zephon_loader.cli import inspect as cli

    ids = torch.tensor([[1, 1, 2, 3, 3, 0, 0], [1, 2, 3, 4, 5, 6, 7]] + [list(range(1, 8))], dtype=torch.int64)
    ids[2] += 15  # ids 16..22: past the palette length, colours repeat
    padding = torch.zeros_like(ids, dtype=torch.bool)
    padding[0, 6] = True
    colours = cli.id_colours(ids, padding)  # [B, S, 4]
    assert colours.shape == (3, 7, 4)
    assert tuple(colours[0, 6]) == cli.PADDING_RGBA
    assert tuple(colours[0, 5]) == cli.UNATTENDED_RGBA  # id 0, not padding: an ineligible token
    documents = colours[ids > 0]
    assert not any(np.array_equal(c, cli.PADDING_RGBA) or np.array_equal(c, cli.UNATTENDED_RGBA) for c in documents)
    # neighbouring documents of a row never share a colour, and the same id always gets the same colour
    for r in range(3):
        for j in range(6):
            if ids[r, j] != ids[r, j + 1] and ids[r, j + 1] > 0:
                assert not np.array_equal(colours[r, j], colours[r, j + 1]), (r, j)
    assert np.array_equal(colours[0, 2], colours[1, 1])  # id 2 in both rows
    palette = cli._document_palette()
    assert len({tuple(c) for c in palette}) == len(palette)  # no repeated colour
    assert all(not np.allclose(c[0], c[1]) or not np.allclose(c[1], c[2]) for c in palette)  # no grey


def test_draw_batch_panels_have_legends_not_colour_bars(loader_yaml):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from zephon_loader.cli import inspect as cli

    one_open_row = {"algorithm": "first_fit", "num_bins": 1}  # a row closes when the next document does not fit
    with build_from_yaml(loader_yaml(sequence_length=64, packing=one_open_row)) as loader:
        batch = loader.preview()
    figure = cli.draw_batch(batch, 1, "t", xdoc=False)
    try:
        assert len(figure.axes) == 4  # a colour bar would add an axis
        ids_axis, attention_axis, classes_axis, mask_axis = figure.axes
        drawn = ids_axis.images[0].get_array()
        assert np.array_equal(drawn, cli.id_colours(batch[F.DOCUMENT_IDS], batch[F.PADDING_MASK]))
        padding = batch[F.PADDING_MASK].numpy()
        assert padding.any() and (drawn[padding] == cli.PADDING_RGBA).all()
        assert not (drawn[~padding] == cli.PADDING_RGBA).all(axis=-1).any()
        for axis in figure.axes:
            labels = [text.get_text() for text in axis.get_legend().get_texts()]
            assert labels, axis.get_title()
        assert "padding" in [t.get_text() for t in ids_axis.get_legend().get_texts()]
        class_labels = [t.get_text() for t in classes_axis.get_legend().get_texts()]
        assert class_labels[0] == f"padding: {int(padding.sum()):,}"
        assert "row 1" in mask_axis.get_title()
    finally:
        plt.close(figure)


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
    assert re.search(rf"^\s+longer_than_row\s+{longer['documents']:,} documents, {longer['tokens']:,} tokens "
                     r"\(longer than a row: first_fit/best_fit cannot split it\); "
                     r"first at source '[ab]', shard .*part-0000[01]\.jsonl, line \d+$", out, re.MULTILINE)
    assert longer["why"] == "longer than a row: first_fit/best_fit cannot split it"
    hint = (f"packing.algorithm first_fit dropped {longer['documents']:,} documents longer than a row "
            f"(sequence_length + 1 = 17 tokens): use packing.algorithm: wrap to keep long documents (split across rows)")
    assert report["hints"] == [hint]
    assert out.count("hint: ") == 1 and f"  hint: {hint}" in out
    for name in ("a", "b"):
        delivered = report["sources"][name]["delivered"]
        dropped = report["sources"][name]["dropped"].get("longer_than_row", {"documents": 0})["documents"]
        assert delivered["documents"] > 0
        assert delivered["documents"] + dropped == 100  # every record of the pass: delivered once, or counted
        assert re.search(rf"source '{name}'\s+{delivered['documents']:,} documents", out)


def test_every_document_longer_than_a_row_is_one_line_that_steers_to_wrap(capsys, loader_yaml):
    """All dropped under first_fit: the error must not say to lower sequence_length (that drops more)."""
    assert cli.main(["run", str(loader_yaml(sequence_length=2, packing={"algorithm": "first_fit"}))]) == 2
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if line.startswith("zephon-loader: error:"))
    assert "the loader yielded no batch: every record was dropped (longer_than_row: 200 (first at source '" in line
    assert line.endswith("use packing.algorithm: wrap to keep long documents (split across rows), or raise sequence_length")
    assert "lower" not in err and "Traceback" not in err


# ----------------------------------------------------------------------------- failures while iterating


@pytest.fixture
def bad_record_yaml(tmp_path, tokenizer_dir):
    folder = tmp_path / "bad"
    (folder / "shards").mkdir(parents=True)
    lines = [json.dumps({"text": f"document number {i} alpha beta"}) for i in range(40)]
    lines[25] = json.dumps({"text": None})
    (folder / "shards" / "part-00000.jsonl").write_text("\n".join(lines) + "\n")
    path = folder / "bad.yaml"
    path.write_text(yaml.safe_dump({"dataloader": {
        "sources": [{"name": "web", "path": "shards"}], "tokenizer": {"path": str(tokenizer_dir)},
        "sequence_length": 16, "micro_batch_size": 2, "shuffle": False, "runtime": {"runner": "threads"},
    }}))
    return path


def test_bad_record_found_while_iterating_is_one_line(capsys, bad_record_yaml):
    assert cli.main(["run", str(bad_record_yaml)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "zephon-loader: error:" in line]
    assert line.endswith("field 'text' got null, expected a string. Store the document text as one JSON string. "
                         "(or set on_bad_record: skip to leave such records out, counted in loader.stats())")
    assert "source 'web', shard " in line and "part-00000.jsonl, line 26:" in line


def test_worker_crash_of_a_user_error_is_one_line_and_other_crashes_are_bugs():
    """Zephon's process runner re-raises a worker's exception as WorkerCrashed (a RuntimeError)."""
    from zephon._internal.runners.concurrent import WorkerCrashed, WorkerErrorInfo

    message = "source 'web', shard /d/part-00000.jsonl, line 2: field 'text' got null, expected a string."
    crashed = WorkerCrashed(WorkerErrorInfo("BadRecordError", message, "Traceback (most recent call last):\n ..."))
    assert cli._user_error(crashed) == message
    assert cli._user_error(WorkerCrashed(WorkerErrorInfo("FileNotFoundError", "no such file: x", "tb"))) == "no such file: x"
    assert cli._user_error(WorkerCrashed(WorkerErrorInfo("AssertionError", "bug", "tb"))) is None
    assert cli._user_error(WorkerCrashed(WorkerErrorInfo("IndexError", "bug", "tb"))) is None
    assert cli._user_error(RuntimeError("bug")) is None
    assert cli._user_error(ValueError("a\n  multi-line\nmessage")) == "a multi-line message"


def test_a_bug_keeps_its_traceback_and_ctrl_c_is_one_line(capsys, monkeypatch):
    def broken(config, steps):
        raise KeyError("internal")

    monkeypatch.setattr(cli, "run", broken)
    with pytest.raises(KeyError, match="internal"):
        cli.main(["run"])

    def interrupted(config, steps):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run", interrupted)
    assert cli.main(["run"]) == cli.EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == "zephon-loader: interrupted\n"


#: Zephon 0.2.0's PackSequences warning at each flush of an uncapped wrap (pack_sequences.py).
ZEPHON_WRAP_NOTICE = (
    "PackSequences wrap: dropping %s trailing token(s) across %d packing group(s) in %d lane(s) that did not "
    "fill a full max_length=%d bin; emitted %d tombstone(s) to close contributor offsets."
)


def test_zephon_packing_notices_are_summarized_once_in_the_report(capsys, monkeypatch, loader_yaml, tmp_path):
    """Zephon's per-flush lines went to stderr one by one, through the progress bar; now counted and reported once."""
    import logging

    import zephon_loader as builders

    real_build = builders.build_text_loader

    class Noisy:
        """The real loader; Zephon's notice logged (by Zephon's own logger) with every batch."""

        def __init__(self, loader):
            self.loader = loader

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.loader.close()

        def __iter__(self):
            for batch in self.loader:
                logging.getLogger("zephon._internal.ops.pack_sequences").warning(ZEPHON_WRAP_NOTICE, 7, 1, 1, 49, 2)
                yield batch

        def stats(self):
            return self.loader.stats()

    monkeypatch.setattr(builders, "build_text_loader", lambda config: Noisy(real_build(config)))
    report_path = tmp_path / "r.json"
    assert cli.main(["run", str(loader_yaml()), "--steps", "5", "--json", str(report_path)]) == 0
    captured = capsys.readouterr()
    assert "PackSequences" not in captured.err
    report = json.loads(report_path.read_text())
    assert report["zephon_log"] == {"wrap_trailing_tokens_dropped": {
        "log_records": 5, "tokens": 35, "packing_groups": 5, "tombstones": 10, "max_length": 49}}
    (line,) = [line for line in captured.out.splitlines() if "zephon log:" in line]
    assert "wrap dropped 35 trailing token(s) that did not fill a max_length=49 row" in line
    assert "logged by 5 flush(es)" in line
    assert not logging.getLogger("zephon._internal.ops.pack_sequences").filters  # removed after the command
    assert not [h for h in logging.getLogger().handlers if isinstance(h, cli._TqdmLogHandler)]


# ----------------------------------------------------------------------------- --version, --help


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out == f"zephon-loader {version}\n"


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_import_neither_torch_nor_zephon(flag):
    """``zephon-loader --help`` took 7-13 s on a fresh machine: it imported torch first."""
    code = (
        "import sys\n"
        "from zephon_loader.cli.commands import main\n"
        "try:\n"
        f"    main([{flag!r}])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = sorted(m for m in ('torch', 'zephon', 'transformers', 'numpy', 'matplotlib') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "zephon-loader" in result.stdout
    assert result.stdout.strip().endswith("HEAVY []"), result.stdout[-300:]


def test_ctrl_c_during_run_prints_the_report_so_far_and_exits_130(tmp_path):
    """A real SIGINT to ``zephon-loader run`` on an endless stream: the partial report, its JSON, exit 130."""
    import signal

    from zephon_loader.config import default_config_path

    node = yaml.safe_load(default_config_path().read_text())
    node["dataloader"].update(passes=None, base_dir=str(default_config_path().parent))
    config = tmp_path / "endless.yaml"
    config.write_text(yaml.safe_dump(node))
    report = tmp_path / "report.json"
    process = subprocess.Popen([sys.executable, "-m", "zephon_loader.cli", "run", str(config), "--json", str(report)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONFAULTHANDLER": "1"},  # SIGABRT below dumps every thread
                               # A suite started in the background (`nohup pytest &`) ignores SIGINT, and a child
                               # inherits that: give the CLI the default disposition, as a terminal would.
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = ""
    try:
        # Event-based: wait until the progress bar shows a delivered batch ("batches: 1batch ..."), then SIGINT.
        while process.poll() is None and not re.search(r"batches: [1-9]", seen):
            chunk = os.read(process.stderr.fileno(), 256).decode(errors="replace")
            if not chunk:
                break
            seen += chunk
        process.send_signal(signal.SIGINT)
        try:
            out, err = process.communicate(timeout=300)
        except subprocess.TimeoutExpired:  # say where it hangs: faulthandler prints every thread on SIGABRT
            process.send_signal(signal.SIGABRT)
            out, err = process.communicate(timeout=60)
            pytest.fail(f"zephon-loader run did not exit 300 s after SIGINT; its threads:\n{err[-12000:]}")
        err = seen + err
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, err[-2000:]
    assert "(interrupted: the batches read so far)" in out and "tokens/s" in out
    assert "this stream is endless (passes: null)" in err and err.rstrip().endswith("zephon-loader: interrupted")
    saved = json.loads(report.read_text())
    assert saved["interrupted"] is True and saved["batches"] >= 1


def test_the_text_picture_never_draws_the_same_panel_twice(loader_yaml):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from zephon_loader.cli import inspect as cli

    with build_from_yaml(loader_yaml(sequence_length=64)) as loader:
        batch = loader.preview()
    assert bool((batch[F.DOCUMENT_IDS] == batch[F.ATTENTION_DOCUMENT_IDS]).all())
    figure = cli.draw_batch(batch, 0, "t", xdoc=False)
    titles = [axis.get_title() for axis in figure.axes]
    plt.close(figure)
    assert titles[1] == "row 0: positions (restart at 0 at each document)" and "= attention ranges" in titles[0]
    holed = dict(batch, **{F.ATTENTION_DOCUMENT_IDS: batch[F.ATTENTION_DOCUMENT_IDS].clone()})
    holed[F.ATTENTION_DOCUMENT_IDS][0, 1] = 0  # an ineligible token: the ranges differ from the documents
    figure = cli.draw_batch(holed, 0, "t", xdoc=False)
    titles = [axis.get_title() for axis in figure.axes]
    plt.close(figure)
    assert titles[:2] == ["document ids per row", "attention ranges per row (what attention sees)"]


def test_every_error_names_the_configuration_and_the_build_says_what_it_does(capsys, loader_yaml, tmp_path):
    """A newcomer's run: one progress line while the loader is built, the first batch's time, and errors that
    name the YAML file (a missing source folder used to lose it)."""
    good = loader_yaml()
    assert cli.main(["run", str(good), "--steps", "1"]) == 0
    err = capsys.readouterr().err
    assert f"zephon-loader: building the loader of {good} (2 source(s)" in err
    assert re.search(r"zephon-loader: first batch after \d+\.\d\d s", err)
    bad = loader_yaml(name="missing.yaml", sources=[{"name": "web", "path": str(tmp_path / "nope"), "weight": 1}])
    assert cli.main(["run", str(bad)]) == 2
    assert f"zephon-loader: error: {bad}: dataloader.sources[0].path ('web')" in capsys.readouterr().err


def test_a_missing_text_field_names_the_setting_and_whether_any_record_has_it(capsys, loader_yaml, tmp_path):
    folder = tmp_path / "other_field"
    folder.mkdir()
    (folder / "part-0.jsonl").write_text("".join(json.dumps({"content": f"document {i} " * 20}) + "\n"
                                                 for i in range(30)))
    config = loader_yaml(name="field.yaml", sources=[{"name": "web", "path": str(folder), "weight": 1}])
    assert cli.main(["run", str(config), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "none of the 30 records of this shard has 'text'" in err
    assert "Set tokenizer.text_field to the field that holds the text (tokenizer.text_field is 'text' now)" in err


def test_rows_longer_than_the_tokenizers_model_max_length_are_warned_with_both_numbers(
        loader_yaml, tokenizer_dir, tmp_path, capfd):
    """sequence_length beyond model_max_length: one warning naming both numbers and the setting; transformers'
    own "Token indices sequence length is longer ..." (about documents, which the loader packs) stays quiet."""
    import shutil
    import warnings

    from zephon_loader import build_text_loader

    short = tmp_path / "tokenizer_8"
    shutil.copytree(tokenizer_dir, short)
    settings = json.loads((short / "tokenizer_config.json").read_text())
    (short / "tokenizer_config.json").write_text(json.dumps({**settings, "model_max_length": 8}))
    config = loader_yaml(name="long.yaml", tokenizer={"path": str(short)})
    with pytest.warns(UserWarning, match=r"sequence_length: got 48, more than the tokenizer's model_max_length 8 "
                                         r".*Set sequence_length <= 8"):
        with build_text_loader(config) as loader:
            next(iter(loader))
    assert "Token indices sequence length" not in capfd.readouterr().err  # transformers logs to stderr itself
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with build_text_loader(loader_yaml(name="fits.yaml", tokenizer={"path": str(short)},
                                           sequence_length=8)) as loader:
            next(iter(loader))
