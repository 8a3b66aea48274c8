"""The processor interface: one decoded image-text record in, its tokens, eligibility, positions and pixels out.

A *processor* is any callable ``ImageTextRecord -> ProcessedRecord`` with the
attributes of :class:`RecordProcessor`. The loader runs it inside Zephon's
workers on every record (after decoding, before packing); the built-in one is
:class:`~zephon_loader.processors.qwen2_vl.Qwen2VLRecordProcessor`. A user
passes their own object to ``build_image_loader(processor=...)`` or names a
factory in YAML (``processor: {_target_: my.module.make_processor, ...}``).

Shapes and dtypes of :class:`ProcessedRecord` (``n`` tokens, ``k`` images,
``p`` patch rows)::

    input_ids             int64   [n]
    loss_mask             bool    [n]     True: the token is a training target (its label is kept)
    mm_token_type_ids     int64   [n]     1 at image placeholder tokens, 0 elsewhere
    pixel_values          float32 [p, D]  Hugging Face Qwen2-VL patch rows of the k images, in order
    image_grid_thw        int64   [k, 3]  (t, h, w) patch grid per image; p == sum(t * h * w)
    attention_eligibility bool    [n]     optional: False = neither attends nor is attended
    position_ids          int64   [3, n]  optional: mRoPE positions local to the record (from 0)

:func:`check_processed` enforces these (a processor bug is a ``TypeError`` /
``ValueError`` naming the processor and the field, never a silently wrong batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, runtime_checkable

import numpy as np

__all__ = ["ImageTextRecord", "ProcessedRecord", "RecordProcessor", "check_processed"]


@dataclass(frozen=True)
class ImageTextRecord:
    """One source record as a processor sees it.

    Attributes:
        text: The record's text with one ``marker`` where each image goes
            (``len(images) == text.count(marker)``, checked before the processor runs).
        images: The decoded images (``PIL.Image.Image``, as Pillow decoded them: any
            mode), in marker order.
        marker: The image marker (``records.image_marker``, default ``"<image>"``).
    """

    text: str
    images: tuple[Any, ...]
    marker: str

    def pieces(self) -> list[str]:
        """The text between markers: ``len(images) + 1`` strings (empty where a marker starts or ends the text)."""
        return self.text.split(self.marker)


@dataclass(frozen=True)
class ProcessedRecord:
    """A processor's output for one record (see the module docstring for shapes and dtypes)."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    mm_token_type_ids: np.ndarray
    pixel_values: np.ndarray
    image_grid_thw: np.ndarray
    attention_eligibility: np.ndarray | None = None
    position_ids: np.ndarray | None = None


@runtime_checkable
class RecordProcessor(Protocol):
    """What the loader needs from a processor besides ``__call__``.

    Attributes:
        pad_token_id: Id the loader pads rows with.
        attention_eligibility: Whether records carry ``attention_eligibility``
            (fixed per processor: the loader refuses contracts that cannot
            exclude tokens, like ``flash_varlen``, before anything starts).
        spatial_merge_size: Patches merged per side into one image token; used
            to compute Qwen2-VL positions for records without ``position_ids``.

    Optional:
        ``bind_get_rope_index(fn) -> processor``: a processor that computes
        positions with the model's ``get_rope_index`` (the loader calls it when
        the caller passes one); ``fingerprint() -> JSON value``: what must match
        for a saved loader state to resume (files, options).
    """

    pad_token_id: int
    attention_eligibility: bool
    spatial_merge_size: int

    def __call__(self, record: ImageTextRecord) -> ProcessedRecord: ...


def _array(value: Any, name: str, owner: str) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        value = value.detach().cpu().numpy()
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{owner}: ProcessedRecord.{name} got {type(value).__name__}, expected a numpy array "
                        "(or torch tensor); fix the processor")
    return value


# numpy dtype kinds of signed and unsigned integers (np.issubdtype(dtype, np.integer), in one lookup).
_INTEGER = "iu"


def _fail(owner: str, name: str, seen: str, expected: str) -> NoReturn:
    raise ValueError(f"{owner}: ProcessedRecord.{name} got {seen}, expected {expected}; fix the processor")


