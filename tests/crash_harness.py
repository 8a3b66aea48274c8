"""Crash/resume harness: SIGKILL a training-like process at random steps, resume, compare with an uninterrupted run.

Shared by ``tests/test_crash_resume.py`` (short) and
``benchmarks/bench_crash_resume.py`` (long); the trainer is
``tests/crash_worker.py``.

One trial:

1. The reference: the same loader configuration iterated uninterrupted in
   this process, one :func:`crash_worker.batch_digest` per batch.
2. Start the worker from scratch (its own process group). Pick a random
   step ahead of the last checkpoint, watch the consumed log grow and
   SIGKILL the worker a random few milliseconds after that step is logged,
   at whatever instant that is (mid-batch, mid-log-write, mid-checkpoint).
   Processes of its group (Zephon ``process`` runner workers) still alive a
   grace period later are counted as orphans and SIGKILLed.
3. Truncate the consumed log to the step of the last checkpoint (the
   atomically saved ``{"step", "loader"}``) and start the worker again; it
   resumes with ``loader.load_state_dict``. Repeat until ``kills`` kills
   landed, then let the last run reach the end of the stream.
4. Compare the log with the reference: lost batches (in the reference, missing
   from the log), repeated batches (extra in the log) and the first position
   where the order differs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crash_worker import LINE_BYTES, batch_digest, load_checkpoint, temporary_path

WORKER = Path(__file__).with_name("crash_worker.py")
#: How often the driver looks at the consumed log while waiting for the kill step.
POLL_SECONDS = 0.002


def make_corpus(root: Path, *, documents: int = 600, seed: int = 11) -> dict[str, Any]:
    """Write two JSONL sources and a locally trained tokenizer under ``root``; returns the base loader mapping.

    ``documents`` texts of 1-60 words split 2:1 between sources ``web`` (3
    shards) and ``code`` (2 shards), mixed 2:1 by weight, packed with ``wrap``
    into ``B=2`` rows of ``S=32`` tokens with the FA4 contract (document ids
    and packed-sequence metadata in every batch): about one batch per two
    documents.
    """
    from conftest import make_texts, train_tokenizer, write_jsonl_shards

    texts = make_texts(documents, seed=seed, max_words=60)
    split = 2 * documents // 3
    tokenizer = train_tokenizer(texts, root / "tokenizer")
    web = write_jsonl_shards(root / "web", [{"text": t} for t in texts[:split]], shards=3)
    code = write_jsonl_shards(root / "code", [{"text": t} for t in texts[split:]], shards=2)
    return {
        "sources": [
            {"name": "web", "path": str(web), "weight": 2.0},
            {"name": "code", "path": str(code), "weight": 1.0},
        ],
        "tokenizer": {"path": str(tokenizer)},
        "sequence_length": 32,
        "micro_batch_size": 2,
        "packing": {"algorithm": "wrap"},
        "contract": {"attn_implementation": "fa4"},
        "seed": seed,
    }


def loader_config(base: Mapping[str, Any], *, runner: str, read_ahead: int, max_workers: int | None = None) -> dict:
    """``base`` with Zephon's ``runner`` (``threads``/``process``/``inline``) and the loader's ``read_ahead``."""
    runtime: dict[str, Any] = {"runner": runner}
    if max_workers is not None:
        runtime["max_workers"] = max_workers
    return {**base, "read_ahead": read_ahead, "runtime": runtime}


def reference_digests(config: Mapping[str, Any]) -> list[str]:
    """One digest per batch of an uninterrupted pass of the loader ``config`` builds (in this process)."""
    from zephon_loader import build_text_loader

    with build_text_loader(dict(config)) as loader:
        return [batch_digest(batch) for batch in loader]


def read_log(path: Path) -> list[str]:
    """The digests of a consumed log, checking every line is complete and numbered ``1, 2, ...`` in order.

    Raises:
        ValueError: A torn line or a step out of sequence (names the line).
    """
    data = path.read_bytes() if path.exists() else b""
    if len(data) % LINE_BYTES:
        raise ValueError(f"{path}: {len(data)} bytes, expected a multiple of {LINE_BYTES} (a torn last line)")
    digests = []
    for index in range(len(data) // LINE_BYTES):
        line = data[index * LINE_BYTES : (index + 1) * LINE_BYTES].decode()
        step, digest = line.rstrip("\n").split(" ")
        if int(step) != index + 1:
            raise ValueError(f"{path}:{index + 1}: step {step}, expected {index + 1}")
        digests.append(digest)
    return digests


@dataclass(frozen=True)
class Comparison:
    """A consumed stream against the reference.

    Attributes:
        batches: Reference length.
        consumed: Consumed length.
        lost: Reference batches missing from the consumed stream (multiset difference).
        repeated: Consumed batches beyond the reference's count of them.
        first_divergence: First index where the two differ (``None``: identical).
    """

    batches: int
    consumed: int
    lost: int
    repeated: int
    first_divergence: int | None

    @property
    def exact(self) -> bool:
        return self.first_divergence is None


def compare(reference: Sequence[str], consumed: Sequence[str]) -> Comparison:
    """Lost, repeated and first out-of-order position of ``consumed`` against ``reference``."""
    want, got = Counter(reference), Counter(consumed)
    first = next((i for i, (a, b) in enumerate(zip(reference, consumed)) if a != b), None)
    if first is None and len(reference) != len(consumed):
        first = min(len(reference), len(consumed))
    return Comparison(
        batches=len(reference),
        consumed=len(consumed),
        lost=sum((want - got).values()),
        repeated=sum((got - want).values()),
        first_divergence=first,
    )


@dataclass(frozen=True)
class TrialResult:
    """One trial: what happened and how the consumed stream compares.

    Attributes:
        runs: Worker processes started.
        kills: SIGKILLs that landed on a live worker.
        mid_save_kills: Kills that landed while a checkpoint was being written
            (its temporary file was left behind; the previous checkpoint was used).
        resumes: Runs that started from a saved checkpoint.
        redone: Logged steps rolled back to a checkpoint (consumed again after resuming).
        orphans: Processes of a worker's group still alive ``orphan_grace_s`` after
            the worker died (killed or exited), then SIGKILLed by the harness.
        comparison: The consumed stream against the reference.
        seconds: Wall time of the trial.
    """

    runs: int
    kills: int
    mid_save_kills: int
    resumes: int
    redone: int
    orphans: int
    comparison: Comparison
    seconds: float


def run_trial(
    config: Mapping[str, Any],
    workdir: Path,
    reference: Sequence[str],
    *,
    kills: int,
    save_every: int,
    seed: int,
    step_seconds: float = 0.0,
    kill_jitter_s: float = 0.02,
    run_timeout_s: float = 300.0,
    orphan_grace_s: float = 10.0,
) -> TrialResult:
    """Kill the worker ``kills`` times at random steps, resume each time, then let it finish; compare.

    Kill steps are drawn uniformly between the step after the last checkpoint
    and ``len(reference) - save_every`` (so the kill usually lands before the
    stream ends); once the driver sees that step logged it waits a random
    ``0..kill_jitter_s`` more, so kills fall anywhere in the step cycle
    (batch, log write, checkpoint write).

    Processes of a worker's group (Zephon ``process`` runner workers) get
    ``orphan_grace_s`` after the worker died to exit on their own; those still
    alive then are counted as orphans and SIGKILLed.

    Raises:
        RuntimeError: A worker failed on its own or ran past ``run_timeout_s``
            (its stderr tail is included).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    config_path, state_path, log_path = workdir / "config.json", workdir / "state.pt", workdir / "consumed.log"
    for path in (state_path, log_path):
        path.unlink(missing_ok=True)
    config_path.write_text(json.dumps(dict(config)))
    rng = random.Random(seed)
    total = len(reference)
    runs = landed = mid_save = resumes = redone = orphans = 0
    start = time.perf_counter()
    while True:
        checkpoint = load_checkpoint(state_path)
        step = 0 if checkpoint is None else int(checkpoint["step"])
        logged = log_path.stat().st_size // LINE_BYTES if log_path.exists() else 0
        redone += max(0, logged - step)
        _truncate(log_path, step * LINE_BYTES)
        resumes += checkpoint is not None
        kill_at = rng.randint(step + 1, max(step + 1, total - save_every)) if landed < kills else None
        delay = rng.uniform(0.0, kill_jitter_s)
        runs += 1
        killed, stray = _run_worker(
            config_path, state_path, log_path, workdir / f"run{runs}.stderr",
            save_every=save_every, step_seconds=step_seconds, kill_at=kill_at, kill_delay_s=delay,
            timeout_s=run_timeout_s, orphan_grace_s=orphan_grace_s,
        )
        orphans += stray
        if not killed:
            break
        landed += 1
        if temporary_path(state_path).exists():
            mid_save += 1
            temporary_path(state_path).unlink()
    return TrialResult(
        runs=runs,
        kills=landed,
        mid_save_kills=mid_save,
        resumes=resumes,
        redone=redone,
        orphans=orphans,
        comparison=compare(reference, read_log(log_path)),
        seconds=time.perf_counter() - start,
    )


