"""Zephon ``process`` runner lifecycle: first batch, Ctrl-C, SIGKILL, close() after errors.

    python benchmarks/bench_process_runner.py [--repeats 3] [--documents 400]

The trainer is ``tests/process_trainer.py`` (a loop over
``build_text_loader`` with ``runtime.runner: process``, in its own session).
Per repeat it prints:

* ``first``: seconds from launching the trainer to its first batch;
* Ctrl-C (SIGINT to the trainer's process group, as a terminal sends it):
  workers that survived it until ``close()``, seconds from the SIGINT to the
  end of ``close()`` and to the trainer's exit, processes left 5 s later;
* SIGKILL of the trainer: worker processes before, processes of its session
  still alive 5 s later (orphans);
* in this process: ``close()`` after an error in the loop body while a
  transform worker is stuck in an operator, and seconds from ``iter()`` to a
  bad record's error reaching the loop, then ``close()``.

Then the medians. Goals: first batch a few seconds, ``close()`` and the exit
after Ctrl-C within a few seconds, no orphan.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import make_texts, train_tokenizer, write_jsonl_shards, zephon_pipeline  # noqa: E402
from process_trainer import StallFrom, TrainerProcess, loader_config  # noqa: E402


def ctrl_c(config: dict, folder: Path) -> dict[str, float]:
    trainer = TrainerProcess(config, folder)
    try:
        trainer.wait_for("first")
        first = time.monotonic() - trainer.started
        trainer.wait_for("step 3")
        workers = len(trainer.workers())
        signalled = time.monotonic()
        os.killpg(trainer.proc.pid, signal.SIGINT)
        alive = int(trainer.wait_for("alive").split()[1])
        closed = float(trainer.wait_for("closed").split()[1])
        trainer.proc.wait(120)
        exited = time.monotonic() - signalled
        left = len(trainer.session_left_after(5.0))
        return {"first": first, "workers": workers, "survived": alive, "close": closed, "exit": exited, "left": left}
    finally:
        trainer.kill_session()


def sigkill(config: dict, folder: Path) -> dict[str, float]:
    trainer = TrainerProcess(config, folder)
    try:
        trainer.wait_for("step 3")
        workers = len(trainer.workers())
        trainer.proc.send_signal(signal.SIGKILL)
        trainer.proc.wait(60)
        return {"workers": workers, "orphans": len(trainer.session_left_after(5.0))}
    finally:
        trainer.kill_session()


def stuck_close(data: Path, tokenizer: Path) -> float:
    """Seconds ``close()`` takes after a loop error while a transform worker sleeps in doc150 (one shard, in order)."""
    from zephon_loader.nodes.source import ZephonSource

    pipeline = zephon_pipeline({**loader_config(data, tokenizer), "shuffle": False}, transform=StallFrom(150))
    source = ZephonSource(pipeline)
    reader = threading.Thread(target=lambda: (source.reset(), source.next(), source.next()), daemon=True)
    reader.start()
    reader.join(120.0)
    if reader.is_alive():
        source.cancel()
        reader.join(60.0)
        source.close()
        raise RuntimeError("no two batches within 120 s")
    time.sleep(1.0)
    started = time.monotonic()
    try:
        with source:
            raise RuntimeError("error in the loop body")
    except RuntimeError:
        pass
    return time.monotonic() - started


def bad_record(data: Path, tokenizer: Path) -> tuple[float, float]:
    """Seconds from ``iter()`` to the bad record's error in the loop, then ``close()`` seconds."""
    from zephon_loader import build_text_loader

    loader = build_text_loader(loader_config(data, tokenizer))
    started = time.monotonic()
    try:
        for _ in loader:
            pass
    except Exception:
        raised = time.monotonic() - started
    else:
        loader.close()
        raise RuntimeError("the bad record raised nothing")
    started = time.monotonic()
    loader.close()
    return raised, time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--documents", type=int, default=400, help="documents in the corpus (at least 200)")
    args = parser.parse_args()
    if args.repeats < 1 or args.documents < 200:
        parser.error("--repeats: expected >= 1; --documents: expected >= 200")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="bench_process_runner_") as scratch:
        root = Path(scratch)
        texts = make_texts(args.documents, seed=0)
        tokenizer = train_tokenizer(texts, root / "tokenizer")
        data = write_jsonl_shards(root / "data", [{"text": t} for t in texts], shards=4)
        one_shard = write_jsonl_shards(root / "one_shard", [{"text": t} for t in texts], shards=1)
        bad = [{"text": t} for t in texts[:100]]
        bad[60] = {"text": 42}
        bad_data = write_jsonl_shards(root / "bad", bad, shards=1)
        config = loader_config(data, tokenizer)
        rows: list[dict[str, float]] = []
        for repeat in range(args.repeats):
            row = ctrl_c(config, root)
            row.update({f"kill_{k}": v for k, v in sigkill(config, root).items()})
            row["stuck_close"] = stuck_close(one_shard, tokenizer)
            row["bad_raised"], row["bad_close"] = bad_record(bad_data, tokenizer)
            rows.append(row)
            print(
                f"[{repeat}] first batch {row['first']:.2f} s | Ctrl-C: {row['survived']:.0f}/{row['workers']:.0f} "
                f"workers survived it, close {row['close']:.2f} s, exit {row['exit']:.2f} s, left {row['left']:.0f} | "
                f"SIGKILL: orphans after 5 s {row['kill_orphans']:.0f}/{row['kill_workers']:.0f} | "
                f"stuck worker: close {row['stuck_close']:.2f} s | bad record: raised after {row['bad_raised']:.2f} s, "
                f"close {row['bad_close']:.2f} s",
                flush=True,
            )
        print("median:", ", ".join(f"{key} {statistics.median(r[key] for r in rows):.2f}" for key in rows[0]))
        print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
