"""Zephon's data-parallel lanes as the loader sees them: which lanes a rank owns.

Zephon deals its stream into ``canonical_replicas`` lanes and gives each DP
rank a fixed set of them (``RuntimeOptions.mapping_strategy``: contiguous
blocks by default). Its ``checkpoint()`` is a collective whose merged result,
the same on every rank, covers every lane, so a Zephon checkpoint alone
resumes at any DP size that divides ``canonical_replicas``; the loader's state
is cut before its read-ahead (:mod:`zephon_loader.nodes.readahead`), so it
holds nothing tied to a rank either.

What the loader needs of the lanes: its rank's DP coordinates, and the lanes
it owns, which decide the part of the per-lane accounting
(:class:`~zephon_loader.stats.LoaderStats`) a rank reports after an elastic
resume.
"""

from __future__ import annotations

from typing import Any

from zephon_loader.zephon_compat import runtime_options

__all__ = ["Lanes", "lane_mapping"]


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


class Lanes:
    """Which lanes a loader's rank reads, from the pipeline's runtime options.

    Args:
        pipeline: The ``zephon.Pipeline`` the loader reads (its runtime options
            fix the ranks, lanes and aggregation transport).
    """

    def __init__(self, pipeline: Any) -> None:
        self._pipeline = pipeline

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
