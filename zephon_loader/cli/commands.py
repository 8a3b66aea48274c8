"""The ``zephon-loader`` command: its parser, ``main``, the ``run`` report and the one-line errors.

    zephon-loader run [CONFIG] [--steps N] [--json FILE]    # iterate and report (bundled default without CONFIG)
    zephon-loader inspect [CONFIG] --out FILE.png [--row R] # draw the first batch
    zephon-loader show CONFIG --steps A-B [--state STATE] [--rank R --world N] [--json]  # what steps trained on
    zephon-loader skip CONFIG STATE --batches N --out STATE2 [--world N]  # resume N steps later
    zephon-loader index FOLDER [FOLDER ...]                 # write each folder's shard digest manifest
    zephon-loader --version

``run`` and ``inspect`` take a text or an image-text config (:mod:`zephon_loader.cli.configs`
tells them apart); ``inspect`` draws with :mod:`zephon_loader.cli.inspect`. ``index`` hashes a
source folder's shards once and writes the digests with each file's size, mtime and ctime into
the folder (:func:`zephon_loader.pipeline.manifest.build_manifest`): a build on any machine then
takes them from there instead of hashing the corpus (run it again after changing shards, as
Zephon's ``build_index``).

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
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from zephon_loader import __version__
from zephon_loader import fields as F
from zephon_loader.cli.configs import WRAP_HINT, config_and_builder, config_path, no_batch_error, progress
from zephon_loader.cli.inspect import image_counts, inspect
from zephon_loader.zephon_compat import worker_crash_info

if TYPE_CHECKING:
    import torch

#: Exceptions that report a mistake in the configuration, the data or the environment (one line, exit 2).
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, OSError, ImportError)
#: Exit statuses: a user error, Ctrl-C.
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def _describe(value: Any) -> str:
    """How the report lists a yielded field: a tensor's dtype and shape, any other value's type and value."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.'):7s} {list(value.shape)}"
    return f"{type(value).__name__:7s} {value!r}"


