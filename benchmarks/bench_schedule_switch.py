"""What a mixture schedule's phase switch costs: the time of the batch at a boundary vs the others.

The bundled demo (2 sources, S=256, B=4) read as an endless stream with a schedule that switches every
``--every`` steps, alternating weights 2:1 and 1:2; per ``next()`` wall time, read_ahead 0 and 2. The batch after
a boundary waits for the new phase's Zephon pipeline to start (workers, first chunks read, tokenized, packed).

    python benchmarks/bench_schedule_switch.py [--every 25] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

from zephon_loader.build import build_text_loader
from zephon_loader.config import read_loader_config
from zephon_loader.config.schema import default_config_path


def run(every: int, steps: int, read_ahead: int) -> tuple[list[float], list[float]]:
    cfg = read_loader_config(str(default_config_path()))
    weights = [{"stories": 2.0, "notes": 1.0}, {"stories": 1.0, "notes": 2.0}]
    phases = [{"until_steps": end, "weights": weights[i % 2]} for i, end in enumerate(range(every, steps, every))]
    schedule = {"schedule": phases + [{"weights": weights[len(phases) % 2]}]}
    import dataclasses

    from zephon_loader.config.reader import _convert
    from zephon_loader.config.schema import MixtureSchedule

    cfg = dataclasses.replace(cfg, mixture=_convert(schedule, MixtureSchedule, "mixture"), passes=None,
                              read_ahead=read_ahead)
    boundary, other = [], []
    with build_text_loader(cfg) as loader:
        it = iter(loader)
        next(it)  # the first batch (pipeline start) is not a switch
        for step in range(2, steps + 1):
            started = time.perf_counter()
            next(it)
            (boundary if (step - 1) % every == 0 else other).append(time.perf_counter() - started)
    return boundary, other


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    for read_ahead in (0, 2):
        boundary, other = run(args.every, args.steps, read_ahead)
        print(f"read_ahead={read_ahead}: boundary batch median {statistics.median(boundary) * 1e3:.1f} ms "
              f"(n={len(boundary)}, max {max(boundary) * 1e3:.1f}), other batches median "
              f"{statistics.median(other) * 1e3:.2f} ms (n={len(other)}, mean {statistics.mean(other) * 1e3:.2f})")


if __name__ == "__main__":
    main()
