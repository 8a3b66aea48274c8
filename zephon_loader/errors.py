"""The one shape of an error message (Zephon's style)."""

from __future__ import annotations

from typing import Any


def field_error(where: str, seen: Any, expected: str, fix: str) -> str:
    """One error line: the field, what was seen, what was expected, how to fix it.

    >>> field_error("chunk_size", 0, "a positive int", "Set chunk_size: null.")
    'chunk_size: got 0, expected a positive int. Set chunk_size: null.'
    """
    return f"{where}: got {seen!r}, expected {expected}. {fix}"
