"""A YAML ``_target_`` is imported and called: what it may name is checked before anything is imported or run."""

from __future__ import annotations

import sys

import pytest
import yaml

from image_data import image_config
from zephon_loader import build_image_loader
from zephon_loader.config import TextLoaderConfig, read_loader_config
from zephon_loader.config.reader import refuse_standard_library_target


def test_a_dataloader_target_outside_the_package_is_refused_before_it_is_imported(tmp_path):
    sys.modules.pop("this", None)  # importing ``this`` prints the Zen of Python
    path = tmp_path / "loader.yaml"
    path.write_text(yaml.safe_dump({"dataloader": {"_target_": "this.s", "sources": []}}))
    with pytest.raises(ValueError, match=r"dataloader\._target_: got 'this\.s', expected "
                                         r"zephon_loader\.ZephonDataloaderConfig"):
        read_loader_config(path, TextLoaderConfig)
    assert "this" not in sys.modules


@pytest.mark.parametrize("target", ["os.system", "subprocess.run", "builtins.eval", "shutil.rmtree"])
def test_a_processor_factory_from_the_standard_library_is_refused_before_it_is_called(tmp_path, target):
    marker = tmp_path / "ran"
    config = image_config({"src": tmp_path}, processor=None)
    config["processor"] = {"_target_": target, "command": f"touch {marker}"}
    with pytest.raises(ValueError, match=rf"dataloader\.processor\._target_: got '{target}', a standard-library "
                                         "callable; expected a factory from your own code or a package"):
        build_image_loader(config)
    assert not marker.exists()


def test_a_nested_target_is_checked_too():
    with pytest.raises(ValueError, match=r"dataloader\.processor\.options\[0\]\._target_: got 'os\.getcwd'"):
        refuse_standard_library_target({"_target_": "my_pkg.make", "options": [{"_target_": "os.getcwd"}]},
                                       "dataloader.processor")
    refuse_standard_library_target({"_target_": "zephon_loader.Qwen2VLRecordProcessor", "path": "x"}, "p")


def test_a_misspelled_key_names_the_closest_one():
    from zephon_loader.config import text_loader_config

    with pytest.raises(ValueError, match=r"dataloader\.shuffel: unknown key \(did you mean 'shuffle'\?\); expected "
                                         r"one of \['base_dir'"):
        text_loader_config(sources=[], shuffel=True)
    with pytest.raises(ValueError, match=r"dataloader\.zzz: unknown key; expected one of"):
        text_loader_config(sources=[], zzz=1)


@pytest.mark.parametrize(("change", "key"), [
    ({"contract": {"attn_implementation": "flash"}}, r"dataloader\.contract\.attn_implementation: got 'flash'"),
    ({"tokenizer": {"path": "no_such_tokenizer"}}, r"dataloader\.tokenizer\.path: got '.*no_such_tokenizer'"),
    ({"sources": [{"name": "a", "path": "no_such_folder"}]}, r"dataloader\.sources\[0\]\.path \('a'\): got"),
    ({"shuffel": True}, r"dataloader\.shuffel: unknown key \(did you mean 'shuffle'\?\)"),
])
def test_every_config_error_has_one_shape_file_key_seen_expected(tmp_path, change, key):
    """File, then the ``dataloader.`` key path, what was seen and what was expected: for schema errors and for
    the ones found while building (paths, tokenizer, attention name)."""
    from zephon_loader import build_text_loader
    from zephon_loader.config import default_config_path

    node = yaml.safe_load(default_config_path().read_text())
    node["dataloader"].update(change)
    node["dataloader"]["base_dir"] = str(default_config_path().parent)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(node))
    with pytest.raises((ValueError, TypeError, FileNotFoundError), match=rf"^{path}: {key}.*expected") as raised:
        build_text_loader(path)
    assert "\n" not in str(raised.value)
