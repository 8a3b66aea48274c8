"""``zephon-loader`` command line: ``run`` and ``inspect``.

    zephon-loader run [CONFIG] [--steps N] [--json FILE]    # iterate and report (bundled default without CONFIG)
    zephon-loader inspect [CONFIG] --out FILE.png [--row R] # draw the first batch
    zephon-loader --version

Failures. A mistake in the configuration, the data or the environment ends
the command with one line, ``zephon-loader: error: <message>``, on stderr and
exit status 2, whether it is found while building or while iterating:
``ValueError`` (bad records included), ``TypeError``, ``OSError`` (missing
files), ``ImportError`` (a missing extra), Zephon's ``ValidationError``, and a
Zephon worker's crash report whose original exception is one of these. Any
other exception is a bug (in zephon_loader or Zephon): it keeps its traceback,
exit status 1, for the bug report. Ctrl-C ends with one line, exit status 130.

Importing this module imports neither torch, Zephon, numpy nor matplotlib:
the commands import what they need when they run, so ``--help`` and
``--version`` answer at once.
"""

from __future__ import annotations

import argparse
import builtins
import json
import logging
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from zephon_loader import __version__

if TYPE_CHECKING:
    import numpy as np
    import torch

    from zephon_loader.config import TextLoaderConfig
    from zephon_loader.loader import ZephonLoader

#: Exceptions that report a mistake in the configuration, the data or the environment (one line, exit 2).
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, OSError, ImportError)
#: Exit statuses: a user error, Ctrl-C.
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
#: The hint printed when first_fit/best_fit dropped documents longer than a row.
WRAP_HINT = "use packing.algorithm: wrap to keep long documents (split across rows)"


def build_from_yaml(path: str | Path) -> ZephonLoader:
    """A single-process loader from a YAML file's ``dataloader`` node: image-text or text, by the node.

    Read by :func:`~zephon_loader.config.read_loader_config`, the reader the
    builders use: ``_target_`` optional, relative paths against the file's folder.
    """
    cfg, build = _reader_and_builder(Path(path))
    return build(cfg)


