"""The loader's temp folders are named after their owner and swept by owner liveness (``zephon_loader.workdirs``).

A process that ends without its cleanup (SIGTERM, SIGKILL) left its
``zephon_loader_pipeline_*`` folders in the temp dir for good; now the next
:func:`~zephon_loader.workdirs.make_work_dir` on the machine removes the
folders whose owner is gone, and only those (the end-to-end SIGTERM case is in
``test_signals``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zephon_loader import workdirs
from zephon_loader.workdirs import WORK_PREFIXES, make_work_dir, owner_alive, sweep_work_dirs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="owner start times come from /proc")


@pytest.fixture
def temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _folder(temp: Path, prefix: str, pid: int, start: int, host: str | None = None) -> Path:
    path = temp / f"{prefix}o{pid}-{start}-{host or workdirs._host_tag()}_abc123"
    path.mkdir()
    (path / "drop_log.jsonl").write_text("{}\n")
    return path


def test_a_work_dir_is_named_after_its_owner(temp: Path) -> None:
    path = Path(make_work_dir("zephon_loader_pipeline_"))
    assert path.parent == temp and path.is_dir()
    start = workdirs._start_ticks(os.getpid())
    assert path.name.startswith(f"zephon_loader_pipeline_o{os.getpid()}-{start}-{workdirs._host_tag()}_")
    assert start and owner_alive(os.getpid(), start)


def test_the_sweep_removes_dead_owners_folders_only(temp: Path) -> None:
    me, my_start = os.getpid(), workdirs._start_ticks(os.getpid())
    dead = [_folder(temp, prefix, _dead_pid(), 12345) for prefix in WORK_PREFIXES]
    reused = _folder(temp, "zephon_loader_pipeline_", me, my_start + 1)  # this pid, another start: the pid was reused
    kept = [
        _folder(temp, "zephon_loader_pipeline_", me, my_start),  # a live owner: this process
        _folder(temp, "zephon_loader_pipeline_", _dead_pid(), 1, host="0badc0de"),  # another host or namespace
        _folder(temp, "zephon_loader_test_", _dead_pid(), 1),  # not a loader prefix
    ]
    old = temp / "zephon_loader_pipeline_k0a_va8p"  # an older version's folder: no owner in its name
    old.mkdir()
    target = temp / "elsewhere"
    target.mkdir()
    link = temp / f"zephon_loader_pipeline_o{_dead_pid()}-1-{workdirs._host_tag()}_link"
    link.symlink_to(target)  # never followed
    removed = sweep_work_dirs()
    assert sorted(removed) == sorted(map(str, dead + [reused]))
    assert not any(p.exists() for p in dead + [reused])
    assert all(p.is_dir() for p in kept + [old, target]) and link.is_symlink()


def test_a_live_owner_in_another_process_keeps_its_folder(temp: Path) -> None:
    code = ("import sys, time; from zephon_loader.workdirs import make_work_dir; "
            "print(make_work_dir('zephon_loader_tokenizer_'), flush=True); sys.stdin.read()")
    owner = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, TMPDIR=str(temp)))
    try:
        folder = Path(owner.stdout.readline().strip())  # type: ignore[union-attr]
        assert folder.parent == temp and folder.is_dir()
        make_work_dir("zephon_loader_pipeline_")  # a build here sweeps
        assert folder.is_dir(), "a live owner's folder was removed"
    finally:
        owner.stdin.close()  # type: ignore[union-attr]
        owner.wait(60)
    make_work_dir("zephon_loader_pipeline_")  # its owner is gone now
    assert not folder.exists()


def test_an_unknown_prefix_is_refused() -> None:
    expected = r"prefix: got 'zephon_loader_other_', expected one of .*workdirs\.WORK_PREFIXES"
    with pytest.raises(ValueError, match=expected):
        make_work_dir("zephon_loader_other_")
