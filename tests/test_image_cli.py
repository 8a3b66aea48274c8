"""What ``zephon-loader run`` / ``inspect`` use for image-text configs (``zephon_loader.cli.inspect``)."""

from __future__ import annotations

import pytest

from conftest import collect
from zephon_loader import ImageLoader, ZephonLoader
from zephon_loader.config import default_config_path
from zephon_loader.cli.configs import build_from_yaml, is_image_config
from zephon_loader.cli.inspect import image_counts, token_kinds
from zephon_loader.cli.inspect import inspect as inspect_images
from zephon_loader.config.image import default_image_config_path

ALIGNED = default_image_config_path().parent / "image_demo_aligned.yaml"


def test_image_configs_are_recognized():
    assert is_image_config(default_image_config_path()) and is_image_config(ALIGNED)
    assert not is_image_config(default_config_path())
    assert is_image_config({"sources": [], "processor": {"path": "x"}})
    assert not is_image_config({"_target_": "zephon_loader.ZephonDataloaderConfig", "sources": []})


def test_build_from_yaml_dispatches_by_kind():
    with build_from_yaml(default_image_config_path()) as loader:
        assert isinstance(loader, ImageLoader)
        batch = collect(loader, 1)[0]
    images, image_tokens = image_counts(batch)
    assert images == int(batch["image_grid_thw"].shape[0]) and image_tokens == int(batch["image_grid_thw"].prod(1).sum() // 4)
    with build_from_yaml(default_config_path()) as loader:
        assert isinstance(loader, ZephonLoader) and not isinstance(loader, ImageLoader)


def test_inspect_draws_spans_fillers_padding_and_positions(tmp_path):
    out = inspect_images(ALIGNED, tmp_path / "batch.png", row=1)
    assert out.stat().st_size > 10_000
    with build_from_yaml(ALIGNED) as loader:
        batch = loader.preview()
        processor = loader.processor
    kinds = token_kinds(batch, (processor.vision_start_token_id, processor.vision_end_token_id))
    assert int((kinds == 1).sum()) == int((~batch["attention_eligibility"] & ~batch["padding_mask"]).sum()) > 0
    assert int((kinds == 2).sum()) == int(batch["mm_token_type_ids"].sum())
    with pytest.raises(ValueError, match=r"--row: got 9, expected a row index in \[0, 4\)"):
        inspect_images(ALIGNED, tmp_path / "x.png", row=9)


def test_the_cli_runs_and_inspects_image_configs(tmp_path, capsys):
    """``zephon-loader run`` / ``inspect`` on the bundled image demo: images counted, one-line errors."""
    import json

    from zephon_loader.cli import commands as cli
    report_path = tmp_path / "report.json"
    assert cli.main(["run", str(default_image_config_path()), "--steps", "3", "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert report["batches"] == 3 and report["images"] > 0
    assert report["fields"]["position_ids"].split()[-3:] == ["[3,", "4,", "512]"]
    assert "images " in capsys.readouterr().out
    out = tmp_path / "image.png"
    assert cli.main(["inspect", str(default_image_config_path()), "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
    assert cli.main(["inspect", str(default_image_config_path()), "--out", str(out), "--row", "99"]) == 2
    assert "--row: got 99" in capsys.readouterr().err


def test_the_cli_runs_a_bundled_config_named_by_pkg_url(capsys):
    """``zephon-loader run pkg://image_demo.yaml``: the packaged image demo, from a clone or a wheel."""
    from zephon_loader.cli import commands as cli
    from zephon_loader.cli.configs import config_path

    assert config_path("pkg://image_demo.yaml") == default_image_config_path()
    assert cli.main(["run", "pkg://image_demo.yaml", "--steps", "1"]) == 0
    assert "images" in capsys.readouterr().out


def test_a_foreign_target_is_not_imported_to_tell_the_kind():
    import sys

    sys.modules.pop("this", None)
    assert not is_image_config({"_target_": "this.s", "processor": {}})
    assert "this" not in sys.modules
