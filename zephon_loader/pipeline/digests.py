"""The shard digests of the resume fingerprint: known at build without reading a shard, or hashed in the background.

A saved state carries, per shard file, the SHA-256 of all its bytes
(:mod:`zephon_loader.fingerprint`), and a resume compares them: a changed
shard, also a same-size edit in the middle, is refused. Computing them used to
be the first thing a build did, so a node that had never seen the corpus read
every byte of it before the first batch (4.45 s at 3.14 GiB from the page
cache; half an hour per node at 2 TB). Now a build reads no shard byte; each
file's digest is

* **known at build** from the cache folder (:func:`~zephon_loader.pipeline.shards.cache_dir`,
  per machine, keyed by ``(size, mtime_ns, ctime_ns, inode, device)``), or from a **digest manifest**
  in the data folder (:data:`MANIFEST_NAME`, written once per corpus version by ``zephon-loader index
  <folder>``, beside Zephon's ``index.json``), used for a file whose size, mtime and ctime (ns) are the
  ones the manifest recorded. Any write to a file changes its ``ctime`` (``touch -d`` and ``cp -p``
  cannot set it back), so a file changed after the manifest was written is not taken from it: the build
  warns, naming the files and the command, and hashes them in the background;
* or **hashed in the background** by one thread per process (:class:`Digests`), started after the
  loader's first batch is delivered (or by the first ``state_dict()``/``load_state_dict()``, which
  wait for it), at a lower CPU priority (nice +10 on Linux), 1 MiB reads. Processes of one machine
  (the ranks of a node) take turns on a lock in the cache folder, so a node hashes a folder once; the
  next build on the machine finds the digests in the cache.

A file whose identity changes while it is hashed is not given a digest: the
``state_dict()`` or ``load_state_dict()`` that needs it raises, naming the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = ["CACHE_ENV", "MANIFEST_NAME", "Digests", "PendingShards", "cache_dir", "file_sha256", "lookup"]

logger = logging.getLogger(__name__)

#: The digest manifest's file name, in the data folder beside Zephon's ``index.json``.
MANIFEST_NAME = "zephon_loader.digests.json"
_MANIFEST_FORMAT = "zephon_loader.digests"
_MANIFEST_VERSION = 1
_CHUNK = 1 << 20  # bytes per read: a cancel or a lowered priority takes effect within one
_NICE = 10  # added to the hashing thread's niceness (Linux: per thread)
_WAIT_NOTICE_S = 2.0  # a wait longer than this is logged once (what is left, and the manifest command)


def index_command(folder: str | os.PathLike[str]) -> str:
    """The command that writes ``folder``'s digest manifest."""
    return f"zephon-loader index {os.fspath(folder)}"


def file_sha256(path: str | os.PathLike[str], cancelled: Callable[[], bool] | None = None) -> str | None:
    """SHA-256 (hex) of a file's bytes, read in 1 MiB pieces; ``None`` when ``cancelled()`` turned true."""
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as handle:
        while True:
            count = handle.readinto(buffer)
            if not count:
                return digest.hexdigest()
            digest.update(view[:count])
            if cancelled is not None and cancelled():
                return None


def _identity(path: str | os.PathLike[str]) -> tuple[int, int, int, int, int]:
    stat = os.stat(path)
    return (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev)


def _what_changed(path: str, before: Sequence[Any], now: Sequence[Any] | None) -> str:
    if now is None:
        return f"{path}: removed"
    if now[0] != before[0]:
        return f"{path}: {before[0]} -> {now[0]} bytes"
    return f"{path}: rewritten (same size, modified)"


# ----------------------------------------------------------------------------- the manifest


def read_manifest(folder: Path) -> dict[str, tuple[int, int, int, str]] | None:
    """``{file: (size, mtime_ns, ctime_ns, sha256)}`` of ``folder``'s manifest; ``None`` when it has none.

    Raises:
        ValueError: A manifest that does not parse (naming it and the command that rewrites it).
    """
    path = folder / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as error:
        raise ValueError(f"{path}: the shard digest manifest cannot be read ({error}); make it readable, rewrite "
                         f"it with: {index_command(folder)}, or delete it") from None
    try:
        data = json.loads(text)
        if data.get("format") != _MANIFEST_FORMAT or data.get("version") != _MANIFEST_VERSION:
            raise ValueError(f"format {data.get('format')!r} version {data.get('version')!r}")
        out = {}
        for name, entry in data["files"].items():
            size, mtime, ctime, digest = entry
            if not (isinstance(digest, str) and len(digest) == 64 and all(isinstance(v, int) for v in
                                                                           (size, mtime, ctime))):
                raise ValueError(f"entry {name!r}")
            out[str(name)] = (size, mtime, ctime, digest)
        return out
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{path}: got a file that is not a zephon_loader digest manifest ({error}), expected "
                         f"{{'format': {_MANIFEST_FORMAT!r}, 'version': {_MANIFEST_VERSION}, 'files': "
                         "{name: [size, mtime_ns, ctime_ns, sha256]}}; rewrite it with: "
                         f"{index_command(folder)}, or delete it") from None


