"""What the distribution declares: license, typing marker, changelog, versions that work.

Issue 11 found no LICENSE or license metadata, no ``py.typed`` although the
code is fully typed, no CHANGELOG, and a ``transformers`` requirement without
the version the bundled tokenizer needs (its ``tokenizer_config.json`` names
``TokenizersBackend``, a transformers 5 class).
"""

from __future__ import annotations

import email
import json
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import zephon_loader

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _requirement(extra: str, name: str) -> str:
    (found,) = [r for r in PYPROJECT["project"]["optional-dependencies"][extra] if re.match(rf"{name}\b", r)]
    return found


def test_license_is_declared_and_shipped():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0"  # SPDX expression (PEP 639), like Zephon and NeMo AutoModel
    assert project["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text
    # PEP 639 metadata needs setuptools >= 77
    (setuptools,) = [r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    assert tuple(int(x) for x in re.search(r">=\s*([\d.]+)", setuptools).group(1).split(".")[:2]) >= (77, 0)


def test_py_typed_marker_is_package_data():
    assert (REPO / "zephon_loader" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["zephon_loader"]


@pytest.mark.parametrize("extra", ["hf", "test"])
def test_transformers_extras_require_version_5(extra):
    assert _requirement(extra, "transformers") == "transformers>=5"


def test_bundled_tokenizer_is_a_transformers_5_folder():
    """Why the pin: transformers 4.x cannot load the bundled folder."""
    config = json.loads((REPO / "zephon_loader" / "data" / "tokenizer" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "TokenizersBackend"


def test_transformers_4_is_refused_with_the_fix(monkeypatch):
    import transformers

    from zephon_loader.tokenizing import load_tokenizer

    monkeypatch.setattr(transformers, "__version__", "4.57.1")
    with pytest.raises(ImportError, match=r"transformers: got 4\.57\.1, expected >= 5 .*pip install 'transformers>=5'"):
        load_tokenizer(REPO / "zephon_loader" / "data" / "tokenizer")


def test_version_is_one_value():
    assert zephon_loader.__version__ == PYPROJECT["project"]["version"]


def test_changelog_has_the_released_and_unreleased_sections():
    text = (REPO / "CHANGELOG.md").read_text()
    assert "https://keepachangelog.com/en/1.1.0/" in text
    headings = re.findall(r"^## \[([^\]]+)\]", text, re.MULTILINE)
    assert headings[:2] == ["Unreleased", PYPROJECT["project"]["version"]]


def test_wheel_carries_license_typing_marker_and_data(tmp_path):
    """Build the wheel offline (the environment's setuptools, no isolation) from a copy of the sources."""
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "zephon_loader", source / "zephon_loader",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         str(source), "-w", str(tmp_path / "dist")],
        capture_output=True, text=True, timeout=300,
    )
    if result.returncode != 0 and "No module named pip" in result.stderr:
        pytest.skip("pip is not installed in this environment")
    assert result.returncode == 0, result.stderr
    (wheel,) = (tmp_path / "dist").glob("zephon_loader-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_bytes(archive.read(metadata_name))
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert "zephon_loader/py.typed" in names
    assert {"zephon_loader/data/demo.yaml", "zephon_loader/data/tokenizer/tokenizer_config.json"} <= names
    assert 'transformers>=5; extra == "hf"' in metadata.get_all("Requires-Dist")
