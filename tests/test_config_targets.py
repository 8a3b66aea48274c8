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


@pytest.mark.parametrize("target", ["zephon_loader.state.os.system", "torch.os.system", "zephon_loader.pipeline.shards.shutil.rmtree"])
def test_a_standard_library_callable_reached_through_another_module_is_refused_before_it_is_called(tmp_path, target):
    """The name check looked at the first dotted name only: ``torch.os.system`` ran the command. The target is now
    resolved (nothing called) and refused by what it is."""
    marker = tmp_path / "ran"
    config = image_config({"src": tmp_path}, processor=None)
    config["processor"] = {"_target_": target, "command": f"touch {marker}", "path": str(marker)}
    with pytest.raises(ValueError, match=rf"^dataloader\.processor\._target_: got '{target}', which is the standard "
                                         r"library's (posix|shutil)\.(system|rmtree); expected a factory"):
        build_image_loader(config)
    assert not marker.exists()


def test_a_target_wrapped_in_this_packages_instantiate_is_checked_before_anything_is_called(tmp_path):
    from zephon_loader.config import instantiate

    marker = tmp_path / "ran"
    inner = {"_target_": "zephon_loader.state.os.system", "command": f"touch {marker}"}
    config = image_config({"src": tmp_path}, processor=None)
    config["processor"] = {"_target_": "zephon_loader.config.instantiate", "node": inner}
    with pytest.raises(ValueError, match=r"^dataloader\.processor\.node\._target_: got 'zephon_loader\.state\.os\."
                                         r"system', which is the standard library's posix\.system"):
        build_image_loader(config)
    with pytest.raises(ValueError, match=r"^_target_\[1\]\._target_: got 'torch\.os\.system', which is the standard "):
        instantiate([{"_target_": "zephon_loader.config.TextLoaderConfig", "sources": []},  # checked, not built
                     {"_target_": "torch.os.system", "command": f"touch {marker}"}])
    assert not marker.exists()


@pytest.mark.parametrize(("target", "what"), [
    ("zephon_loader.cli.__main__", "a module's __main__"),
    ("zephon_loader.cli.main", "this package's command line"),
    ("zephon_loader.state", "the module zephon_loader.state"),
    ("zephon_loader.state.os", "which is the standard library's os"),
])
def test_a_module_its_main_or_the_command_line_is_refused_as_a_processor(tmp_path, target, what):
    config = image_config({"src": tmp_path}, processor=None)
    config["processor"] = {"_target_": target}
    with pytest.raises(ValueError, match=rf"^dataloader\.processor\._target_: got '{target}', {what}"):
        build_image_loader(config)


def test_a_dataloader_target_of_a_modules_main_is_refused_without_running_it(tmp_path, monkeypatch):
    """``_target_: zephon_loader.cli.__main__`` imported the command line, which parsed the training script's
    arguments and exited the process (SystemExit 2)."""
    monkeypatch.setattr(sys, "argv", ["train.py", "--bogus"])
    sys.modules.pop("zephon_loader.cli.__main__", None)
    path = tmp_path / "loader.yaml"
    path.write_text(yaml.safe_dump({"dataloader": {"_target_": "zephon_loader.cli.__main__", "sources": []}}))
    for read in (lambda: read_loader_config(path, TextLoaderConfig), lambda: build_image_loader(path)):
        with pytest.raises(ValueError, match=rf"^{path}: dataloader\._target_: got 'zephon_loader\.cli\.__main__', "
                                             r"expected zephon_loader\.Zephon(VLM)?DataloaderConfig"):
            read()
    assert "zephon_loader.cli.__main__" not in sys.modules


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


_MINIMAL = {"sources": [{"name": "a", "path": "a"}], "sequence_length": 16, "micro_batch_size": 1}


def test_canonical_replicas_is_bounded_and_its_cost_said():
    """``canonical_replicas: 10000`` was accepted (first batch after 113 s, an 8.5 MB state)."""
    import warnings

    from zephon_loader.config import text_loader_config

    with pytest.raises(ValueError, match=r"^dataloader\.distributed\.canonical_replicas: got 10000, expected an int in "
                                         r"\[1, 4096\] or null\. Each lane costs about 0\.85 kB in every saved state"):
        text_loader_config(**_MINIMAL, distributed={"canonical_replicas": 10000})
    with pytest.warns(RuntimeWarning, match=r"canonical_replicas: 2048 lanes \(above 1024\).*about 1\.7 MB per state "
                                            r"and 23 s before the first batch"):
        text_loader_config(**_MINIMAL, distributed={"canonical_replicas": 2048})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text_loader_config(**_MINIMAL, distributed={"canonical_replicas": 1024})


@pytest.mark.parametrize("value", ["pkg://../../etc", "pkg:///etc", "pkg://corpus/../../..", "pkg://"])
def test_a_pkg_path_outside_the_package_data_is_refused(value):
    """``pkg://`` accepted ``..`` and absolute paths: any file of the machine, named as the package's data."""
    import argparse

    from zephon_loader.cli.configs import config_path
    from zephon_loader.config import text_loader_config

    with pytest.raises(ValueError, match=rf"^dataloader\.tokenizer\.path: got '{value}', expected pkg://NAME with NAME "
                                         r"a file or folder inside the package's data folder"):
        text_loader_config(**_MINIMAL, tokenizer={"path": value})
    with pytest.raises(ValueError, match=r"^dataloader\.sources\[0\]\.path: got"):
        text_loader_config(**{**_MINIMAL, "sources": [{"name": "a", "path": value}]})
    with pytest.raises(argparse.ArgumentTypeError, match=rf"^got '{value}', expected pkg://NAME"):
        config_path(value)
    text_loader_config(**{**_MINIMAL, "sources": [{"name": "a", "path": "pkg://corpus"}]}, tokenizer={"path": "pkg://tokenizer"})