# ----------------------------------------------------------------------------- the build's lookup

#: Environment variable naming the cache folder (content digests, decoded views).
CACHE_ENV = "ZEPHON_LOADER_CACHE"

def cache_dir() -> Path:
    """``$ZEPHON_LOADER_CACHE``, else ``$XDG_CACHE_HOME/zephon_loader``, else ``~/.cache/zephon_loader``.

    Safe to delete between runs (it is rebuilt: digests by reading the shards again).
    """
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zephon_loader"


def _cache_file(folder: Path) -> Path:
    return cache_dir() / "digests" / (hashlib.sha256(os.fsencode(folder)).hexdigest()[:24] + ".json")


def _read_cache(cache: Path) -> dict[str, Any]:
    try:
        known = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _cached(known: dict[str, Any], name: str, ident: Sequence[Any]) -> str | None:
    entry = known.get(name)
    if isinstance(entry, list) and len(entry) == 2 and entry[0] == list(ident) and isinstance(entry[1], str):
        return entry[1]
    return None


def lookup(folder: Path, files: Sequence[str], identities: Sequence[Sequence[Any]]) -> tuple["Digests", bool]:
    """Each file's digest as far as it is known without reading a shard; whether any file is new to this machine.

    From the machine's cache where the identity is unchanged, else from the folder's manifest where the
    size, mtime and ctime are the manifest's; the rest are left to :meth:`Digests.start`. Reads the cache
    file and the manifest (two small JSON files), no shard.

    Warns (``RuntimeWarning``) when the manifest does not describe some files as they are: it names them and
    the command that rewrites the manifest; those files are hashed in the background.

    Returns:
        ``(digests, new)``: ``new`` when some file's identity is not in this machine's cache (Zephon's
        catalog of the folder is then dropped, as before).
    """
    cache = _cache_file(folder)
    known = _read_cache(cache)
    manifest = read_manifest(folder)
    values: list[str | None] = []
    stale: list[str] = []
    new = False
    for name, ident in zip(files, identities, strict=True):
        digest = _cached(known, name, ident)
        if digest is None:
            new = True
            listed = manifest.get(name) if manifest is not None else None
            if listed is not None and tuple(listed[:3]) == tuple(ident[:3]):
                digest = listed[3]
            elif manifest is not None:
                stale.append(f"{name} is not in it" if listed is None else
                             f"{name} has {ident[0]} bytes, the manifest {listed[0]}" if listed[0] != ident[0] else
                             f"{name} was modified or its status changed after it was written (mtime/ctime)")
        values.append(digest)
    if stale:
        shown = "; ".join(stale[:3]) + (f"; and {len(stale) - 3} more" if len(stale) > 3 else "")
        warnings.warn(f"zephon_loader: {folder / MANIFEST_NAME} does not describe {len(stale)} of {len(files)} "
                      f"files as they are ({shown}); their digests are not taken from it but computed in the "
                      "background (every byte of them read once on this machine; a state_dict() waits for them). "
                      f"Rewrite the manifest after changing shards: {index_command(folder)}",
                      RuntimeWarning, stacklevel=4)
    return Digests(folder, files, identities, values, cache), new


# ----------------------------------------------------------------------------- the hashing thread


