"""The one shape of an error message (Zephon's style), and the error a bad record raises."""

from __future__ import annotations

from typing import Any


def field_error(where: str, seen: Any, expected: str, fix: str) -> str:
    """One error line: the field, what was seen, what was expected, how to fix it.

    >>> field_error("chunk_size", 0, "a positive int", "Set chunk_size: null.")
    'chunk_size: got 0, expected a positive int. Set chunk_size: null.'
    """
    return described_error(where, repr(seen), expected, fix)


def described_error(where: str, seen: str, expected: str, fix: str) -> str:
    """:func:`field_error` with what was seen already described (e.g. ``"3 rows"``, a tensor's dtype and shape).

    >>> described_error("zephon_batch", "5 rows", "1 to micro_batch_size=4", "Batch by B.")
    'zephon_batch: got 5 rows, expected 1 to micro_batch_size=4. Batch by B.'
    """
    return f"{where}: got {seen}, expected {expected}. {fix}"


class BadRecordError(ValueError):
    """A record the loader refuses under ``on_bad_record: error``; the message names its source, shard file and
    line/row, the field, what was seen and what was expected."""