def check_processed(out: Any, *, owner: str, eligibility: bool) -> ProcessedRecord:
    """``out`` checked against the interface, as numpy arrays of the documented dtypes.

    Args:
        out: What the processor returned.
        owner: The processor's name for messages.
        eligibility: Whether the processor declared ``attention_eligibility``.

    Returns:
        A :class:`ProcessedRecord` of numpy arrays (int64 ids/types/grids/positions,
        bool masks, float32 pixels); the processor's arrays are not modified.

    Raises:
        TypeError / ValueError: naming ``owner``, the field, what was seen and what was expected.
    """
    # Once per record in the pipeline's processing thread: every check is a cheap test, and a message is
    # only formatted when it fails (formatting dtypes and shapes costs more than the checks).
    if not isinstance(out, ProcessedRecord):
        raise TypeError(f"{owner}: returned {type(out).__name__}, expected a zephon_loader.processors.ProcessedRecord")
    ids = _array(out.input_ids, "input_ids", owner)
    if not (ids.ndim == 1 and ids.size > 0 and ids.dtype.kind in _INTEGER):
        _fail(owner, "input_ids", f"{ids.dtype} shape {ids.shape}", "a non-empty 1-D integer array [n]")
    n = ids.shape[0]
    fields: dict[str, np.ndarray] = {"input_ids": ids.astype(np.int64, copy=False)}
    for name, dtype in (("loss_mask", np.bool_), ("mm_token_type_ids", np.int64)):
        value = _array(getattr(out, name), name, owner)
        if value.shape != (n,):
            _fail(owner, name, f"shape {value.shape}", f"one value per token, shape ({n},)")
        fields[name] = value.astype(dtype, copy=False)
    types = fields["mm_token_type_ids"]
    if not ((types == 0) | (types == 1)).all():
        _fail(owner, "mm_token_type_ids", f"values {np.unique(types).tolist()}",
              "0 (text) or 1 (image); videos are not supported")
    grid = _array(out.image_grid_thw, "image_grid_thw", owner)
    if not (grid.ndim == 2 and grid.shape[1] == 3 and grid.dtype.kind in _INTEGER
            and (grid.size == 0 or int(grid.min()) > 0)):
        _fail(owner, "image_grid_thw", f"{grid.dtype} shape {grid.shape}", "a positive integer array [images, 3]")
    grid = grid.astype(np.int64, copy=False)
    pixels = _array(out.pixel_values, "pixel_values", owner)
    patches = int(grid.prod(axis=1).sum()) if grid.size else 0
    if not (pixels.ndim == 2 and pixels.shape[0] == patches and pixels.dtype.kind == "f"):
        _fail(owner, "pixel_values", f"{pixels.dtype} shape {pixels.shape}",
              f"a float array [{patches}, patch_dim] (sum of t*h*w over image_grid_thw)")
    fields["image_grid_thw"] = grid
    fields["pixel_values"] = pixels.astype(np.float32, copy=False)
    elig = None
    if out.attention_eligibility is not None or eligibility:
        if out.attention_eligibility is None:
            _fail(owner, "attention_eligibility", "None",
                  f"a bool array ({n},): the processor declares attention_eligibility=True")
        elig = _array(out.attention_eligibility, "attention_eligibility", owner)
        if elig.shape != (n,):
            _fail(owner, "attention_eligibility", f"shape {elig.shape}", f"shape ({n},)")
        if not eligibility:
            _fail(owner, "attention_eligibility", "an array",
                  "None: the processor declares attention_eligibility=False")
        elig = elig.astype(np.bool_, copy=False)
        if not elig.any():
            _fail(owner, "attention_eligibility", "no eligible token", "at least one eligible token")
    positions = None
    if out.position_ids is not None:
        positions = _array(out.position_ids, "position_ids", owner)
        if not (positions.shape == (3, n) and positions.dtype.kind in _INTEGER):
            _fail(owner, "position_ids", f"{positions.dtype} shape {positions.shape}", f"an integer array [3, {n}]")
        low = int(positions.min())
        if low < 0:
            _fail(owner, "position_ids", f"minimum {low}", "nonnegative positions local to the record")
        positions = positions.astype(np.int64, copy=False)
    return ProcessedRecord(attention_eligibility=elig, position_ids=positions, **fields)
