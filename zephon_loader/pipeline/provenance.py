"""Where a record came from, and the log of records left out.

* :class:`ShardTable`: Zephon's ``sample_id = (dataset_id, shard_id, index)``
  back to a source, shard file and line (JSONL, 1-based) or row (Parquet,
  0-based), for every message about a record.
* :func:`row_pieces` / :func:`describe_rows`: what each packed row of a Zephon
  ``SampleBatch`` holds (which record, which token span), and that as
  source, shard, line/row (step provenance, ``loader.provenance(batch)`` and
  ``zephon-loader show``).
* :class:`DropLog`: an append-only JSONL file of drop events shared by every
  Zephon worker (threads or processes): one line per dropped record, keyed by
  the record's cursor so a record read twice (a resume replays from a chunk
  start) counts once. :mod:`zephon_loader.stats` reads it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from zephon_loader.errors import BadRecordError

__all__ = ["DropLog", "ShardTable", "SourceShards", "describe_rows", "raw_provenance", "row_pieces"]


# ----------------------------------------------------------------------------- where a record is


@dataclass(frozen=True)
class SourceShards:
    """One source's shard files in Zephon's shard-id order (sorted file names).

    ``readable``: per file, where its records are plain text (a compressed shard's decoded copy), for
    re-reading a line on an error path; empty: the files themselves.
    """

    name: str
    folder: str
    files: tuple[str, ...]
    kind: str  # "jsonl" | "parquet" | a format of pipeline.formats
    readable: tuple[str, ...] = ()

    def text_path(self, shard: int) -> str:
        """The path to re-read shard ``shard``'s lines from."""
        return self.readable[shard] if self.readable else os.path.join(self.folder, self.files[shard])


@dataclass(frozen=True)
class ShardTable:
    """Maps Zephon's ``sample_id = (dataset_id, shard_id, index)`` to a source, shard file and line/row.

    Zephon numbers a directory's shards in sorted file-name order and a JSONL
    record by its non-blank line; :meth:`where` turns that back into the
    physical 1-based line (reading the file only on this error path).
    """

    sources: tuple[SourceShards, ...]
    #: What changed in the shard files since the build (one line), or ``None``; see ``pipeline.shards``.
    changes: Callable[[], str | None] | None = field(default=None, compare=False)

    def changed_files(self) -> str | None:
        """One line naming the shards changed, truncated or removed since the build; ``None`` when none did."""
        return self.changes() if self.changes is not None else None

    def source_name(self, sample_id: Sequence[int]) -> str:
        dataset = int(sample_id[0])
        return self.sources[dataset].name if 0 <= dataset < len(self.sources) else f"dataset #{dataset}"

    def where(self, sample_id: Sequence[int]) -> str:
        """``source 'web', shard /data/web/part-00001.jsonl, line 17`` (or ``row 16`` for Parquet)."""
        dataset, shard, index = (int(x) for x in sample_id[:3])
        if not 0 <= dataset < len(self.sources):
            return f"dataset #{dataset}, shard #{shard}, record #{index}"
        src = self.sources[dataset]
        if not 0 <= shard < len(src.files):
            return f"source {src.name!r}, shard #{shard} of {src.folder}, record #{index}"
        file = os.path.join(src.folder, src.files[shard])
        if src.kind != "jsonl":  # Parquet, and the formats of pipeline.formats: a row of the shard's file
            return f"source {src.name!r}, shard {file}, row {index} (0-based)"
        line = _physical_line(src.text_path(shard), index)
        return f"source {src.name!r}, shard {file}, " + (f"line {line}" if line else f"record #{index}")

    def locate(self, sample_id: Sequence[int]) -> dict[str, Any]:
        """Where a record is, as data: ``{"source", "shard" (file or URL), "line" (JSONL, 1-based) or "row"
        (Parquet and the other formats, 0-based), "record" (Zephon's index in the shard)}``.

        A JSONL shard's line numbers are read once per shard (cached) and counted as Zephon counts records
        (non-blank lines). A sample id outside the table (not this configuration's data) raises ``ValueError``.
        """
        dataset, shard, index = (int(x) for x in sample_id[:3])
        if not 0 <= dataset < len(self.sources) or not 0 <= shard < len(self.sources[dataset].files):
            raise ValueError(
                f"provenance: Zephon's sample id {tuple(sample_id)!r} names dataset {dataset}, shard {shard}; expected "
                f"one of this configuration's {len(self.sources)} sources and its shards: the batch does not come "
                "from this loader's data")
        src = self.sources[dataset]
        where: dict[str, Any] = {"source": src.name, "shard": _join(src.folder, src.files[shard])}
        if src.kind == "jsonl":
            lines = _line_index(src.text_path(shard))
            where["line"] = lines[index] if lines is not None and index < len(lines) else None
        else:
            where["row"] = index
        where["record"] = index
        return where

    def field_presence(self, sample_id: Sequence[int], field: str, limit: int = 10_000) -> str:
        """How many records of the shard holding ``sample_id`` have ``field`` (at most ``limit`` read; this error
        path only): ``"none of the 50 records of this shard has 'text'"``; ``""`` when it cannot be told."""
        dataset, shard = int(sample_id[0]), int(sample_id[1])
        if not 0 <= dataset < len(self.sources) or not 0 <= shard < len(self.sources[dataset].files):
            return ""
        src = self.sources[dataset]
        if src.kind != "jsonl":
            return ""
        seen = having = 0
        try:
            with _open_text(src.text_path(shard)) as handle:
                for line in handle:
                    if line.isspace():
                        continue
                    seen += 1
                    try:
                        having += isinstance(record := json.loads(line), dict) and field in record
                    except ValueError:
                        pass
                    if seen >= limit:
                        break
        except OSError:
            return ""
        first = f"the first {seen}" if seen >= limit else f"the {seen}"
        if not having:
            return f"none of {first} records of this shard has {field!r}"
        return f"{having} of {first} records of this shard have {field!r}"

    def unparsable(self, error: Exception) -> BadRecordError:
        """The error for a JSONL line Zephon's reader could not parse, naming the shard and line.

        Zephon's ``json.loads`` sees one line, so its own message says "line 1";
        the first line of the sources that does not parse is searched here (only
        on this error path). Such a line is always an error, even under
        ``on_bad_record: skip``: Zephon's reader fails before any check runs.
        """
        for src in self.sources:
            if src.kind != "jsonl":
                continue
            for shard, name in enumerate(src.files):
                file = os.path.join(src.folder, name)
                text = src.text_path(shard)
                if not text.endswith(".jsonl"):
                    continue
                with _open_text(text) as handle:
                    for number, line in enumerate(handle, start=1):
                        if line.isspace():
                            continue
                        try:
                            json.loads(line)
                        except ValueError as bad:
                            return BadRecordError(
                                f"source {src.name!r}, shard {file}, line {number}: not valid JSON ({bad.msg.removesuffix(' at')}, "
                                f"column {bad.colno}): {line.strip()[:60]!r}. Fix or remove the line; a line that "
                                "does not parse is an error even under on_bad_record: skip "
                                "(Zephon's reader fails on it)."
                            )
        return BadRecordError(f"a JSONL shard holds a line that is not valid JSON ({error}); none found on re-reading "
                              "the shards: were they changed while the loader ran?")


def _join(folder: str, name: str) -> str:
    from zephon_loader.pipeline.object_store import is_url

    return f"{folder.rstrip('/')}/{name}" if is_url(folder) else os.path.join(folder, name)


_LINE_INDEXES: dict[tuple[str, int, int], list[int] | None] = {}


def _line_index(file: str) -> list[int] | None:
    """1-based physical line of each record of a plain JSONL file (Zephon numbers non-blank lines); ``None``
    for a compressed shard (its record index is named instead). Cached per file, size and mtime."""
    if not file.endswith(".jsonl"):
        return None
    try:
        stat = os.stat(file)
        key = (file, stat.st_size, stat.st_mtime_ns)
    except OSError:
        key = (file, -1, -1)
    if key not in _LINE_INDEXES:
        try:
            with _open_text(file) as handle:
                _LINE_INDEXES[key] = [number for number, line in enumerate(handle, start=1) if not line.isspace()]
        except Exception:  # noqa: BLE001 - an unreadable file: the record index is named instead
            _LINE_INDEXES[key] = None
    return _LINE_INDEXES[key]


# ----------------------------------------------------------------------------- what a row holds

def raw_provenance(sample_batch: Any) -> list[tuple[Any, Any, int]]:
    """What :func:`row_pieces` needs of each row of a ``SampleBatch``, by reference (no copy, no work):
    ``(contributors, positions, padding_length)``."""
    rows = []
    for record in sample_batch.records:
        meta = record.meta
        payload = record.payload
        positions = payload.get("positions") if isinstance(payload, dict) else None
        packing = meta.tags.get("_packing_metadata") or {}
        rows.append((meta.contribution_refs(), positions, int(packing.get("padding_length") or 0)))
    return rows


def row_pieces(contributors: Sequence[Any], positions: Any, padding: int) -> list[tuple[tuple[int, int, int], int,
                                                                                     int, bool]]:
    """The pieces of one packed row: ``[(sample_id, start, end, last), ...]`` in row order.

    Zephon's packer gives a packed record, per segment in order, the record it came from
    (``meta.contributors``: the record's cursor with its ``sample_id``; ``is_last_child``: this segment is the
    record's last piece) and ``positions`` that restart at 0 at every segment (the trailing padding forms
    one more run); ``start``/``end`` are columns of the packed row of ``S + 1`` tokens, end exclusive.

    Raises:
        ValueError: No positions, or segments and contributors that do not pair up (a pipeline this
            function does not know).
    """
    import numpy as np

    if positions is None:
        raise ValueError("provenance: the packed rows carry no 'positions' (Zephon's pack_flat with "
                         "emit_positions), expected the text pipeline's rows; this loader's rows cannot be traced")
    positions = np.asarray(positions)
    starts = np.flatnonzero(positions == 0).tolist()
    bounds = starts + [int(positions.shape[0])]
    runs = [(bounds[i], bounds[i + 1]) for i in range(len(starts))]
    if padding:
        if not runs or runs[-1][1] - runs[-1][0] != padding:
            raise ValueError(f"provenance: a row's last run of positions is {runs[-1] if runs else None}, expected "
                             f"the {padding} padding tokens Zephon's packer reported")
        runs = runs[:-1]
    if len(runs) != len(contributors):
        raise ValueError(f"provenance: a packed row has {len(runs)} segments (by its positions) and "
                         f"{len(contributors)} contributing records, expected one record per segment")
    return [(tuple(int(x) for x in ref.cursor.sample_id[:3]), start, end, bool(ref.is_last_child))
            for ref, (start, end) in zip(contributors, runs)]


def describe_rows(raw: Sequence[tuple[Any, Any, int]], table: ShardTable, sequence_length: int) -> list[
        list[dict[str, Any]]]:
    """Per row of a batch (:func:`raw_provenance`), its pieces as data::

        {"source", "shard", "line" | "row", "record", "start", "end", "tokens", "ends_document"}

    ``start``/``end``: the piece's columns of ``input_ids`` (end exclusive); the packed row has ``S + 1``
    tokens and its last one reaches the model only as a label, so ``end`` is at most ``S`` (a piece made of
    that token alone has ``start == end == S``). ``tokens``: the piece's tokens in the packed row (label-only
    one included). ``ends_document``: the piece is its document's last (``wrap`` cuts a document across rows:
    its earlier pieces have ``False``).
    """
    rows = []
    for contributors, positions, padding in raw:
        pieces = []
        for sample_id, start, end, last in row_pieces(contributors, positions, padding):
            piece = table.locate(sample_id)
            piece.update(start=min(start, sequence_length), end=min(end, sequence_length), tokens=end - start,
                         ends_document=last)
            pieces.append(piece)
        rows.append(pieces)
    return rows


def _physical_line(file: str, index: int) -> int | None:
    """1-based line number of the ``index``-th non-blank line (Zephon's record numbering)."""
    if not file.endswith(".jsonl"):
        return None  # compressed shards: Zephon's index is all we can name cheaply
    try:
        with _open_text(file) as handle:
            seen = -1
            for number, line in enumerate(handle, start=1):
                if not line.isspace():
                    seen += 1
                    if seen == index:
                        return number
    except Exception:  # noqa: BLE001 - an unreadable file or object: the record index is named instead
        return None
    return None


def _open_text(path: str) -> Any:
    """A shard's lines as text (undecodable bytes replaced): a local file, or an object on storage (downloaded,
    on these error paths only)."""
    from zephon_loader.pipeline.object_store import is_url

    if not is_url(path):
        return open(path, encoding="utf-8", errors="replace")
    import io

    from zephon_loader.zephon_compat import read_object

    return io.StringIO(read_object(path).decode("utf-8", errors="replace"))


# ----------------------------------------------------------------------------- drop log


class DropLog:
    """Append-only JSONL file of dropped records, shared by Zephon's workers (threads or processes).

    One line per drop: ``{"key": [lane, chunk, offset], "sample": [dataset, shard, index],
    "source": name, "reason": str, "tokens": int | null, "where": str}``. Appends
    of one short line are atomic on POSIX, so concurrent workers never interleave.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def append(self, event: Mapping[str, Any]) -> None:
        line = json.dumps(event, separators=(",", ":")) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode("utf-8"))
        finally:
            os.close(fd)

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, encoding="utf-8") as handle:
                return [json.loads(line) for line in handle if line.strip()]
        except FileNotFoundError:
            return []
