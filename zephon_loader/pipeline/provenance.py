"""Where a record came from, and the log of records left out.

* :class:`ShardTable`: Zephon's ``sample_id = (dataset_id, shard_id, index)``
  back to a source, shard file and line (JSONL, 1-based) or row (Parquet,
  0-based), for every message about a record.
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

__all__ = ["DropLog", "ShardTable", "SourceShards"]


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
