"""Zephon's ``process`` runner shuts down with the loader (``zephon_loader.nodes.workers``).

* A SIGKILLed trainer leaves no worker behind (they used to live on forever).
* Ctrl-C (SIGINT to the process group): the workers ignore it, the
  ``KeyboardInterrupt`` reaches the training loop, ``close()`` ends every
  worker and returns promptly.
* ``close()`` after an error in the loop body returns within a few seconds
  even while a worker is stuck in an operator (it used to wait Zephon's 5 s
  drain, 10 s join and 5 s terminate timeouts); an error from the pipeline (a
  bad record) reaches the loop and ``close()`` leaves no worker.
* Workers are forked from a fork server that preloaded Zephon and torch, with
  the environment of the moment they start (as spawned ones would).

Measured figures (first batch, ``close()``, exits, orphans, before and after)
are printed by ``benchmarks/bench_process_runner.py``; the bounds asserted here
only catch hangs and the old timeouts. Linux only (``/proc``, pidfds).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import write_jsonl_shards, zephon_pipeline
from process_trainer import StallFrom, TrainerProcess, exit_zero_if_environ, loader_config

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc and pidfds")

#: Generous bound on ``close()`` (measured 1.3-1.6 s idle, 3.6 s with a load of 12 on 2 cores).
CLOSE_BOUND_S = 10.0


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory, corpus_texts: list[str]) -> Path:
    return write_jsonl_shards(tmp_path_factory.mktemp("process_text"), [{"text": t} for t in corpus_texts], shards=2)


def test_sigkilled_trainer_leaves_no_worker(text_dir: Path, tokenizer_dir: Path, tmp_path: Path) -> None:
    trainer = TrainerProcess(loader_config(text_dir, tokenizer_dir), tmp_path)
    try:
        trainer.wait_for("step 2")
        workers = trainer.workers()
        assert workers, "the process runner started no worker process"
        trainer.proc.send_signal(signal.SIGKILL)
        assert trainer.proc.wait(30) == -signal.SIGKILL
        left = trainer.session_left_after(10.0)
        assert not left, f"processes left 10 s after the trainer was SIGKILLed: {left}"
    finally:
        trainer.kill_session()


def test_ctrl_c_reaches_the_loop_and_close_ends_every_worker(text_dir: Path, tokenizer_dir: Path, tmp_path: Path) -> None:
    trainer = TrainerProcess(loader_config(text_dir, tokenizer_dir), tmp_path)
    try:
        trainer.wait_for("step 2")
        workers = trainer.workers()
        os.killpg(trainer.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        trainer.wait_for("interrupted", timeout=CLOSE_BOUND_S)
        alive = int(trainer.wait_for("alive").split()[1])
        assert alive == len(workers), f"{len(workers) - alive} of {len(workers)} workers died of the SIGINT"
        closed = float(trainer.wait_for("closed", timeout=CLOSE_BOUND_S).split()[1])
        assert closed < CLOSE_BOUND_S
        assert trainer.wait_for("left") == "left 0"
        assert trainer.proc.wait(30) == 0
        left = trainer.session_left_after(5.0)
        assert not left, f"processes left 5 s after the trainer exited: {left}"
    finally:
        trainer.kill_session()


def test_close_after_a_loop_error_with_a_stuck_worker(tmp_path: Path, corpus_texts: list[str], tokenizer_dir: Path) -> None:
    from zephon_loader.nodes.source import ZephonSource

    # One shard, no shuffle: records reach the transform in order, in Zephon's fetch
    # microbatches of 64, so doc150 (third microbatch) stalls after the first batches.
    data = write_jsonl_shards(tmp_path / "one_shard", [{"text": t} for t in corpus_texts], shards=1)
    pipeline = zephon_pipeline(
        {"sources": [{"name": "web", "path": str(data)}], "sequence_length": 32, "micro_batch_size": 2,
         "tokenizer": {"path": str(tokenizer_dir)}, "packing": {"algorithm": "wrap"}, "shuffle": False,
         "runtime": {"runner": "process"}},
        transform=StallFrom(150),
    )
    source = ZephonSource(pipeline)
    contained = pipeline._options.mp_context

    def read_two() -> None:
        source.reset()
        source.next()
        source.next()

    reader = threading.Thread(target=read_two, daemon=True)  # a test that cannot hang if the stall came early
    reader.start()
    reader.join(60.0)
    try:
        assert not reader.is_alive(), "no two batches within 60 s"
        time.sleep(1.0)  # Zephon reads ahead: a transform worker is inside doc150 by now
        assert contained.live_pids()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="loop body"):
            with source:
                raise RuntimeError("error in the loop body")
        took = time.monotonic() - started
    finally:
        if reader.is_alive():
            source.cancel()
            reader.join(30.0)
        source.close()
    assert took < CLOSE_BOUND_S, f"close() took {took:.1f} s"
    assert contained.live_pids() == []


def test_cancel_unblocks_a_reader_waiting_in_zephon(text_dir: Path, tokenizer_dir: Path) -> None:
    from zephon_loader.nodes.source import ZephonSource

    pipeline = zephon_pipeline(
        {"sources": [{"name": "web", "path": str(text_dir)}], "sequence_length": 32, "micro_batch_size": 2,
         "tokenizer": {"path": str(tokenizer_dir)}, "runtime": {"runner": "process"}},
        transform=StallFrom(0),  # no batch ever comes
    )
    source = ZephonSource(pipeline)
    contained = pipeline._options.mp_context
    ended: list[str] = []

    def read() -> None:
        source.reset()
        try:
            source.next()
            ended.append("a batch")
        except BaseException as error:  # StopIteration or Zephon's error: either ends the wait
            ended.append(type(error).__name__)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60.0
        while not contained.live_pids():  # the engine is built and its workers started
            assert time.monotonic() < deadline, "no worker started within 60 s"
            time.sleep(0.05)
        started = time.monotonic()
        source.cancel()
        reader.join(CLOSE_BOUND_S)
        assert not reader.is_alive(), f"next() still blocked {CLOSE_BOUND_S} s after cancel()"
        assert ended and ended != ["a batch"]
        assert time.monotonic() - started < CLOSE_BOUND_S
    finally:
        source.close()
    assert contained.live_pids() == []


def test_bad_record_error_reaches_the_loop_and_close_leaves_no_worker(
    tmp_path: Path, corpus_texts: list[str], tokenizer_dir: Path
) -> None:
    from zephon_loader import build_text_loader
    from zephon_loader.errors import BadRecordError

    records: list[dict[str, Any]] = [{"text": t} for t in corpus_texts[:60]]
    records[30] = {"text": 42}
    data = write_jsonl_shards(tmp_path / "bad", records, shards=1)
    loader = build_text_loader(loader_config(data, tokenizer_dir))
    contained = loader.pipeline._options.mp_context
    try:
        # The same exception type as under the thread runner (not Zephon's WorkerCrashed wrapper).
        with pytest.raises(BadRecordError, match=r"^source 'web', shard .*part-00000\.jsonl, line 31: field 'text'"):
            for _ in loader:
                pass
        started = time.monotonic()
    finally:
        loader.close()
    assert time.monotonic() - started < CLOSE_BOUND_S
    assert contained.live_pids() == []


def _ignores_sigint(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as handle:
        mask = next(int(line.split()[1], 16) for line in handle if line.startswith("SigIgn:"))
    return bool(mask >> (signal.SIGINT - 1) & 1)


def test_contained_workers_ignore_sigint_and_die_after_the_grace_period() -> None:
    from zephon_loader.nodes.workers import WorkerContext

    context = WorkerContext("forkserver", grace_s=0.2)
    process = context.Process(target=time.sleep, args=(120.0,), daemon=True)
    process.start()
    try:
        assert context.live_pids() == [process.pid]
        deadline = time.monotonic() + 10.0
        while not _ignores_sigint(process.pid):  # the worker reached its run()
            assert time.monotonic() < deadline, "the worker never set SIGINT to ignored"
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGINT)
        process.join(0.5)
        assert process.is_alive(), "a contained worker died of SIGINT"
        started = time.monotonic()
        context.shut_down()
        process.join(5.0)
        assert process.exitcode == -signal.SIGKILL
        assert time.monotonic() - started < 3.0
        assert context.kill() == []
    finally:
        if process.is_alive():
            process.kill()
            process.join()


def test_fork_server_workers_get_the_environment_of_their_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from zephon_loader.nodes.workers import WorkerContext

    context = WorkerContext("forkserver")
    name = "ZEPHON_LOADER_TEST_PROBE"
    for value in ("before", "after"):  # the first start may start the fork server; the second never does
        monkeypatch.setenv(name, value)
        process = context.Process(target=exit_zero_if_environ, args=(name, value), daemon=True)
        process.start()
        process.join(30.0)
        assert process.exitcode == 0, f"the worker did not see {name}={value!r}"


def test_pipelines_get_a_contained_fork_server_context(text_dir: Path, tokenizer_dir: Path) -> None:
    from zephon_loader.nodes.source import ZephonSource
    from zephon_loader.nodes.workers import WorkerContext

    def pipeline(**runtime: Any) -> Any:
        return zephon_pipeline(
            {"sources": [{"name": "web", "path": str(text_dir)}], "sequence_length": 32, "micro_batch_size": 2,
             "tokenizer": {"path": str(tokenizer_dir)}, "runtime": runtime},
        )

    process = ZephonSource(pipeline(runner="process")).pipeline._options
    assert isinstance(process.mp_context, WorkerContext)
    assert process.mp_context.get_start_method() == "forkserver"
    assert process.shutdown_mode == "hard"
    threads = ZephonSource(pipeline()).pipeline._options
    assert isinstance(threads.mp_context, WorkerContext)
    assert threads.shutdown_mode == "graceful"  # "hard" would leave Zephon's threads running after close()
    # A start method the user set on the pipeline (Zephon's own option) is kept, in a contained context.
    spawn = ZephonSource(pipeline(runner="process").options(mp_context="spawn")).pipeline._options
    assert spawn.mp_context.get_start_method() == "spawn"

    copy = pickle.loads(pickle.dumps(process.mp_context))  # Zephon's mtp_mode pickles its options
    assert (copy.get_start_method(), copy.grace_s, copy.live_pids()) == ("forkserver", process.mp_context.grace_s, [])
