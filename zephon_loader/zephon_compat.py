"""Zephon 0.2 as this package sees it: its API's key names, and the one place that touches its private names.

No other module of the package imports ``zephon._internal`` or reads a
private attribute of a Zephon object: each such use is a named function or
constant here, with what it wraps and why no public API serves. A Zephon
upgrade is checked in this file.

* :class:`ZephonKeys`: Zephon's payload and ``to_training`` key names.
* Pipeline internals: :func:`runtime_options` (its ``RuntimeOptions``),
  :func:`set_records_per_call` (records per tokenize call),
  :func:`close_engine` (stop its engine from another thread).
* Checkpoints: :func:`check_engine_state` (Zephon's checkpoint schema),
  :func:`release_rounds` (what an engine retains of its last round),
  :func:`local_position` and :func:`checkpoint_at` (a checkpoint as of an
  earlier batch: the position before the loader's read-ahead);
  :func:`local_checkpoint`, :func:`checkpoint_lanes`, :func:`lanes_of_checkpoint`
  and :func:`merge_lane_checkpoints` (a rank's own lanes, no collective).
* Cross-rank rounds: :func:`round_coordinator`, :func:`aggregate_round`
  (the transport of Zephon's own checkpoint collective).
* Errors and logs: :func:`worker_crash_info` (an operator's error re-raised
  by the process runner), :data:`ZEPHON_PACK_LOGGER`.
* Readers: :func:`jsonl_suffixes` (the file names Zephon reads as JSONL),
  :func:`compression_of` and :func:`decompress_to` (its shard decoders),
  :func:`forget_catalog` (its cached shard catalog of a folder),
  :func:`jsonl_reader_module` (its JSONL reader, made to keep undecodable bytes).
* Object storage: :func:`store_objects` (a prefix's objects with their ETags, through the client Zephon
  reads with), :func:`read_object_range` and :func:`read_object` (an object's bytes).

Imports nothing from :mod:`zephon_loader`; Zephon itself is imported inside
the functions that need it, so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = [
    "ZEPHON_LOSS_MASK_KEY",
    "ZEPHON_PACK_LOGGER",
    "WINDOW_WARNINGS",
    "ZEPHON_TOKENS_KEY",
    "ZephonKeys",
    "aggregate_round",
    "check_engine_state",
    "checkpoint_at",
    "close_engine",
    "explained_window_warnings",
    "lanes_out_of_step",
    "warn_resuming_mid_window",
    "warn_taken_mid_window",
    "import_ray_runner",
    "jsonl_suffixes",
    "checkpoint_lanes",
    "lanes_of_checkpoint",
    "local_checkpoint",
    "local_position",
    "merge_lane_checkpoints",
    "read_object",
    "release_rounds",
    "round_coordinator",
    "read_object_range",
    "runtime_options",
    "set_records_per_call",
    "store_objects",
    "worker_crash_info",
]


class ZephonKeys:
    """Zephon 0.2.0's own payload and ``to_training`` key names.

    These are Zephon's API names, not zephon_loader batch fields (those live in
    :mod:`zephon_loader.fields`); some coincide today. Kept in this one place so
    a Zephon rename is a one-line change.
    """

    #: Token field emitted by tokenize/tokenize_chat, read by pack_flat, emitted by to_training.
    TOKENS = "input_ids"
    #: Per-token supervision mask from tokenize_chat; consumed by to_training(return_labels=True).
    LOSS_MASK = "loss_mask"
    #: Segment-local positions from pack_flat(emit_positions=True).
    POSITIONS = "positions"
    LABELS = "labels"
    PADDING_MASK = "padding_mask"
    CU_SEQLENS = "cu_seqlens"
    MAX_SEQLEN = "max_seqlen"
    IDS = "ids"
    TEXTS = "texts"


ZEPHON_TOKENS_KEY = ZephonKeys.TOKENS
ZEPHON_LOSS_MASK_KEY = ZephonKeys.LOSS_MASK


#: The logger Zephon 0.2's ``PackSequences`` operator writes its packing notices to (its module's
#: ``__name__``, under ``zephon._internal.ops``). Zephon has no public logger or hook for these notices.
ZEPHON_PACK_LOGGER = "zephon._internal.ops.pack_sequences"

#: The suffix Zephon reads as JSONL when :func:`jsonl_suffixes` cannot ask it.
_JSONL_SUFFIX = ".jsonl"


def runtime_options(pipeline: Any) -> Any:
    """The ``zephon.options.RuntimeOptions`` of a ``zephon.Pipeline`` (live, not a copy).

    Zephon 0.2 keeps them in ``Pipeline._options``; its public
    ``Pipeline.options(**hints)`` only sets them, and nothing reads them back.
    The loader needs them to know its ranks, lanes, runners and aggregation
    transport.
    """
    return pipeline._options


def set_records_per_call(pipeline: Any, records: int) -> None:
    """Make the tokenize op just added to ``pipeline`` (its tail) take at most ``records`` records per call.

    Zephon 0.2's ``TokenizeText``/``TokenizeChat`` take ``max_batch`` (default 64) but ``Pipeline.tokenize``
    and ``tokenize_chat`` do not pass it; in deterministic mode (the loader's) the op's accumulator waits for a
    full ``max_batch`` before each call, so the first batch waited for 64 documents to be read and tokenized
    (on long documents: seconds, and their text and tokens held at once). Sets the op's ``_max_batch``
    (``TokenizeBase``), read when Zephon builds the accumulator at engine start.

    Raises:
        RuntimeError: The tail is not a tokenize op with that attribute (a Zephon upgrade changed it).
    """
    op = getattr(getattr(pipeline, "_tail", None), "op", None)
    if not hasattr(op, "_max_batch"):
        raise RuntimeError(f"zephon_loader: Zephon's tokenize op has no _max_batch (got {type(op).__name__}); "
                           "this Zephon version is not the one zephon_loader was written for (0.2)")
    op._max_batch = int(records)


def import_ray_runner() -> None:
    """Import Zephon 0.2's Ray runner (``zephon._internal.runners.ray``: ``RemoteStageRunner``, which imports
    ``ray`` and cloudpickle), so that a missing piece fails at the build rather than when the engine places the
    tokenize stage. Raises ``ImportError`` as the import does."""
    import zephon._internal.runners.ray  # noqa: F401


def close_engine(pipeline: Any) -> None:
    """Close a ``zephon.Pipeline``'s engine from any thread, so that a ``next()`` blocked in it returns soon.

    Wraps ``Pipeline._engine.close()``: Zephon 0.2 has no public call for this,
    and ``close()`` of its engine is what Zephon itself calls from a thread
    other than the iterating one (its final prefetch buffer's ``on_stop``).
    Does nothing before Zephon built its engine (early in the first ``next()``).
    """
    engine = getattr(pipeline, "_engine", None)
    if engine is not None:
        engine.close()


def check_engine_state(checkpoint: Mapping[str, Any]) -> None:
    """Raise Zephon's own error unless ``checkpoint`` passes Zephon 0.2's checkpoint schema; starts nothing.

    Wraps ``zephon._internal.checkpoint.EngineStateV2.load``: Zephon's public
    ``Pipeline.restore`` checks the schema only when it applies the state, and
    the loader checks a state when it is loaded, long before it is applied.
    """
    from zephon._internal.checkpoint import EngineStateV2

    EngineStateV2.load(checkpoint)


def local_position(pipeline: Any, *, prime: bool = False) -> dict[str, Any]:
    """This rank's share of the checkpoint at this instant, without a collective.

    Wraps ``Engine._state_dict_local()``: the per-rank shard that Zephon 0.2's
    ``checkpoint()`` merges across ranks (every lane this rank owns: progress,
    in-flight chunks, work-source cursors; JSON-able). Taken right after a
    batch left the pipeline's iterator, it is the position "that batch
    delivered, the next one not": the loader keeps one now and then, so a
    state can be cut before its read-ahead (:func:`checkpoint_at`) instead of
    carrying the pulled batches. Zephon has no public call for a local,
    non-collective position. Zephon builds the shard afresh (its schemas'
    ``to_dict``), so it is kept without a copy (``tests/test_source.py``
    checks that a shard does not change as the engine moves on); about 2 ms
    for 8 lanes.

    Args:
        prime: Nothing was pulled since the pipeline's ``iter()``: build its
            engine first and apply a pending ``restore()`` to it, as
            ``checkpoint()`` and the first ``next()`` do (``Pipeline._ensure``,
            ``Engine.load_state_dict(..., replay=True)``); the iteration then
            continues on that engine. An engine left over from an earlier
            iteration is closed, so it is replaced.
    """
    if prime:
        pending = getattr(pipeline, "_pending_restore", None)
        engine = getattr(pipeline, "_engine", None)
        if pending is not None or engine is None or engine._closed:
            pipeline._prime_worksource()
            pipeline._ensure()
            if pending is not None:
                with explained_window_warnings():  # Zephon's "resuming a mid-window checkpoint", explained
                    pipeline._engine.load_state_dict(pending, replay=True)
                pipeline._pending_restore = None
    return pipeline._engine._state_dict_local()


def checkpoint_at(
    pipeline: Any,
    local: Mapping[str, Any],
    *,
    extra: tuple[str, Any, Callable[[list[Any]], Any]],
) -> tuple[dict[str, Any], Any]:
    """Zephon's checkpoint of the position ``local`` (a :func:`local_position`) describes. A collective.

    What ``pipeline.checkpoint()`` would have returned at the instant
    ``local`` was taken: every rank contributes its shard to Zephon's own
    round (``Engine._coordinator.aggregate`` with ``Engine._merge_state_dicts``,
    the same ranks, storage, timeout and checks as ``checkpoint()``), and the
    merged result covers every lane. The round bookkeeping a shard carries
    (``last_round_id``, ``checkpoint_reload_count``) is this instant's, as in a
    fresh shard. A single rank merges nothing (Zephon's own local path,
    including its mid-window check).

    Args:
        pipeline: The ``zephon.Pipeline`` whose engine took ``local``.
        local: This rank's shard.
        extra: ``(key, value, merge)``: a JSON-able ``value`` of this rank's
            that travels in the same round under ``key``; the leader merges all
            ranks' values (in global-rank order) with ``merge``. One round
            instead of two.

    Returns:
        ``(checkpoint, merged extra)``; the extra is ``merge([value])`` on a
        single rank.

    Raises:
        RuntimeError: Zephon's coordinator failed (a timeout naming the missing ranks, unreadable storage).
    """
    from zephon._internal.coordination import AggregationRound

    engine = pipeline._engine
    shard = local_checkpoint(pipeline, local)
    if not engine._takes_part_in_rounds():
        if engine._owned_lanes:
            engine._check_mid_window_counts(shard.get("lane_emitted") or {}, int(engine._world.canonical_replicas))
        return shard, extra[2]([extra[1]])
    key, shard[extra[0]] = extra[0], extra[1]

    def merge(shards: list[dict[str, Any]]) -> dict[str, Any]:
        ordered = sorted(shards, key=lambda s: int(s["world"]["global_rank"]))
        values = [s.get(key) for s in ordered]
        merged = engine._merge_state_dicts([{k: v for k, v in s.items() if k != key} for s in shards])
        merged[key] = extra[2](values)
        return merged

    merged = engine._coordinator.aggregate(
        AggregationRound(
            local=shard,
            is_leader=int(engine._world.global_rank) == 0,
            expected_ranks=frozenset(range(int(engine._world.world_size))),
            expected_lanes=frozenset(range(int(engine._world.canonical_replicas))),
        ),
        merge=merge,
    )
    merged = dict(merged)
    value = merged.pop(key, None)
    return merged, value


#: Zephon 0.2's checkpoint entries keyed by lane (``EngineStateV2``): a rank restores only the lanes it owns from
#: them (``Engine.load_state_dict`` reads owned lanes only; ``progress``, ``lane_next_cid`` and ``lane_ws_state``
#: are required for each, the others optional).
LANE_KEYED = ("progress", "lane_next_cid", "lane_ws_state", "inflight", "replay_cursors", "epoch_boundaries",
              "lane_emitted")


def local_checkpoint(pipeline: Any, local: Mapping[str, Any]) -> dict[str, Any]:
    """Zephon's checkpoint of this rank's lanes at the position ``local`` (a :func:`local_position`); no collective.

    What :func:`checkpoint_at` sends into Zephon's round, without the round: the shard with the round
    bookkeeping (``last_round_id``, ``checkpoint_reload_count``) of this instant. It restores the lanes it
    holds (:func:`lanes_of_checkpoint`); a job's shards merge with :func:`merge_lane_checkpoints`.
    """
    engine = pipeline._engine
    shard = dict(local)
    shard["last_round_id"] = engine._last_round_id
    shard["checkpoint_reload_count"] = engine._checkpoint_reload_count
    return shard


def checkpoint_lanes(checkpoint: Mapping[str, Any]) -> frozenset[int]:
    """The lanes a Zephon checkpoint holds (its ``progress`` keys; a merged checkpoint: every lane)."""
    return frozenset(int(lane) for lane in (checkpoint.get("progress") or {}))


def lanes_of_checkpoint(checkpoint: Mapping[str, Any], lanes: Any) -> dict[str, Any]:
    """A copy of ``checkpoint`` holding only ``lanes``: its lane-keyed entries (:data:`LANE_KEYED`) cut to them,
    of ``rr_next_idx`` (Zephon's round-robin position per owner, keyed ``"<worker>/<active>:<lanes>"``) the
    entries of owners whose lanes are among them, of a shard's ``world.mapping`` (DP group -> lanes; Zephon reads
    only ``world.canonical_replicas`` on load) the groups holding them. Everything else is job-wide and kept."""
    wanted = {int(lane) for lane in lanes}
    out = dict(checkpoint)
    for key in LANE_KEYED:
        entries = checkpoint.get(key)
        if isinstance(entries, Mapping):
            out[key] = {lane: value for lane, value in entries.items() if int(lane) in wanted}
    rr = checkpoint.get("rr_next_idx")
    if isinstance(rr, Mapping):
        out["rr_next_idx"] = {key: value for key, value in rr.items() if _rr_lanes(key) <= wanted}
    world = checkpoint.get("world")
    if isinstance(world, Mapping) and isinstance(world.get("mapping"), Mapping):  # every DP group's lanes: O(lanes)
        out["world"] = {**world, "mapping": {group: lanes for group, lanes in world["mapping"].items()
                                             if {int(lane) for lane in lanes} & wanted}}
    return out


def _rr_lanes(key: Any) -> set[int]:
    """The lanes of a ``rr_next_idx`` key (``Engine._rr_key``: ``"<worker>/<active>:<lane>,<lane>,..."``)."""
    try:
        return {int(lane) for lane in str(key).split(":", 1)[1].split(",") if lane}
    except (IndexError, ValueError):
        return {-1}  # not Zephon 0.2's format: kept only by a checkpoint of every lane


def merge_lane_checkpoints(checkpoints: list[Mapping[str, Any]]) -> dict[str, Any]:
    """One Zephon checkpoint holding the lanes of each of ``checkpoints`` (ranks' :func:`local_checkpoint`, or
    cuts of them), without a collective or an engine: what ``Engine._merge_state_dicts`` makes of a round's shards,
    for the lanes given (not necessarily all).

    Raises:
        ValueError: Another lane count, another round (``last_round_id`` or ``checkpoint_reload_count``: not one
            instant of one job), or a lane in two of them with different entries. Each names the checkpoints.
    """
    from zephon._internal.checkpoint import EngineStateV2

    first = checkpoints[0]
    for index, checkpoint in enumerate(checkpoints[1:], start=1):
        for key in ("last_round_id", "checkpoint_reload_count"):
            if checkpoint.get(key) != first.get(key):
                raise ValueError(f"states[{index}]: Zephon's {key} is {checkpoint.get(key)!r}, states[0]'s "
                                 f"{first.get(key)!r}: not the same instant of one job")
        lanes = (checkpoint.get("world") or {}).get("canonical_replicas")
        if lanes != (first.get("world") or {}).get("canonical_replicas"):
            raise ValueError(f"states[{index}]: canonical_replicas {lanes!r}, states[0]'s "
                             f"{(first.get('world') or {}).get('canonical_replicas')!r}")
    merged = dict(first)
    merged["world"] = {"canonical_replicas": (first.get("world") or {}).get("canonical_replicas"),
                       "world_size": (first.get("world") or {}).get("world_size")}
    for key in (*LANE_KEYED, "rr_next_idx"):
        union: dict[Any, Any] = {}
        origin: dict[str, int] = {}
        for index, checkpoint in enumerate(checkpoints):
            for lane, value in (checkpoint.get(key) or {}).items():
                name = str(lane)
                if name in origin and union[name] != value:
                    raise ValueError(f"states[{index}] and states[{origin[name]}]: both hold {key}[{name}], with "
                                     "different values: not one instant of one job")
                origin.setdefault(name, index)
                union.setdefault(name, value)
        merged[key] = {(int(lane) if key != "rr_next_idx" else lane): value for lane, value in union.items()}
    EngineStateV2.load(merged)  # Zephon's schema holds
    return merged


def release_rounds(pipeline: Any) -> None:
    """Delete what the pipeline's engine retains of its last checkpoint round, now (idempotent).

    Wraps ``Engine._clean_merged()``: Zephon 0.2 does this in the engine's
    ``__del__``, whenever it is garbage-collected; at interpreter exit, after
    the process group (and the ``torch://`` store it meets at) is gone, the
    deletion waits for the store's full timeout (180 s). The loader calls this
    when it stops a pipeline, while the store is still up. Does nothing
    before Zephon built its engine.
    """
    engine = getattr(pipeline, "_engine", None)
    if engine is not None:
        engine._clean_merged()


def round_coordinator(
    options: Any, *, global_rank: int, world_size: int, plan_id: str, worker_info: Callable[[], tuple[int, int]]
) -> Any:
    """A coordinator of cross-rank rounds over the transport of ``options`` (``aggregate_dir`` or ``aggregate_store``).

    Wraps ``zephon._internal.coordination.make_coordinator``, what Zephon 0.2's
    ``checkpoint()`` collective runs on (the same ranks, storage and timeout).
    Zephon has no public collective; reusing this one needs no process group
    of the loader's own. Use it with :func:`aggregate_round`; release it with
    its ``cleanup()``.
    """
    from zephon._internal.coordination import make_coordinator

    return make_coordinator(
        options, global_rank=global_rank, world_size=world_size, plan_id=plan_id, worker_info=worker_info
    )


def aggregate_round(
    coordinator: Any,
    local: Mapping[str, Any],
    *,
    reload_count: int,
    is_leader: bool,
    expected_ranks: frozenset[int],
    expected_lanes: frozenset[int],
    merge: Callable[[list[dict[str, Any]]], dict[str, Any]],
) -> dict[str, Any]:
    """Run one round of a :func:`round_coordinator`: every rank's ``local`` shard, merged by the leader, on every rank.

    Wraps ``coordinator.reload_count`` (part of the round's namespace, as
    Zephon sets it from its checkpoint's ``checkpoint_reload_count``) and
    ``coordinator.aggregate(zephon._internal.coordination.AggregationRound(...))``.
    ``local`` must carry ``world`` (``global_rank``, ``dp_group_id``,
    ``mapping``) and ``progress`` (one key per lane): what Zephon checks the
    round's coverage with.

    Raises:
        RuntimeError: The coordinator failed (a timeout naming the missing
            ranks, unreadable storage).
    """
    from zephon._internal.coordination import AggregationRound

    coordinator.reload_count = reload_count
    return coordinator.aggregate(
        AggregationRound(
            local=local, is_leader=is_leader, expected_ranks=expected_ranks, expected_lanes=expected_lanes
        ),
        merge=merge,
    )


def worker_crash_info(error: BaseException) -> Any | None:
    """What Zephon 0.2's process runner says about an operator's exception, or ``None`` for any other error.

    That runner re-raises an exception of a worker process in the trainer as
    ``zephon._internal.runners.concurrent.WorkerCrashed``, a ``RuntimeError``
    whose ``info`` (a ``WorkerErrorInfo``) carries ``exc_type`` (the original
    class name, a str), ``message`` and ``traceback``. Zephon exports neither
    class; the type is recognized by its name, so this never imports Zephon.

    Returns:
        ``error.info`` when ``error`` is a ``WorkerCrashed`` carrying one, else ``None``.
    """
    if type(error).__name__ != "WorkerCrashed":
        return None
    return getattr(error, "info", None)


def jsonl_suffixes() -> tuple[str, ...]:
    """The file-name endings Zephon 0.2 reads as JSONL (e.g. ``.jsonl``, compressed variants).

    Wraps ``zephon._internal.io.suffixes.JSONL_SUFFIXES``: Zephon's public
    ``Dataset.from_path`` picks the reader from these endings but does not
    export them. ``(".jsonl",)`` when that private module is gone.
    """
    try:
        from zephon._internal.io.suffixes import JSONL_SUFFIXES

        return tuple(JSONL_SUFFIXES)
    except Exception:  # pragma: no cover - private module moved
        return (_JSONL_SUFFIX,)


def compression_of(name: str) -> str | None:
    """Zephon's compression name for a shard file name (``"gzip"`` for ``x.jsonl.gz``), ``None`` for a plain one.

    Wraps ``zephon._internal.utils.compression.compression_for_name`` (the endings its JSONL reader decodes).
    """
    from zephon._internal.utils.compression import compression_for_name

    return compression_for_name(name)


def decompress_to(source: Any, target: Any, compression: str) -> None:
    """Decode a compressed shard file into ``target`` with Zephon's own decoder (``decompress_file``)."""
    from zephon._internal.utils.compression import decompress_file

    decompress_file(source, target, compression)


def jsonl_reader_module() -> Any:
    """Zephon 0.2's JSONL format module (``zephon._internal.io.formats.jsonl``): :mod:`zephon_loader.pipeline.jsonl_text`
    replaces its ``_count_records`` and ``JsonlShard`` by versions that decode with ``surrogateescape``, so an
    undecodable byte reaches the record checks (which name its line) instead of failing inside the reader."""
    from zephon._internal.io.formats import jsonl

    return jsonl


def forget_catalog(root: str, kind: str) -> None:
    """Drop Zephon's pointer from a local dataset folder to its cached shard catalog (the catalog is rebuilt,
    records counted again, at the next engine start).

    Zephon 0.2 caches the catalog under ``{tempdir}/zephon-{uid}/catalog`` (or ``$ZEPHON_CATALOG_DIR``) keyed
    by the folder, its format and the names and sizes of its shards (``catalog.handle._source_key``): a
    same-size edit that changes the record count keeps the old key, and every later run on the machine fails
    ("Catalog ... disagrees with count-only discovery") until the folder is cleared by hand.
    """
    from zephon._internal.io.catalog import handle
    from zephon._internal.io.catalog.builder import DatasetHeader

    key = handle._source_key(DatasetHeader(name="", root=root, format=kind, path=root))
    pointer = handle._schema_dir(handle._catalog_dir()) / ".bykey" / f"{key}.fp"
    try:
        pointer.unlink(missing_ok=True)
    except OSError:  # another user's catalog folder: nothing cached for us there
        pass


_ROUTER: Any = None
_ROUTER_LOCK = threading.Lock()


def _router() -> Any:
    """One ``RouterStorageBackend`` per process (it caches a store per bucket, credentials resolved once)."""
    global _ROUTER
    with _ROUTER_LOCK:
        if _ROUTER is None:
            from zephon._internal.io.storage.router import RouterStorageBackend

            _ROUTER = RouterStorageBackend()
        return _ROUTER


def store_objects(url: str) -> list[dict[str, Any]]:
    """The objects directly under a prefix URL (``s3://bucket/prefix``), each ``{"name", "size", "e_tag",
    "last_modified"}`` (``last_modified`` a ``datetime``, ``e_tag`` as the store sends it, ``None`` when absent).

    Lists with the obstore client Zephon's own reader uses (``RouterStorageBackend._backend_for(url)
    ._get_store(bucket)``: the same credentials, region and ``S3_ENDPOINT_URL``): its public ``listdir``/``walk``
    give names and sizes but no ETag, which the resume fingerprint needs. One list request per 1,000 objects.
    Raises the store's own exception (obstore's), unchanged.
    """
    import obstore as obs
    from zephon._internal.io.storage._utils import split_url

    _, bucket, prefix = split_url(url)
    base = prefix if (not prefix or prefix.endswith("/")) else prefix + "/"
    store = _router()._backend_for(url)._get_store(bucket)
    out = []
    for chunk in obs.list(store, prefix=base):
        for obj in chunk:
            name = str(obj["path"])[len(base):] if str(obj["path"]).startswith(base) else ""
            if name and "/" not in name:
                out.append({"name": name, "size": int(obj["size"]), "e_tag": obj.get("e_tag"),
                            "last_modified": obj.get("last_modified")})
    return sorted(out, key=lambda o: o["name"])


def read_object(url: str) -> bytes:
    """A whole object's bytes, through the client Zephon reads with (for error paths: re-reading a line)."""
    import obstore as obs
    from zephon._internal.io.storage._utils import split_url

    _, bucket, key = split_url(url)
    return bytes(obs.get(_router()._backend_for(url)._get_store(bucket), key).bytes())


def read_object_range(url: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of an object (Zephon's ``RouterStorageBackend.read_range``; a local path works too)."""
    return bytes(_router().read_range(url, start, end=end))


#: Zephon 0.2's warnings about a checkpoint cut inside a global window (``engine.Engine``), and what they mean
#: for a loader's user: message prefix -> the explanation the loader warns with instead, once per process.
WINDOW_WARNINGS = {
    "[zephon] Checkpoint taken mid-window": (
        "zephon_loader: this state was taken inside a Zephon window (where it was cut, its lanes had delivered "
        "different numbers of batches: a step inside a window, or a read-ahead anchor a few batches back). "
        "Resuming it at the same data-parallel size is exact, batch for batch. At another size every row is still "
        "delivered exactly once, but the rest of the pass comes in another order than an uninterrupted run's."
    ),
    "[zephon] Resuming a mid-window checkpoint": (
        "zephon_loader: resuming at another data-parallel size a state taken inside a Zephon window (its lanes had "
        "delivered different numbers of batches where it was cut): every row is delivered exactly once, but the "
        "rest of the pass comes in another order than an uninterrupted run's at either size."
    ),
}
_TAKEN = "[zephon] Checkpoint taken mid-window"
_RESUMING = "[zephon] Resuming a mid-window checkpoint"
_explained: set[str] = set()
_explained_lock = threading.Lock()


def lanes_out_of_step(cuts: list[tuple[Mapping[str, Any], Mapping[str, int]]], canonical_replicas: int) -> bool:
    """Whether a state's lanes were out of step where it was cut: ``cuts`` are ``(checkpoint, skip)`` pairs (every
    old rank's of one instant, or one of every lane), a checkpoint at an anchor plus the batches per lane
    delivered after it. Out of step: the lanes' delivered counts at the cut (``lane_emitted`` + ``skip``)
    differ, or their counts at the anchor do (a resume re-produces each lane from its anchor and drops its
    ``skip`` batches, so lanes whose anchors lag fall behind the others by that many at another size).
    ``False`` unless every lane's count is known (Zephon's own rule)."""
    anchor: dict[int, int] = {}
    delivered: dict[int, int] = {}
    for checkpoint, skip in cuts:
        for lane, count in (checkpoint.get("lane_emitted") or {}).items():
            anchor[int(lane)] = int(count)
            delivered[int(lane)] = int(count) + int(skip.get(str(lane), skip.get(lane, 0)) or 0)
    if len(anchor) != canonical_replicas:
        return False
    return len(set(anchor.values())) > 1 or len(set(delivered.values())) > 1


def warn_resuming_mid_window(cuts: list[tuple[Mapping[str, Any], Mapping[str, int]]], canonical_replicas: int,
                             world_size: int) -> None:
    """Warn (explained, once per process) when a state whose lanes were out of step where it was cut
    (:func:`lanes_out_of_step`) is resumed at another world size than it was taken at. Zephon's restore warns
    only from the anchor's counts and only when it sees every lane (a rank restoring its own lanes does not)."""
    sizes = {(checkpoint.get("world") or {}).get("world_size") for checkpoint, _ in cuts} - {None}
    if sizes and sizes != {world_size} and lanes_out_of_step(cuts, canonical_replicas):
        with explained_window_warnings():
            warnings.warn(f"{_RESUMING} (the lanes were out of step where the state was cut)", RuntimeWarning,
                          stacklevel=2)


def warn_taken_mid_window(cut: tuple[Mapping[str, Any], Mapping[str, int]], canonical_replicas: int) -> None:
    """Warn (explained, once per process) when a state of every lane is cut with its lanes out of step
    (:func:`lanes_out_of_step`): Zephon's own warning sees only the anchor's counts."""
    if lanes_out_of_step([cut], canonical_replicas):
        with explained_window_warnings():
            warnings.warn(f"{_TAKEN} (the lanes were out of step where the state was cut)", RuntimeWarning,
                          stacklevel=2)


@contextlib.contextmanager
def explained_window_warnings(taken: bool = True) -> Iterator[None]:
    """Replace Zephon's mid-window checkpoint warnings raised inside with :data:`WINDOW_WARNINGS` (each once
    per process); every other warning is re-issued as it was.

    Zephon words them for its own engine ("will permute the remainder of the current global window"), which a
    user reads as "my data order changes": the loader says what a resume guarantees instead.

    Args:
        taken: Explain "checkpoint taken mid-window"; ``False`` drops it (a checkpoint the loader takes for
            itself, e.g. what the ranks carry into the next pass, is no state of the user's).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for record in caught:
        text = str(record.message)
        prefix = next((p for p in WINDOW_WARNINGS if text.startswith(p)), None)
        if prefix == _TAKEN and not taken:
            continue
        if prefix is None:
            warnings.warn_explicit(record.message, record.category, record.filename, record.lineno)
            continue
        with _explained_lock:
            first = prefix not in _explained
            _explained.add(prefix)
        if first:
            warnings.warn(WINDOW_WARNINGS[prefix], RuntimeWarning, stacklevel=3)
