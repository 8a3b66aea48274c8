"""The end of a pass, agreed by every rank: the same number of batches per rank in every epoch.

Zephon deals documents to lanes, and a lane's packed batches depend on its
documents' lengths, so the ranks' lanes hold different numbers of batches in
a pass (74 and 93 at 2 ranks on the standard library's sources). A loop that
runs one collective per batch (DDP, FSDP) then pairs one rank's last batches
with another's next epoch, and hangs or crashes when the short rank stops.

So in a job with a process group the ranks agree how far the pass goes on:
at an exchange (:meth:`PassAgreement.exchange`, one ``all_reduce(MIN)`` of a
few ints) every rank promises the batches it holds read ahead (pulled from
Zephon and not yet delivered: ``next()`` returns them whatever happens), and
the minimum over the ranks is granted: the next that many batches need no
exchange. The read-ahead holds up to :attr:`PassAgreement.WINDOW` batches
under the agreement, so away from a pass end there is one collective per up
to that many batches, started :attr:`PassAgreement.LEAD` batches before the
grant runs out as an asynchronous ``all_reduce`` whose answer is waited for
only when it is needed (off ``next()``'s critical path while batches are
ready). When the grant runs out without a new one, the exchange is blocking
and says whether every rank has a next batch; the first time one rank has
none, every rank ends its pass at that same batch: exactly where an exchange
per batch would end it (a granted batch is one every rank has). The exchanges
run on the default process group when its backend takes CPU tensors (gloo,
or ``cpu:gloo,...``), in the training's own order of collectives (every rank
issues them at the same batches); otherwise (nccl) on a gloo group of the
loader's own, made once.
Nothing is dropped: what the other ranks had left is carried into the next
epoch and delivered first (:meth:`ZephonSource.carry_over
<zephon_loader.nodes.source.ZephonSource.carry_over>`), so every record is
still read once per pass and an epoch is "the same number of batches on
every rank: the shortest rank's count of that pass, the others' leftovers
coming first in the next".

Two cases have no such epoch and fail at once, on every rank, instead:

* A rank with no batch at all in a pass started from its beginning (its
  lanes hold no record: fewer records than the ranks can share): the pass
  would end at 0 batches on every rank, every epoch, while the others'
  carried batches pile up. :class:`EmptyRankError` names the ranks and the fix.
* A loader iterated on some ranks only (evaluation on rank 0): the agreement
  needs every rank of the process group. At the loader's first batch the
  ranks meet in the process group's store (no collective: a rank alone can
  wait there); one that waited :data:`START_TIMEOUT_S` for the others raises
  :class:`AgreementError` naming ``distributed.even_passes`` and the fix,
  and so does a rank whose peers are at another loader's first batch.

Not used with one rank, with ``passes: null`` (there is no pass end), without
a process group (ranks given as ``dp_rank``/``dp_world_size`` and a shared
folder: each rank's pass ends with its lanes), or with
``distributed.even_passes: false``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Any, Mapping, Sequence

__all__ = ["AgreementError", "EmptyRankError", "PassAgreement", "START_TIMEOUT_ENV", "START_TIMEOUT_S"]

_log = logging.getLogger("zephon_loader")

#: Environment variable: seconds a rank waits at a loader's first batch for the other ranks to reach it.
START_TIMEOUT_ENV = "ZEPHON_LOADER_AGREEMENT_TIMEOUT_S"
#: Default of :data:`START_TIMEOUT_ENV`; a warning names the ranks still missing after a sixth of it.
START_TIMEOUT_S = 60.0
#: Where the ranks meet in the process group's store.
_STORE_PREFIX = "zephon_loader/agreement"

_FIX = ("To iterate a loader on some ranks only (e.g. evaluation on rank 0), build it with dp_rank=0, "
        "dp_world_size=1 (that rank reads every record) or with distributed.even_passes: false (each rank reads "
        "its own lanes and its pass ends with them)")


class AgreementError(RuntimeError):
    """The ranks of the process group do not iterate this loader together (``distributed.even_passes``)."""


class EmptyRankError(RuntimeError):
    """A rank has no batch in a pass: an even pass would hold no batch (``distributed.even_passes``)."""


def start_timeout_s() -> float:
    """:data:`START_TIMEOUT_ENV` if set (seconds > 0), else :data:`START_TIMEOUT_S`."""
    value = os.environ.get(START_TIMEOUT_ENV)
    if not value:
        return START_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{START_TIMEOUT_ENV}: got {value!r}, expected seconds > 0 (default {START_TIMEOUT_S:g})")
    return seconds


def loader_identity(fingerprint: Mapping[str, Any]) -> str:
    """What names a loader across ranks: its sources and a digest of its (rank-independent) fingerprint."""
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:12]
    names = [str(source[0]) for source in fingerprint.get("sources", []) if source]
    return f"sources {names}, fingerprint {digest}"


class PassAgreement:
    """The ranks' pass end, agreed with one ``all_reduce(MIN)`` per up to :attr:`WINDOW` batches.

    Per batch the loader calls :meth:`granted` (no collective: is this batch
    promised by every rank?) and, when it is not, :meth:`exchange` (blocking).
    The group is chosen at the first :meth:`exchange`, after the ranks met in
    the store (:meth:`_meet`): the default group when its backend takes CPU
    tensors, else a gloo group made then (``new_group`` is itself a collective:
    every rank makes it at its first ``next()``, in step).

    Attributes:
        collectives: Collectives this agreement ran (a count for tests and benchmarks).

    Args:
        identity: Names the loader across ranks (:func:`loader_identity`).
        micro_batch_size: ``B``, for the messages.
    """

    #: Batches a rank keeps read ahead to promise (the read-ahead's ``hold``); one exchange per up to this many.
    WINDOW = 8
    #: The next exchange starts (asynchronously) when this many granted batches are left.
    LEAD = 2

    def __init__(self, identity: str = "", micro_batch_size: int | None = None) -> None:
        self._group: Any = None
        self._ready = False  # the ranks met and the group is chosen
        self.collectives = 0
        self._index = 0  # the batch of the pass about to be asked about
        self._horizon = 0  # the first batch of the pass not promised by every rank
        self._launch: tuple[Any, Any, int] | None = None  # (work, tensor, index) of the asynchronous exchange
        self._launched_at = -1
        self._identity = identity
        self._micro_batch_size = micro_batch_size
        self._first = False  # the next exchange is the first of a pass
        self._fresh = False  # that pass starts from its beginning (not a resumed state)
        self._epoch: int | None = None
        self._step = 0  # the step of the pass it starts at (a resumed state's), -1 unknown
        self._failed: EmptyRankError | AgreementError | None = None  # this pass's: raised again, no collective

    @classmethod
    def for_job(cls, identity: str = "", micro_batch_size: int | None = None) -> "PassAgreement | None":
        """An agreement when ``torch.distributed`` is initialized with several ranks, else ``None``."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return cls(identity, micro_batch_size)
        return None

    def begin_pass(self, fresh: bool, epoch: int | None = None, step: int = 0) -> None:
        """A pass begins (``iter()``): from its beginning (``fresh``) or from a loaded state, in ``epoch``, at
        ``step`` of the pass (a loaded state's; ``-1``: not known). The first exchange checks that every rank
        begins at the same epoch and step."""
        self._first, self._fresh, self._epoch, self._failed = True, fresh, epoch, None
        self._step = int(step)
        # An exchange started in the last pass completes on its own (every rank issued it at the same batch);
        # its answer is about that pass: dropped.
        self._index, self._horizon, self._launch, self._launched_at = 0, 0, None, -1

    def granted(self, pending: Any) -> bool:
        """Whether every rank promised the next batch (then it is counted as taken); no blocking collective.

        Args:
            pending: ``() -> int``, the batches this rank holds read ahead now (the next one included; inline,
                pulled now up to :attr:`WINDOW`), for the asynchronous exchange started :attr:`LEAD` batches
                before the grant runs out.

        Raises:
            EmptyRankError: This pass's, again (every rank raised it at the same batch).
        """
        if self._failed is not None:
            raise self._failed
        index = self._index
        if index >= self._horizon and self._launch is not None:
            self._collect()
        if index >= self._horizon:
            return False
        if self._launch is None and self._horizon - index <= self.LEAD and self._launched_at != index:
            self._start(index, min(int(pending()), self.WINDOW))
        self._index += 1
        return True

    def _start(self, index: int, promise: int) -> None:
        import torch
        import torch.distributed as dist

        values = torch.tensor([int(promise)], dtype=torch.int64)
        work = dist.all_reduce(values, op=dist.ReduceOp.MIN, group=self._group, async_op=True)
        self.collectives += 1
        self._launch, self._launched_at = (work, values, index), index

    def _collect(self) -> None:
        assert self._launch is not None
        work, values, index = self._launch
        self._launch = None
        work.wait()
        self._horizon = max(self._horizon, index + int(values.item()))

    def exchange(self, has_batch: bool | int, drained: Sequence[bool]) -> tuple[bool, bool, list[bool]]:
        """Every rank's answer, combined (a blocking collective); when every rank has a batch, the grant
        of :meth:`granted` becomes the smallest promise, the batch asked about included.

        Args:
            has_batch: This rank has a next batch in the pass: how many it holds read ahead (an int, its
                promise), or ``True``/``False`` (one or none).
            drained: Per pipeline of this rank's chain, whether this rank has read all of it
                (the chains have the same length on every rank).

        Returns:
            ``(every rank has one, some rank has one, per pipeline: every rank has read all of it)``.

        Raises:
            AgreementError: At the loader's first batch, the other ranks did not reach it in time (or are at
                another loader's).
            EmptyRankError: At the first batch of a pass started from its beginning, some ranks have none
                and others have some (every rank raises it).
        """
        import torch
        import torch.distributed as dist

        if self._failed is not None:  # every rank raised it at the same batch: again, on every rank
            raise self._failed
        if not self._ready:
            self._meet()
            backend = str(dist.get_backend())
            # The default group carries CPU tensors with gloo (also "cpu:gloo,cuda:nccl"); nccl does not.
            self._group = None if "gloo" in backend else dist.new_group(backend="gloo")
            self._ready = True
        if self._launch is not None:  # (granted() collects it first; kept for a direct call)
            self._collect()
        promise = max(0, int(has_batch))
        first, self._first = self._first, False
        # The first exchange of a pass also carries where each rank begins it: min and max of epoch and step.
        where = [self._epoch or 0, -(self._epoch or 0), self._step, -self._step] if first else []
        values = torch.tensor([promise, -promise, *map(int, drained), *where], dtype=torch.int64)
        dist.all_reduce(values, op=dist.ReduceOp.MIN, group=self._group)
        self.collectives += 1
        out = values.tolist()
        if where:
            out, (epochs, steps) = out[:-4], ((out[-4], -out[-3]), (out[-2], -out[-1]))
            if (epochs[0] != epochs[1] or steps[0] != steps[1]) and steps[0] >= 0:
                self._failed = AgreementError(
                    f"distributed.even_passes: the ranks begin this pass at different positions (epochs "
                    f"{epochs[0]}..{epochs[1]}, steps {steps[0]}..{steps[1]}; this rank: epoch {self._epoch or 0}, "
                    f"step {self._step}): the loader states they loaded were saved at different steps (a rank's "
                    "file from another checkpoint), so their batches would no longer pair up. Load the states "
                    "every rank saved at one step (one checkpoint folder) on every rank")
                raise self._failed
        every, some = out[0] > 0, out[1] < 0
        if first and self._fresh and some and not every:  # the same on every rank: every rank raises
            self._failed = self._empty_ranks(bool(promise))
            raise self._failed
        if every:
            self._horizon = max(self._horizon, self._index + out[0])
            self._index += 1
        return every, some, [bool(v) for v in out[2:]]

    def _empty_ranks(self, has_batch: bool) -> EmptyRankError:
        """The error naming the ranks without a batch (one more ``all_reduce``, on every rank)."""
        import torch
        import torch.distributed as dist

        world = dist.get_world_size()
        empty = torch.zeros(world, dtype=torch.int64)
        empty[dist.get_rank()] = int(not has_batch)
        dist.all_reduce(empty, op=dist.ReduceOp.SUM, group=self._group)
        self.collectives += 1
        ranks = [rank for rank, none in enumerate(empty.tolist()) if none]
        epoch = f"epoch {self._epoch}'s pass" if self._epoch is not None else "this pass"
        batch = f" x micro_batch_size {self._micro_batch_size}" if self._micro_batch_size else ""
        return EmptyRankError(
            f"distributed.even_passes: rank(s) {ranks} of the {world} in the process group have no batch in "
            f"{epoch} (their Zephon lanes hold no record: the sources have fewer records than {world} ranks"
            f"{batch} can share), so a pass even on every rank would hold 0 batches, every epoch. Read this "
            "loader on fewer ranks (dp_rank=0, dp_world_size=1 reads every record on each rank, as validation "
            "loaders do), give it more records, or set distributed.even_passes: false (each rank reads its own "
            "lanes, a rank without records yields no batch: no collective per batch in the loop then)"
        )

    def _meet(self) -> None:
        """Wait until every rank reached its first batch of this loader, in the default group's store.

        The ``n``-th loader a rank starts meets the others' ``n``-th: each rank sets
        ``<prefix>/<n>/<rank>`` to the loader's identity and waits for every rank's key (a store
        wait needs no other rank, unlike ``new_group``). A rank missing after the timeout, or one
        at another loader, is an :class:`AgreementError` naming the fix.
        """
        import torch.distributed as dist

        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # no store to meet in (a torch without it): go on to new_group
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        timeout = start_timeout_s()
        n = store.add(f"{_STORE_PREFIX}/count/{rank}", 1)
        keys = [f"{_STORE_PREFIX}/{n}/{k}" for k in range(world)]
        store.set(keys[rank], self._identity)
        started = time.monotonic()
        warn_at = started + timeout / 6
        pause = 0.005
        while not store.check(keys):  # polled: a timed-out store.wait() logs a C++ warning each time
            time.sleep(pause)
            pause = min(2 * pause, 0.2)
            now = time.monotonic()
            if now < warn_at and now - started < timeout:
                continue
            missing = [k for k, key in enumerate(keys) if not store.check([key])]
            if now - started >= timeout:
                raise AgreementError(
                    f"distributed.even_passes: rank {rank} began iterating this loader ({self._identity}), but "
                    f"rank(s) {missing} of the {world} in the process group did not within {timeout:g} s. With "
                    "even_passes (the default) every rank of the process group iterates the loader together: "
                    f"before each batch the ranks agree whether the pass goes on. {_FIX}. A rank that is only "
                    f"late: raise {START_TIMEOUT_ENV} (seconds)"
                )
            _log.warning("zephon_loader: rank %d waits for rank(s) %s to begin iterating this loader (%s); with "
                         "distributed.even_passes every rank must iterate it, it fails after %g s", rank, missing,
                         self._identity, timeout)
            warn_at = float("inf")
        others = {k: store.get(key).decode() for k, key in enumerate(keys)}
        foreign = sorted(k for k, identity in others.items() if identity != self._identity)
        if foreign:
            raise AgreementError(
                f"distributed.even_passes: rank {rank} began iterating this loader ({self._identity}) while "
                f"rank(s) {foreign} began another ({others[foreign[0]]}): the ranks' loaders would pair each "
                f"other's batches. Iterate the loaders in the same order on every rank. {_FIX}"
            )
