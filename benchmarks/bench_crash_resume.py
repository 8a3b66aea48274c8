"""Crash/resume trials: SIGKILL a training-like process at random steps, resume, compare with an uninterrupted run.

    python benchmarks/bench_crash_resume.py [--trials 10] [--runner threads|process] [--read-ahead 2] [--kills 3]

The harness is ``tests/crash_harness.py`` (shared with
``tests/test_crash_resume.py``), the trainer ``tests/crash_worker.py``: it
logs a digest of every consumed batch (fsync'd) and saves
``{"step", "loader": loader.state_dict()}`` atomically every ``--save-every``
steps. Each trial kills it ``--kills`` times at random steps (a different
random sequence per trial), truncates the log to the last checkpoint, resumes,
and finally compares the consumed stream with the uninterrupted reference.

Prints one line per trial and a summary: trials, kills, batches compared,
lost, repeated, out-of-order trials, and the processes a dead worker left
behind for longer than ``--orphan-grace`` seconds (orphans; Zephon's
``process`` runner workers). Goal: 0 lost, 0 repeated, 0 out of order,
0 orphans.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from crash_harness import loader_config, make_corpus, reference_digests, run_trial  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--runner", choices=["threads", "process"], default="threads", help="Zephon runtime.runner")
    parser.add_argument("--read-ahead", type=int, default=2, help="loader read_ahead (0 = inline)")
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs per trial before the last run finishes")
    parser.add_argument("--save-every", type=int, default=7, help="checkpoint every N steps")
    parser.add_argument("--documents", type=int, default=600, help="corpus size (about 1 batch per 2 documents)")
    parser.add_argument("--max-workers", type=int, default=None, help="Zephon runtime.max_workers")
    parser.add_argument("--step-seconds", type=float, default=0.003, help="simulated compute per training step")
    parser.add_argument("--kill-jitter", type=float, default=0.02,
                        help="seconds (random 0..this) between seeing the kill step logged and the SIGKILL")
    parser.add_argument("--orphan-grace", type=float, default=10.0,
                        help="seconds a killed worker's process group gets to exit on its own before counting orphans")
    parser.add_argument("--seed", type=int, default=0, help="kill steps of trial i are drawn with seed + i")
    parser.add_argument("--workdir", type=Path, default=None, help="keep corpus, logs and states here")
    args = parser.parse_args()
    for name in ("trials", "save_every", "documents"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: got {getattr(args, name)}, expected an int >= 1")
    if args.kills < 0 or args.read_ahead < 0:
        parser.error("--kills and --read-ahead: expected ints >= 0")

    with tempfile.TemporaryDirectory(prefix="bench_crash_resume_") as scratch:
        root = args.workdir or Path(scratch)
        corpus = make_corpus(root / "corpus", documents=args.documents)
        config = loader_config(corpus, runner=args.runner, read_ahead=args.read_ahead, max_workers=args.max_workers)
        start = time.perf_counter()
        reference = reference_digests(config)
        same = ""
        if args.runner != "threads":
            threads = reference_digests(loader_config(corpus, runner="threads", read_ahead=args.read_ahead))
            same = f"; same stream as the threads runner: {'yes' if threads == reference else 'NO'}"
        print(
            f"runner={args.runner} read_ahead={args.read_ahead} max_workers={args.max_workers} "
            f"save_every={args.save_every} kills/trial={args.kills}: reference {len(reference)} batches "
            f"in {time.perf_counter() - start:.1f} s{same}"
        )
        totals: Counter[str] = Counter()
        for trial in range(args.trials):
            result = run_trial(
                config, root / f"trial{trial}", reference, kills=args.kills, save_every=args.save_every,
                seed=args.seed + trial, step_seconds=args.step_seconds,
                kill_jitter_s=args.kill_jitter, orphan_grace_s=args.orphan_grace,
            )
            c = result.comparison
            print(
                f"trial {trial}: runs={result.runs} kills={result.kills} (mid-save {result.mid_save_kills}) "
                f"resumes={result.resumes} redone={result.redone} batches={c.batches} consumed={c.consumed} "
                f"lost={c.lost} repeated={c.repeated} first_divergence={c.first_divergence} "
                f"orphans={result.orphans} {result.seconds:.1f} s"
            )
            totals.update(
                kills=result.kills, mid_save=result.mid_save_kills, batches=c.batches, lost=c.lost,
                repeated=c.repeated, out_of_order=int(not c.exact), orphans=result.orphans, redone=result.redone,
            )
        print(
            f"summary: trials={args.trials} kills={totals['kills']} (mid-save {totals['mid_save']}) "
            f"batches compared={totals['batches']} lost={totals['lost']} repeated={totals['repeated']} "
            f"trials out of order={totals['out_of_order']} orphans={totals['orphans']} "
            f"steps redone after resume={totals['redone']} ({time.perf_counter() - start:.0f} s)"
        )

if __name__ == "__main__":
    main()
