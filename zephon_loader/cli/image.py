"""What ``zephon-loader run`` / ``inspect`` need for image-text configs (the CLI in :mod:`zephon_loader.cli.commands` dispatches here).

* :func:`is_image_config`: whether a YAML (or mapping) describes an image-text loader.
* :func:`image_counts`: images and image tokens of one yielded batch (for the run report's images/s).
* :func:`inspect_images` / :func:`draw_image_batch`: the ``inspect`` figure of an image-text batch:
  token kinds (text, image, vision delimiters, ineligible fillers, padding),
  document ids, the three mRoPE position axes of one row, and that row's
  block-causal mask.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from zephon_loader import fields as F

__all__ = ["TOKEN_KINDS", "draw_image_batch", "image_counts", "inspect_images", "is_image_config"]

#: Keys only an image-text ``dataloader`` section has.
_IMAGE_KEYS = ("processor", "records")

#: Token kinds of the first panel (RGBA), in order of precedence (padding wins).
TOKEN_KINDS = (
    ("padding", (1.0, 1.0, 1.0, 1.0)),
    ("ineligible filler", (0.25, 0.25, 0.25, 1.0)),
    ("image token", (0.84, 0.15, 0.16, 1.0)),
    ("vision start / end", (0.99, 0.60, 0.20, 1.0)),
    ("text, label supervised", (0.17, 0.63, 0.17, 1.0)),
    ("text, label not supervised", (0.60, 0.80, 0.60, 1.0)),
)


def is_image_config(config: str | Path | Mapping[str, Any]) -> bool:
    """Whether ``config`` (a YAML path or a ``dataloader`` mapping) is an image-text loader config.

    True when its ``_target_`` names :class:`~zephon_loader.config.image.ImageLoaderConfig`
    (or a subclass, like ``ZephonVLMDataloaderConfig``), or it has ``processor`` or ``records``.
    """
    from zephon_loader.config import LOADER_SECTION, load_yaml, resolve_target
    from zephon_loader.config.image import ImageLoaderConfig

    node = load_yaml(Path(config)).get(LOADER_SECTION) if isinstance(config, (str, Path)) else config
    if not isinstance(node, Mapping):
        return False
    target = node.get("_target_")
    if isinstance(target, str):
        try:
            built = resolve_target(target)
        except ImportError:
            return False
        return isinstance(built, type) and issubclass(built, ImageLoaderConfig)
    return any(key in node for key in _IMAGE_KEYS)


def image_counts(batch: Mapping[str, Any]) -> tuple[int, int]:
    """``(images, image tokens)`` of one yielded batch (``(0, 0)`` for a text batch)."""
    counts = batch.get(F.N_IMAGES_PER_SAMPLE)
    types = batch.get(F.MM_TOKEN_TYPE_IDS)
    return (int(counts.sum()) if isinstance(counts, torch.Tensor) else 0,
            int((types == 1).sum()) if isinstance(types, torch.Tensor) else 0)


def token_kinds(batch: Mapping[str, Any], vision_ids: tuple[int, ...]) -> torch.Tensor:
    """int64 ``[B, S]`` index into :data:`TOKEN_KINDS` of every token of a preview batch."""
    padding = batch[F.PADDING_MASK]
    ineligible = (batch[F.ATTENTION_DOCUMENT_IDS] == 0) & ~padding
    image = batch[F.MM_TOKEN_TYPE_IDS] == 1
    delimiter = torch.isin(batch[F.INPUT_IDS], torch.tensor(vision_ids, dtype=torch.int64))
    supervised = batch[F.LABELS] != F.IGNORE_INDEX
    kinds = torch.where(supervised, 4, 5)
    for index, where in ((3, delimiter), (2, image), (1, ineligible), (0, padding)):
        kinds = torch.where(where, index, kinds)
    return kinds


def draw_image_batch(batch: Mapping[str, Any], row: int, title: str, *, vision_ids: tuple[int, ...],
                     xdoc: bool) -> Any:
    """The ``inspect`` figure of an image-text :meth:`~zephon_loader.loader.ZephonLoader.preview` batch.

    Args:
        batch: Internal names: ``input_ids``, ``labels``, ``document_ids``,
            ``attention_document_ids``, ``mm_token_type_ids`` ``[B, S]``,
            ``padding_mask`` bool ``[B, S]``, ``position_ids`` ``[3, B, S]``.
        row: The row whose positions and mask are drawn.
        title: Figure title.
        vision_ids: Ids of ``<|vision_start|>`` and ``<|vision_end|>``.
        xdoc: Cross-document attention (names the panels).

    Returns:
        The matplotlib ``Figure`` (the caller saves and closes it).
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from zephon_loader.cli.commands import id_colours
    from zephon_loader.finalize.final_map import block_causal_mask

    padding = batch[F.PADDING_MASK]
    kinds = token_kinds(batch, vision_ids)
    figure, axes = plt.subplots(2, 2, figsize=(15, 9))
    axis = axes[0, 0]
    axis.imshow(ListedColormap([c for _, c in TOKEN_KINDS])(kinds.numpy()), aspect="auto", interpolation="nearest")
    counts = [int((kinds == index).sum()) for index in range(len(TOKEN_KINDS))]
    axis.legend(handles=[Patch(facecolor=c, edgecolor="black", label=f"{name}: {n:,}")
                         for (name, c), n in zip(TOKEN_KINDS, counts)],
                loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    axis.set_title("tokens by kind (image spans, fillers, padding)")
    axis = axes[0, 1]
    axis.imshow(id_colours(batch[F.DOCUMENT_IDS], padding), aspect="auto", interpolation="nearest")
    axis.set_title("document ids per row (one record each)")
    for axis in (axes[0, 0], axes[0, 1]):
        axis.set_xlabel("token")
        axis.set_ylabel("row")
    axis = axes[1, 0]
    positions = batch[F.POSITION_IDS][:, row]
    columns = torch.arange(positions.shape[-1])
    for index, (name, style) in enumerate((("temporal", "-"), ("height", "--"), ("width", ":"))):
        axis.plot(columns.numpy(), positions[index].numpy(), style, label=name, linewidth=1.2)
    used = int((~padding[row]).sum())
    if used < positions.shape[-1]:
        axis.axvspan(used - 0.5, positions.shape[-1] - 0.5, color="0.9", label="padding (own run)")
    image = batch[F.MM_TOKEN_TYPE_IDS][row] == 1
    axis.scatter(columns[image].numpy(), positions[2, image].numpy(), s=4, color="tab:red", label="image tokens")
    axis.legend(loc="upper left", fontsize=8)
    axis.set_title(f"row {row}: mRoPE positions, three axes" + (" (continued across records: xdoc)" if xdoc else ""))
    axis.set_xlabel("token")
    axis.set_ylabel("position")
    axis = axes[1, 1]
    mask = block_causal_mask(batch[F.ATTENTION_DOCUMENT_IDS][row:row + 1])[0, 0]
    axis.imshow(mask.numpy(), interpolation="nearest", cmap=ListedColormap(["white", "tab:blue"]), vmin=0, vmax=1)
    axis.set_title(f"row {row}: block-causal mask (xdoc={xdoc}); fillers in no block")
    axis.set_xlabel("key")
    axis.set_ylabel("query")
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def inspect_images(config: str | Path, out_png: str | Path, row: int = 0) -> Path:
    """Draw the first batch of an image-text config (:func:`draw_image_batch`) to ``out_png``.

    Raises:
        ImportError: matplotlib is missing.
        ValueError: ``row`` outside ``[0, micro_batch_size)``, an invalid configuration, an empty stream.
    """
    from zephon_loader.cli.commands import save_figure, use_matplotlib

    use_matplotlib()

    from zephon_loader.build_image import build_image_loader
    from zephon_loader.config import read_loader_config
    from zephon_loader.config.image import ImageLoaderConfig

    config, out_png = Path(config), Path(out_png)
    cfg = read_loader_config(config, ImageLoaderConfig)
    rows = cfg.micro_batch_size
    if rows is not None and (isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < rows):
        raise ValueError(f"--row: got {row!r}, expected a row index in [0, {rows}) (micro_batch_size is {rows} "
                         f"in {config})")
    with build_image_loader(cfg) as loader:
        try:
            batch = loader.preview()
        except RuntimeError as error:
            raise ValueError(f"{config}: {error}; every record was dropped ({loader.stats()['dropped']})") from error
        settings, processor = loader.settings, loader.processor
    vision_ids = tuple(int(getattr(processor, name)) for name in ("vision_start_token_id", "vision_end_token_id")
                       if getattr(processor, name, None) is not None)
    ids = batch[F.DOCUMENT_IDS]
    title = (f"{config.name}: B={ids.shape[0]}, S={ids.shape[1]}, contract={settings.packed_mask_type}, "
             f"images={int(batch[F.N_IMAGES_PER_SAMPLE].sum())}")
    return save_figure(draw_image_batch(batch, row, title, vision_ids=vision_ids, xdoc=settings.xdoc), out_png)
