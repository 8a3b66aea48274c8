"""The work source: which records Zephon reads, in which order, on which data-parallel lane.

First stage of the data flow (config → builder → **work source** → tokenize →
pack → batch). It turns the configured shard folders into Zephon datasets, picks
a chunk size with which every pass of every source is read whole, sets the
flush cadence that goes with it, and gives this rank its Zephon lane:

* :func:`build_work_source`: ``zephon.StaticMixtureWorkSource`` plus the
  ``ShardTable`` that names a record's shard file and line, and the runtime
  options of the lanes (:func:`lane_options`).
* :func:`choose_chunk_size`: the whole-pass chunk-size rule (Zephon 0.2.0
  skips the rest of a pass when a chunk's quota does not fit; see
  :func:`_split_pass`).

Everything here runs in the driver before any Zephon worker starts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from zephon_loader.config.schema import LoaderConfig
from zephon_loader.errors import field_error as _err
from zephon_loader.pipeline.object_store import is_url, store_failure, store_raised
from zephon_loader.pipeline.provenance import ShardTable, SourceShards
from zephon_loader.pipeline.shards import SourceFiles, check_distinct
from zephon_loader.pipeline.source_checks import check_parquet_columns, check_pass_length, pass_records

__all__ = [
    "CHUNKS_PER_LANE",
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_FLUSH_WINDOW_BATCHES",
    "MAX_FLUSH_EVERY_K_CHUNKS",
    "OpenedSources",
    "WorkSource",
    "build_work_source",
    "choose_chunk_size",
    "default_flush_window",
    "lane_options",
    "open_sources",
]

#: Zephon's own default ``StaticMixtureWorkSource(chunk_size=...)``; the upper bound we pick from.
DEFAULT_CHUNK_SIZE = 16384


def _liveness_required(share: float, chunk_size: int) -> int:
    """Zephon 0.2.0's repeat-policy bound (``StaticMixtureWorkSource`` validate_liveness)."""
    quota = share * chunk_size
    if quota.is_integer():
        return int(quota)
    return min(math.ceil(quota) + 1, chunk_size)


#: With ``chunk_size=None`` and several DP lanes, the chunk size leaves at least this many chunks per lane.
CHUNKS_PER_LANE = 8
#: Zephon 0.2.0 flushes its packing (and batching) state every this many chunks per lane by default
#: (``RuntimeOptions.flush_every_k_chunks``); each flush pads out the open rows.
ZEPHON_FLUSH_EVERY_K_CHUNKS = 8
#: Most chunks between flushes we ask for: every chunk between two flushes is kept in flight,
#: saved in the checkpoint (about 170 bytes each: 1.4 MB and ~0.1 s per state at chunk size 1,
#: like Zephon's default 8 chunks of 16384 records) and replayed on restore.
MAX_FLUSH_EVERY_K_CHUNKS = 8192
#: At the default ``flush_every_records`` a lane flushes at least every this many batches' worth of shard
#: bytes (:func:`default_flush_window`): a resume re-reads at most that much, each flush costs about half a
#: batch of padding.
DEFAULT_FLUSH_WINDOW_BATCHES = 1024


def _largest_servable_chunk_size(counts: Sequence[int], shares: Sequence[float], upper: int) -> int:
    """Largest ``chunk_size <= upper`` Zephon's repeat-liveness check accepts; 0 when a dataset is empty.

    With Zephon's default (repeat-until-one-pass) policy a dataset with
    normalized weight ``w`` must hold at least ``w * chunk_size`` samples
    (``ceil(.) + 1`` when fractional).
    """

    def fits(chunk: int) -> bool:
        return all(n >= _liveness_required(s, chunk) for n, s in zip(counts, shares, strict=True))

    if not fits(1):
        return 0
    lo, hi = 1, int(upper)  # fits(lo) is the invariant
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _whole_passes(counts: Sequence[int], shares: Sequence[float], chunk: int) -> bool:
    """Whether Zephon reads every pass of every dataset whole with this chunk size (see :func:`_split_pass`)."""
    if chunk == 1:
        return True
    total = 0
    for count, share in zip(counts, shares, strict=True):
        quota = share * chunk
        if not quota.is_integer() or quota < 1 or count % int(quota):
            return False
        total += int(quota)
    return total == chunk


