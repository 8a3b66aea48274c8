"""The shard formats a source may hold, one table: what each is, how it is recognised, opened and fingerprinted.

Part of the first step of the work source (config → builder → **shard files**
→ work source → tokenize → pack → batch). JSONL and Parquet folders are listed
by :func:`~zephon_loader.pipeline.shards.list_shards`; the formats Zephon 0.2
reads through an optional extra are opened here, by :func:`open_source`, when a
source's ``format`` (``dataloader.sources[i].format``), or what its folder
holds, is one of them:

* **What a format is** (:data:`FORMATS`): its name in the config, Zephon's
  ``Dataset.from_path(fmt=...)`` name, the Python packages Zephon imports to
  read it and the ``pip install 'zephon-loader[<extra>]'`` that brings them,
  its marker files, and how a record is located (Zephon's
  ``sample_id = (dataset, shard, index)``: which file a shard is, and that the
  index is a 0-based row in it).
* **Recognising a folder** (:func:`detect`, with ``format: null``): LitData
  (``index.json`` with ``config`` and ``chunks``, what ``litdata.optimize``
  writes), Lance (``_versions/*.manifest``), Vortex (``*.vortex`` files); a
  Mosaic MDS folder (``index.json`` with ``shards``, no ``format_version``) and
  a Hugging Face ``save_to_disk`` folder (``state.json`` + ``*.arrow``) are
  recognised and refused with the reason and the conversion that works. A
  folder holding the files of two formats (:func:`formats_in`; a Lance dataset
  with a stray ``.jsonl``, a LitData folder with a JSONL file) is refused
  naming both: Zephon reads one of them by its own precedence and skips the rest.
* **Content** (:func:`open_source`, :class:`FormatFiles`): every data file of
  the folder (name, size, SHA-256 through the same digest cache and manifest as JSONL/Parquet shards), the
  resume fingerprint's part for the source, so an edited, added or removed
  data file refuses an old state; the same files are watched while the loader
  runs (:meth:`~zephon_loader.pipeline.shards.SourceFiles.changes`).

Zephon reads these folders itself (``zephon_root`` is the folder) and recognises them by the same marker
files; nothing is written into them. :func:`open_source` is the one entry point of the work source for
every source (JSONL/Parquet folders and URLs go on to ``shards.open_source``).

Not offered, and why (checked on a CPU machine with zephon 0.2.0, Dec 2026;
the reasons users see are ``config.schema.UNREAD_FORMATS``): MDS needs
``mosaicml-streaming`` (0.13.0), whose ``import streaming`` imports ``torchvision`` (the PyPI wheel is the CUDA build
and does not load against the CPU torch) and which pins ``transformers<5``
(the loader's ``hf``/``trainer`` extras need transformers 5); its fork ``streaming-community`` 0.14.2 lifts
the pin but still imports ``torchvision`` from ``import streaming`` (0.28.0 from the index fails against the
CPU torch 2.13: ``operator torchvision::nms does not exist``), so Zephon's MDS reader stays disabled; Zephon's
Hugging Face reader serves ``hf://`` Hub URLs only (it resolves them online),
and no Zephon format reads the Arrow files of a ``save_to_disk`` folder.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from zephon_loader.config.schema import SOURCE_FORMATS, UNREAD_FORMATS
from zephon_loader.errors import described_error as _described
from zephon_loader.errors import field_error as _err
from zephon_loader.pipeline.object_store import is_url
from zephon_loader.pipeline.digests import MANIFEST_NAME, lookup
from zephon_loader.pipeline.shards import Identity, SourceFiles, _identity, files_by_format, refuse_mixed
from zephon_loader.pipeline.shards import open_source as open_shards

__all__ = ["FORMATS", "FormatFiles", "ShardFormat", "check_kind", "detect", "forget_catalogs", "formats_in",
           "install_line", "list_files", "open_source", "owns", "require_packages"]


@dataclass(frozen=True)
class ShardFormat:
    """One shard format a source may hold.

    Attributes:
        name: Its ``dataloader.sources[i].format`` value.
        title: What it is, for messages ("a Lance dataset").
        markers: The files that identify it in a folder (for messages and docs).
        zephon_fmt: Zephon's name of the format (``Dataset.from_path(fmt=...)``, its catalog key); Zephon
            recognises the folder by the same marker files.
        modules: The modules Zephon imports to read it (checked at build, with the install line).
        packages: The PyPI packages that provide them.
        extra: The ``zephon-loader`` extra that installs them (``None``: always installed).
        shard: What one Zephon shard is (the file a record's location names).
        unsupported: Why the loader refuses it and what to do instead (``None``: supported).
    """

    name: str
    title: str
    markers: str
    zephon_fmt: str | None
    modules: tuple[str, ...] = ()
    packages: str = ""
    extra: str | None = None
    shard: str = "one file"
    unsupported: str | None = None


#: Every format the loader knows, by config name; :data:`SOURCE_FORMATS` are the ones it reads.
FORMATS: dict[str, ShardFormat] = {f.name: f for f in (
    ShardFormat("jsonl", "a folder of JSONL shards", "*.jsonl (or .jsonl.gz, .zst, ...) files", None,
                shard="one .jsonl file; a record is a non-blank line"),
    ShardFormat("parquet", "a folder of Parquet shards", "*.parquet files", None, ("pyarrow",), "pyarrow",
                shard="one .parquet file; a record is a row"),
    ShardFormat("litdata", "a LitData dataset (litdata.optimize output)",
                "index.json with 'config' and 'chunks', and its chunk-*.bin files", "litdata",
                ("litdata",), "litdata", "litdata", shard="one chunk file (index.json order); a record is a row"),
    ShardFormat("lance", "a Lance dataset", "_versions/*.manifest and data/*.lance", "lance", ("lance", "pyarrow"),
                "pylance", "lance",
                shard="one fragment's data file (manifest order, latest version); a record is a live row"),
    ShardFormat("vortex", "a folder of Vortex files", "*.vortex files", "vortex", ("vortex",), "vortex-data",
                "vortex", shard="one .vortex file; a record is a row"),
    ShardFormat("mds", "a Mosaic Streaming (MDS) dataset", "index.json with 'shards' and no 'format_version'",
                "mds", unsupported=UNREAD_FORMATS["mds"]),
    ShardFormat("hf", "a Hugging Face datasets folder (save_to_disk)", "state.json, dataset_info.json, *.arrow",
                None, unsupported=UNREAD_FORMATS["hf"]),
)}
# The schema validates the field with SOURCE_FORMATS; tests/test_shard_formats.py checks this table agrees.
#: The formats opened by this module (the others are folders of shard files, see ``shards.list_shards``).
_OWN_LAYOUT = ("litdata", "lance", "vortex", "mds", "hf")
_MDS_OR_LITDATA_INDEX = "index.json"


def install_line(fmt: ShardFormat) -> str:
    """``pip install 'zephon-loader[lance]'`` (the packages by name when the format has no extra)."""
    return f"pip install 'zephon-loader[{fmt.extra}]'" if fmt.extra else f"pip install {fmt.packages}"


# ----------------------------------------------------------------------------- recognising a folder


def _read_index(folder: Path) -> dict | None:
    try:
        data = json.loads((folder / _MDS_OR_LITDATA_INDEX).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def formats_in(folder: Path) -> dict[str, tuple[str, ...]]:
    """Per format whose files ``folder`` holds, the files that show it (relative): LitData's or MDS's
    ``index.json``, Lance's manifests, a ``save_to_disk`` folder's ``state.json`` and Arrow files, and the top-level
    files of each suffix format (JSONL, Vortex, Parquet: Zephon's ``AUTO_DETECT_ORDER``), in Zephon's precedence
    (an index first, then the suffixes, then Lance)."""
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    seen: dict[str, tuple[str, ...]] = {}
    index = _read_index(folder)
    if index is not None and "config" in index and "chunks" in index:
        seen["litdata"] = (_MDS_OR_LITDATA_INDEX,)
    elif index is not None and "shards" in index and "format_version" not in index:  # Zephon's index has one
        seen["mds"] = (_MDS_OR_LITDATA_INDEX,)
    seen.update(files_by_format(names))
    versions = folder / "_versions"
    manifests = sorted(p.name for p in versions.iterdir() if p.name.endswith(".manifest")) if versions.is_dir() else []
    if manifests:
        seen["lance"] = tuple(f"_versions/{n}" for n in manifests)
    arrow = tuple(n for n in names if n.endswith(".arrow"))
    if "state.json" in names and arrow:
        seen["hf"] = ("state.json", *arrow)
    return seen


def detect(folder: Path) -> str | None:
    """The format of ``folder`` when it is one this module opens (LitData, Lance, Vortex, MDS, Hugging Face);
    ``None`` otherwise (JSONL/Parquet shards, or nothing: ``shards.list_shards`` decides and explains)."""
    if not folder.is_dir():
        return None
    seen = formats_in(folder)
    return next((kind for kind in ("litdata", "mds", "lance", "hf", "vortex") if kind in seen), None)


def owns(configured: str, folder: str | os.PathLike[str], fmt: str | None) -> bool:
    """Whether this module lists the source: its ``format``, or its folder's files, say a format of its own
    (a ``format: parquet`` on a Lance dataset, say, is refused here, naming the format found)."""
    if is_url(configured):
        return False  # a URL: the caller's listing decides
    return fmt in _OWN_LAYOUT or detect(Path(folder)) is not None


def check_kind(where: str, fmt: str | None, kind: str, folder: str | os.PathLike[str]) -> None:
    """Refuse a folder of ``kind`` shards (what ``list_shards`` found) configured as another ``format``."""
    if fmt is not None and fmt != kind:
        raise ValueError(_described(where, f"{FORMATS[kind].title} in {os.fspath(folder)}", FORMATS[fmt].title,
                                    f"Set format: {kind} (or null), or point the source at {FORMATS[fmt].title}."))


def require_packages(fmt: ShardFormat, where: str) -> None:
    """Raise one line naming the install command when a package Zephon needs for ``fmt`` is missing."""
    for module in fmt.modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ImportError(
                f"{where}: {fmt.title} needs the Python package {fmt.packages} (import {module!r} failed: {error}); "
                f"install it with: {install_line(fmt)}") from None


# ----------------------------------------------------------------------------- listing each format's files


def _litdata_files(where: str, folder: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    index = _read_index(folder)
    chunks = index.get("chunks") if index is not None else None
    if not (isinstance(chunks, list) and isinstance(index.get("config"), dict)
            and all(isinstance(c, dict) and isinstance(c.get("filename"), str) for c in chunks)):
        raise ValueError(_err(where, os.fspath(folder / _MDS_OR_LITDATA_INDEX),
                              "a LitData index.json with 'config' and a 'chunks' list of {'filename': ...}",
                              "Point the source at the folder litdata.optimize(output_dir=...) wrote."))
    shards = tuple(str(c["filename"]) for c in chunks)
    missing = [n for n in shards if not (folder / n).is_file()]
    if missing:
        raise ValueError(_err(where, os.fspath(folder), f"every chunk file index.json names (missing: {missing[:3]})",
                              "Copy the whole litdata.optimize output folder, or optimize again."))
    return (_MDS_OR_LITDATA_INDEX, *shards), shards


def _lance_files(where: str, folder: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    import lance

    try:
        fragments = lance.dataset(os.fspath(folder)).get_fragments()
    except Exception as error:  # noqa: BLE001 - pylance raises its own error types
        raise ValueError(_err(where, os.fspath(folder), "a Lance dataset pylance opens",
                              f"pylance could not open it ({type(error).__name__}: {error}); write it with "
                              "lance.write_dataset(...).")) from None
    shards = []
    for fragment in fragments:
        data = fragment.data_files()
        if len(data) != 1:
            raise ValueError(_err(where, f"fragment {fragment.fragment_id} with {len(data)} data files",
                                  "one data file per fragment (Zephon reads one file per shard)",
                                  "Rewrite the dataset (lance.write_dataset(lance.dataset(path).to_table(), "
                                  "new_path)) after add_columns."))
        shards.append(f"data/{os.path.basename(data[0].path)}")
    # Every file of the dataset (manifests, transactions, deletion files, data): a new version, a deletion or an
    # edit changes the fingerprint.
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                   if p.is_file() and p != folder / MANIFEST_NAME)  # the digest manifest is not the dataset's
    return tuple(files), tuple(shards)


def _vortex_files(where: str, folder: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    shards = tuple(sorted(p.name for p in folder.iterdir() if p.is_file() and p.name.endswith(".vortex")))
    return shards, shards  # list_files checked that there is one at least


_LISTERS: dict[str, Callable[[str, Path], tuple[tuple[str, ...], tuple[str, ...]]]] = {
    "litdata": _litdata_files, "lance": _lance_files, "vortex": _vortex_files}


@dataclass(frozen=True)
class FormatFiles(SourceFiles):
    """A source of a format of this module as the build found it: ``files`` are the file of each Zephon shard in
    shard-id order (what a record's location names); ``others`` the rest of its data files (LitData's
    ``index.json``, Lance's manifests, transactions and deletion files), in the fingerprint and watched too.

    Attributes:
        others: The data files that are not shards, relative to the folder.
        other_identities: Their ``(size, mtime_ns, ctime_ns, inode, device)`` at the build (their digests
            follow the shards' in ``digests``).
    """

    others: tuple[str, ...] = ()
    other_identities: tuple[Identity, ...] = ()

    def _other_files(self) -> SourceFiles:
        return SourceFiles(self.name, self.where, self.folder, self.others, self.kind, self.other_identities,
                           self.digests, self.zephon_root)

    def fingerprint(self) -> list[list[object]]:
        """``[[file, size, sha256[:16]], ...]`` of the shard files, then of the other data files (``digests``
        holds both, in that order; waits for those still being computed)."""
        return [[name, ident[0], digest[:16]] for name, ident, digest in
                zip(self.files + self.others, self.identities + self.other_identities, self.digests.wait(),
                    strict=True)]

    def outline(self) -> list[list[object]]:
        """``[[file, size], ...]`` of the shard files, then of the other data files."""
        return super().outline() + self._other_files().outline()

    def changes(self) -> list[str]:
        """What changed in the shard files and the other data files since the build (empty: none)."""
        return super().changes() + self._other_files().changes()


def open_source(name: str, where: str, configured: str, folder: str | os.PathLike[str],
                fmt: str | None = None) -> SourceFiles:
    """One source as the build finds it, in any format: the one entry point of ``work_source.open_sources``.

    JSONL/Parquet folders (and URLs) go to :func:`~zephon_loader.pipeline.shards.open_source`, checked against
    a configured ``format``; LitData, Lance and Vortex (given or recognised, :func:`owns`) are listed here
    and every data file hashed through the same digest cache; Zephon reads the folder itself.

    Args:
        name: The source's name.
        where: Its config location for messages.
        configured: Its path as configured.
        folder: That path resolved.
        fmt: Its configured ``format`` (``None``: recognised by the folder's files).

    Raises:
        ValueError: Not a folder of that format, a format the loader does not read (with the reason and the
            conversion), or what :func:`~zephon_loader.pipeline.shards.open_source` refuses.
        ImportError: The format's package is missing (one line with the ``pip install`` command).
    """
    if not owns(configured, folder, fmt):
        source = open_shards(name, where, configured, folder)
        check_kind(where, fmt, source.kind, folder)
        return source
    real = os.path.realpath(folder)
    kind, files, shards = list_files(where, configured, real, fmt)
    shard_set = set(shards)
    others = tuple(n for n in files if n not in shard_set)
    identities = tuple(_identity(os.stat(os.path.join(real, n))) for n in shards + others)
    digests, changed = lookup(Path(real), shards + others, identities)
    if changed:
        digests.write_cache_now()
        forget_catalogs(kind, real, files)
    count = len(shards)
    return FormatFiles(name, where, real, shards, kind, identities[:count], digests, real,
                       others=others, other_identities=identities[count:])


def list_files(where: str, configured: str, folder: str | os.PathLike[str],
               fmt: str | None) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """The files of one source of a format this module opens (:func:`owns`).


    Args:
        where: The source's config location for messages.
        configured: Its path as configured.
        folder: That path resolved (symlinks followed).
        fmt: Its configured ``format`` (``None``: :func:`detect`).

    Returns:
        ``(format, files, shard files)``: every data file of the folder, relative to it (the fingerprint:
        index, manifests and data), and the file of each Zephon shard in shard-id order.

    Raises:
        ValueError: Not a folder of that format, or a format the loader does not read (with the reason).
        ImportError: The format's package is missing (one line with the ``pip install`` command).
    """
    path = Path(folder)
    if not path.is_dir():
        raise ValueError(_err(where, os.fspath(path), "an existing directory" if not path.exists() else
                              "a directory (not a file)", f"Point the source at the folder of {configured!r}."))
    seen = formats_in(path)
    refuse_mixed(where, os.fspath(path), seen, next((k for k in seen if k != "hf"), None))  # Zephon's pick
    found = next(iter(seen), None)  # the folder's one format (or none)
    kind = fmt or found
    spec = FORMATS[kind]
    if spec.unsupported:
        raise ValueError(_described(where, f"{spec.title} ({os.fspath(path)}: {spec.markers})",
                                    f"a format the loader reads ({', '.join(SOURCE_FORMATS)})", spec.unsupported + "."))
    if found != kind:
        seen_text = FORMATS[found].title if found else "no " + spec.markers
        raise ValueError(_described(where, f"{seen_text} in {os.fspath(path)}", f"{spec.title} ({spec.markers})",
                                    f"Set format: {found} (or null)." if found else
                                    f"Point the source at {spec.title}, or set format: null."))
    require_packages(spec, where)
    files, shard_files = _LISTERS[kind](where, path)
    return kind, files, shard_files


def forget_catalogs(kind: str, folder: str, files: tuple[str, ...]) -> None:
    """Drop Zephon's cached shard catalog of a source whose files changed since the last build on this machine.

    Zephon keys it by the folder and its index's (or files') names and sizes, a Lance dataset by its manifest
    path alone: a dataset rewritten in place was read by the old catalog ("Shard raw file missing").
    """
    from zephon_loader.zephon_compat import forget_catalog

    for root in [folder] + [os.path.join(folder, n) for n in files if n.endswith(".manifest")]:
        forget_catalog(root, FORMATS[kind].zephon_fmt or kind)
