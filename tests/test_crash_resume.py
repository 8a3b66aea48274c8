"""SIGKILL a training-like process at random steps, resume from its last atomic checkpoint: nothing lost or repeated.

The harness (``crash_harness.py``) and the trainer (``crash_worker.py``) are
shared with ``benchmarks/bench_crash_resume.py``, which runs many more trials.
"""

from __future__ import annotations

import pytest

from crash_harness import compare, loader_config, make_corpus, reference_digests, run_trial

SAVE_EVERY = 7


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("crash_corpus"), documents=400)


@pytest.mark.parametrize(
    ("runner", "read_ahead", "kills"),
    [
        ("threads", 0, 2),
        ("threads", 2, 2),
        # A process-runner worker start costs seconds more (Zephon's worker processes): one kill, the
        # default read-ahead only (read-ahead does not depend on the runner). The benchmark runs more.
        ("process", 2, 1),
    ],
)
def test_sigkill_and_resume_loses_and_repeats_nothing(corpus, tmp_path, runner, read_ahead, kills):
    config = loader_config(corpus, runner=runner, read_ahead=read_ahead)
    reference = reference_digests(config)
    assert len(reference) > 4 * SAVE_EVERY
    result = run_trial(
        config, tmp_path, reference, kills=kills, save_every=SAVE_EVERY, seed=read_ahead, step_seconds=0.003,
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