def _split_pass(counts: Sequence[int], shares: Sequence[float], chunk: int) -> tuple[int, str] | None:
    """Why ``chunk`` can end some dataset's pass inside a chunk: ``(dataset index, reason)``, or None.

    Zephon 0.2.0's ``StaticMixtureWorkSource`` draws an integer quota per
    dataset and chunk (``AccumulatorStrategy``: ``share * chunk_size`` plus a
    carried fraction, corrected so the quotas sum to ``chunk_size``). When a
    dataset's cursor holds fewer records than its quota, ``compute_quotas``
    calls ``cursor.reset()``: the next pass starts and the records left in
    the current one are never drawn. A pass is whole only if the cursor is
    empty whenever it turns over, which holds when

    * ``chunk == 1``: every quota is 0 or 1, so a cursor turns over only
      when empty; or
    * every ``share * chunk`` (in Zephon's float arithmetic) is a whole
      number ``q`` and the quotas sum to ``chunk``: every chunk then draws
      exactly ``q`` records of the dataset, and ``q`` divides its count.

    Other sizes draw varying quotas; they are not accepted.
    """
    if _whole_passes(counts, shares, chunk):
        return None
    quotas = [share * chunk for share in shares]
    for index, quota in enumerate(quotas):
        if not quota.is_integer() or quota < 1:
            return index, (f"it draws {quota:.4g} records per chunk on average, not a whole number, so its "
                           "per-chunk draws vary and a pass can end inside a chunk")
    if sum(int(q) for q in quotas) != chunk:
        return 0, f"the per-source draws {[int(q) for q in quotas]} do not sum to chunk_size={chunk}"
    index, count, quota = next(
        (i, n, int(q)) for i, (n, q) in enumerate(zip(counts, quotas, strict=True)) if n % int(q))
    return index, (f"it draws {quota} records per chunk, so the last {count % quota} of its "
                   f"{count} records would be skipped in every pass")


def _shares(weights: Sequence[float]) -> list[float]:
    """Normalized weights as Zephon computes them (the quotas depend on the exact floats)."""
    import zephon

    normalized = zephon.MixtureSpec({str(i): float(w) for i, w in enumerate(weights)}).normalized
    return [normalized[str(i)] for i in range(len(weights))]


def choose_chunk_size(
    counts: Sequence[int], weights: Sequence[float], *, upper: int = DEFAULT_CHUNK_SIZE
) -> int:
    """Largest ``chunk_size <= upper`` with which every pass of every dataset is delivered whole.

    Zephon 0.2.0 skips the records a dataset has left in its pass when a
    chunk's quota for it does not fit (see :func:`_split_pass`). With the
    sizes returned here that never happens: every chunk draws exactly
    ``share * chunk_size`` records of each dataset and that number divides
    the dataset's record count, or ``chunk_size`` is 1 (always whole; one
    chunk per record costs Zephon tens of microseconds of bookkeeping per
    record). Zephon's repeat-liveness check accepts every size returned.

    Args:
        counts: Sample count of each dataset.
        weights: Its mixture weight (any positive scale).
        upper: Largest chunk size to consider.

    Returns:
        The chunk size, or 0 when some dataset is empty.
    """
    if any(int(n) <= 0 for n in counts):
        return 0
    shares = _shares(weights)
    return next((chunk for chunk in range(int(upper), 1, -1) if _whole_passes(counts, shares, chunk)), 1)


