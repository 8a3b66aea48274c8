"""SIGKILL a training-like process at random steps, resume from its last atomic checkpoint: nothing lost or repeated.

The harness (``crash_harness.py``) and the trainer (``crash_worker.py``) are
shared with ``benchmarks/bench_crash_resume.py``, which runs many more trials.
"""

from __future__ import annotations

import pytest

from crash_harness import compare, loader_config, make_corpus, reference_digests, run_trial

KILLS = 3
SAVE_EVERY = 7


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("crash_corpus"), documents=400)


@pytest.mark.parametrize(
    "runner",
    [
        "threads",
        pytest.param(
            "process",
            marks=pytest.mark.skip(
                reason="Zephon's process runner spawns 13 workers that each import torch: 20-45 s to the first "
                "batch on 2 shared cores, about 110 s for one trial with one kill, over this file's one-minute "
                "budget (issue 9 part 5, process runner start-up/shutdown, is handled separately); run "
                "benchmarks/bench_crash_resume.py --runner process"
            ),
        ),
    ],
)
@pytest.mark.parametrize("read_ahead", [0, 2])
def test_sigkill_and_resume_loses_and_repeats_nothing(corpus, tmp_path, runner, read_ahead):
    config = loader_config(corpus, runner=runner, read_ahead=read_ahead)
    reference = reference_digests(config)
    assert len(reference) > 4 * SAVE_EVERY
    result = run_trial(
        config, tmp_path, reference, kills=KILLS, save_every=SAVE_EVERY, seed=read_ahead, step_seconds=0.003,
        run_timeout_s=120,
    )
    assert result.kills >= 1, result  # kill steps stop SAVE_EVERY short of the end, so they land
    consumed = result.comparison
    assert (consumed.lost, consumed.repeated, consumed.first_divergence) == (0, 0, None), result
    assert consumed.consumed == len(reference)
    assert result.orphans == 0, result


def test_compare_counts_lost_repeated_and_reordered():
    reference = ["a", "b", "c", "d"]
    assert compare(reference, reference).exact
    lost = compare(reference, ["a", "b", "d"])
    assert (lost.lost, lost.repeated, lost.first_divergence) == (1, 0, 2)
    repeated = compare(reference, ["a", "b", "b", "c", "d"])
    assert (repeated.lost, repeated.repeated, repeated.first_divergence) == (0, 1, 2)
    swapped = compare(reference, ["a", "c", "b", "d"])
    assert (swapped.lost, swapped.repeated, swapped.first_divergence) == (0, 0, 1)
    short = compare(reference, ["a", "b"])
    assert (short.lost, short.first_divergence) == (2, 2)
