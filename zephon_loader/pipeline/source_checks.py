"""Build-time checks of the sources that need their shards or record counts (run in the driver, before any worker).

* :func:`check_parquet_columns`: every column of every Parquet shard has a type
  Zephon's reader can take rows of (a ``string_view`` column failed at the
  first batch with ``ArrowNotImplementedError``, naming nothing). Reads each
  shard's footer only.
* :func:`check_pass_length`: under ``mixture: repeat`` with finite ``passes``,
  warns when one pass needs far more records than the sources hold (weights
  ``1 : 1e-9`` made one pass need about 1e11 records, without a word).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from zephon_loader.errors import field_error as _err

__all__ = ["PASS_LENGTH_WARN_RATIO", "check_parquet_columns", "check_pass_length", "pass_records"]

#: :func:`check_pass_length` warns when one pass reads more than this many times all the sources' records.
PASS_LENGTH_WARN_RATIO = 100


@lru_cache(maxsize=None)
def _takes_rows(arrow_type: Any) -> bool:
    """Whether pyarrow's ``take`` (what Zephon's Parquet reader calls) has a kernel for ``arrow_type``."""
    import pyarrow as pa

    try:
        pa.table({"c": pa.nulls(1, type=arrow_type)}).take(pa.array([0], type=pa.int64()))
    except (pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return False
    except Exception:  # pragma: no cover - another failure is not this check's to report
        return True
    return True


#: What to cast a type without a ``take`` kernel to (by the type's string prefix).
_CASTS = {"string_view": "pa.large_string()", "binary_view": "pa.large_binary()", "list_view": "pa.large_list(...)",
          "large_list_view": "pa.large_list(...)"}


def check_parquet_columns(source: str, files: Sequence[str | os.PathLike[str]],
                          sizes: Sequence[int] | None = None) -> None:
    """Refuse a Parquet shard with a column Zephon 0.2.0's reader cannot take rows of (``string_view``, ...).

    Reads each file's footer only (its schema). Call it once per build for each Parquet source.

    Args:
        source: The source's name (for the message).
        files: Its Parquet shard files (local paths, or object URLs with ``sizes``).
        sizes: Per object its size, for files on object storage (the footer is read by two range reads).

    Raises:
        ValueError: Naming the source, shard file, column, its type and the cast that fixes it.
    """
    import pyarrow.parquet as pq

    from zephon_loader.pipeline.object_store import read_parquet_schema

    for i, path in enumerate(files):
        file = os.fspath(path)
        try:
            schema = pq.read_schema(file) if sizes is None else read_parquet_schema(file, sizes[i])
        except Exception:  # noqa: BLE001 - an unreadable footer is reported where Zephon reads it
            continue
        for column in schema:
            if _takes_rows(column.type):
                continue
            kind = str(column.type)
            cast = next((to for prefix, to in _CASTS.items() if kind.startswith(prefix)), "a plain Arrow type")
            raise ValueError(_err(
                f"source {source!r}, shard {file}, column {column.name!r}", kind,
                "a column type Zephon's Parquet reader can take rows of (string, large_string, binary, list, ...)",
                f"pyarrow has no 'take' kernel for {kind}, so reading any row fails. Rewrite the shards with the "
                f"column cast, e.g. pq.write_table(table.cast(table.schema.set(table.schema.get_field_index("
                f"{column.name!r}), pa.field({column.name!r}, {cast}))), path)."))


def pass_records(counts: Sequence[int], shares: Sequence[float]) -> float:
    """Records one ``mixture: repeat`` pass reads: it ends when every source was read whole once at its share,
    so about ``max(count / share)``."""
    return max(int(n) / float(s) for n, s in zip(counts, shares, strict=True))


def check_pass_length(names: Sequence[str], counts: Sequence[int], weights: Sequence[float], *, mixture: str,
                      passes: int | None, ratio: float = PASS_LENGTH_WARN_RATIO) -> float | None:
    """Warn when one ``mixture: repeat`` pass reads more than ``ratio`` times all the sources' records.

    Only with finite ``passes`` (an endless stream has no pass to end) and ``mixture: repeat``
    (``once`` reads every record once).

    Args:
        names, counts, weights: Each source's name, record count and configured weight.

    Returns:
        The records one pass reads when it warned, else ``None``.
    """
    if mixture != "repeat" or passes is None or not counts:
        return None
    total = sum(int(n) for n in counts)
    weight_sum = sum(float(w) for w in weights)
    shares = [float(w) / weight_sum for w in weights]
    records = pass_records(counts, shares)
    if records <= ratio * total:
        return None
    slowest = max(range(len(counts)), key=lambda i: int(counts[i]) / shares[i])
    proportional = ", ".join(f"{name!r}: {int(n)}" for name, n in zip(names, counts, strict=True))
    warnings.warn(
        f"dataloader.sources: one pass of mixture: repeat reads about {records:.3g} records, "
        f"{records / total:.3g} times the {total} records of all sources (expected at most {ratio}x): it ends only "
        f"when {names[slowest]!r} ({int(counts[slowest])} records at weight {weights[slowest]:g}, share "
        f"{shares[slowest]:.3g}) has been read whole, so the other sources repeat all that time. Weights "
        f"{dict(zip(names, [float(w) for w in weights], strict=True))}. Raise the weight of {names[slowest]!r} "
        f"(weights proportional to the record counts, {{{proportional}}}, read each source once per pass), use "
        "mixture: once, or set passes: null and train by steps.",
        UserWarning, stacklevel=2)
    return records
