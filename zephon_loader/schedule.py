"""Mixture schedules: weights that change at exact steps or token counts (``mixture: {schedule: [...]}``).

Each phase of a schedule is its own Zephon pipeline over the same sources and lanes, with the phase's weights
and seed (:func:`phase_seed`) and its own aggregation run id, read endlessly; the source
(:class:`~zephon_loader.nodes.source.ZephonSource` with a :class:`~zephon_loader.nodes.source.PhasePlan`)
delivers ``lengths[k]`` batches of every lane from phase ``k``'s pipeline, then switches to phase ``k + 1``'s,
from its start. A boundary is a batch count per lane, so it is the same on every rank and at every DP size:

* ``until_steps: N``: the phase ends after ``N`` batches of each lane from the start of the stream (the step
  when each rank reads one lane);
* ``until_tokens: T``: after ``ceil(T / (lanes * B * S))`` of them, the first step whose token slots
  (``lanes * B * S`` per step, padding included) reach ``T``.

A state records the phase and each lane's batches in it; its fingerprint holds the phases up to the current one
(:func:`schedule_fingerprint`), so a resume refuses a changed past or current phase and takes a changed future
one at its boundary.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Sequence

from zephon_loader.config.schema import MixturePhase

__all__ = ["phase_ends", "phase_lengths", "phase_run_id_suffix", "phase_seed", "schedule_fingerprint"]


def phase_ends(schedule: Sequence[MixturePhase], *, lanes: int, micro_batch_size: int,
               sequence_length: int) -> list[int | None]:
    """Per phase, the batches of each lane from the start of the stream at which it ends (``None``: the last).

    Raises:
        ValueError: Two token boundaries that fall on the same step (naming both phases).
    """
    per_step = lanes * micro_batch_size * sequence_length
    ends: list[int | None] = []
    for index, phase in enumerate(schedule):
        if phase.until_steps is not None:
            end: int | None = int(phase.until_steps)
        elif phase.until_tokens is not None:
            end = max(1, math.ceil(phase.until_tokens / per_step))
        else:
            end = None
        previous = ends[-1] if ends else 0
        if end is not None and end <= previous:  # until_tokens closer than one step apart
            raise ValueError(
                f"dataloader.mixture.schedule[{index}].until_tokens: got {phase.until_tokens:g}, which ends at step "
                f"{end}, as the phase before it does ({lanes} lanes x {micro_batch_size} x {sequence_length} = "
                f"{per_step} tokens a step); expected each phase to last at least one step")
        ends.append(end)
    return ends


def phase_lengths(ends: Sequence[int | None]) -> list[int | None]:
    """Batches of each lane per phase (``None`` for the last) from :func:`phase_ends`."""
    lengths: list[int | None] = []
    previous = 0
    for end in ends:
        lengths.append(None if end is None else end - previous)
        previous = end if end is not None else previous
    return lengths


def phase_seed(seed: int, phase: int) -> int:
    """The shuffle seed of phase ``phase``: ``seed`` for phase 0, then a hash of ``(seed, phase)``."""
    if phase == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"zephon_loader.phase:{seed}:{phase}".encode()).digest()[:4], "big")


def phase_run_id_suffix(phase: int) -> str:
    """Suffix of the aggregation run id per phase: a phase's rounds never meet another's files."""
    return "" if phase == 0 else f".phase{phase}"


def schedule_fingerprint(schedule: Sequence[MixturePhase], ends: Sequence[int | None]) -> list[dict[str, Any]]:
    """The fingerprint's ``schedule``: per phase its weights and its end in batches of each lane."""
    return [{"weights": {name: float(weight) for name, weight in sorted(phase.weights.items())}, "until_steps": end}
            for phase, end in zip(schedule, ends, strict=True)]
