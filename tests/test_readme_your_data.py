"""README "Your data", run as written: its shell, YAML and Python blocks in a temporary folder.

The shell block makes the data folder; the YAML is ``train.yaml``; the Python
block is ``train.py``. The only changes: the data holds a few hundred
documents (two records train nothing), and the tokenizer folder is the bundled
one (the README says where it is). The loop is stopped at step 30 (its last
checkpoint at 20) and run again: the resumed run trains steps 21..60 with the
uninterrupted run's losses.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _blocks() -> dict[str, str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Your data\n", 1)[1].split("\n## ", 1)[0]
    found = {language: re.findall(rf"^```{language}\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
             for language in ("bash", "yaml", "python")}
    assert all(len(blocks) == 1 for blocks in found.values()), {k: len(v) for k, v in found.items()}
    return {language: blocks[0] for language, blocks in found.items()}


def _losses(output: str) -> dict[int, str]:
    return {int(step): loss for step, loss in re.findall(r"^step (\d+) loss (\S+)$", output, re.MULTILINE)}


def _run(folder: Path, script: str) -> dict[int, str]:
    (folder / "train.py").write_text(script)
    done = subprocess.run([sys.executable, "train.py"], cwd=folder, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return _losses(done.stdout)


@pytest.fixture(scope="module")
def folder_factory(tmp_path_factory):
    blocks = _blocks()
    import zephon_loader

    bundled = Path(zephon_loader.__file__).parent / "data"

    def make(name: str) -> Path:
        folder = tmp_path_factory.mktemp(name)
        subprocess.run(["bash", "-c", blocks["bash"]], cwd=folder, check=True)
        corpus = [json.loads(line) for shard in sorted((bundled / "corpus").rglob("*.jsonl"))
                  for line in shard.read_text().splitlines() if line.strip()]
        with open(folder / "data" / "web" / "part-00000.jsonl", "a") as handle:
            for record in corpus:
                handle.write(json.dumps({"text": record["text"]}) + "\n")
        shutil.copytree(bundled / "tokenizer", folder / "tokenizer")
        (folder / "train.yaml").write_text(blocks["yaml"])
        return folder

    return make, blocks["python"]


def test_the_readme_loop_runs_as_written_and_resumes_exactly(folder_factory):
    make, script = folder_factory
    uninterrupted = _run(make("whole"), script)
    assert sorted(uninterrupted) == list(range(1, 61))
    folder = make("stopped")
    stopped = _run(folder, script.replace("STEPS, EVERY, CKPT = 60,", "STEPS, EVERY, CKPT = 30,", 1))
    assert sorted(stopped) == list(range(1, 31))
    resumed = _run(folder, script)  # the last checkpoint is step 20: steps 21..60 again
    assert sorted(resumed) == list(range(21, 61))
    assert resumed == {step: loss for step, loss in uninterrupted.items() if step > 20}
