"""The end of a pass, agreed by every rank: the same number of batches per rank in every epoch.

Zephon deals documents to lanes, and a lane's packed batches depend on its
documents' lengths, so the ranks' lanes hold different numbers of batches in
a pass (74 and 93 at 2 ranks on the standard library's sources). A loop that
runs one collective per batch (DDP, FSDP) then pairs one rank's last batches
with another's next epoch, and hangs or crashes when the short rank stops.

So in a job with a process group, before each batch every rank says whether
it has one (:meth:`PassAgreement.exchange`: one ``all_reduce`` of a few ints
on a gloo group of the loader's own, made once, ~0.1 ms on loopback); the
first time one rank has none, every rank ends its pass at that same batch.
Nothing is dropped: what the other ranks had left is carried into the next
epoch and delivered first (:meth:`ZephonSource.carry_over
<zephon_loader.nodes.source.ZephonSource.carry_over>`), so every record is
still read once per pass and an epoch is "the same number of batches on
every rank: the shortest rank's count of that pass, the others' leftovers
coming first in the next".

Not used with one rank, with ``passes: null`` (there is no pass end), without
a process group (ranks given as ``dp_rank``/``dp_world_size`` and a shared
folder: each rank's pass ends with its lanes), or with
``distributed.even_passes: false``.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["PassAgreement"]


class PassAgreement:
    """One ``all_reduce(MIN)`` per batch over every rank of the default process group, on a gloo group.

    The group is made at the first :meth:`exchange` (``new_group`` is itself a
    collective: every rank makes it at its first ``next()``, in step).
    """

    def __init__(self) -> None:
        self._group: Any = None

    @classmethod
    def for_job(cls) -> "PassAgreement | None":
        """An agreement when ``torch.distributed`` is initialized with several ranks, else ``None``."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return cls()
        return None

    def exchange(self, has_batch: bool, drained: Sequence[bool]) -> tuple[bool, bool, list[bool]]:
        """Every rank's answer, combined.

        Args:
            has_batch: This rank has a next batch in the pass.
            drained: Per pipeline of this rank's chain, whether this rank has read all of it
                (the chains have the same length on every rank).

        Returns:
            ``(every rank has one, some rank has one, per pipeline: every rank has read all of it)``.
        """
        import torch
        import torch.distributed as dist

        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        values = torch.tensor([int(has_batch), -int(has_batch), *map(int, drained)], dtype=torch.int64)
        dist.all_reduce(values, op=dist.ReduceOp.MIN, group=self._group)
        out = values.tolist()
        return bool(out[0]), bool(-out[1]), [bool(v) for v in out[2:]]