class Digests:
    """Per file of a folder, its SHA-256 (hex): known at build, or computed by the process' hashing thread.

    Args:
        folder: The folder; ``files`` its file names, ``identities`` their identities at the build.
        values: The digests known now (``None``: to hash).
        cache: The machine's cache file for the folder, written when the missing ones are done
            (``None``: not cached, e.g. ETag digests of objects).
    """

    def __init__(self, folder: Path | None, files: Sequence[str], identities: Sequence[Sequence[Any]],
                 values: Sequence[str | None], cache: Path | None = None) -> None:
        self._folder = folder
        self._files = tuple(files)
        self._identities = tuple(tuple(i) for i in identities)
        self._values = list(values)
        self._cache = cache
        self._missing = [i for i, v in enumerate(self._values) if v is None]
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._started = False
        self._cancelled = False
        self._unavailable = "the loader was closed"  # why a cancelled one has no digests
        self._noticed = False
        if not self._missing:
            self._done.set()

    @classmethod
    def of(cls, values: Sequence[str]) -> "Digests":
        """Digests known whole (e.g. of a remote source's ETags)."""
        return cls(None, [""] * len(values), [()] * len(values), values)

    def __len__(self) -> int:
        return len(self._values)

    def ready(self) -> bool:
        """Whether every digest is known (or hashing failed: :meth:`wait` raises)."""
        return self._done.is_set()

    def pending_bytes(self) -> int:
        """Bytes of the files whose digest is still to compute."""
        return sum(int(self._identities[i][0]) for i in self._missing if self._values[i] is None)

    def start(self) -> None:
        """Queue the missing digests on the hashing thread (once; nothing when all are known)."""
        with _LOCK:
            if self._done.is_set() or self._started or self._cancelled:
                return
            self._started = True
        _submit(self)

    def wait(self, why: str = "the loader") -> tuple[str, ...]:
        """Every digest, hashing the missing ones first (starts them if needed; logs a long wait once).

        Raises:
            ValueError: A file changed or vanished since the build (naming it), or could not be read.
            RuntimeError: Cancelled (the loader was closed).
        """
        self.start()
        if not self._done.wait(_WAIT_NOTICE_S) and not self._noticed:
            self._noticed = True
            left = self.pending_bytes()
            logger.warning("zephon_loader: %s waits for the SHA-256 of %d shard file(s) of %s (%.2f GiB left to "
                           "read; the resume fingerprint needs them); a digest manifest makes them known at "
                           "build: %s", why, sum(1 for i in self._missing if self._values[i] is None), self._folder,
                           left / 2**30, index_command(self._folder or ""))
        self._done.wait()
        if self._error is not None:
            raise self._error
        if self._cancelled:
            raise RuntimeError(f"zephon_loader: the shard digests of {self._folder} are not computed here "
                               f"({self._unavailable})")
        return tuple(v for v in self._values if v is not None)

    def cancel(self) -> None:
        """Stop hashing for these files (a closed loader): dropped from the queue, or stopped within one read."""
        with _LOCK:
            if not self._done.is_set():
                self._cancelled = True
                if self in _QUEUE:
                    _QUEUE.remove(self)
                if _CURRENT is not self:  # not started, or dropped from the queue: nothing runs for it
                    self._done.set()
        self._done.wait(60)
        with _LOCK:
            thread = _THREAD if not _QUEUE and _CURRENT in (None, self) else None
        if thread is not None and thread is not threading.current_thread():
            thread.join(10)  # it ends with the queue: no hashing thread outlives the loader that started it

    def _compute(self) -> None:
        """On the hashing thread: the machine's lock, the cache again (another process may have hashed), then
        the rest, and the cache written."""
        try:
            with _machine_lock(self._cache, lambda: self._cancelled):
                known = _read_cache(self._cache) if self._cache is not None else {}
                for i in self._missing:
                    if self._cancelled:
                        return
                    name, ident = self._files[i], self._identities[i]
                    self._values[i] = _cached(known, name, ident) or self._hash(i)
                    if self._values[i] is None:
                        return
                self._write_cache()
        except _Cancelled:
            pass
        except BaseException as error:  # noqa: BLE001 - handed to the waiter
            self._error = error
        finally:
            self._done.set()

    def _hash(self, i: int) -> str | None:
        assert self._folder is not None
        path = os.path.join(self._folder, self._files[i])
        before = self._identities[i]
        try:
            now: tuple[Any, ...] | None = _identity(path)
        except FileNotFoundError:
            now = None
        if now == before:
            try:
                digest = file_sha256(path, lambda: self._cancelled)
                now = _identity(path)
            except FileNotFoundError:
                now = None
            if now == before:
                return digest
        raise ValueError(
            f"shard changed while the loader ran ({_what_changed(path, before, now)}) before its SHA-256 was "
            "computed for the resume fingerprint, so no state can describe the records the loader reads. Leave "
            "shards unchanged during a run; to train on the new data, build a new loader")

    def _write_cache(self) -> None:
        if self._cache is None or self._folder is None:
            return
        from zephon_loader.state import write_json_atomically

        fresh = {name: [list(ident), value] for name, ident, value in
                 zip(self._files, self._identities, self._values, strict=True)}
        try:
            write_json_atomically(self._cache, fresh)
        except OSError as error:  # a read-only home: hashed again next time
            logger.warning("zephon_loader: cannot write the shard digest cache %s (%s); the shards are hashed "
                           "again on this machine at every build; set %s to a writable folder", self._cache,
                           error, CACHE_ENV)

    def write_cache_now(self) -> None:
        """Record digests known at build (from the manifest) in the machine's cache (a small JSON write)."""
        if self._done.is_set() and self._error is None and not self._cancelled:
            self._write_cache()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a worker process's copy of the sources): the values known now, no thread state."""
        return {"folder": self._folder, "files": self._files, "identities": self._identities,
                "values": list(self._values)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["folder"], state["files"], state["identities"], state["values"], None)  # type: ignore[misc]
        if self._missing:  # not hashed here: only the process that built the loader computes them
            self._cancelled = True
            self._unavailable = "a copy in another process; the process that built the loader computes them"
            self._done.set()


