"""Qwen2-VL multimodal RoPE positions of one record: ``[3, n]`` (temporal, height, width).

Two ways, the same result (``tests/test_image_processors.py`` proves it
against ``transformers``' ``Qwen2VLModel.get_rope_index``):

* :func:`qwen2_vl_positions`: transformers' rule, vectorized with numpy (no
  Python loop over tokens or images).
* :class:`RopeIndex`: the model's own ``get_rope_index``, called on one record
  the way AutoModel 0.7.0's ``neat_packing_vlm`` calls it.

The rule (transformers 5, ``Qwen2VLModel.get_rope_index`` with
``mm_token_type_ids``): tokens form runs of equal type. A text run continues
the position counter on all three axes (``p, p+1, ...``). The ``i``-th image
run holds ``t * (h/m) * (w/m)`` tokens in ``(t, h, w)`` order (``m`` = spatial
merge size); its token at grid cell ``(a, b, c)`` gets ``(p + a, p + b, p + c)``
and the counter then advances by ``max(h, w) / m``.

Ineligible tokens (synthetic fillers) do not count: positions are computed
over the eligible tokens alone, so every eligible token has exactly the
position it would have without the fillers; a filler repeats the position of
the eligible token before it (never 0 on every axis after the first token, so
it never looks like the start of a record).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import numpy as np

__all__ = ["RopeIndex", "fill_ineligible", "qwen2_vl_positions"]


def qwen2_vl_positions(
    mm_token_type_ids: np.ndarray,
    image_grid_thw: np.ndarray,
    spatial_merge_size: int,
    attention_eligibility: np.ndarray | None = None,
) -> np.ndarray:
    """Qwen2-VL mRoPE positions of one record.

    Args:
        mm_token_type_ids: int ``[n]``, 1 at image placeholder tokens, 0 at text.
        image_grid_thw: int64 ``[k, 3]``, one row per image run, in order.
        spatial_merge_size: ``m``; ``h`` and ``w`` are divisible by it.
        attention_eligibility: Optional bool ``[n]``; ineligible tokens are left
            out of the count (see the module docstring).

    Returns:
        int64 ``[3, n]``, nonnegative, starting at 0.

    Raises:
        ValueError: The image runs do not match ``image_grid_thw`` (count or size).
    """
    types = np.asarray(mm_token_type_ids)
    if attention_eligibility is not None and not bool(np.all(attention_eligibility)):
        keep = np.asarray(attention_eligibility, dtype=bool)
        inner = qwen2_vl_positions(types[keep], image_grid_thw, spatial_merge_size)
        return fill_ineligible(inner, keep)
    n = types.shape[0]
    grid = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    is_image = types != 0
    run_start = np.ones(n, dtype=bool)
    run_start[1:] = is_image[1:] != is_image[:-1]
    image_starts = np.flatnonzero(run_start & is_image)
    if image_starts.shape[0] != grid.shape[0]:
        raise ValueError(f"mm_token_type_ids: got {image_starts.shape[0]} image runs, expected one per "
                         f"image_grid_thw row ({grid.shape[0]}); images must be separated by text tokens")
    merge = int(spatial_merge_size)
    t, h, w = grid[:, 0], grid[:, 1] // merge, grid[:, 2] // merge
    image_of = np.cumsum(run_start & is_image) - 1  # image run index of each token (meaningful at image tokens)
    run_lengths = np.bincount(image_of[is_image], minlength=grid.shape[0])
    if not np.array_equal(run_lengths, t * h * w):
        bad = int(np.flatnonzero(run_lengths != t * h * w)[0])
        raise ValueError(f"mm_token_type_ids: image {bad} has {int(run_lengths[bad])} tokens, expected "
                         f"t*(h/m)*(w/m) = {int(t[bad] * h[bad] * w[bad])} for grid {grid[bad].tolist()} and m={merge}")
    # The counter advances by 1 per text token and by max(h, w) at the first token of each image run.
    step = (~is_image).astype(np.int64)
    step[image_starts] = np.maximum(h, w)
    before = np.cumsum(step) - step  # counter value before each token
    positions = np.broadcast_to(before, (3, n)).copy()
    if image_starts.shape[0]:
        idx = np.flatnonzero(is_image)
        image = image_of[idx]
        start = before[image_starts][image]
        cell = idx - image_starts[image]
        area = h[image] * w[image]
        positions[0, idx] = start + cell // area
        positions[1, idx] = start + (cell // w[image]) % h[image]
        positions[2, idx] = start + cell % w[image]
    return positions


def fill_ineligible(eligible_positions: np.ndarray, eligible: np.ndarray) -> np.ndarray:
    """Spread positions of the eligible tokens back to all ``n`` tokens; an ineligible token repeats the one before.

    Args:
        eligible_positions: int64 ``[3, e]``, positions of the ``e`` eligible tokens in order.
        eligible: bool ``[n]`` with ``e`` True entries.

    Returns:
        int64 ``[3, n]`` (a leading ineligible token, which no built-in processor makes, gets 0).
    """
    before = np.cumsum(eligible) - 1  # index of the last eligible token at or before each token
    out = eligible_positions[:, np.maximum(before, 0)]
    out[:, before < 0] = 0
    return out


class RopeIndex:
    """A model's ``get_rope_index`` applied to one record (AutoModel 0.7.0's ``neat_packing_vlm`` convention).

    The callable is inspected once: it gets ``input_ids [1, n]``,
    ``image_grid_thw`` (``None`` without images), ``mm_token_type_ids [1, n]`` when
    its signature takes it, and ``attention_mask [1, n]`` = eligibility when
    the record has ineligible tokens (transformers leaves masked tokens at 0;
    :func:`fill_ineligible` then gives them the position before).

    Copying (``copy.deepcopy``, done by Zephon for each worker thread) shares the
    callable: a bound ``model.get_rope_index`` must never copy the model.
    Pickling (Zephon's ``process`` runner) is refused: it would send the model
    to every worker process.
    """

    def __init__(self, get_rope_index: Callable[..., Any]) -> None:
        if not callable(get_rope_index):
            raise TypeError(f"get_rope_index: got {type(get_rope_index).__name__}, expected the model's "
                            "get_rope_index callable")
        try:
            parameters = inspect.signature(get_rope_index).parameters
        except (TypeError, ValueError) as error:
            raise TypeError(f"get_rope_index: cannot read its signature ({error}); expected a function taking "
                            "input_ids, image_grid_thw and mm_token_type_ids like Qwen2VLModel.get_rope_index") from error
        if "input_ids" not in parameters or "image_grid_thw" not in parameters:
            raise TypeError(f"get_rope_index: its parameters are {list(parameters)}, expected input_ids and "
                            "image_grid_thw (Qwen2VLModel.get_rope_index)")
        self.function = get_rope_index
        self._takes_types = "mm_token_type_ids" in parameters
        self._takes_mask = "attention_mask" in parameters

    def __deepcopy__(self, memo: dict[int, Any]) -> "RopeIndex":
        return self

    def __reduce__(self) -> Any:
        raise TypeError("get_rope_index cannot be sent to worker processes (it would pickle the model); "
                        "use runtime.runner: threads with get_rope_index")

    def __call__(self, input_ids: np.ndarray, mm_token_type_ids: np.ndarray, image_grid_thw: np.ndarray,
                 attention_eligibility: np.ndarray | None = None) -> np.ndarray:
        """int64 ``[3, n]`` positions of one record (shapes as :func:`qwen2_vl_positions`)."""
        import torch

        holes = attention_eligibility is not None and not bool(np.all(attention_eligibility))
        if holes and not self._takes_mask:
            raise TypeError("get_rope_index: takes no attention_mask, but the record has ineligible tokens that "
                            "must not count; drop image_token_alignment or pass a get_rope_index with attention_mask")
        kwargs: dict[str, Any] = {
            "input_ids": torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64))[None],
            "image_grid_thw": torch.from_numpy(np.asarray(image_grid_thw, dtype=np.int64)) if len(image_grid_thw)
            else None,
        }
        if self._takes_types:
            kwargs["mm_token_type_ids"] = torch.from_numpy(np.ascontiguousarray(mm_token_type_ids, dtype=np.int64))[None]
        if holes:
            kwargs["attention_mask"] = torch.from_numpy(np.asarray(attention_eligibility, dtype=np.int64))[None]
        with torch.no_grad():
            result = self.function(**kwargs)
        positions = result[0] if isinstance(result, tuple) else result
        positions = positions.detach().cpu()
        if positions.ndim == 3:
            positions = positions[:, 0, :]
        out = positions.numpy().astype(np.int64, copy=True)
        if holes:
            keep = np.asarray(attention_eligibility, dtype=bool)
            out = fill_ineligible(out[:, keep], keep)
        return out
