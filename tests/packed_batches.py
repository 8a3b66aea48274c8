"""Random packed batches for property tests, and slow obviously-correct references.

The references loop over rows and documents on purpose: they are the
specification the vectorized code is checked against.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from zephon_loader import fields as F


@st.composite
def packed_batches(draw, *, max_rows: int = 4, max_len: int = 40, axes: tuple[int, ...] = (1, 3), eligibility=True):
    """A TrainingBatch as collate produces it, plus an optional eligibility mask.

    Rows hold 1+ subdocuments of random lengths then trailing padding; positions
    are local per subdocument (mRoPE axes get random nonnegative coordinates
    that restart at 0 at each subdocument start on every axis).
    """
    batch_size = draw(st.integers(1, max_rows))
    sequence_length = draw(st.integers(2, max_len))
    num_axes = draw(st.sampled_from(axes))
    ids = torch.zeros(batch_size, sequence_length, dtype=torch.int64)
    positions = torch.zeros(num_axes, batch_size, sequence_length, dtype=torch.int64)
    for b in range(batch_size):
        used = draw(st.integers(1, sequence_length))
        column, doc = 0, 0
        while column < used:
            length = draw(st.integers(1, used - column))
            doc += 1
            ids[b, column : column + length] = doc
            local = torch.arange(length)
            positions[0, b, column : column + length] = local
            for axis in range(1, num_axes):
                extra = torch.tensor(draw(st.lists(st.integers(0, 5), min_size=length, max_size=length)))
                extra[0] = 0
                positions[axis, b, column : column + length] = extra
            column += length
        # Zephon numbers the pad tail as its own run of positions.
        positions[:, b, used:] = torch.arange(sequence_length - used)
    padding = ids == 0
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    batch = {
        F.INPUT_IDS: torch.randint(0, 500, (batch_size, sequence_length), generator=generator),
        F.LABELS: torch.randint(0, 500, (batch_size, sequence_length), generator=generator).masked_fill(
            padding, F.IGNORE_INDEX
        ),
        F.PADDING_MASK: padding,
        F.POSITION_IDS: positions[0].clone() if num_axes == 1 else positions,
        F.DOCUMENT_IDS: ids,
    }
    if eligibility and draw(st.booleans()):
        rate = draw(st.sampled_from([0.05, 0.3, 1.0]))
        holes = torch.rand(batch_size, sequence_length, generator=generator) < rate
        batch[F.ATTENTION_ELIGIBILITY] = ~holes
    return batch


def reference_metadata(ids: torch.Tensor) -> dict:
    """Loop-based build_packed_sequence_metadata (docs/contract.md §6)."""
    batch_size, sequence_length = ids.shape
    width = max(1, int(ids.max())) + 1
    indices = torch.full((batch_size, sequence_length), -1, dtype=torch.int64)
    cu = torch.full((batch_size, width), -1, dtype=torch.int32)
    longest = 0
    for b in range(batch_size):
        boundaries, total = [0], 0
        for s in range(sequence_length):
            if ids[b, s] != 0:
                indices[b, s] = s
        for doc in range(1, width):
            n = int((ids[b] == doc).sum())
            if n:
                total += n
                boundaries.append(total)
                longest = max(longest, n)
        cu[b, : len(boundaries)] = torch.tensor(boundaries, dtype=torch.int32)
    return {F.PACKED_TOKEN_INDICES: indices, F.CU_SEQLENS: cu, F.MAX_SEQLEN: longest}


def reference_xdoc_positions(document_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Loop-based docs/contract.md §6 offsets: offset_k = offset_(k-1) + max_coord(k-1) + 1."""
    pos = positions if positions.ndim == 3 else positions.unsqueeze(0)
    out = pos.clone()
    for b in range(document_ids.shape[0]):
        offset = 0
        for doc in range(1, int(document_ids[b].max()) + 1):
            where = document_ids[b] == doc
            if not where.any():
                continue
            out[:, b, where] = pos[:, b, where] + offset
            offset += int(pos[:, b, where].max()) + 1
    return out if positions.ndim == 3 else out[0]


def clone_batch(batch: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def assert_unchanged(before: dict, after: dict) -> None:
    """Every tensor of ``before`` (a clone) still equals the caller's tensor in ``after``."""
    for name, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, after[name]), f"{name} was modified in place"
