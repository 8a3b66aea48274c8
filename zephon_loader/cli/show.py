"""``zephon-loader show`` (what steps trained on) and ``zephon-loader skip`` (resume n steps later), no GPU needed.

* :func:`show`: builds the loader of a config as rank ``R`` of ``N`` (alone: no other rank is started and no
  collective runs), resumes the state when one is given (reading from its position, never from the start
  of the run) and reads the steps asked for (:meth:`ZephonLoader.provenance_of_steps`): per step, per row,
  each piece's source, shard, line/row and ``input_ids`` span. A table, or ``--json``.
* :func:`skip`: a state ``n`` steps later (:meth:`ZephonLoader.skip_batches`) at a DP size of ``N``: ``N``
  rank processes (one per rank, meeting in a temporary aggregation folder) each skip their ``n`` batches;
  the state they agree on is written.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import tempfile
import traceback
from pathlib import Path
from typing import Any

__all__ = ["format_table", "parse_steps", "show", "skip"]


def parse_steps(text: str) -> tuple[int, int]:
    """``"1200-1210"`` -> ``(1200, 1210)`` (inclusive), ``"7"`` -> ``(7, 7)``.

    Raises:
        ValueError: Anything else, or a range whose end comes before its start.
    """
    first, sep, last = text.partition("-")
    try:
        span = (int(first), int(last) if sep else int(first))
    except ValueError:
        raise ValueError(f"--steps: got {text!r}, expected STEP or FIRST-LAST (e.g. 1200-1210), steps >= 0") from None
    if span[0] < 0 or span[1] < span[0]:
        raise ValueError(f"--steps: got {text!r}, expected 0 <= FIRST <= LAST")
    return span


def _build(config: Path, rank: int, world: int, aggregate: str) -> Any:
    """The loader of ``config`` as rank ``rank`` of ``world``; with several ranks, Zephon's aggregation goes to
    ``aggregate`` (a folder of this command's: the run's own store is never touched)."""
    from zephon_loader.cli.configs import config_and_builder

    cfg, build = config_and_builder(config)
    if world > 1:
        distributed = dataclasses.replace(cfg.distributed, aggregate_dir=aggregate, aggregate_store=None,
                                          run_id=cfg.distributed.run_id or "zephon-loader-cli")
        cfg = dataclasses.replace(cfg, distributed=distributed)
    return build(cfg, dp_rank=rank, dp_world_size=world, pin_memory=False)


def _state_files(path: Path, option: str = "--state") -> list[Path]:
    """The state file at ``path``, or every file a pattern matches (:func:`~zephon_loader.state.state_paths`: the
    per-rank states of ``distributed.state_scope: rank``, all of which a loader at any DP size reads)."""
    from zephon_loader.state import state_paths

    text = str(path)
    files = state_paths(path)
    if files is not None:
        if not files:
            raise ValueError(f"{option}: got {text!r}, expected a pattern matching the state files loader.save_state "
                             "wrote; no file matches")
        return [Path(name) for name in files]
    if not Path(path).is_file():
        raise ValueError(f"{option}: got {text!r}, expected a state file written by loader.save_state (or "
                         "zephon-loader skip; per-rank states: a pattern such as 'ckpt/loader-*.pt'); no such file")
    return [Path(path)]


def _read_state(path: Path, option: str = "--state") -> dict[str, Any]:
    """The first state file of :func:`_state_files`."""
    from zephon_loader.state import read_state_file

    return read_state_file(_state_files(path, option)[0])


def _load(loader: Any, path: Path, option: str = "--state") -> None:
    """Resume ``loader`` from the state(s) at ``path`` (one file, or every rank's file of a pattern), refused
    as :func:`_state_files` says when there is none."""
    _state_files(path, option)
    loader.load_state(path)


def show(config: Path, steps: tuple[int, int], state: Path | None = None, rank: int = 0,
         world: int = 1) -> dict[str, Any]:
    """The provenance of steps ``steps[0] .. steps[1]`` of rank ``rank`` of ``world``.

    Returns ``{"config", "state", "rank", "world", "steps": [{"step", "epoch", "lane", "rows": [[piece, ...]]}],
    "skipped_steps"}`` (pieces as :meth:`ZephonLoader.provenance`).
    """
    if not 0 <= rank < world:
        raise ValueError(f"--rank: got {rank}, expected 0 <= RANK < --world ({world})")
    with tempfile.TemporaryDirectory(prefix="zephon-loader-show-") as aggregate:
        with _build(config, rank, world, aggregate) as loader:
            if state is not None:
                _load(loader, state)
            found = loader.provenance_of_steps(*steps)
    skipped = found[0]["skipped_steps"] if found else []
    for entry in found:
        for key in ("rank", "world", "skipped_steps"):
            entry.pop(key, None)
    return {"config": str(config), "state": str(state) if state is not None else None, "rank": rank,
            "world": world, "skipped_steps": skipped, "steps": found}


def format_table(report: dict[str, Any]) -> str:
    """The ``show`` report as a table: one line per piece."""
    lines = [f"zephon-loader show  {report['config']}" + (f"  --state {report['state']}" if report["state"] else "")
             + f"  rank {report['rank']} of {report['world']}"]
    for skip in report["skipped_steps"]:
        lines.append(f"  (steps {skip['from_step']}-{skip['from_step'] + skip['batches'] - 1} were skipped: "
                     "never trained)")
    lines.append(f"  {'step':>6} {'row':>3} {'span':>11} {'tok':>5}  {'source':12} {'where':>12}  shard")
    for entry in report["steps"]:
        for row, pieces in enumerate(entry["rows"]):
            for piece in pieces:
                where = (f"line {piece['line']}" if piece.get("line") is not None else
                         f"row {piece['row']}" if "row" in piece else f"record #{piece['record']}")
                span = f"{piece['start']}-{piece['end']}"
                cut = "" if piece["ends_document"] else "  (continues in a later row)"
                lines.append(f"  {entry['step']:>6} {row:>3} {span:>11} {piece['tokens']:>5}  {piece['source'][:12]:12} "
                             f"{where:>12}  {piece['shard']}{cut}")
    return "\n".join(lines)


def _skip_rank(task: dict[str, Any]) -> None:
    """One rank of :func:`skip` (a spawned process): writes its state, or its error, next to ``task['out']``."""
    out = Path(task["out"])
    try:
        with _build(Path(task["config"]), task["rank"], task["world"], task["aggregate"]) as loader:
            _load(loader, Path(task["state"]), "STATE")
            loader.skip_batches(task["batches"])
            out.write_text(json.dumps(loader.state_dict()))
    except BaseException as error:  # noqa: BLE001 - reported by the parent
        out.with_suffix(".error").write_text(json.dumps({"type": type(error).__name__, "message": str(error),
                                                         "traceback": traceback.format_exc()}))


def skip(config: Path, state: Path, batches: int, out: Path, world: int = 1, timeout_s: float = 3600) -> dict:
    """Write to ``out`` the state of ``state`` ``batches`` steps later at a DP size of ``world``.

    Returns ``{"from_step", "to_step", "skipped_batches", "out"}``.

    Raises:
        ValueError: Bad arguments, or what :meth:`ZephonLoader.skip_batches` refuses (a rank's error).
    """
    if batches < 1:
        raise ValueError(f"--batches: got {batches}, expected an int >= 1")
    if world < 1:
        raise ValueError(f"--world: got {world}, expected an int >= 1 (the DP size the run resumes at)")
    from zephon_loader.state import save_state_file
    from zephon_loader.stats import LoaderStats

    saved = _read_state(state, "STATE")
    with tempfile.TemporaryDirectory(prefix="zephon-loader-skip-") as folder:
        tasks = [{"config": str(config), "state": str(state), "batches": batches, "rank": rank, "world": world,
                  "aggregate": str(Path(folder) / "aggregate"), "out": str(Path(folder) / f"rank{rank}.json")}
                 for rank in range(world)]
        Path(tasks[0]["aggregate"]).mkdir()
        if world == 1:
            _skip_rank(tasks[0])
        else:
            context = multiprocessing.get_context("spawn")
            processes = [context.Process(target=_skip_rank, args=(task,)) for task in tasks]
            for process in processes:
                process.start()
            for process in processes:
                process.join(timeout_s)
            for process in processes:
                if process.is_alive():
                    process.kill()
        for task in tasks:
            error = Path(task["out"]).with_suffix(".error")
            if error.exists():
                reported = json.loads(error.read_text())
                if reported["type"] in ("ValueError", "TypeError", "OSError", "FileNotFoundError"):
                    raise ValueError(f"rank {task['rank']} of {world}: {reported['message']}")
                raise RuntimeError(f"rank {task['rank']} of {world} failed:\n{reported['traceback']}")
            if not Path(task["out"]).exists():
                raise RuntimeError(f"rank {task['rank']} of {world} wrote no state (killed after {timeout_s:.0f} s, "
                                   "or it died); run it again, or with --world 1 to see its error")
        states = [json.loads(Path(task["out"]).read_text()) for task in tasks]
    if "lanes" in states[0]:  # distributed.state_scope: rank: each rank's own lanes, a file each
        if "{dp_rank}" not in str(out) and world > 1:
            raise ValueError(f"--out: got {str(out)!r}, expected a path with {{dp_rank}} in it (e.g. "
                             "'ckpt/loader-{dp_rank}.pt'): the config's distributed.state_scope is 'rank', so each "
                             f"of the {world} ranks has a state of its own")
        for rank, rank_state in enumerate(states):
            save_state_file(str(out).replace("{dp_rank}", str(rank)), rank_state)
    elif any(other != states[0] for other in states[1:]):
        raise RuntimeError("skip: the ranks' states differ, expected the same state on every rank (a bug)")
    else:
        save_state_file(out, states[0])
    before = LoaderStats.steps_of(saved["stats"])[0] if saved.get("stats") else None
    after = LoaderStats.steps_of(states[0]["stats"])[0]
    return {"from_step": before, "to_step": after, "skipped_batches": batches, "world": world, "out": str(out)}
