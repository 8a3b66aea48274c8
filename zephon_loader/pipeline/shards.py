"""The shard files a loader reads, fixed at build: listed, identified by content, and shown to Zephon.

First step of the work source (config → builder → **shard files** → work
source → tokenize → pack → batch). :func:`open_source` runs once per source
when a loader is built; every epoch's pipeline reads the same files:

* **Listing.** The shard files of the folder in Zephon's order (sorted names,
  one format). Two sources on one folder (directly or through a symlink), or
  sharing a shard file (a hard link), are refused: every record would come twice.
* **Content.** Each file's SHA-256 over all its bytes, the resume
  fingerprint's shard part (:mod:`zephon_loader.fingerprint`). The build reads
  no shard byte for it (:mod:`zephon_loader.pipeline.digests`): a digest is
  taken from the cache folder (:func:`cache_dir`, keyed by the file's identity
  ``(size, mtime_ns, ctime_ns, inode, device)``: any write to a file changes
  its ``ctime``, so a changed file is hashed again) or from the folder's digest
  manifest (``zephon-loader index``), else computed in the background after the
  first batch; ``state_dict()``/``load_state_dict()`` wait for them. Hashing
  reads every byte once (about the cost of Zephon's own record count without
  an index: see ``benchmarks/bench_shard_scan.py``).
* **What Zephon reads** (:attr:`SourceFiles.zephon_root`): the source folder
  itself when it holds plain shards; a *view* in the cache folder when it holds
  compressed ones (``.jsonl.gz``, ``.zst``, ...): decoded copies and links to
  the plain shards, keyed by the files' identities, so nothing is written into the
  data folder (it may be read-only) and a replaced ``.gz`` is decoded anew
  (Zephon's own decoder reuses a ``.raw`` copy beside the data by its size).
* **Zephon's index and catalog.** An ``index.json`` in the folder (Zephon's
  ``python -m zephon.build_index``) must describe the files as they are (the
  same names and sizes, written after the last shard changed), else the build
  is refused naming the file and the command that rebuilds it. When a file's
  identity changed since the last build on this machine, Zephon's cached shard
  catalog of the folder is dropped so that Zephon counts the records again.
* **On object storage** (a source path ``s3://``, ``gs://``, ``az://``): listed with the ETag of each
  object, which stands for its content (nothing downloaded), and read by Zephon itself
  (:mod:`zephon_loader.pipeline.object_store`).
* **While the loader runs** (:meth:`SourceFiles.changes`): a shard changed,
  truncated or removed after the build is named (source, path, what changed)
  when an epoch starts and when Zephon fails to read; shards added after the
  build are not read (the stream stays the one the fingerprint describes).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from zephon_loader.errors import described_error as _described
from zephon_loader.errors import field_error as _err
from zephon_loader.pipeline import object_store
from zephon_loader.pipeline.digests import CACHE_ENV, Digests, cache_dir, lookup
from zephon_loader.zephon_compat import compression_of, decompress_to, forget_catalog, jsonl_suffixes

__all__ = ["CACHE_ENV", "SourceFiles", "cache_dir", "check_distinct", "files_by_format", "list_shards", "open_source",
           "refuse_mixed", "shard_format", "suffix_formats"]

_PARQUET_SUFFIX = ".parquet"
_VORTEX_SUFFIXES = (".vortex",)
_INDEX_NAMES = ("index.json", "_index.json")  # Zephon 0.2's discovery order

#: ``(size, mtime_ns, ctime_ns, inode, device)`` of a file.
Identity = tuple[int, int, int, int, int]


def _identity(stat: os.stat_result) -> Identity:
    return (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev)


@dataclass(frozen=True)
class SourceFiles:
    """One source's shard files as the build found them.

    Attributes:
        name: The source's name.
        where: Its config location, e.g. ``dataloader.sources[0].path ('web')``.
        folder: The folder (resolved: symlinks followed), or the prefix URL of a remote source.
        files: Shard file names in Zephon's shard-id order.
        kind: ``"jsonl"`` | ``"parquet"``.
        identities: Per file, ``(size, mtime_ns, ctime_ns, inode, device)`` at the build; for a remote
            source ``(size, ETag, last change in ns)``.
        digests: Per file, the SHA-256 (hex) of its bytes (:class:`~zephon_loader.pipeline.digests.Digests`:
            some may still be computed in the background; :meth:`fingerprint` waits for them); for a remote
            object, of its ETag and size (known at build).
        zephon_root: The folder Zephon reads (``folder``, or the decoded view of compressed shards).
        readable: Per file, the path holding its records as plain text (the decoded copy of a
            compressed shard; the URL of a remote one), for re-reading a line on an error path.
    """

    name: str
    where: str
    folder: str
    files: tuple[str, ...]
    kind: str
    identities: tuple[tuple[object, ...], ...]
    digests: Digests
    zephon_root: str
    readable: tuple[str, ...] = field(default=())

    @property
    def remote(self) -> bool:
        """Whether the source is on object storage (its folder is a URL)."""
        return object_store.is_url(self.folder)

    def fingerprint(self) -> list[list[object]]:
        """``[[file name, size, sha256[:16]], ...]``: the resume fingerprint's part for this source; a remote
        object's entry ends with ``"etag"`` (its digest is of the ETag, not of the bytes). Waits for digests
        still being computed (:meth:`Digests.wait <zephon_loader.pipeline.digests.Digests.wait>`)."""
        mark = ["etag"] if self.remote else []
        return [[name, ident[0], digest[:16], *mark]
                for name, ident, digest in zip(self.files, self.identities, self.digests.wait(), strict=True)]

    def outline(self) -> list[list[object]]:
        """``[[file name, size], ...]``: the fingerprint's entries without the digests (known at build)."""
        return [[name, ident[0]] for name, ident in zip(self.files, self.identities, strict=True)]

    def changes(self) -> list[str]:
        """What changed in the shard files since the build: ``["<path>: 4096 -> 2048 bytes", ...]`` (empty: none).

        A stat per file; the content is not read again (a rewrite changes ``mtime``/``ctime``). A remote source
        is listed again (one request per 1,000 objects): a new size or ETag is a change.

        Raises:
            ValueError: A remote source's store cannot be reached (naming the URL and what to check).
        """
        if self.remote:
            return object_store.remote_changes(self.where, self.folder, self.files, self.identities)
        out = []
        for name, before in zip(self.files, self.identities, strict=True):
            path = os.path.join(self.folder, name)
            try:
                now = _identity(os.stat(path))
            except FileNotFoundError:
                out.append(f"{path}: removed")
                continue
            if now[0] != before[0]:
                out.append(f"{path}: {before[0]} -> {now[0]} bytes")
            elif now != before:
                out.append(f"{path}: rewritten (same size, modified)")
        return out