def _describe(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.'):7s} {list(value.shape)}"
    return f"{type(value).__name__:7s} {value!r}"


def _attention_ids(batch: dict[str, Any]) -> torch.Tensor | None:
    """Per-token attention ranges [B, S] from whichever yielded field carries them."""
    from zephon_loader import fields as F

    if F.PACKED_SEQ_IDS in batch:
        return batch[F.PACKED_SEQ_IDS]
    mask = batch.get(F.ATTENTION_MASK)
    if mask is not None and getattr(mask, "ndim", None) == 2:
        return mask
    return None


def _no_batch_error(config: Path, dropped: dict[str, Any]) -> ValueError:
    """Why a loader yielded nothing, and the fix for each reason its records were dropped for."""
    from zephon_loader.pipeline.records import LONGER_THAN_ROW

    counts = "; ".join(f"{reason}: {e['documents']:,} (first at {e['first']})" for reason, e in dropped.items())
    fixes = []
    if LONGER_THAN_ROW in dropped:
        fixes.append(f"{WRAP_HINT}, or raise sequence_length")
    if {"too_many_tokens", "too_many_bytes"} & set(dropped):
        fixes.append("raise or unset max_record_tokens / max_record_bytes")
    if set(dropped) - {LONGER_THAN_ROW, "too_many_tokens", "too_many_bytes"}:
        fixes.append("fix the records (or set on_bad_record: error to stop at the first one)")
    return ValueError(
        f"{config}: the loader yielded no batch: "
        + (f"every record was dropped ({counts}); " + "; ".join(fixes) if dropped
           else "the sources yielded no record and nothing was dropped; add data")
    )


def _reader_and_builder(config: Path) -> tuple[Any, Callable[[Any], Any]]:
    """The config a YAML file holds and the builder for it: the image-text loader's, or the text loader's."""
    from zephon_loader.config import read_loader_config
    from zephon_loader.cli.image import is_image_config

    if is_image_config(config):
        from zephon_loader.build_image import build_image_loader
        from zephon_loader.config.image import ImageLoaderConfig

        return read_loader_config(config, ImageLoaderConfig), build_image_loader
    from zephon_loader.build import build_text_loader

    return read_loader_config(config), build_text_loader


def _hints(config: Any, dropped: dict[str, Any]) -> list[str]:
    """Advice the report prints after the drops."""
    from zephon_loader.config import TextLoaderConfig
    from zephon_loader.pipeline.records import LONGER_THAN_ROW

    if LONGER_THAN_ROW not in dropped or not isinstance(config, TextLoaderConfig):
        return []  # image-text records are never split: packing.oversized says what happens to long ones
    entry = dropped[LONGER_THAN_ROW]
    return [
        f"packing.algorithm {config.packing.algorithm} dropped {entry['documents']:,} documents longer than a row "
        f"(sequence_length + 1 = {config.sequence_length + 1} tokens): {WRAP_HINT}"
    ]


class _TqdmLogHandler(logging.Handler):
    """Log lines written above the progress bar (``tqdm.write``) instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # pragma: no cover - logging's own contract: never raise from emit
            self.handleError(record)


@contextmanager
def _command_logging() -> Iterator[Any]:
    """For one command: warnings above the progress bar, Zephon's per-flush packing notices counted.

    Yields the :class:`~zephon_loader.zephon_logs.ZephonLogSummary`; the
    command reports its totals once. Everything is removed on exit (``main``
    may run several times in one process, e.g. in tests).
    """
    from zephon_loader.zephon_logs import summarize_zephon_logs

    handler = _TqdmLogHandler(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(message)s"))  # what logging prints without a handler
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with summarize_zephon_logs(report=False) as notices:
            yield notices
    finally:
        root.removeHandler(handler)


def run(config: Path, steps: int | None, out=None) -> dict[str, Any]:
    """Iterate a loader and report throughput and packing statistics (printed to ``out``, default stdout).

    The report (also returned, and written by ``--json``): batches, build and
    iteration time, tokens/s, padding fraction, documents per row,
    label-supervised fraction, the yielded fields, documents and tokens
    delivered per source, what was dropped by reason (how many, why, first
    location), hints (e.g. ``wrap`` when documents were longer than a row) and
    the totals of Zephon's packing notices (``zephon_log``).

    Raises:
        ValueError: The configuration is invalid, or the loader yielded no batch
            (the message lists what was dropped and how to keep it).
    """
    from tqdm import tqdm

    from zephon_loader import fields as F
    from zephon_loader.cli.image import image_counts

    out = sys.stdout if out is None else out  # looked up per call, so redirect_stdout/capture work

    started = time.perf_counter()
    cfg, build = _reader_and_builder(config)
    with _command_logging() as notices, build(cfg) as loader:
        built = time.perf_counter()
        batches = tokens = padding = supervised = positions = ranges = rows = images = 0
        first: dict[str, Any] | None = None
        for batch in tqdm(loader, total=steps, desc="batches", unit="batch", file=sys.stderr, leave=False):
            if first is None:
                first = batch
            pad = batch[F.PADDING_MASK]
            batches += 1
            rows += pad.shape[0]
            positions += pad.numel()
            padding += int(pad.sum())
            tokens += pad.numel() - int(pad.sum())
            supervised += int((batch[F.LABELS] != F.IGNORE_INDEX).sum())
            ids = _attention_ids(batch)
            ranges += int(ids.amax(dim=1).sum()) if ids is not None else pad.shape[0]
            images += image_counts(batch)[0]
            if steps is not None and batches >= steps:
                break
        elapsed = time.perf_counter() - built
        stats = loader.stats()
    dropped = stats["dropped"]
    for reason, entry in dropped.items():
        entry["why"] = stats["reasons"].get(reason, reason)
    if first is None:
        raise _no_batch_error(config, dropped)
    report = {
        "config": str(config),
        "batches": batches,
        "build_s": round(built - started, 3),
        "iterate_s": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed) if elapsed > 0 else None,
        "padding_fraction": round(padding / positions, 4),
        "documents_per_row": round(ranges / rows, 2),
        "label_supervised_fraction": round(supervised / positions, 4),
        "images": images,
        "fields": {name: _describe(value) for name, value in first.items()},
        "sources": stats["sources"],
        "dropped": dropped,
        "hints": _hints(cfg, dropped),
        "zephon_log": notices.totals(),
    }
    print(f"zephon-loader run  {config}", file=out)
    print(f"  batches                 {batches}  (built in {report['build_s']} s, iterated in {report['iterate_s']} s)", file=out)
    print(f"  tokens/s (non-padding)  {report['tokens_per_s']:,}", file=out)
    print(f"  padding fraction        {report['padding_fraction']:.4f}", file=out)
    print(f"  documents per row       {report['documents_per_row']:.2f}  (attention ranges)", file=out)
    print(f"  label-supervised frac.  {report['label_supervised_fraction']:.4f}", file=out)
    if images:
        print(f"  images                  {images:,}  ({images / elapsed:,.0f} images/s)", file=out)
    for name, entry in report["sources"].items():
        delivered = entry["delivered"]
        print(f"  source {name!r:17s} {delivered['documents']:,} documents, {delivered['tokens']:,} tokens delivered",
              file=out)
    if dropped:
        print("  dropped (loader.stats()):", file=out)
        for reason, entry in dropped.items():
            print(f"    {reason:22s} {entry['documents']:,} documents, {entry['tokens']:,} tokens ({entry['why']}); "
                  f"first at {entry['first']}", file=out)
    else:
        print("  dropped                 nothing", file=out)
    for hint in report["hints"]:
        print(f"  hint: {hint}", file=out)
    for line in notices.lines():
        print(f"  zephon log: {line}", file=out)
    print("  yielded fields:", file=out)
    for name, text in report["fields"].items():
        print(f"    {name:22s} {text}", file=out)
    return report


#: Colours of the categorical panels (RGBA). Padding is white and the "not in any range" grey is
#: used by nothing else: the document palette below leaves out the greys.
PADDING_RGBA = (1.0, 1.0, 1.0, 1.0)
UNATTENDED_RGBA = (0.25, 0.25, 0.25, 1.0)
#: Token classes of the third panel, drawn in this order of precedence (padding wins).
TOKEN_CLASSES = (
    ("padding", PADDING_RGBA),
    ("ineligible (attends to nothing)", UNATTENDED_RGBA),
    ("label not supervised (-100)", (0.99, 0.75, 0.44, 1.0)),
    ("label supervised", (0.17, 0.63, 0.17, 1.0)),
)
#: Documents listed by name in a legend; later ids reuse the palette's colours.
LEGEND_DOCUMENTS = 8


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


def token_classes(labels: torch.Tensor, padding: torch.Tensor, ineligible: torch.Tensor) -> np.ndarray:
    """Index into :data:`TOKEN_CLASSES` per token, ``[B, S]`` int64 (padding > ineligible > label class)."""
    import numpy as np

    from zephon_loader import fields as F

    classes = np.where(labels.numpy() == F.IGNORE_INDEX, 2, 3)
    classes[ineligible.numpy()] = 1
    classes[padding.numpy()] = 0
    return classes


def _id_legend(axis: Any, max_id: int, *, unattended: str | None) -> None:
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
    axis.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def draw_batch(batch: dict[str, Any], row: int, title: str, *, xdoc: bool) -> Any:
    """The ``inspect`` figure of a :meth:`~zephon_loader.loader.ZephonLoader.preview` batch.

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
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from zephon_loader import fields as F
    from zephon_loader.finalize.final_map import block_causal_mask

    ids = batch[F.DOCUMENT_IDS]
    attention_ids = batch[F.ATTENTION_DOCUMENT_IDS]
    padding = batch[F.PADDING_MASK]
    ineligible = (attention_ids == 0) & ~padding
    classes = token_classes(batch[F.LABELS], padding, ineligible)
    mask = block_causal_mask(attention_ids[row : row + 1])[0, 0]

    figure, axes = plt.subplots(2, 2, figsize=(15, 9))
    for axis, values, panel in (
        (axes[0, 0], ids, "document ids per row"),
        (axes[0, 1], attention_ids, "attention ranges per row (what attention sees)"),
    ):
        axis.imshow(id_colours(values, padding), aspect="auto", interpolation="nearest")
        axis.set_title(panel)
        _id_legend(axis, int(values.max()), unattended="ineligible (in no range)" if values is attention_ids else None)
    axis = axes[1, 0]
    axis.imshow(ListedColormap([c for _, c in TOKEN_CLASSES])(classes), aspect="auto", interpolation="nearest")
    counts = [int((classes == index).sum()) for index in range(len(TOKEN_CLASSES))]
    axis.set_title("tokens by class")
    axis.legend(handles=[Patch(facecolor=c, edgecolor="black", label=f"{name}: {n:,}")
                         for (name, c), n in zip(TOKEN_CLASSES, counts)],
                loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    for axis in (axes[0, 0], axes[0, 1], axes[1, 0]):
        axis.set_xlabel("token")
        axis.set_ylabel("row")
        axis.set_yticks(range(ids.shape[0]) if ids.shape[0] <= 16 else axis.get_yticks())
    axis = axes[1, 1]
    axis.imshow(mask.numpy(), interpolation="nearest", cmap=ListedColormap(["white", "tab:blue"]), vmin=0, vmax=1)
    axis.legend(handles=[Patch(facecolor="tab:blue", label="attends"),
                         Patch(facecolor="white", edgecolor="black", label="masked")],
                loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    axis.set_title(f"row {row}: block-causal mask (query × key, xdoc={xdoc})")
    axis.set_xlabel("key")
    axis.set_ylabel("query")
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def inspect(config: Path, out_png: Path, row: int = 0) -> Path:
    """Draw the first batch (:func:`draw_batch`) to ``out_png``.

    Raises:
        ImportError: matplotlib is missing (the message names the ``viz`` extra).
        ValueError: ``row`` outside ``[0, micro_batch_size)``, an invalid
            configuration, or a stream without any batch.
    """
    use_matplotlib()

    from zephon_loader.build import build_text_loader
    from zephon_loader.config import read_loader_config
    from zephon_loader.cli.image import inspect_images, is_image_config
    from zephon_loader.zephon_logs import summarize_zephon_logs

    if is_image_config(config):  # image spans, fillers, padding and the three position axes
        return inspect_images(config, out_png, row)
    cfg = read_loader_config(config)
    rows = cfg.micro_batch_size
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < rows:
        raise ValueError(
            f"--row: got {row!r}, expected a row index in [0, {rows}) (micro_batch_size is {rows} in {config})"
        )
    with summarize_zephon_logs(), build_text_loader(cfg) as loader:  # Zephon's packing notices: once, at the end
        try:
            batch = loader.preview()
        except RuntimeError as error:  # an empty stream: say what was dropped and how to keep it
            raise _no_batch_error(config, loader.stats()["dropped"]) from error
        settings = loader.settings
    ids = batch["document_ids"]
    title = f"{config.name}: B={ids.shape[0]}, S={ids.shape[1]}, contract={settings.packed_mask_type}"
    return save_figure(draw_batch(batch, row, title, xdoc=settings.xdoc), out_png)


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


def _user_error(error: BaseException) -> str | None:
    """The one-line message of a user error (see the module docstring), or None for a bug.

    Zephon's process runner re-raises an operator's exception in the trainer as
    ``WorkerCrashed`` (a ``RuntimeError`` carrying ``info.exc_type`` and
    ``info.message``, the worker's traceback in its text): a user error in a
    worker is reported by its own message.
    """
    if isinstance(error, USER_ERRORS) or _is_zephon_validation_error(error):
        return " ".join(str(error).split()) or type(error).__name__
    info = getattr(error, "info", None)
    if type(error).__name__ == "WorkerCrashed" and info is not None:
        name = str(getattr(info, "exc_type", ""))
        known = getattr(builtins, name, None)
        if name in ("BadRecordError", "JSONDecodeError") or (
            isinstance(known, type) and issubclass(known, USER_ERRORS)
        ):
            return " ".join(str(getattr(info, "message", error)).split())
    return None


def _is_zephon_validation_error(error: BaseException) -> bool:
    validation = sys.modules.get("zephon.validation")  # only if Zephon was imported: never import it here
    kind = getattr(validation, "ValidationError", None)
    return isinstance(kind, type) and isinstance(error, kind)


def build_parser() -> argparse.ArgumentParser:
    """The ``zephon-loader`` argument parser (``--version``, ``run``, ``inspect``)."""
    parser = argparse.ArgumentParser(
        prog="zephon-loader",
        description="Packed token batches from a Zephon pipeline: iterate a loader and report (run), "
        "or draw its first batch (inspect). Without CONFIG both use the bundled demo.",
        epilog="A configuration or data error ends with one line 'zephon-loader: error: ...' and exit status 2.",
    )
    parser.add_argument("--version", action="version", version=f"zephon-loader {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="iterate a loader and report throughput and packing statistics")
    run_parser.add_argument("config", nargs="?", type=Path, default=None, help="YAML (default: the bundled demo)")
    run_parser.add_argument("--steps", type=int, default=None, help="stop after N batches (default: one pass)")
    run_parser.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    inspect_parser = commands.add_parser("inspect", help="draw the first batch to a PNG")
    inspect_parser.add_argument("config", nargs="?", type=Path, default=None, help="YAML (default: the bundled demo)")
    inspect_parser.add_argument("--out", type=Path, required=True, help="PNG file to write")
    inspect_parser.add_argument("--row", type=int, default=0,
                                help="row whose block mask is drawn, 0 <= ROW < micro_batch_size (default 0)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``zephon-loader``; returns the exit status (0, 2 user error, 130 Ctrl-C)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run" and args.steps is not None and args.steps <= 0:
        parser.error(f"--steps: got {args.steps}, expected a positive int")
    try:
        from zephon_loader.config import default_config_path

        config = args.config if args.config is not None else default_config_path()
        if args.command == "run":
            report = run(config, args.steps)
            if args.json is not None:
                args.json.write_text(json.dumps(report, indent=2))
        else:
            print(f"wrote {inspect(config, args.out, args.row)}")
    except KeyboardInterrupt:
        print("zephon-loader: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:
        message = _user_error(error)
        if message is None:
            raise  # a bug: keep the traceback for the report
        print(f"zephon-loader: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
