"""The loader's temporary folders: named after their owner process, swept at the next build once it is gone.

A loader works in folders of its own under the temp dir (Zephon's drop log
and catalog, a recipe's saved tokenizer), removed by ``close()`` and by a
failed build. A process that ends without running its cleanup (SIGTERM from
a scheduler, SIGKILL, a crash in native code) leaves them behind, one set per
run. :func:`make_work_dir` names every folder after the process that created
it: ``<prefix>o<pid>-<start>-<host>_<random>``, where ``start`` is the
process's start time in clock ticks since boot (Linux ``/proc/<pid>/stat``,
``0`` elsewhere) and ``host`` a short digest of the boot id and pid
namespace (of the host name where there is no ``/proc``). Before creating a
folder it sweeps the temp dir (:func:`sweep_work_dirs`): a folder of one of
:data:`WORK_PREFIXES`, owned by this user, named by this host and namespace,
whose owner is gone (no process with that pid, or one with another start
time: the pid was reused) is removed. Nothing else is touched:

* a folder whose owner lives (a loader in another process of this machine),
  whatever its age;
* a folder named by another host, boot or pid namespace (a temp dir shared
  between containers or machines): its pid means nothing here;
* a folder of another user, or without an owner in its name (made by an
  older version of the package: remove those by hand once, ``rm -rf
  $TMPDIR/zephon_loader_*``).

No signal handler is installed: the program's own reaction to SIGTERM (by
default, to end at once) is kept; its folders go at the next build on the
machine.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import tempfile

__all__ = ["WORK_PREFIXES", "make_work_dir", "owner_alive", "sweep_work_dirs"]

#: Prefixes of the folders the loader makes (a pipeline's work folder per kind, a recipe's saved tokenizer).
WORK_PREFIXES = ("zephon_loader_pipeline_", "zephon_loader_image_pipeline_", "zephon_loader_tokenizer_")

_OWNER = re.compile(r"o(?P<pid>[0-9]+)-(?P<start>[0-9]+)-(?P<host>[0-9a-f]{8})_")


def _start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (Linux); ``None``: no such process; ``0``: unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            # After the command (which may hold spaces and parentheses): state, ppid, ... starttime is field 22.
            return int(handle.read().rsplit(b")", 1)[1].split()[19])
    except FileNotFoundError:
        return None if os.path.isdir("/proc/self") else _pid_exists_elsewhere(pid)
    except (OSError, IndexError, ValueError):  # unreadable: count it as alive, with an unknown start time
        return 0


def _pid_exists_elsewhere(pid: int) -> int | None:
    """Without ``/proc``: ``0`` (alive, start time unknown) or ``None`` (no such process)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # another user's process
        return 0
    return 0


def _host_tag() -> str:
    """8 hex digits naming this boot and pid namespace (pids mean the same in every process with this tag)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            identity = handle.read().strip() + ":" + str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        identity = socket.gethostname()
    return hashlib.sha256(identity.encode()).hexdigest()[:8]


def owner_alive(pid: int, start: int) -> bool:
    """Whether the process that made a folder (``pid``, start time ``start`` in ticks; 0: unknown) still runs.

    A start time of 0 on either side (no ``/proc``, unreadable) counts as a match: such a folder is kept while
    any process has its pid.
    """
    now = _start_ticks(pid)
    return now is not None and (now == start or 0 in (now, start))


def _owner_tag() -> str:
    pid = os.getpid()
    return f"o{pid}-{_start_ticks(pid) or 0}-{_host_tag()}_"


def sweep_work_dirs(folder: str | None = None) -> list[str]:
    """Remove the loader's folders in ``folder`` (default: the temp dir) whose owner process is gone.

    Only folders of :data:`WORK_PREFIXES` named by this host and pid namespace and owned by this user; see the
    module docstring. Never raises (a folder that cannot be listed or removed stays).

    Returns:
        The paths removed.
    """
    folder = tempfile.gettempdir() if folder is None else folder
    host, uid = _host_tag(), os.getuid() if hasattr(os, "getuid") else None
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        prefix = next((p for p in WORK_PREFIXES if entry.name.startswith(p)), None)
        owner = _OWNER.match(entry.name, len(prefix)) if prefix is not None else None
        if owner is None or owner["host"] != host:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if uid is not None and entry.stat(follow_symlinks=False).st_uid != uid:
                continue
        except OSError:
            continue
        if owner_alive(int(owner["pid"]), int(owner["start"])):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.lexists(entry.path):
            removed.append(entry.path)
    return removed


def make_work_dir(prefix: str) -> str:
    """A new folder in the temp dir named ``<prefix>o<pid>-<start>-<host>_<random>``, after a sweep.

    The caller removes it when done (``close()``); if this process ends first, the next build on the machine
    removes it (:func:`sweep_work_dirs`).

    Args:
        prefix: One of :data:`WORK_PREFIXES`.

    Raises:
        ValueError: ``prefix`` is not one of :data:`WORK_PREFIXES` (its folders would never be swept).
    """
    if prefix not in WORK_PREFIXES:
        raise ValueError(
            f"prefix: got {prefix!r}, expected one of {list(WORK_PREFIXES)}. "
            "Add the new prefix to zephon_loader.workdirs.WORK_PREFIXES so that its folders are swept."
        )
    sweep_work_dirs()
    return tempfile.mkdtemp(prefix=prefix + _owner_tag())