def list_shards(where: str, configured: str, path: Path) -> tuple[tuple[str, ...], str]:
    """The shard files of a local source folder in Zephon's order (sorted names), and their format.

    Args:
        where: The config location for messages, e.g. ``sources[0].path ('web')``.
        configured: The path as configured.
        path: The resolved folder.

    Returns:
        ``(file names, "jsonl" | "parquet")``.

    Raises:
        ValueError: Not an existing folder, no shards, or the files of several formats
            (Zephon would silently read only one of them).
    """
    raw = os.fspath(path)
    if not path.exists():
        raise ValueError(_err(where, raw, "an existing directory of .jsonl or .parquet shards", "Check the path."))
    if not path.is_dir():
        raise ValueError(_err(where, raw, "a directory (not a file)", "Pass the directory that holds the shards."))
    return shard_format(where, raw, sorted(p.name for p in path.iterdir() if p.is_file()))


def suffix_formats() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The formats Zephon recognises by file-name suffix, with those suffixes, in its precedence order (a folder
    holding several is read as the first: ``zephon._internal.io.suffixes.AUTO_DETECT_ORDER``)."""
    return (("jsonl", jsonl_suffixes()), ("vortex", _VORTEX_SUFFIXES), ("parquet", (_PARQUET_SUFFIX,)))


def files_by_format(names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Per suffix format (:func:`suffix_formats`) with files among ``names``, those names (order kept)."""
    found = {kind: tuple(n for n in names if n.endswith(suffixes)) for kind, suffixes in suffix_formats()}
    return {kind: files for kind, files in found.items() if files}


def refuse_mixed(where: str, shown: str, seen: dict[str, Sequence[str]], read: str | None) -> None:
    """Refuse a folder (or prefix) holding the files of more than one format: Zephon would read one of them and
    silently skip the others' records.

    Args:
        where: The source's config location.
        shown: The folder or prefix URL.
        seen: Per format found, the files (or marker files) that show it.
        read: The format Zephon would read (``None``: none of them).
    """
    if len(seen) < 2:
        return
    parts = [f"{kind} ({', '.join(files[:3])}{f', and {len(files) - 3} more' if len(files) > 3 else ''})"
             for kind, files in seen.items()]
    skipped = " and ".join(k for k in seen if k != read)
    outcome = (f"Zephon reads only the {read} files of such a folder, none of the {skipped} records"
               if read else "Zephon reads none of them")
    raise ValueError(_described(where, f"{shown} holding the files of {len(seen)} formats: " + "; ".join(parts),
                                "one format per folder",
                                f"{outcome}; move the other format's files out of the folder, or give each format "
                                "its own folder and source."))