@dataclass(frozen=True)
class WorkSource:
    """What :func:`build_work_source` returns.

    Attributes:
        source: The ``zephon.StaticMixtureWorkSource`` (one pass of every source).
        chunk_size: Records per work chunk (whole passes guaranteed).
        flush_every_k_chunks: Zephon's flush cadence for that chunk size.
        opened: The shard files it reads (the next epoch's work source reads the same).
        flush_window: Records per lane between flushes when the default cadence was shortened
            (:func:`default_flush_window`); ``None`` when it was not (Zephon's cadence, or
            ``flush_every_records`` as configured).
    """

    source: Any
    chunk_size: int
    flush_every_k_chunks: int
    opened: "OpenedSources"
    flush_window: int | None = None

    @property
    def shards(self) -> ShardTable:
        """Sample id → source, shard file and line/row (for error messages and drop logs)."""
        return self.opened.shards


@dataclass(frozen=True)
class OpenedSources:
    """The configured sources as the build found them; every epoch's work source reads these.

    Attributes:
        files: Per source, its shard files (:class:`~zephon_loader.pipeline.shards.SourceFiles`).
        datasets: Per source, the ``zephon.Dataset`` over them (discovered once).
        counts: Per source, its record count.
        shards: Sample id -> source, shard file and line/row.
    """

    files: tuple[SourceFiles, ...]
    datasets: tuple[Any, ...]
    counts: tuple[int, ...]
    shards: ShardTable

    def fingerprint(self) -> dict[str, list[list[object]]]:
        """The resume fingerprint's shard part: per source, ``[[file, size, sha256[:16]], ...]``."""
        return {files.name: files.fingerprint() for files in self.files}

    def check_unchanged(self) -> None:
        """Raise when a shard changed, was truncated or removed since the build (each epoch checks)."""
        message = shards_changed_message(self.files)
        if message:
            raise ValueError(message)


def shards_changed_message(sources: Sequence[SourceFiles]) -> str | None:
    """One line naming the first shards that changed since the build (then a count) and what to do; ``None``
    when none did."""
    changes = [(files, change) for files in sources for change in files.changes()]
    if not changes:
        return None
    shown = "; ".join(f"source {files.name!r}, {change}" for files, change in changes[:3])
    more = f"; and {len(changes) - 3} more" if len(changes) > 3 else ""
    return (f"shards changed while the loader ran ({shown}{more}): the loader reads the shards as they were "
            "when it was built. Leave shards unchanged during a run; to train on the new data, build a new loader "
            "(a state saved before is then refused by its fingerprint)")


def open_sources(config: LoaderConfig) -> OpenedSources:
    """List, hash and discover every configured source once (:func:`~zephon_loader.pipeline.formats.open_source`).

    Warns when one ``mixture: repeat`` pass would read over 100x the records (``source_checks``).

    Raises:
        ValueError: A missing/empty/mixed folder or prefix, a store that cannot be listed, two sources on one
            folder or file, a stale Zephon index, a source without records, or a Parquet column Zephon cannot
            take rows of.
    """
    import zephon

    from zephon_loader.pipeline import formats

    files = []
    for i, source in enumerate(config.sources):
        where = f"dataloader.sources[{i}].path ({source.name!r})"
        folder = source.path if is_url(source.path) else config.resolve_path(source.path)
        files.append(formats.open_source(source.name, where, source.path, folder, source.format))
    check_distinct(files)
    datasets = tuple(_discover(zephon, f) for f in files)
    counts = tuple(int(ds.total()) for ds in datasets)
    for f, n in zip(files, counts, strict=True):
        if n == 0:
            raise ValueError(_err(f.where, f.folder, "at least one record", "The shards are empty; add data or drop the source."))
    check_pass_length([f.name for f in files], counts, [s.weight for s in config.sources], mixture=config.mixture,
                      passes=config.passes)
    for f in files:
        if f.kind == "parquet":
            check_parquet_columns(f.name, [os.path.join(f.folder, n) for n in f.files],
                                  sizes=[int(i[0]) for i in f.identities] if f.remote else None)
    table = ShardTable(tuple(SourceShards(f.name, f.folder, f.files, f.kind, f.readable) for f in files),
                       changes=partial(shards_changed_message, tuple(files)))
    return OpenedSources(tuple(files), datasets, counts, table)


