"""Data-parallel training loop skeleton on the bundled demo: ``torchrun --nproc_per_node N examples/distributed.py``.

Each rank builds its loader with no data-parallel arguments: the builder takes
rank and size from the initialized process group, Zephon's ``torch://``
aggregation store and a run id derived from the configuration. Each rank reads
its own lane(s). The loop saves every rank's state at step ``--save-at`` (a
collective: all ranks at the same step), and with ``--resume DIR`` continues
from such a state, also at another number of ranks (``canonical_replicas``
divisible by both). ``--state-scope rank``: each rank's state holds its own
lanes (``distributed.state_scope: rank``), and a resume reads every rank's file.
A resume at another number of ranks says once that the rest of the pass comes
in another order than an uninterrupted run's when the lanes were out of step
where the state was cut (usually: the ranks' read-ahead anchors differ); every
row still comes exactly once (docs/distributed.md, "What a resume guarantees").

    torchrun --nproc_per_node 2 examples/distributed.py --steps 20 --save-at 10 --out /tmp/zl
    torchrun --nproc_per_node 1 examples/distributed.py --resume /tmp/zl --steps 10
    torchrun --nproc_per_node 4 examples/distributed.py --state-scope rank --steps 20 --save-at 10 --out /tmp/zr
    torchrun --nproc_per_node 2 examples/distributed.py --state-scope rank --resume /tmp/zr --steps 10
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch.distributed as dist

from zephon_loader import build_text_loader
from zephon_loader.config import default_config_path, read_loader_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-at", type=int, default=None, help="save every rank's loader state after this step")
    parser.add_argument("--out", type=Path, default=Path("loader-states"))
    parser.add_argument("--resume", type=Path, default=None, help="folder of states saved by --save-at")
    parser.add_argument("--state-scope", choices=("job", "rank"), default="job",
                        help="distributed.state_scope: every lane in each rank's state (job), or its own lanes (rank)")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # "nccl" on GPUs; the loader only needs the default group
    rank = dist.get_rank()
    # canonical_replicas 4: resumable at 1, 2 or 4 data-parallel ranks.
    config = read_loader_config(default_config_path())
    distributed = type(config.distributed)(canonical_replicas=4, state_scope=args.state_scope)
    config = type(config)(**{**config.__dict__, "distributed": distributed})
    with build_text_loader(config) as loader:
        if args.resume is not None and args.state_scope == "rank":
            loader.load_state(str(args.resume / "rank*.json"))  # every rank's file: this rank keeps its lanes
        elif args.resume is not None:
            # Every rank's state is the same, and holds every lane's position: a rank of a new size loads any of them.
            saved = args.resume / f"rank{rank % len(list(args.resume.glob('rank*.json')))}.json"
            loader.load_state(saved)
        tokens = 0
        for step, batch in enumerate(loader, start=1):
            tokens += int((~batch["padding_mask"]).sum())  # model step here
            if step == args.save_at:
                # job: a collective; rank: this rank's lanes, no collective. Atomic (tmp, fsync, rename).
                loader.save_state(args.out / f"rank{rank}.json")
            if step == args.steps:
                break
        print(f"rank {rank}/{loader.dp_world_size}: {step} batches, {tokens} tokens, epoch {loader.epoch}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
