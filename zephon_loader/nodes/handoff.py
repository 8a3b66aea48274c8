"""Read-ahead batches across data-parallel topologies: which lanes a rank owns, and the cross-rank gather.

Zephon deals its stream into ``canonical_replicas`` lanes and gives each DP
rank a fixed set of them (``RuntimeOptions.mapping_strategy``: contiguous
blocks by default). Its ``checkpoint()`` is a collective whose merged result,
the same on every rank, covers every lane, so a Zephon checkpoint alone
resumes at any DP size that divides ``canonical_replicas``.

Batches the loader's read-ahead has pulled but not delivered are part of the
position too (Zephon already counts them as delivered), but each lives on one
rank only. After an elastic resume the lane of such a batch may belong to
another rank, and each new rank reads a single old rank's state (AutoModel
loads ``dp_rank_{r}``; going from 2 ranks to 1, only rank 0's). So
:meth:`LaneHandoff.gather` collects every rank's buffered batches, tagged with
their lane, into every rank's state, through the transport Zephon's own
checkpoint uses (its round coordinator over ``aggregate_dir`` or
``aggregate_store``, :func:`~zephon_loader.zephon_compat.round_coordinator`,
in a namespace of its own, with the same ranks, storage and timeout); on resume each rank keeps the batches of the lanes it owns
(:meth:`LaneHandoff.owned_lanes`). Cost: each rank's state holds up to
``read_ahead * dp_world_size`` collated batches.

Nothing here starts a worker; the gather runs only inside ``state_dict()``,
right after Zephon's checkpoint collective, on every rank.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Mapping, Sequence

from zephon_loader.zephon_compat import aggregate_round, round_coordinator, runtime_options

__all__ = ["LaneHandoff", "lane_mapping"]

#: Suffix of the coordinator namespace (``run_id``) the gather uses beside Zephon's own rounds.
NAMESPACE_SUFFIX = ".zephon_loader.read_ahead"


def lane_mapping(options: Any) -> dict[int, tuple[int, ...]]:
    """DP group -> the canonical lanes it owns, as Zephon 0.2.0's ``Engine._build_world`` deals them.

    Args:
        options: The pipeline's ``zephon.options.RuntimeOptions`` (``world_size``,
            ``dp_degree``, ``canonical_replicas``, ``mapping_strategy``; unset
            ones take Zephon's defaults).
    """
    world = int(options.world_size or 1)
    dp = int(options.dp_degree) if options.dp_degree is not None else world
    replicas = int(options.canonical_replicas) if options.canonical_replicas is not None else dp
    if (options.mapping_strategy or "contiguous").lower() == "interleaved":
        return {group: tuple(range(group, replicas, dp)) for group in range(dp)}
    base, extra = divmod(replicas, dp)
    mapping: dict[int, tuple[int, ...]] = {}
    start = 0
    for group in range(dp):
        count = base + (1 if group < extra else 0)
        mapping[group] = tuple(range(start, start + count))
        start += count
    return mapping


class LaneHandoff:
    """Lane ownership and the all-rank gather of read-ahead batches for one pipeline.

    Args:
        pipeline: The ``zephon.Pipeline`` the loader reads (its runtime options
            fix the ranks, lanes and aggregation transport).
    """

    def __init__(self, pipeline: Any) -> None:
        self._pipeline = pipeline
        self._coordinator: Any = None

    @property
    def _runtime(self) -> Any:
        return runtime_options(self._pipeline)

    @property
    def canonical_replicas(self) -> int:
        """Number of canonical lanes; lane ids are ``0 .. canonical_replicas - 1``."""
        options = self._runtime
        if options.canonical_replicas is not None:
            return int(options.canonical_replicas)
        return int(options.dp_degree) if options.dp_degree is not None else int(options.world_size or 1)

    def _dp_group(self) -> int:
        options = self._runtime
        return int(options.dp_group_id) if options.dp_group_id is not None else int(options.global_rank or 0)

    @property
    def data_parallel(self) -> tuple[int, int]:
        """``(dp_rank, dp_world_size)`` the pipeline was built for."""
        options = self._runtime
        return self._dp_group(), int(options.dp_degree or options.world_size or 1)

    def owned_lanes(self) -> frozenset[int]:
        """The lanes this rank reads now."""
        return frozenset(lane_mapping(self._runtime)[self._dp_group()])

    def gather(self, checkpoint: Mapping[str, Any], entries: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Every rank's buffered ``{"lane", "batch"}`` entries, on every rank. A collective.

        Args:
            checkpoint: Zephon's merged checkpoint taken just before (the same
                on every rank); its restore generation names the namespace,
                as Zephon does for its own rounds.
            entries: This rank's buffered batches, in delivery order.

        Returns:
            All ranks' entries, by DP group, each group's in delivery order
            (one rank per DP group: its model-parallel peers read the same lanes).
            A single-rank job returns ``entries`` (nothing to exchange).

        Raises:
            RuntimeError: Zephon's coordinator failed (timeout naming the
                missing ranks, unreadable storage).
        """
        options = self._runtime
        world = int(options.world_size or 1)
        if world == 1:
            return [dict(entry) for entry in entries]
        coordinator = self._coordinator_for(options, world)
        mapping = lane_mapping(options)
        group = self._dp_group()
        local = {
            # The shape Zephon's coordinator checks coverage with: rank, DP group, lanes.
            "world": {
                "global_rank": int(options.global_rank or 0),
                "dp_group_id": group,
                "mapping": {str(g): list(lanes) for g, lanes in mapping.items()},
            },
            "progress": {str(lane): 0 for lane in mapping[group]},
            "buffered": [dict(entry) for entry in entries],
        }
        merged = aggregate_round(
            coordinator,
            local,
            reload_count=int(checkpoint.get("checkpoint_reload_count") or 0),
            is_leader=int(options.global_rank or 0) == 0,
            expected_ranks=frozenset(range(world)),
            expected_lanes=frozenset(range(self.canonical_replicas)),
            merge=_merge_shards,
        )
        return [dict(entry) for entry in merged["buffered"]]

    def _coordinator_for(self, options: Any, world: int) -> Any:
        if self._coordinator is None:
            ours = {"run_id": f"{options.run_id}{NAMESPACE_SUFFIX}"}
            if options.aggregate_dir:  # a folder of its own beside Zephon's run folders
                ours["aggregate_dir"] = os.path.join(os.fspath(options.aggregate_dir), NAMESPACE_SUFFIX.lstrip("."))
            self._coordinator = round_coordinator(
                dataclasses.replace(options, **ours),
                global_rank=int(options.global_rank or 0),
                world_size=world,
                plan_id="zephon_loader-read-ahead",
                worker_info=lambda: (0, 1),
            )
        return self._coordinator

    def close(self) -> None:
        """Release the coordinator's retained round result (best effort; idempotent)."""
        coordinator, self._coordinator = self._coordinator, None
        if coordinator is not None:
            try:
                coordinator.cleanup()
            except Exception as error:  # storage already gone at shutdown: say so, do not fail close()
                warnings.warn(f"zephon_loader: could not clean up the read-ahead gather's last round: {error!r}",
                              RuntimeWarning, stacklevel=2)


def _merge_shards(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """The leader's merge: one shard per DP group (its lowest global rank), groups in order."""
    chosen: dict[int, dict[str, Any]] = {}
    for shard in sorted(shards, key=lambda s: int(s["world"]["global_rank"])):
        chosen.setdefault(int(shard["world"]["dp_group_id"]), shard)
    return {"buffered": [entry for group in sorted(chosen) for entry in chosen[group]["buffered"]]}
