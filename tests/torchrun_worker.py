"""Worker for test_distributed.py: run by ``torchrun --nproc_per_node 2`` on loopback (gloo).

Each rank builds its loader with no data-parallel arguments and no
``distributed`` section: the builder takes rank and size from the initialized
process group, Zephon's ``torch://`` aggregate store and a run id derived from
the config. It takes ``state_dict()`` after 3 batches (a collective), finishes
the pass, then resumes a fresh loader from the state and checks the remainder
is identical. Exit code 0 = exact.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import yaml

from zephon_loader import fields as F
from zephon_loader.build import build_text_loader
from zephon_loader.config import default_config_path


def main() -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = yaml.safe_load(default_config_path().read_text())["dataloader"]
    node.pop("_target_")
    node.update(
        base_dir=str(default_config_path().parent),
        runtime={"runner": "threads"},
        sequence_length=128,
    )
    with build_text_loader(node) as loader:  # DP coordinates from torch.distributed
        options = loader.pipeline._options
        assert (options.global_rank, options.world_size, options.aggregate_store) == (rank, world, "torch://"), options
        assert options.run_id.startswith("zephon_loader-"), options.run_id
        it = iter(loader)
        head = [next(it)[F.INPUT_IDS] for _ in range(3)]
        state = loader.state_dict()
        rest = [batch[F.INPUT_IDS] for batch in it]
    with build_text_loader(node) as loader:
        loader.load_state_dict(state)
        again = [batch[F.INPUT_IDS] for batch in loader]
    exact = len(rest) == len(again) and all(torch.equal(a, b) for a, b in zip(rest, again))
    gathered = [None] * world
    dist.all_gather_object(gathered, torch.cat([b.flatten() for b in head]).tolist())
    distinct = rank != 0 or gathered[0] != gathered[1]
    print(f"rank {rank}: {len(rest)} batches after the state, resume exact: {exact}, lanes distinct: {distinct}")
    dist.destroy_process_group()
    return 0 if exact and distinct and rest else 1


if __name__ == "__main__":
    sys.exit(main())