def shard_format(where: str, shown: str, names: Sequence[str]) -> tuple[tuple[str, ...], str]:
    """``(shard names, "jsonl" | "parquet")`` among a folder's (or prefix's) sorted file names.

    Raises:
        ValueError: No shards, or the files of several formats (:func:`refuse_mixed`).
    """
    seen = files_by_format(names)
    if not seen.keys() & {"jsonl", "parquet"}:
        raise ValueError(
            _err(where, shown, "a directory containing *.jsonl or *.parquet shards (none found)",
                 "Point the source at the folder that holds the shard files.")
        )
    kind = next(iter(seen))  # Zephon's precedence
    refuse_mixed(where, shown, seen, kind)
    return seen[kind], kind


def open_source(name: str, where: str, configured: str, folder: str | os.PathLike[str]) -> SourceFiles:
    """List and identify one source's shards (their digests: known or to hash, :func:`~zephon_loader.pipeline.
    digests.lookup`); check its Zephon index; make the view Zephon reads. Reads no shard byte unless some are
    compressed (decoded into the view).

    Args:
        name: The source's name.
        where: Its config location for messages.
        configured: Its path as configured.
        folder: That path resolved (relative to the config file).

    Raises:
        ValueError: Not a folder of shards of one format (:func:`list_shards`), or a stale ``index.json``
            (naming the file, what differs and the rebuild command); for a URL also an unknown scheme, a
            missing client or a store that refuses the listing.
    """
    if object_store.is_url(configured):
        return _open_remote(name, where, configured)
    files, kind = list_shards(where, configured, Path(folder))
    resolved = Path(os.path.realpath(folder))
    stats = [os.stat(resolved / n) for n in files]
    identities = tuple(_identity(s) for s in stats)
    digests, changed = lookup(resolved, files, identities)
    _check_local_index(where, resolved, files, kind, stats)
    if changed:
        digests.write_cache_now()  # those the manifest gave: this machine knows them from now on
    compressed = [compression_of(n) for n in files]
    if any(compressed):
        root, readable = _decoded_view(resolved, files, compressed, identities)
    else:
        root, readable = str(resolved), tuple(str(resolved / n) for n in files)
    source = SourceFiles(name, where, str(resolved), files, kind, identities, digests, root, readable)
    if changed and root == str(resolved):
        forget_catalog(root, kind)  # Zephon keys its catalog by names and sizes: a same-size edit would not re-key it
    return source


def _open_remote(name: str, where: str, configured: str) -> SourceFiles:
    """:func:`open_source` for a prefix URL: one listing (sizes, ETags), the index checked, nothing downloaded."""
    url = object_store.check_url(where, configured)
    objects = object_store.list_objects(where, url)
    by_name = {o["name"]: o for o in objects}
    files, kind = shard_format(where, url, [o["name"] for o in objects])
    object_store.check_keys(where, url, files)
    identities = tuple(object_store.identity(by_name[n]) for n in files)
    index = next((n for n in _INDEX_NAMES if n in by_name), None)
    if index is not None:
        from zephon_loader.zephon_compat import read_object_range

        ident = object_store.identity(by_name[index])
        try:
            text = read_object_range(f"{url}/{index}", 0, ident[0]).decode("utf-8")
        except BaseException as error:  # obstore's errors; a Rust panic is a BaseException
            if not object_store.store_raised(error):
                raise
            raise ValueError(object_store.store_failure(where, f"{url}/{index}", error, "reading")) from None
        # An upload's time is not the content's (a sync may send index.json first): names and sizes only.
        _check_index(where, f"{url}/{index}", text, None, files, [(i[0], 0) for i in identities], kind, url)
    digests = Digests.of(tuple(object_store.digest_of(i) for i in identities))
    return SourceFiles(name, where, url, files, kind, identities, digests, url,
                       tuple(f"{url}/{n}" for n in files))


