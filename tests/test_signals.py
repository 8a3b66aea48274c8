"""SIGTERM (what schedulers send) and a missing ``__main__`` guard under the ``process`` runner.

* SIGTERM to the training process (or to its whole process group): no
  process of its session is left (workers exit with their parent, the fork
  server with its last client), and the loader's temp folders, left by a
  process that ran no cleanup, are removed by the next build on the machine
  (``zephon_loader.workdirs``). Before: ``zephon_loader_pipeline_*`` folders
  piled up in the temp dir, one set per run.
* The fork server leaves promptly even while it preloads (an import of torch
  takes seconds, tens on a busy machine) and at its exit (tearing down an
  interpreter holding torch took 1-5 s, during which the server and the
  resource tracker were still there: "SIGTERM left 3 processes", "SIGINT
  left a fork-server process"). Both are drawn out to 600 s here by a
  preloaded test module (``slow_fork_server``); the bound only needs to be
  far below that.
* A script that builds and iterates a ``process``-runner loader at top level
  (no ``if __name__ == "__main__":`` guard) fails with the README's advice
  instead of hanging forever while every worker re-runs it.

Linux only (``/proc``, sessions).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import write_jsonl_shards
from process_trainer import PRELOAD_ENV, TrainerProcess, loader_config

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and sessions")

#: Bound that only catches a hang or a process waiting out ``slow_fork_server.SLOW_S`` (600 s): what it bounds
#: takes well under 1 s on idle cores and a few seconds beside two CPU burners on 2 cores.
HANG_BOUND_S = 60.0
PREFIXES = ("zephon_loader_pipeline_", "zephon_loader_image_pipeline_", "zephon_loader_tokenizer_")


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory, corpus_texts: list[str]) -> Path:
    return write_jsonl_shards(tmp_path_factory.mktemp("signal_text"), [{"text": t} for t in corpus_texts], shards=2)


def _slow_fork_server(mode: str) -> dict[str, str]:
    """Trainer environment: its fork server preloads ``slow_fork_server`` in ``mode`` (``start`` or ``exit``)."""
    # The fork server imports its preload list before it applies the parent's sys.path: PYTHONPATH finds the module.
    path = os.pathsep.join([str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {PRELOAD_ENV: "slow_fork_server", "SLOW_FORK_SERVER": mode, "PYTHONPATH": path}


def _loader_folders(temp: Path) -> list[str]:
    return sorted(p.name for p in temp.iterdir() if p.name.startswith(PREFIXES))


@pytest.mark.parametrize("to", ["trainer", "group"])
def test_sigterm_leaves_no_process_and_the_next_build_removes_its_folders(
    to: str, text_dir: Path, tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zephon_loader import build_text_loader

    temp = tmp_path / "tmp"
    temp.mkdir()
    trainer = TrainerProcess(loader_config(text_dir, tokenizer_dir), tmp_path, env={"TMPDIR": str(temp)})
    try:
        trainer.wait_for("step 2")
        assert trainer.workers(), "the process runner started no worker process"
        left_behind = _loader_folders(temp)
        assert left_behind, f"no loader folder in the trainer's temp dir {temp}"
        if to == "group":
            os.killpg(trainer.proc.pid, signal.SIGTERM)
        else:
            trainer.proc.send_signal(signal.SIGTERM)
        assert trainer.proc.wait(HANG_BOUND_S) == -signal.SIGTERM
        left = trainer.session_left_after(HANG_BOUND_S)
        assert not left, f"processes left {HANG_BOUND_S} s after SIGTERM to the {to}: {left}"
    finally:
        trainer.kill_session()
    # SIGTERM ran no cleanup: the folders stay until the next build on the machine removes them.
    assert _loader_folders(temp) == left_behind
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    config = dict(loader_config(text_dir, tokenizer_dir), runtime={"runner": "threads"})
    with build_text_loader(config):
        mine = set(_loader_folders(temp))
        assert mine and not mine & set(left_behind), "the dead trainer's folders were not removed at the build"
    assert _loader_folders(temp) == []


def test_fork_server_exits_with_the_trainer_while_it_preloads(
    text_dir: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    trainer = TrainerProcess(loader_config(text_dir, tokenizer_dir), tmp_path, env=_slow_fork_server("start"))
    try:
        trainer.wait_for("fork server preloading")  # after zephon_loader's preload module: its watch runs
        trainer.proc.send_signal(signal.SIGTERM)
        assert trainer.proc.wait(HANG_BOUND_S) == -signal.SIGTERM
        left = trainer.session_left_after(HANG_BOUND_S)
        assert not left, f"processes left {HANG_BOUND_S} s after SIGTERM during the fork server's preload: {left}"
    finally:
        trainer.kill_session()


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_fork_server_skips_its_interpreter_teardown(
    how: str, text_dir: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    trainer = TrainerProcess(loader_config(text_dir, tokenizer_dir), tmp_path, env=_slow_fork_server("exit"))
    try:
        trainer.wait_for("step 2")
        if how == "sigterm":
            trainer.proc.send_signal(signal.SIGTERM)
            assert trainer.proc.wait(HANG_BOUND_S) == -signal.SIGTERM
        else:
            os.killpg(trainer.proc.pid, signal.SIGINT)
            assert trainer.wait_for("left", timeout=HANG_BOUND_S) == "left 0"
            assert trainer.proc.wait(HANG_BOUND_S) == 0
        left = trainer.session_left_after(HANG_BOUND_S)
        assert not left, f"processes left {HANG_BOUND_S} s after the trainer exited ({how}): {left}"
    finally:
        trainer.kill_session()


NO_GUARD = """\
import json
import sys

