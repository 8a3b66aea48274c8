"""Zephon 0.2 as this package sees it: its API's key names, and the one place that touches its private names.

No other module of the package imports ``zephon._internal`` or reads a
private attribute of a Zephon object: each such use is a named function or
constant here, with what it wraps and why no public API serves. A Zephon
upgrade is checked in this file.

Imports nothing from :mod:`zephon_loader`.
"""

from __future__ import annotations

__all__ = ["ZEPHON_LOSS_MASK_KEY", "ZEPHON_TOKENS_KEY", "ZephonKeys"]


class ZephonKeys:
    """Zephon 0.2.0's own payload and ``to_training`` key names.

    These are Zephon's API names, not zephon_loader batch fields (those live in
    :mod:`zephon_loader.fields`); some coincide today. Kept in this one place so
    a Zephon rename is a one-line change.
    """

    #: Token field emitted by tokenize/tokenize_chat, read by pack_flat, emitted by to_training.
    TOKENS = "input_ids"
    #: Per-token supervision mask from tokenize_chat; consumed by to_training(return_labels=True).
    LOSS_MASK = "loss_mask"
    #: Segment-local positions from pack_flat(emit_positions=True).
    POSITIONS = "positions"
    LABELS = "labels"
    PADDING_MASK = "padding_mask"
    CU_SEQLENS = "cu_seqlens"
    MAX_SEQLEN = "max_seqlen"
    IDS = "ids"
    TEXTS = "texts"


ZEPHON_TOKENS_KEY = ZephonKeys.TOKENS
ZEPHON_LOSS_MASK_KEY = ZephonKeys.LOSS_MASK