def check_distinct(sources: Sequence[SourceFiles]) -> None:
    """Refuse two sources that read one folder or one file (every record would be delivered twice)."""
    seen: dict[object, SourceFiles] = {}
    for source in sources:
        inodes = [] if source.remote else [("file", ident[3:]) for ident in source.identities]
        for key in [("folder", source.folder)] + inodes:
            other = seen.setdefault(key, source)
            if other is not source:
                what = (f"the folder {source.folder}" if key[0] == "folder" else
                        f"a shard file (the same inode): {_name_of(source, key[1])}")
                raise ValueError(_err(source.where, source.folder, "a folder no other source reads",
                                      f"{other.where} reads {what} too, so each of its records would be delivered "
                                      "twice; give each source its own shards, or one source a larger weight."))


def _name_of(source: SourceFiles, inode: tuple[int, int]) -> str:
    return next(os.path.join(source.folder, n) for n, i in zip(source.files, source.identities) if i[3:] == inode)


# ----------------------------------------------------------------------------- Zephon's index


def _check_local_index(where: str, folder: Path, files: Sequence[str], kind: str,
                       stats: Sequence[os.stat_result]) -> None:
    """:func:`_check_index` for a local folder's ``index.json`` (if it has one)."""
    index = next((folder / n for n in _INDEX_NAMES if (folder / n).is_file()), None)
    if index is None:
        return
    try:
        text = index.read_text(encoding="utf-8")
    except OSError as error:
        text = f"<unreadable: {error}>"
    _check_index(where, os.fspath(index), text, index.stat().st_mtime_ns, files,
                 [(st.st_size, st.st_mtime_ns) for st in stats], kind, os.fspath(folder))


def _check_index(where: str, index: str, text: str, index_time: int | None, files: Sequence[str],
                 sizes_times: Sequence[tuple[int, int]], kind: str, folder: str) -> None:
    """Refuse an index file that no longer describes the shards (Zephon would read by it: records hidden).

    Args:
        index: The index file's path or URL; ``text`` its content, ``index_time`` its last change (ns;
            ``None``: not compared, as for an object, whose time is its upload's).
        sizes_times: Per shard, ``(size, last change in ns)``.
    """
    rebuild = f"python -m zephon.build_index {kind} {folder}"
    try:
        data = json.loads(text)
        listed = {str(s["basename"]): int(s["bytes"]) for s in data["shards"]}
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(_err(where, index, "a Zephon index (format_version, shards)",
                              f"It does not parse ({type(error).__name__}); rebuild it: {rebuild}")) from error
    problems = []
    for name, (size, changed) in zip(files, sizes_times, strict=True):
        if name not in listed:
            problems.append(f"{name} is not in it")
        elif listed[name] != size:
            problems.append(f"{name} has {size} bytes, the index says {listed[name]}")
        elif index_time is not None and changed > index_time:
            problems.append(f"{name} was modified after the index was written")
    problems += [f"{name} is in it but not in the folder" for name in sorted(set(listed) - set(files))]
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise ValueError(_err(where, index, "an index that describes the shards as they are",
                              f"It is stale ({shown}), so Zephon would read by it and miss or misplace records. "
                              f"Rebuild it after every change to the shards: {rebuild} (or delete it)."))


# ----------------------------------------------------------------------------- the decoded view


def _decoded_view(folder: Path, files: Sequence[str], compressed: Sequence[str | None],
                  identities: Sequence[Identity]) -> tuple[str, tuple[str, ...]]:
    """A folder in the cache Zephon reads instead of ``folder``: ``000000-<name>.jsonl`` per shard, in order
    (a decoded copy of a compressed shard, a symlink to a plain one); keyed by the shards' identities
    (``(size, mtime_ns, ctime_ns, inode, device)``: a replaced or rewritten file gets a new view)."""
    key = hashlib.sha256(json.dumps([os.fspath(folder), list(files), [list(i) for i in identities]]).encode()
                         ).hexdigest()[:24]
    views = cache_dir() / "views"
    view = views / key
    names = [f"{i:06d}-{_plain_name(n, c)}" for i, (n, c) in enumerate(zip(files, compressed, strict=True))]
    readable = tuple(str(view / n) for n in names)
    if (view / ".complete").is_file():
        return str(view), readable
    views.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{key}-{uuid.uuid4().hex[:8]}-", dir=views))
    try:
        for source_name, kind, view_name in zip(files, compressed, names, strict=True):
            if kind is None:
                os.symlink(folder / source_name, building / view_name)
            else:
                decompress_to(folder / source_name, building / view_name, kind)
        (building / ".complete").write_text("", encoding="utf-8")
        try:
            os.rename(building, view)
        except OSError:  # another rank or process made it first: theirs is the same content
            if not (view / ".complete").is_file():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return str(view), readable


def _plain_name(name: str, compression: str | None) -> str:
    if compression is None:
        return name
    return name[: name.rindex(".jsonl") + len(".jsonl")]
