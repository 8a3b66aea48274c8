"""Data-parallel coordinates: passed, or taken from torch.distributed, and checked before anything starts.

The two-rank run with coordinates from torch.distributed is ``test_distributed.py``'s torchrun test.
"""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from zephon_loader import build_text_loader
from zephon_loader.build import data_parallel
from zephon_loader.config import text_loader_config
from zephon_loader.pipeline.text import DataParallel


def _config(jsonl_sources, tokenizer_dir, **overrides):
    return {
        "sources": [{"name": "a", "path": str(jsonl_sources["a"])}],
        "tokenizer": {"path": str(tokenizer_dir)},
        "sequence_length": 32,
        "micro_batch_size": 2,
        "runtime": {"runner": "threads"},
        **overrides,
    }


def test_without_torch_distributed_it_is_one_rank(jsonl_sources, tokenizer_dir):
    assert not dist.is_initialized()
    cfg = text_loader_config(**_config(jsonl_sources, tokenizer_dir))
    assert data_parallel(cfg, None, None) == DataParallel(0, 1)
    dp = data_parallel(cfg, 1, 2)
    assert (dp.rank, dp.size, dp.aggregate_store) == (1, 2, None)


def test_an_initialized_process_group_gives_rank_size_store_and_run_id(jsonl_sources, tokenizer_dir, tmp_path):
    cfg = text_loader_config(**_config(jsonl_sources, tokenizer_dir))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert data_parallel(cfg, None, None) == DataParallel(0, 1)  # one rank: no store needed
        with build_text_loader(cfg) as loader:
            assert next(iter(loader))["input_ids"].shape == (2, 32)
    finally:
        dist.destroy_process_group()


def test_run_id_is_derived_from_the_config_and_configured_values_win(jsonl_sources, tokenizer_dir, monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    cfg = text_loader_config(**_config(jsonl_sources, tokenizer_dir))
    dp = data_parallel(cfg, None, None)
    assert (dp.rank, dp.size, dp.aggregate_store) == (1, 4, "torch://")
    assert dp.run_id == data_parallel(cfg, None, None).run_id and dp.run_id.startswith("zephon_loader-")
    other = text_loader_config(**_config(jsonl_sources, tokenizer_dir, seed=5))
    assert data_parallel(other, None, None).run_id != dp.run_id  # another stream, another run id
    configured = text_loader_config(**_config(jsonl_sources, tokenizer_dir, distributed={
        "aggregate_dir": "/shared/agg", "run_id": "mine"}))
    assert data_parallel(configured, None, None) == DataParallel(1, 4, run_id=None)  # the YAML's settings are used


def test_explicit_coordinates_get_the_same_derived_run_id_on_every_rank(jsonl_sources, tokenizer_dir, tmp_path):
    """Zephon's own default run id names per-process folders: two ranks waited 180 s for each other."""
    cfg = text_loader_config(**_config(jsonl_sources, tokenizer_dir, distributed={"aggregate_dir": str(tmp_path)}))
    ranks = [data_parallel(cfg, rank, 2) for rank in (0, 1)]
    assert ranks[0].run_id == ranks[1].run_id and ranks[0].run_id.startswith("zephon_loader-")
    assert ranks[0].aggregate_store is None  # the YAML's aggregate_dir is used
    assert data_parallel(cfg, 0, 1).run_id is None  # one rank: nothing to meet


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dp_rank": 0}, r"dp_rank/dp_world_size: got 0/None, expected both or neither"),
        ({"dp_rank": 2, "dp_world_size": 2}, r"dp_rank: got 2, expected < dp_world_size \(2\)"),
        ({"dp_rank": -1, "dp_world_size": 2}, r"dp_rank: got -1"),
        ({"dp_rank": 0, "dp_world_size": 3}, r"canonical_replicas: got 4, expected a multiple of the data-parallel size 3"),
    ],
)
def test_bad_coordinates_are_refused_before_any_worker_starts(jsonl_sources, tokenizer_dir, tmp_path, kwargs, match):
    config = _config(jsonl_sources, tokenizer_dir,
                     distributed={"canonical_replicas": 4, "aggregate_dir": str(tmp_path)})
    threads = threading.active_count()
    with pytest.raises(ValueError, match=match):
        build_text_loader(config, **kwargs)
    assert threading.active_count() <= threads


def test_coordinates_from_a_process_group_or_a_device_mesh_dimension(jsonl_sources, tokenizer_dir, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    cfg = text_loader_config(**_config(jsonl_sources, tokenizer_dir))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        assert data_parallel(cfg, None, None, group) == DataParallel(0, 1)
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        assert data_parallel(cfg, None, None, mesh["dp"]) == DataParallel(0, 1)
        with pytest.raises(ValueError, match=r"dp_group: got a 2-D DeviceMesh, expected its data-parallel dimension"):
            data_parallel(cfg, None, None, mesh)
        with pytest.raises(ValueError, match=r"dp_group: got a group and dp_rank/dp_world_size"):
            data_parallel(cfg, 0, 1, group)
        with build_text_loader(cfg, dp_group=mesh["dp"]) as loader:
            assert (loader.dp_rank, loader.dp_world_size) == (0, 1)
    finally:
        dist.destroy_process_group()


def test_a_group_of_four_gives_its_rank_and_size(jsonl_sources, tokenizer_dir, monkeypatch):
    """The coordinates are the group's, not the world's (tensor-parallel peers share a data-parallel rank)."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 7 if group is None else 3)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8 if group is None else 4)
    cfg = text_loader_config(**_config(jsonl_sources, tokenizer_dir))
    dp = data_parallel(cfg, None, None, object())
    assert (dp.rank, dp.size, dp.aggregate_store) == (3, 4, "torch://")


def test_a_loader_built_before_the_process_group_refuses_to_run_under_several_ranks(jsonl_sources, tokenizer_dir,
                                                                                     monkeypatch):
    """Lightning starts its DDP processes inside ``fit``: a loader built before reads one lane for every rank."""
    with build_text_loader(_config(jsonl_sources, tokenizer_dir)) as loader, \
            build_text_loader(_config(jsonl_sources, tokenizer_dir), dp_rank=0, dp_world_size=1) as explicit:
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        with pytest.raises(RuntimeError, match=r"built as the only data-parallel rank .* process group of 2 ranks"):
            iter(loader)
        assert next(iter(explicit))["input_ids"].shape == (2, 32)  # coordinates passed: one rank on purpose


def test_before_the_process_group_the_launchers_rank_and_size_are_the_coordinates(jsonl_sources, tokenizer_dir,
                                                                                   monkeypatch):
    """torchrun sets RANK/WORLD_SIZE for each process; a trainer (Lightning) initializes the group inside fit."""
    cfg = text_loader_config(**_config(jsonl_sources, tokenizer_dir))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    dp = data_parallel(cfg, None, None)
    assert (dp.rank, dp.size, dp.aggregate_store) == (1, 2, "torch://") and dp.run_id.startswith("zephon_loader-")
    assert data_parallel(cfg, 0, 1) == DataParallel(0, 1)  # passed coordinates win
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert data_parallel(cfg, None, None) == DataParallel(0, 1)
    monkeypatch.setenv("WORLD_SIZE", "two")
    assert data_parallel(cfg, None, None) == DataParallel(0, 1)
