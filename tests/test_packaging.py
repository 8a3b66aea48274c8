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


def _build_wheel(tmp_path: Path) -> Path:
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
    return wheel


def test_wheel_carries_license_typing_marker_and_data(tmp_path):
    wheel = _build_wheel(tmp_path)
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


def _tracked_copy(tmp_path: Path) -> Path:
    """The repository's tracked files (as a clone has them), copied to ``tmp_path/src``."""
    source = tmp_path / "src"
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if (REPO / name).is_file():
            shutil.copy(REPO / name, target)  # a symlinked config is copied as the file it names
    return source


def test_sdist_carries_what_its_readme_and_tests_refer_to(tmp_path):
    import tarfile

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git checkout")
    source = _tracked_copy(tmp_path)
    built = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(tmp_path / 'dist')!r})"],
        cwd=source, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (sdist,) = (tmp_path / "dist").glob("zephon_loader-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
        metadata = email.message_from_bytes(archive.extractfile(
            next(m for m in archive.getmembers() if m.name.endswith("/PKG-INFO"))).read())
    for needed in ("CHANGELOG.md", "LICENSE", "README.md", "docs/contract.md", "configs/demo.yaml",
                   "configs/image_demo.yaml", "examples/distributed.py", "scripts/dev.sh", "scripts/constraints.txt",
                   "benchmarks/bench_loader.py", "tests/test_packaging.py", "tests/conftest.py"):
        assert needed in names, needed
    assert not any("__pycache__" in name for name in names)
    assert metadata["Author"] or metadata["Author-email"]
    assert "Programming Language :: Python :: 3.11" in metadata.get_all("Classifier")


@pytest.mark.skipif(sys.platform != "linux", reason="a fresh venv with the CPU torch of these machines")
def test_the_image_demo_runs_from_a_wheel_installed_with_the_image_extra(tmp_path):
    """A fresh virtual environment: CPU torch, then the wheel with ``[image]`` only; the packaged image demo runs
    (``zephon-loader run pkg://image_demo.yaml``)."""
    wheel = _build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q", "-c", str(REPO / "scripts" / "constraints.txt")]
    for step in (["torch==2.13.0"], [f"{wheel}[image]"]):
        done = subprocess.run(pip + step, capture_output=True, text=True, timeout=900)
        if done.returncode != 0 and any(word in done.stderr for word in ("Could not find", "No matching", "connection")):
            pytest.skip(f"the package index cannot serve {step}: {done.stderr.strip().splitlines()[-1]}")
        assert done.returncode == 0, done.stderr[-3000:]
    run = subprocess.run([str(venv / "bin" / "zephon-loader"), "run", "pkg://image_demo.yaml", "--steps", "2"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "images" in run.stdout and "batches                 2" in run.stdout


def test_help_on_the_package_is_short_fast_and_names_every_public_name():
    """``help(zephon_loader)``: the usage example and every public name, without importing torch for each."""
    code = ("import pydoc, sys, zephon_loader; text = pydoc.render_doc(zephon_loader, renderer=pydoc.plaintext); "
            "print(len(text.splitlines())); print('torch' in sys.modules); "
            "print(all(name in text for name in zephon_loader.__all__)); print('build_text_loader(' in text)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    lines, torch_loaded, every_name, example = out.stdout.split()
    assert int(lines) < 200 and torch_loaded == "False" and every_name == "True" and example == "True"
    assert "build_text_loader" in dir(zephon_loader) or "build_text_loader" in zephon_loader.__all__
