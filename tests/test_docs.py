"""The documentation site builds with warnings as errors (``mkdocs build --strict``).

A broken link between pages, a missing anchor, a page left out of the
navigation or a docstring mkdocstrings cannot read fails the build. MkDocs
comes with the test environment (``scripts/dev.sh``, the ``docs`` extra).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_documentation_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="MkDocs is installed by scripts/dev.sh's test step (the docs extra)")
    pytest.importorskip("mkdocstrings")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    pages = {path.relative_to(tmp_path / "site").as_posix() for path in (tmp_path / "site").rglob("index.html")}
    assert {"index.html", "configuration/index.html", "trainers/index.html", "api/index.html"} <= pages
    assert "zephon_loader.loader.ZephonLoader" in (tmp_path / "site" / "api" / "index.html").read_text()