def _attention_ids(batch: dict[str, Any]) -> torch.Tensor | None:
    """Per-token attention ranges [B, S] from whichever yielded field carries them."""
    if F.PACKED_SEQ_IDS in batch:
        return batch[F.PACKED_SEQ_IDS]
    mask = batch.get(F.ATTENTION_MASK)
    if mask is not None and getattr(mask, "ndim", None) == 2:
        return mask
    return None


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

    Ctrl-C stops the iteration and the report covers the batches read so far
    (``"interrupted": true``); ``main`` then exits with 130.

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

    out = sys.stdout if out is None else out  # looked up per call, so redirect_stdout/capture work

    started = time.perf_counter()
    cfg, build = config_and_builder(config)
    progress(f"building the loader of {config} ({len(cfg.sources)} source(s); the shards are listed and checked "
             "first)")
    if cfg.passes is None and steps is None:
        print("zephon-loader: this stream is endless (passes: null): stop it with Ctrl-C (the report so far is "
              "printed) or pass --steps N", file=sys.stderr)
    interrupted = False
    with _command_logging() as notices, build(cfg) as loader:
        built = time.perf_counter()
        batches = tokens = padding = supervised = positions = ranges = rows = images = 0
        first: dict[str, Any] | None = None
        try:
            for batch in tqdm(loader, total=steps, desc="batches", unit="batch", file=sys.stderr, leave=False):
                if first is None:
                    first = batch
                    progress(f"first batch after {time.perf_counter() - started:.2f} s")
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
        except KeyboardInterrupt:  # Ctrl-C: the report of what was read so far, then exit 130
            if first is None:
                raise
            interrupted = True
        elapsed = time.perf_counter() - built
        stats = loader.stats()
    dropped = stats["dropped"]
    for reason, entry in dropped.items():
        entry["why"] = stats["reasons"].get(reason, reason)
    if first is None:
        raise no_batch_error(config, dropped)
    report = {
        "config": str(config),
        "interrupted": interrupted,
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
    print(f"zephon-loader run  {config}" + ("  (interrupted: the batches read so far)" if interrupted else ""),
          file=out)
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


def index(folders: Sequence[str], out=None) -> None:
    """Write each folder's digest manifest, one line per folder (files, bytes, seconds)."""
    from zephon_loader.pipeline.manifest import build_manifest

    for folder in folders:
        start = time.perf_counter()
        path, files, total = build_manifest(folder)
        print(f"wrote {path}: {files} files, {total / 2**30:.2f} GiB hashed in {time.perf_counter() - start:.1f} s",
              file=out)


def _user_error(error: BaseException) -> str | None:
    """The one-line message of a user error (see the module docstring), or None for a bug.

    Zephon's process runner re-raises an operator's exception in the trainer as
    ``WorkerCrashed`` (a ``RuntimeError`` carrying ``info.exc_type`` and
    ``info.message``, the worker's traceback in its text): a user error in a
    worker is reported by its own message.
    """
    if isinstance(error, USER_ERRORS) or _is_zephon_validation_error(error):
        return " ".join(str(error).split()) or type(error).__name__
    info = worker_crash_info(error)
    if info is not None:
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
    """The ``zephon-loader`` argument parser (``--version``, ``run``, ``inspect``, ``index``)."""
    parser = argparse.ArgumentParser(
        prog="zephon-loader",
        description="Packed token batches from a Zephon pipeline: iterate a loader and report (run), "
        "or draw its first batch (inspect). Without CONFIG both use the bundled demo.",
        epilog="A configuration or data error ends with one line 'zephon-loader: error: ...' and exit status 2.",
    )
    parser.add_argument("--version", action="version", version=f"zephon-loader {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="iterate a loader and report throughput and packing statistics")
    run_parser.add_argument("config", nargs="?", type=config_path, default=None,
                            help="YAML file, or pkg://NAME for a bundled one (default: pkg://demo.yaml)")
    run_parser.add_argument("--steps", type=int, default=None, help="stop after N batches (default: one pass)")
    run_parser.add_argument("--json", type=Path, default=None, help="also write the report as JSON here")
    inspect_parser = commands.add_parser("inspect", help="draw the first batch to a PNG")
    inspect_parser.add_argument("config", nargs="?", type=config_path, default=None,
                                help="YAML file, or pkg://NAME for a bundled one (default: pkg://demo.yaml)")
    inspect_parser.add_argument("--out", type=Path, required=True, help="PNG file to write")
    inspect_parser.add_argument("--row", type=int, default=0,
                                help="row whose block mask is drawn, 0 <= ROW < micro_batch_size (default 0)")
    show_parser = commands.add_parser("show", help="which documents each row of some steps held (source, shard, "
                                      "line/row, token span), without training")
    show_parser.add_argument("config", type=config_path, help="the run's YAML file (or pkg://NAME)")
    show_parser.add_argument("--steps", required=True, help="STEP or FIRST-LAST, 0-based steps of the pass")
    show_parser.add_argument("--state", type=Path, default=None,
                             help="a state saved at or before FIRST: reading starts there (default: the pass start)")
    show_parser.add_argument("--rank", type=int, default=0, help="the data-parallel rank (default 0)")
    show_parser.add_argument("--world", type=int, default=1, help="the data-parallel size of the run (default 1)")
    show_parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    skip_parser = commands.add_parser("skip", help="write a state that resumes N steps after STATE (the "
                                      "skipped batches are counted and recorded in it)")
    skip_parser.add_argument("config", type=config_path, help="the run's YAML file (or pkg://NAME)")
    skip_parser.add_argument("state", type=Path, help="the saved state (.json, or torch.save)")
    skip_parser.add_argument("--batches", type=int, required=True, help="steps to skip (batches on each rank)")
    skip_parser.add_argument("--out", type=Path, required=True, help="where to write the new state")
    skip_parser.add_argument("--world", type=int, default=1,
                             help="the data-parallel size the run resumes at (default 1)")
    index_parser = commands.add_parser(
        "index", help="hash a source folder's shards once and write the digests beside Zephon's index.json",
        description="Writes FOLDER/zephon_loader.digests.json: each shard's SHA-256 with its size, mtime and "
        "ctime. A build on any machine then takes the resume fingerprint's digests from it (reading no shard) "
        "for every file still as recorded; a file changed since is hashed again in the background, with a "
        "warning. Run it again after changing shards (like python -m zephon.build_index).")
    index_parser.add_argument("folders", nargs="+", metavar="FOLDER", help="a local source folder")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``zephon-loader``; returns the exit status (0, 2 user error, 130 Ctrl-C)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run" and args.steps is not None and args.steps <= 0:
        parser.error(f"--steps: got {args.steps}, expected a positive int")
    try:
        from zephon_loader.config import default_config_path

        config = None if args.command == "index" else (
            args.config if args.config is not None else default_config_path())
        if args.command == "index":
            index(args.folders)
        elif args.command == "show":
            from zephon_loader.cli.show import format_table, parse_steps, show

            report = show(config, parse_steps(args.steps), args.state, args.rank, args.world)
            print(json.dumps(report, indent=2) if args.json else format_table(report))
        elif args.command == "skip":
            from zephon_loader.cli.show import skip

            done = skip(config, args.state, args.batches, args.out, args.world)
            print(f"wrote {done['out']}: steps {done['from_step']}-{done['to_step'] - 1} skipped at DP size "
                  f"{done['world']}; it resumes at step {done['to_step']}")
        elif args.command == "run":
            report = run(config, args.steps)
            if args.json is not None:
                args.json.write_text(json.dumps(report, indent=2))
            if report["interrupted"]:
                raise KeyboardInterrupt  # after the partial report (and its --json)
        else:
            print(f"wrote {inspect(config, args.out, args.row)}")
    except KeyboardInterrupt:
        print("zephon-loader: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:
        message = _user_error(error)
        if message is None:
            raise  # a bug: keep the traceback for the report
        name = str(config) if config is not None else ""
        if name and name not in message:  # every error names the configuration it came from
            message = f"{name}: {message}"
        print(f"zephon-loader: error: {message}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