from zephon_loader import build_text_loader

print("top level", flush=True)
with open(sys.argv[1]) as handle:
    config = json.load(handle)
with build_text_loader(config) as loader:
    for step, batch in enumerate(loader):
        if step == 3:
            break
print("done", flush=True)
"""


def test_a_script_without_the_main_guard_fails_with_the_readme_advice(
    text_dir: Path, tokenizer_dir: Path, tmp_path: Path
) -> None:
    import json

    from zephon_loader.nodes.workers import MAIN_GUARD_ADVICE

    script, config = tmp_path / "train_no_guard.py", tmp_path / "config.json"
    script.write_text(NO_GUARD)
    config.write_text(json.dumps(loader_config(text_dir, tokenizer_dir)))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, str(script), str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
    try:
        # Before: every worker re-ran the script, failed, and the training process waited forever.
        output, _ = proc.communicate(timeout=5 * HANG_BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"no error within {5 * HANG_BOUND_S} s; output:\n{output[-5000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 1, output[-5000:]
    assert "done" not in output.splitlines()
    # The training process's own error (the last line of its traceback, after its workers'): what, where, the fix.
    error = [line for line in output.splitlines() if line.startswith("RuntimeError: runtime.runner 'process': worker")]
    assert error, output[-5000:]
    assert f"re-runs the main module {script}" in error[-1] and MAIN_GUARD_ADVICE in error[-1]
    assert 'under `if __name__ == "__main__":`' in error[-1]
    # Each worker's own error names the missing guard too.
    assert "a worker process is starting Zephon workers of its own while it re-runs the main module" in output


class _FailsToUnpickle:
    """A process argument that cannot be unpickled in the child: it exits before its run() begins."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (_refuse, ("refused in the child",))


def _refuse(message: str) -> None:
    raise ValueError(message)


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_worker_that_dies_before_its_run_fails_its_start(method: str) -> None:
    from zephon_loader.nodes.workers import WorkerContext

    context = WorkerContext(method)
    process = context.Process(target=print, args=(_FailsToUnpickle(),), daemon=True)
    with pytest.raises(RuntimeError, match=r"worker process \d+ exited with status 1 before it began its work"):
        process.start()  # before: start() returned and the caller waited for the worker forever
    assert context.live_pids() == []


def test_a_worker_re_running_the_main_module_refuses_to_start_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    from zephon_loader.nodes.workers import MAIN_GUARD_ADVICE, WorkerContext

    context = WorkerContext("forkserver")
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)  # as spawn._main sets
    with pytest.raises(RuntimeError, match="while it re-runs the main module") as raised:
        context.Process(target=print, daemon=True)
    assert MAIN_GUARD_ADVICE in str(raised.value)