class _Cancelled(Exception):
    """The job was cancelled while it waited for the machine's lock."""


_LOCK = threading.Lock()
_QUEUE: deque[Digests] = deque()
_THREAD: threading.Thread | None = None
_CURRENT: Digests | None = None  # the job the thread computes


def _submit(job: Digests) -> None:
    global _THREAD
    with _LOCK:
        _QUEUE.append(job)
        if _THREAD is None:
            _THREAD = threading.Thread(target=_run, name="zephon-loader-digests", daemon=True)
            _THREAD.start()


def _run() -> None:
    """The hashing thread: the queued jobs in order, then it ends (a later job starts a new one)."""
    global _THREAD, _CURRENT
    _lower_priority()
    while True:
        with _LOCK:
            _CURRENT = None
            if not _QUEUE:
                _THREAD = None
                return
            job = _CURRENT = _QUEUE.popleft()
        job._compute()


def _lower_priority() -> None:
    """Nice +10 for this thread (Linux sets niceness per thread): training and Zephon's readers go first."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + _NICE))
    except (AttributeError, OSError):  # not Linux/Unix: same priority as the rest
        pass


@contextlib.contextmanager
def _machine_lock(cache: Path | None, cancelled: Callable[[], bool]) -> Iterator[None]:
    """An exclusive lock per folder and machine in the cache folder: the ranks of a node hash a folder once
    (the next one finds the digests in the cache). Without ``fcntl`` or a writable cache folder: no lock."""
    if cache is None:
        yield
        return
    try:
        import fcntl

        cache.parent.mkdir(parents=True, exist_ok=True)
        handle = open(cache.with_name(f"{cache.stem}.{socket.gethostname()}.lock"), "a+b")
    except (ImportError, OSError):
        yield
        return
    try:
        while True:  # polled, so that a cancel (a closed loader) is not held up by another process's hashing
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if cancelled():
                    raise _Cancelled from None
                time.sleep(0.2)
        yield
    finally:
        handle.close()  # releases the lock


# ----------------------------------------------------------------------------- what the loader waits on


class PendingShards:
    """The resume fingerprint's shard part of a loader's sources: ready now, or once their digests are hashed.

    Args:
        sources: The loader's :class:`~zephon_loader.pipeline.shards.SourceFiles` (each with ``name``,
            ``digests`` and ``fingerprint()``).
    """

    def __init__(self, sources: Sequence[Any]) -> None:
        self._sources = tuple(sources)

    def ready(self) -> bool:
        """Whether every digest is known (:meth:`result` does not wait)."""
        return all(source.digests.ready() for source in self._sources)

    def start(self) -> None:
        """Queue the missing digests on the hashing thread (idempotent)."""
        for source in self._sources:
            source.digests.start()

    def result(self, why: str = "state_dict()/load_state_dict()") -> dict[str, list[list[object]]]:
        """``{source: [[file, size, sha256[:16]], ...]}``, waiting for the digests (:meth:`Digests.wait`)."""
        self.start()
        for source in self._sources:
            source.digests.wait(why)
        return {source.name: source.fingerprint() for source in self._sources}

    def outline(self) -> dict[str, list[list[object]]]:
        """``{source: [[file, size], ...]}``: what is known without digests."""
        return {source.name: [list(entry[:2]) for entry in source.outline()] for source in self._sources}

    def cancel(self) -> None:
        """Stop the hashing of these sources (the loader is closed)."""
        for source in self._sources:
            source.digests.cancel()