def _discover(zephon: Any, files: SourceFiles) -> Any:
    """Zephon's dataset over one source (its count-only discovery). A remote source names its format (Zephon's
    detection turns a store's refusal into "Unsupported dataset format") and a store failure says what to check."""
    if not files.remote:
        return zephon.Dataset.from_path(files.name, files.zephon_root)
    try:
        return zephon.Dataset.from_path(files.name, files.zephon_root, fmt=files.kind)
    except BaseException as error:  # obstore's errors reach here unwrapped; a Rust panic is a BaseException
        if not store_raised(error):
            raise
        raise ValueError(store_failure(files.where, files.folder, error, "counting the records of")) from None


def default_flush_window(opened: OpenedSources, weights: Sequence[float], rows: int, row_tokens: int) -> int:
    """Records per lane between flushes at the default ``flush_every_records``: as many as hold
    :data:`DEFAULT_FLUSH_WINDOW_BATCHES` batches of ``rows x row_tokens`` tokens, counting one token per
    shard byte.

    A token covers at least one byte of text for every tokenizer (special tokens aside), so the
    tokens between two flushes, which a resume re-reads, are at most that many batches; a BPE
    tokenizer on English or code (about 3-4 bytes a token) flushes every ~250-350 batches. The
    mean bytes per record is the mixture's (each source's stored bytes over its records, weighted
    by its share); compressed shards hold more tokens per byte. Deterministic from what the
    fingerprint holds (shard sizes, record counts, weights, shapes).

    Args:
        opened: The opened sources (their shard sizes and record counts).
        weights: Each source's mixture weight.
        rows: Rows per batch ``B``.
        row_tokens: Tokens per packed row (``S + 1`` for text).

    Returns:
        At least 1.
    """
    mean_bytes = sum(share * sum(int(identity[0]) for identity in files.identities) / max(count, 1)
                     for share, files, count in zip(_shares(weights), opened.files, opened.counts, strict=True))
    return max(1, int(DEFAULT_FLUSH_WINDOW_BATCHES * rows * row_tokens // max(mean_bytes, 1.0)))


def build_work_source(config: LoaderConfig, *, lanes: int, seed: int | None = None,
                      sources: OpenedSources | None = None,
                      batch_shape: tuple[int, int] | None = None) -> WorkSource:
    """The mixture of the configured shard folders, read in whole passes (``config.mixture``).

    Args:
        config: The validated loader config (sources, ``chunk_size``, ``shuffle``, ``seed``).
        lanes: Zephon's canonical lane count (chunks are dealt to lanes whole).
        seed: Overrides ``config.seed`` (e.g. an epoch's seed).
        sources: What :func:`open_sources` found at the build (checked unchanged); ``None`` opens them now.
        batch_shape: ``(rows, tokens per row)`` of the batches packed from these records: with
            ``flush_every_records`` unset, the records between flushes are capped at
            :func:`default_flush_window` of it. ``None``: Zephon's cadence (8 chunks of the largest size).

    Raises:
        ValueError: A missing/empty/mixed folder, shards changed since ``sources`` was made, or an explicit
            ``chunk_size`` with which some pass would not be read whole (the message names the source and
            the size to use instead).
    """
    import zephon

    if sources is None:
        sources = open_sources(config)
    else:
        sources.check_unchanged()
    names = [source.name for source in config.sources]
    counts = list(sources.counts)
    weights = [source.weight for source in config.sources]
    once = config.mixture == "once"
    window = config.flush_every_records or None  # 0: Zephon's cadence, never shortened
    flush_cap = None
    if config.flush_every_records is None and batch_shape is not None:
        flush_cap = default_flush_window(sources, weights, *batch_shape)
    if once:  # every record exactly once: Zephon clamps a running-out source's quota, no pass is cut short
        upper = _lane_cap(min(DEFAULT_CHUNK_SIZE, sum(counts)), counts, lanes)
        chunk_size = config.chunk_size or (upper if window is None else min(upper, window))
    else:
        chunk_size, upper = _work_chunk_size(names, counts, weights, config.chunk_size, lanes, window)
    if window is not None:
        # The records between flushes asked for: chunks no larger, as many of them as fit.
        if chunk_size > window:
            raise ValueError(_err("dataloader.flush_every_records", window, f"at least chunk_size={chunk_size}",
                                  "Zephon flushes between whole chunks: raise it, or lower chunk_size "
                                  "(or set chunk_size: null to fit it)."))
        flush_every_k_chunks = window // chunk_size
    else:
        # Every K chunks Zephon flushes packing and batching: the open rows are padded and a short batch
        # is delivered (padded to B by collate). Keep the records between flushes near what its default
        # K gives at the largest size the data allows, so small chunk sizes do not flush every few records.
        flush_every_k_chunks = min(MAX_FLUSH_EVERY_K_CHUNKS, max(ZEPHON_FLUSH_EVERY_K_CHUNKS,
                                                                 -(-ZEPHON_FLUSH_EVERY_K_CHUNKS * upper // chunk_size)))
    capped = None
    if (flush_cap is not None and flush_every_k_chunks * chunk_size > flush_cap
            and _run_records_per_lane(counts, weights, once, config.passes, lanes) > flush_cap):
        # A resume re-reads up to one window: shorten it to the cap, in whole chunks (smaller ones when the
        # chunk size is ours to choose and one chunk would exceed it).
        if config.chunk_size is None and chunk_size > flush_cap:
            chunk_size = min(upper, flush_cap) if once else choose_chunk_size(counts, weights, upper=flush_cap)
        flush_every_k_chunks = min(MAX_FLUSH_EVERY_K_CHUNKS, max(1, flush_cap // chunk_size))
        capped = flush_every_k_chunks * chunk_size
    source = zephon.StaticMixtureWorkSource(
        list(sources.datasets),
        zephon.MixtureSpec(dict(zip(names, weights, strict=True))),
        chunk_size=chunk_size,
        seed=int(config.seed if seed is None else seed),
        shuffle_shards=config.shuffle,
        shuffle_within_shard=config.shuffle,
        # once: each source read once, then dropped from the mixture (the others renormalized);
        # repeat: every source repeats until the slowest was read whole `passes` times (None: endless).
        **_pass_policy(once, config.passes),
    )
    return WorkSource(source, chunk_size, flush_every_k_chunks, sources, capped)


def _run_records_per_lane(counts: Sequence[int], weights: Sequence[float], once: bool, passes: int | None,
                          lanes: int) -> float:
    """About how many records one lane reads in one epoch (``inf`` when endless): a flush window at least
    that long never flushes before the epoch's own flush, so shortening it would change nothing a resume
    re-reads (and would refuse states of the same stream)."""
    if once:
        return sum(counts) / lanes
    if passes is None:
        return math.inf
    return pass_records(counts, _shares(weights)) * passes / lanes


def _pass_policy(once: bool, passes: int | None) -> dict[str, Any]:
    """Zephon's exhaustion settings: once (``redistribute``), ``passes`` passes, or endless repetition."""
    if once:
        return {"exhausted_policy": "redistribute"}
    if passes is None:
        return {"exhausted_policy": "repeat", "stop_after_passes": None}
    return {"stop_after_passes": int(passes)}


def _lane_cap(largest: int, counts: Sequence[int], lanes: int) -> int:
    """The largest chunk size to choose: ``largest``, lowered with several lanes to leave each lane
    :data:`CHUNKS_PER_LANE` chunks (Zephon deals whole chunks to lanes: with small sources one lane would
    get everything and the others nothing)."""
    if lanes <= 1:
        return largest
    return max(1, min(largest, sum(counts) // (CHUNKS_PER_LANE * lanes)))


def _work_chunk_size(
    names: Sequence[str], counts: Sequence[int], weights: Sequence[float], chunk_size: int | None, lanes: int,
    window: int | None = None,
) -> tuple[int, int]:
    """``(chunk size, the largest size the data allows)``: the configured size checked, or the chosen one
    (no larger than ``window``, the records asked for between flushes, when given)."""
    shares = _shares(weights)
    largest = _largest_servable_chunk_size(counts, shares, DEFAULT_CHUNK_SIZE)
    upper = _lane_cap(largest, counts, lanes)
    if chunk_size is None:
        return choose_chunk_size(counts, weights, upper=upper if window is None else min(upper, window)), upper
    if chunk_size > largest:
        short = [
            f"{name!r} has {n} records, needs {_liveness_required(s, chunk_size)}"
            for name, n, s in zip(names, counts, shares, strict=True)
            if n < _liveness_required(s, chunk_size)
        ]
        raise ValueError(
            _err("dataloader.chunk_size", chunk_size, f"at most {largest} for these sources ({'; '.join(short)})",
                 "Set chunk_size: null to choose the largest size that fits, or add data.")
        )
    split = _split_pass(counts, shares, chunk_size)
    if split is not None:
        index, reason = split
        chosen, below = (choose_chunk_size(counts, weights, upper=u) for u in (upper, chunk_size))
        raise ValueError(
            _err("dataloader.chunk_size", chunk_size, "a size with which every pass of every source is read whole",
                 f"With it, Zephon can skip the end of a pass of sources[{index}] ({names[index]!r}): "
                 f"{reason}. Set chunk_size: null (picks {chosen} here)"
                 + (f" or chunk_size: {below}." if below != chosen else "."))
        )
    return chunk_size, upper


#: Zephon ``RuntimeOptions`` keys of the data-parallel layout (set by :func:`lane_options` only).
DP_OPTION_KEYS = frozenset(
    {"world_size", "global_rank", "dp_degree", "dp_group_id", "canonical_replicas", "aggregate_dir",
     "aggregate_store", "run_id"}
)


def lane_options(
    dp_rank: int, dp_world_size: int, *, canonical_replicas: int | None, aggregate_dir: str | None,
    aggregate_store: str | None, run_id: str | None,
) -> dict[str, Any]:
    """Zephon ``RuntimeOptions`` giving this data-parallel rank its lane(s).

    Zephon's world is the data-parallel group: tensor/pipeline peers of a DP
    rank read the same lane, and only one of them saves its state (AutoModel
    saves loader state on TP0/PP0 per DP rank), so the checkpoint collective
    spans DP ranks only.

    Raises:
        ValueError: ``canonical_replicas`` not a multiple of ``dp_world_size``;
            both or neither of ``aggregate_dir``/``aggregate_store`` with several ranks.
    """
    replicas = dp_world_size if canonical_replicas is None else canonical_replicas
    if replicas % dp_world_size:
        raise ValueError(
            _err("dataloader.distributed.canonical_replicas", replicas, f"a multiple of the data-parallel size {dp_world_size}",
                 "Pick canonical_replicas divisible by every DP size you will resume with (e.g. 8 for 1, 2, 4, 8).")
        )
    if aggregate_dir is not None and aggregate_store is not None:
        raise ValueError(_err("dataloader.distributed.aggregate_dir/aggregate_store", (aggregate_dir, aggregate_store),
                              "at most one", "Drop one."))
    if dp_world_size > 1 and aggregate_dir is None and aggregate_store is None:
        raise ValueError(
            _err("dataloader.distributed.aggregate_dir", None, f"a shared directory (or aggregate_store) with {dp_world_size} "
                 "data-parallel ranks",
                 "Zephon checkpoints are collective across ranks; set distributed.aggregate_dir: <shared fs path> "
                 "or distributed.aggregate_store: torch:// (with torch.distributed initialized).")
        )
    options: dict[str, Any] = {}
    if dp_world_size > 1 or canonical_replicas is not None:
        options.update(world_size=dp_world_size, global_rank=dp_rank, dp_degree=dp_world_size,
                       dp_group_id=dp_rank, canonical_replicas=replicas)
    if aggregate_dir is not None:
        options["aggregate_dir"] = aggregate_dir
    if aggregate_store is not None:
        options["aggregate_store"] = aggregate_store
    if run_id is not None:
        options["run_id"] = run_id
    return options
