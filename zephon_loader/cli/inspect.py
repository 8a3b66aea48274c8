"""The ``zephon-loader inspect`` picture: the first batch of a text or image-text loader, drawn to a PNG.

* :func:`inspect`: build the loader a YAML describes, take its first batch, draw it, save it.
* :func:`draw_batch` (text) / :func:`draw_image_batch` (image-text): the four-panel figure of a
  :meth:`~zephon_loader.loader.ZephonLoader.preview` batch. Both draw with the helpers below:
  categorical id panels (:func:`id_colours`), token-class panels (:data:`TOKEN_CLASSES`,
  :data:`TOKEN_KINDS`) with counted legends, and one row's block-causal mask.
* :func:`image_counts`: images and image tokens of one yielded batch (the image figure's title,
  and the images/s of the ``run`` report).
* :func:`use_matplotlib` / :func:`save_figure`: matplotlib's file-only backend, and writing a figure.

Importing this module imports neither torch, numpy nor matplotlib: each function imports what it needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from zephon_loader import fields as F
from zephon_loader.cli.configs import config_and_builder, no_batch_error, progress

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = [
    "PADDING_RGBA", "TOKEN_CLASSES", "TOKEN_KINDS", "UNATTENDED_RGBA", "draw_batch", "draw_image_batch",
    "id_colours", "image_counts", "inspect", "save_figure", "token_classes", "token_kinds", "use_matplotlib",
]

#: Colours of the categorical panels (RGBA). Padding is white and the "not in any range" grey is
#: used by nothing else: the document palette below leaves out the greys.
PADDING_RGBA = (1.0, 1.0, 1.0, 1.0)
UNATTENDED_RGBA = (0.25, 0.25, 0.25, 1.0)
#: Token classes of a text batch's class panel, in order of precedence (padding wins).
TOKEN_CLASSES = (
    ("padding", PADDING_RGBA),
    ("ineligible (attends to nothing)", UNATTENDED_RGBA),
    ("label not supervised (-100)", (0.99, 0.75, 0.44, 1.0)),
    ("label supervised", (0.17, 0.63, 0.17, 1.0)),
)
#: Token kinds of an image-text batch's kind panel, in order of precedence (padding wins).
TOKEN_KINDS = (
    ("padding", PADDING_RGBA),
    ("ineligible filler", UNATTENDED_RGBA),
    ("image token", (0.84, 0.15, 0.16, 1.0)),
    ("vision start / end", (0.99, 0.60, 0.20, 1.0)),
    ("text, label supervised", (0.17, 0.63, 0.17, 1.0)),
    ("text, label not supervised", (0.60, 0.80, 0.60, 1.0)),
)
#: Documents listed by name in a legend; later ids reuse the palette's colours.
LEGEND_DOCUMENTS = 8
#: The processor attributes holding the ids of ``<|vision_start|>`` and ``<|vision_end|>``.
_VISION_ID_ATTRIBUTES = ("vision_start_token_id", "vision_end_token_id")


def inspect(config: str | Path, out_png: str | Path, row: int = 0) -> Path:
    """Draw the first batch of the loader ``config`` describes to ``out_png``; returns ``out_png``.

    A text config is drawn by :func:`draw_batch`, its Zephon packing notices
    counted and logged once; an image-text config by :func:`draw_image_batch`
    (image spans, fillers, padding and the three position axes).

    Raises:
        ImportError: matplotlib is missing (the message names the ``viz`` extra).
        ValueError: ``row`` outside ``[0, micro_batch_size)`` (refused before
            anything is built), an invalid configuration, or a stream without any batch.
    """
    use_matplotlib()

    from zephon_loader.config import ImageLoaderConfig
    from zephon_loader.zephon_logs import summarize_zephon_logs

    config, out_png = Path(config), Path(out_png)
    cfg, build = config_and_builder(config)
    progress(f"building the loader of {config} to draw its first batch ({len(cfg.sources)} source(s))")
    image = isinstance(cfg, ImageLoaderConfig)
    rows = cfg.micro_batch_size
    if rows is not None and (isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < rows):
        raise ValueError(
            f"--row: got {row!r}, expected a row index in [0, {rows}) (micro_batch_size is {rows} in {config})"
        )
    with (nullcontext() if image else summarize_zephon_logs()), build(cfg) as loader:
        try:
            batch = loader.preview()
        except RuntimeError as error:  # an empty stream: say what was dropped
            dropped = loader.stats()["dropped"]
            raise (ValueError(f"{config}: {error}; every record was dropped ({dropped})") if image
                   else no_batch_error(config, dropped)) from error
        settings = loader.settings
        vision_ids = _vision_ids(loader.processor) if image else ()
    ids = batch[F.DOCUMENT_IDS]
    named = cfg.contract.attn_implementation if cfg.contract is not None else None
    contract = settings.packed_mask_type + (" + metadata" if settings.metadata else "")
    title = (f"{config.name}: B={ids.shape[0]}, S={ids.shape[1]}, contract="
             + (f"{named} ({contract})" if named else contract))
    if not image:
        return save_figure(draw_batch(batch, row, title, xdoc=settings.xdoc), out_png)
    title += f", images={image_counts(batch)[0]}"
    return save_figure(draw_image_batch(batch, row, title, vision_ids=vision_ids, xdoc=settings.xdoc), out_png)


def _vision_ids(processor: Any) -> tuple[int, ...]:
    """The ids of ``<|vision_start|>`` and ``<|vision_end|>`` a record processor defines (either may be absent)."""
    return tuple(int(getattr(processor, name)) for name in _VISION_ID_ATTRIBUTES
                 if getattr(processor, name, None) is not None)


def use_matplotlib() -> None:
    """Select matplotlib's file-only backend (no display needed).

    Raises:
        ImportError: matplotlib is missing (the message names the ``viz`` extra).
    """
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(
            "inspect: matplotlib is not installed; it draws the batch. "
            "Install it with: pip install 'zephon-loader[viz]'"
        ) from error
    matplotlib.use("Agg")


def save_figure(figure: Any, out_png: Path) -> Path:
    """Write a matplotlib figure to ``out_png`` (its folder created) and close it."""
    import matplotlib.pyplot as plt

    try:
        out_png.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(out_png, dpi=110)
    finally:
        plt.close(figure)
    return out_png


# ----------------------------------------------------------------------------- what a batch holds


def image_counts(batch: Mapping[str, Any]) -> tuple[int, int]:
    """``(images, image tokens)`` of one yielded batch (``(0, 0)`` for a text batch)."""
    import torch

    counts = batch.get(F.N_IMAGES_PER_SAMPLE)
    types = batch.get(F.MM_TOKEN_TYPE_IDS)
    return (int(counts.sum()) if isinstance(counts, torch.Tensor) else 0,
            int((types == 1).sum()) if isinstance(types, torch.Tensor) else 0)


def token_classes(labels: torch.Tensor, padding: torch.Tensor, ineligible: torch.Tensor) -> np.ndarray:
    """Index into :data:`TOKEN_CLASSES` per token, ``[B, S]`` int64 (padding > ineligible > label class)."""
    import numpy as np

    classes = np.where(labels.numpy() == F.IGNORE_INDEX, 2, 3)
    classes[ineligible.numpy()] = 1
    classes[padding.numpy()] = 0
    return classes


def token_kinds(batch: Mapping[str, Any], vision_ids: tuple[int, ...]) -> torch.Tensor:
    """int64 ``[B, S]`` index into :data:`TOKEN_KINDS` of every token of an image-text preview batch."""
    import torch

    padding = batch[F.PADDING_MASK]
    ineligible = (batch[F.ATTENTION_DOCUMENT_IDS] == 0) & ~padding
    image = batch[F.MM_TOKEN_TYPE_IDS] == 1
    delimiter = torch.isin(batch[F.INPUT_IDS], torch.tensor(vision_ids, dtype=torch.int64))
    supervised = batch[F.LABELS] != F.IGNORE_INDEX
    kinds = torch.where(supervised, 4, 5)
    for index, where in ((3, delimiter), (2, image), (1, ineligible), (0, padding)):
        kinds = torch.where(where, index, kinds)
    return kinds


# ----------------------------------------------------------------------------- colours


def _document_palette() -> np.ndarray:
    """``[K, 4]`` float RGBA: matplotlib's tab20 with its two greys left out, strong colours first.

    Consecutive ids get different hues, so neighbouring documents of a row never share a colour.
    """
    import matplotlib
    import numpy as np

    tab20 = np.asarray(matplotlib.colormaps["tab20"].colors)
    order = [*range(0, 20, 2), *range(1, 20, 2)]
    return np.asarray([(*tab20[i], 1.0) for i in order if i not in (14, 15)])  # 14, 15: the greys


def id_colours(ids: torch.Tensor, padding: torch.Tensor) -> np.ndarray:
    """Per-token RGBA ``[B, S, 4]`` float for a categorical id panel.

    Args:
        ids: int64 ``[B, S]`` 1-based ids (documents or attention ranges), 0 = in no range.
        padding: bool ``[B, S]``, True at padding.

    Returns:
        Id ``k >= 1`` in palette colour ``(k - 1) % K``; padding in :data:`PADDING_RGBA`
        (white); any other 0 (an ineligible token) in :data:`UNATTENDED_RGBA`. No two
        of these share a colour.
    """
    import numpy as np

    palette = _document_palette()
    ids_np = ids.numpy()
    colours = palette[np.maximum(ids_np - 1, 0) % len(palette)]
    colours[ids_np == 0] = UNATTENDED_RGBA
    colours[padding.numpy()] = PADDING_RGBA
    return colours


# ----------------------------------------------------------------------------- figures


def draw_batch(batch: Mapping[str, Any], row: int, title: str, *, xdoc: bool) -> Any:
    """The ``inspect`` figure of a text :meth:`~zephon_loader.loader.ZephonLoader.preview` batch.

    Four panels, all categorical (legends, no colour bars): document ids,
    attention ranges (what attention sees: ineligible tokens in no range),
    token classes (supervised / unsupervised label / ineligible / padding),
    and row ``row``'s block-causal mask. Padding is white everywhere.

    Args:
        batch: Internal names: int64 ``[B, S]`` ``document_ids``,
            ``attention_document_ids``, ``labels``; bool ``[B, S]`` ``padding_mask``.
        row: Row of the mask panel, ``0 <= row < B``.
        title: Figure title.
        xdoc: Cross-document attention (names the mask panel).

    Returns:
        The matplotlib ``Figure`` (the caller saves and closes it).
    """
    from matplotlib.patches import Patch

    ids = batch[F.DOCUMENT_IDS]
    attention_ids = batch[F.ATTENTION_DOCUMENT_IDS]
    padding = batch[F.PADDING_MASK]
    ineligible = (attention_ids == 0) & ~padding

    figure, axes = _four_panels()
    # Without eligibility marks or xdoc the attention ranges are the documents: the panel beside them then
    # shows row `row`'s positions instead of the same picture twice.
    same = bool((ids == attention_ids).all())
    panels = [(axes[0, 0], ids, "document ids per row (= attention ranges: no eligibility marks, no xdoc)" if same
               else "document ids per row", None)]
    if not same:
        panels.append((axes[0, 1], attention_ids, "attention ranges per row (what attention sees)",
                       "ineligible (in no range)"))
    for axis, values, panel, unattended in panels:
        _id_panel(axis, values, padding, panel)
        _id_legend(axis, int(values.max()), unattended=unattended)
    if same:
        _text_positions_panel(axes[0, 1], batch, row)
    _class_panel(axes[1, 0], token_classes(batch[F.LABELS], padding, ineligible), TOKEN_CLASSES, "tokens by class")
    for axis in [panel[0] for panel in panels] + [axes[1, 0]]:
        _token_axes(axis)
        axis.set_yticks(range(ids.shape[0]) if ids.shape[0] <= 16 else axis.get_yticks())
    axis = axes[1, 1]
    _mask_panel(axis, attention_ids, row, f"row {row}: block-causal mask (query × key, xdoc={xdoc})")
    _side_legend(axis, [Patch(facecolor="tab:blue", label="attends"),
                        Patch(facecolor="white", edgecolor="black", label="masked")])
    return _titled(figure, title)


def draw_image_batch(batch: Mapping[str, Any], row: int, title: str, *, vision_ids: tuple[int, ...],
                     xdoc: bool) -> Any:
    """The ``inspect`` figure of an image-text :meth:`~zephon_loader.loader.ZephonLoader.preview` batch.

    Four panels: token kinds (text, image, vision delimiters, ineligible
    fillers, padding), document ids, the three mRoPE position axes of row
    ``row``, and that row's block-causal mask.

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
    padding = batch[F.PADDING_MASK]

    figure, axes = _four_panels()
    _class_panel(axes[0, 0], token_kinds(batch, vision_ids).numpy(), TOKEN_KINDS,
                 "tokens by kind (image spans, fillers, padding)")
    _id_panel(axes[0, 1], batch[F.DOCUMENT_IDS], padding, "document ids per row (one record each)")
    for axis in (axes[0, 0], axes[0, 1]):
        _token_axes(axis)
        rows = padding.shape[0]
        axis.set_yticks(range(rows) if rows <= 16 else range(0, rows, max(1, rows // 8)))  # whole rows only
    _positions_panel(axes[1, 0], batch, row, xdoc=xdoc)
    _mask_panel(axes[1, 1], batch[F.ATTENTION_DOCUMENT_IDS], row,
                f"row {row}: block-causal mask (xdoc={xdoc}); fillers in no block")
    return _titled(figure, title)


def _four_panels() -> tuple[Any, Any]:
    """A new figure and its 2 × 2 axes, the size of every ``inspect`` picture."""
    import matplotlib.pyplot as plt

    return plt.subplots(2, 2, figsize=(15, 9))


def _titled(figure: Any, title: str) -> Any:
    """``figure`` with its title, laid out."""
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def _side_legend(axis: Any, handles: Sequence[Any]) -> None:
    """A legend of ``handles`` right of ``axis``, outside the panel."""
    axis.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def _token_axes(axis: Any) -> None:
    """Axis labels of a ``[B, S]`` panel: tokens across, rows down."""
    axis.set_xlabel("token")
    axis.set_ylabel("row")


def _id_panel(axis: Any, ids: torch.Tensor, padding: torch.Tensor, title: str) -> None:
    """A ``[B, S]`` categorical id panel, coloured by :func:`id_colours`."""
    axis.imshow(id_colours(ids, padding), aspect="auto", interpolation="nearest")
    axis.set_title(title)


def _id_legend(axis: Any, max_id: int, *, unattended: str | None) -> None:
    """The legend of an id panel: padding, the no-range grey (when ``unattended`` names it), the first ids."""
    from matplotlib.patches import Patch

    palette = _document_palette()
    handles = [Patch(facecolor=PADDING_RGBA, edgecolor="black", label="padding")]
    if unattended is not None:
        handles.append(Patch(facecolor=UNATTENDED_RGBA, label=unattended))
    handles += [Patch(facecolor=palette[(k - 1) % len(palette)], label=f"id {k}")
                for k in range(1, min(max_id, LEGEND_DOCUMENTS) + 1)]
    if max_id > LEGEND_DOCUMENTS:
        handles.append(Patch(facecolor="none", edgecolor="none",
                             label=f"... up to id {max_id} (colours repeat every {len(palette)})"))
    _side_legend(axis, handles)


def _class_panel(axis: Any, classes: np.ndarray, table: Sequence[tuple[str, tuple[float, ...]]], title: str) -> None:
    """A ``[B, S]`` panel of token classes (indices into ``table``), its legend counting each class."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    axis.imshow(ListedColormap([c for _, c in table])(classes), aspect="auto", interpolation="nearest")
    counts = [int((classes == index).sum()) for index in range(len(table))]
    _side_legend(axis, [Patch(facecolor=c, edgecolor="black", label=f"{name}: {n:,}")
                        for (name, c), n in zip(table, counts)])
    axis.set_title(title)


def _mask_panel(axis: Any, attention_ids: torch.Tensor, row: int, title: str) -> None:
    """Row ``row``'s block-causal mask (query × key): attended in blue, masked in white."""
    from matplotlib.colors import ListedColormap

    from zephon_loader.finalize.final_map import block_causal_mask

    mask = block_causal_mask(attention_ids[row : row + 1])[0, 0]
    axis.imshow(mask.numpy(), interpolation="nearest", cmap=ListedColormap(["white", "tab:blue"]), vmin=0, vmax=1)
    axis.set_title(title)
    axis.set_xlabel("key")
    axis.set_ylabel("query")


def _text_positions_panel(axis: Any, batch: Mapping[str, Any], row: int) -> None:
    """Row ``row``'s positions (restarting at 0 at each document), its padding run shaded."""
    import torch

    padding = batch[F.PADDING_MASK][row]
    positions = batch[F.POSITION_IDS][row]
    columns = torch.arange(positions.shape[-1])
    axis.plot(columns.numpy(), positions.numpy(), "-", color="tab:blue", linewidth=1.2, label="position_ids")
    used = int((~padding).sum())
    if used < positions.shape[-1]:
        axis.axvspan(used - 0.5, positions.shape[-1] - 0.5, color="0.9", label="padding (own run)")
    axis.legend(loc="upper left", fontsize=8)
    axis.set_title(f"row {row}: positions (restart at 0 at each document)")
    axis.set_xlabel("token")
    axis.set_ylabel("position")


def _positions_panel(axis: Any, batch: Mapping[str, Any], row: int, *, xdoc: bool) -> None:
    """Row ``row``'s three mRoPE position axes, its padding run shaded, its image tokens marked."""
    import torch

    padding = batch[F.PADDING_MASK]
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