def _truncate(path: Path, size: int) -> None:
    """Cut the consumed log back to ``size`` bytes (the checkpoint's steps); it must hold at least that many."""
    if not path.exists():
        if size:
            raise RuntimeError(f"{path}: missing, expected at least {size} bytes (the checkpoint's steps)")
        return
    if path.stat().st_size < size:
        raise RuntimeError(
            f"{path}: {path.stat().st_size} bytes, expected at least {size}: the checkpoint is ahead of the log "
            "(the worker must fsync each log line before checkpointing)"
        )
    os.truncate(path, size)


def _run_worker(
    config_path: Path, state_path: Path, log_path: Path, stderr_path: Path, *,
    save_every: int, step_seconds: float, kill_at: int | None, kill_delay_s: float, timeout_s: float,
    orphan_grace_s: float,
) -> tuple[bool, int]:
    """Run the worker; SIGKILL it ``kill_delay_s`` after step ``kill_at`` is logged. Returns (killed, orphans)."""
    command = [
        sys.executable, str(WORKER), "--config", str(config_path), "--state", str(state_path),
        "--log", str(log_path), "--save-every", str(save_every), "--step-seconds", str(step_seconds),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with stderr_path.open("wb") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    killed = False
    try:
        while process.poll() is None:
            if kill_at is not None and log_path.exists() and log_path.stat().st_size >= kill_at * LINE_BYTES:
                time.sleep(kill_delay_s)
                process.send_signal(signal.SIGKILL)
                killed = process.wait() == -signal.SIGKILL
                break
            if time.monotonic() > deadline:
                process.send_signal(signal.SIGKILL)
                process.wait()
                raise RuntimeError(f"crash worker ran past {timeout_s:.0f} s:\n{_tail(stderr_path)}")
            time.sleep(POLL_SECONDS)
    finally:
        if process.poll() is None:  # interrupted: never leave the worker running
            process.send_signal(signal.SIGKILL)
            process.wait()
        stray = _reap_group(process.pid, orphan_grace_s)
    if not killed and process.returncode != 0:
        raise RuntimeError(f"crash worker exited with status {process.returncode}:\n{_tail(stderr_path)}")
    return killed, stray


def _group_members(pgid: int) -> list[int]:
    """Live processes whose process group is ``pgid`` (from /proc; zombies excluded)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry))
    return members


def _reap_group(pgid: int, grace_s: float, timeout_s: float = 30.0) -> int:
    """Give what is left of the worker's process group ``grace_s`` to exit on its own, then SIGKILL it.

    Returns how many processes were still alive after the grace period (orphans).
    """
    deadline = time.monotonic() + grace_s
    while _group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _group_members(pgid)
    if left:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout_s
        while _group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
    return len(left)


def _tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:]
