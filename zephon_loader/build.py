"""Builders: configuration → contract → final-map settings → DP coordinates → Zephon pipeline → nodes → loader.

:func:`build_loader` is the one sequence, read top to bottom; what differs per
kind of record is asked of its :class:`~zephon_loader.stages.Stage`.
:func:`build_text_loader` and :func:`build_image_loader` read the config and
pick the stage. The packing contract is checked first, once, before any
Zephon source or worker starts: a loader that cannot serve the model never
begins reading data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import shutil
from functools import partial
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping

from zephon_loader.config import ImageLoaderConfig, LoaderConfig, TextLoaderConfig, read_loader_config
from zephon_loader.contract import PackingContract, validate_packing_contract
from zephon_loader.finalize import FinalizeSettings
from zephon_loader.loader import ImageLoader, ZephonLoader
from zephon_loader.nodes.source import PhasePlan, ZephonSource
from zephon_loader.pipeline.digests import PendingShards
from zephon_loader.pipeline.text import DataParallel
from zephon_loader.schedule import phase_ends, phase_lengths, phase_run_id_suffix, phase_seed, schedule_fingerprint
from zephon_loader.stages import ImageStage, Stage, TextStage
from zephon_loader.stats import CountingCollate, LoaderStats
from zephon_loader.tokenizing import fit_tokenizer_threads
from zephon_loader.workdirs import make_work_dir

__all__ = ["build_image_loader", "build_loader", "build_text_loader", "data_parallel",
           "epoch_run_id_suffix", "epoch_seed", "resolve_contract", "stream_fingerprint"]


def build_loader(
    cfg: LoaderConfig,
    stage: Stage,
    *,
    packing_contract: object | None = None,
    dp_rank: int | None = None,
    dp_world_size: int | None = None,
    dp_group: Any = None,
    collate_wrapper: Callable | None = None,
    dataset_build_context: ContextManager[Any] | None = None,
    pin_memory: bool | None = None,
    loader_class: type[ZephonLoader] | None = None,
) -> ZephonLoader:
    """Build a loader of ``cfg`` with ``stage`` (see :func:`build_text_loader` for the arguments).

    Steps, in order; nothing reads data before every check passed:

    1. the contract: the model's or the YAML's (:func:`resolve_contract`), and the stage's refusals;
    2. the final-map settings it implies (eligibility as far as known: a processor may add it in step 4);
    3. this rank's data-parallel coordinates (:func:`data_parallel`);
    4. inside ``dataset_build_context`` (entered once): the tokenizer threads fitted to the machine
       (:func:`~zephon_loader.tokenizing.fit_tokenizer_threads`), the stage's ``prepare`` (tokenizer folder,
       processor), then the Zephon pipeline, in a work folder the loader owns;
    5. the final-map settings again, if the processor brought eligibility;
    6. the nodes and the loader: source (rebuilt per epoch), collate, final map, accounting, fingerprint
       (the shard digests it lacks are hashed in the background after the first batch:
       :mod:`zephon_loader.pipeline.digests`).

    Raises:
        TypeError/ValueError: Bad configuration, contract or processor, before anything starts.
    """
    contract = resolve_contract(cfg, packing_contract)
    stage.check_contract(contract)
    finalize = partial(
        FinalizeSettings.from_contract,
        contract,
        xdoc=cfg.xdoc,
        return_packed_sequence_metadata=cfg.return_packed_sequence_metadata,
        return_source_ids=cfg.return_source_ids,
        micro_batch_size=stage.micro_batch_size,
        sequence_length=cfg.sequence_length,
        block_mask_budget_bytes=cfg.block_mask_budget_bytes,
    )
    eligibility = stage.attention_eligibility
    settings = finalize(attention_eligibility=eligibility)
    dp = data_parallel(cfg, dp_rank, dp_world_size, dp_group)

    owned: list[str] = []
    try:
        with dataset_build_context or contextlib.nullcontext():
            fit_tokenizer_threads()  # before anything tokenizes (the library's pool is off on 1-2 cores)
            stage.prepare(owned)
            if stage.attention_eligibility != eligibility:  # refuses contracts that cannot exclude a token in a record
                settings = finalize(attention_eligibility=stage.attention_eligibility)
            work_dir = make_work_dir(stage.work_prefix)  # swept at the next build if this process dies
            owned.append(work_dir)
            schedule = cfg.schedule
            ends = (phase_ends(schedule, lanes=cfg.distributed.canonical_replicas or dp.size,
                               micro_batch_size=stage.micro_batch_size, sequence_length=cfg.sequence_length)
                    if schedule is not None else None)
            built = stage.build_pipeline(work_dir=work_dir, dp=dp,
                                         weights=schedule[0].weights if schedule is not None else None)
            if schedule is not None:  # every phase's work source now: a weight no chunk size serves fails here
                for phase in range(1, len(schedule)):
                    stage.build_pipeline(work_dir=work_dir, dp=dp, weights=schedule[phase].weights)
    except BaseException:
        _close(owned, stage)
        raise

    def pipeline_for_epoch(epoch: int) -> Any:
        """The Zephon pipeline of one epoch: the same data and lanes, the epoch's shuffle seed."""
        return stage.build_pipeline(work_dir=work_dir, dp=dp, seed=epoch_seed(cfg.seed, epoch),
                                    run_id_suffix=epoch_run_id_suffix(epoch)).pipeline

    def pipeline_for_phase(phase: int) -> Any:
        """The Zephon pipeline of a mixture schedule's phase: the same data and lanes, the phase's weights,
        seed and run id."""
        assert schedule is not None
        return stage.build_pipeline(work_dir=work_dir, dp=dp, seed=phase_seed(cfg.seed, phase),
                                    run_id_suffix=phase_run_id_suffix(phase), weights=schedule[phase].weights).pipeline

    assert stage.sources is not None  # opened by the first build_pipeline()
    # The shard digests: known now (cache, manifest), or hashed in the background after the first batch; until
    # then the fingerprint holds each shard's name and size, and the loader waits for them in state_dict().
    shards = PendingShards(stage.sources.files)
    ready = shards.ready()
    fingerprint = stream_fingerprint(cfg, shards.result() if ready else shards.outline(), dp, contract,
                                     stage.micro_batch_size, stage.fingerprint(built))
    owned_digests = None if ready else shards
    if schedule is not None:
        assert ends is not None
        fingerprint["mixture"] = "schedule"
        fingerprint["schedule"] = schedule_fingerprint(schedule, ends)
        source = ZephonSource(built.pipeline, built.shards,
                              phases=PhasePlan(pipeline_for_phase, phase_lengths(ends)))
    else:
        source = ZephonSource(built.pipeline, built.shards, pipeline_for_epoch=pipeline_for_epoch)
    if loader_class is None:
        loader_class = stage.loader_class
    elif not (isinstance(loader_class, type) and issubclass(loader_class, stage.loader_class)):
        raise TypeError(f"loader_class: got {loader_class!r}, expected a subclass of {stage.loader_class.__name__}")
    loader = loader_class(
        source,
        CountingCollate(stage.collate(built), phase_of=(lambda: source.phase) if schedule is not None else None),
        settings,
        read_ahead=cfg.read_ahead,
        collate_wrapper=collate_wrapper,
        fingerprint=fingerprint,
        shard_digests=owned_digests,
        pin_memory=pin_memory,
        on_close=partial(_close, owned, stage, owned_digests),
        stats=LoaderStats([source.name for source in cfg.sources], built.drop_log, reasons=stage.drop_reasons()),
        single_rank_by_default=dp.defaulted,
        # Ranks in step at every pass end (a pass without end needs no agreement).
        even_passes=cfg.passes is not None and cfg.distributed.even_passes and dp.size > 1,
        state_scope=cfg.distributed.state_scope,
        **stage.loader_kwargs(),
    )
    close_first = getattr(stage, "close_first", None)
    if close_first is not None:  # runner: ray: closed at exit while Ray is up (pipeline/ray_runner.py)
        close_first(loader._finalizer)
    return loader


def build_text_loader(
    config: TextLoaderConfig | Mapping[str, Any] | str | Path,
    *,
    packing_contract: object | None = None,
    tokenizer: Any = None,
    dp_rank: int | None = None,
    dp_world_size: int | None = None,
    dp_group: Any = None,
    collate_wrapper: Callable | None = None,
    dataset_build_context: ContextManager[Any] | None = None,
    pin_memory: bool | None = None,
    loader_class: type[ZephonLoader] | None = None,
) -> ZephonLoader:
    """Build a :class:`~zephon_loader.loader.ZephonLoader` for text (or pretokenized, or chat) sources.

    Args:
        config: A :class:`~zephon_loader.config.TextLoaderConfig`, its YAML
            mapping, or a YAML path (its ``dataloader`` section, relative
            paths resolved against the file's folder).
        packing_contract: The model's contract; ``None`` uses the YAML's
            ``contract`` (default: block-causal, no metadata).
        tokenizer: The recipe's tokenizer, used when the YAML names none.
        dp_rank: This rank's data-parallel rank (with ``dp_world_size``); Zephon
            gives each DP rank its own lane(s). Unset (both): taken from
            ``torch.distributed``'s default group when it is initialized
            (then ``aggregate_store`` defaults to ``torch://`` and ``run_id``
            to one derived from the config, the same on every rank), else a
            single rank. With several ranks and explicit coordinates set
            ``distributed.aggregate_dir`` or ``aggregate_store``.
        dp_world_size: The data-parallel size (given with ``dp_rank``).
        dp_group: Instead of the two: the data-parallel ``ProcessGroup`` or
            1-D ``DeviceMesh`` (e.g. ``mesh["dp"]``) whose rank and size they are.
        collate_wrapper: AutoModel-style wrapper applied to each yielded batch.
        dataset_build_context: Entered while the Zephon pipeline is built (AutoModel's rank ordering).
        pin_memory: ``None`` = pin when CUDA is available.
        loader_class: A :class:`~zephon_loader.loader.ZephonLoader` subclass to build (default: that class);
            e.g. a flavour that is also a ``StatefulDataLoader`` for a slot that checks for one.

    Raises:
        TypeError/ValueError: Bad configuration or contract, before anything starts.
    """
    cfg = read_loader_config(config)
    with _errors_name_the_file(config):
        return build_loader(cfg, TextStage(cfg, tokenizer), packing_contract=packing_contract, dp_rank=dp_rank,
                            dp_world_size=dp_world_size, dp_group=dp_group, collate_wrapper=collate_wrapper,
                            dataset_build_context=dataset_build_context, pin_memory=pin_memory,
                            loader_class=loader_class)


def build_image_loader(
    config: ImageLoaderConfig | Mapping[str, Any] | str | Path,
    *,
    packing_contract: object | None = None,
    processor: Any = None,
    get_rope_index: Callable[..., Any] | None = None,
    dp_rank: int | None = None,
    dp_world_size: int | None = None,
    dp_group: Any = None,
    collate_wrapper: Callable | None = None,
    dataset_build_context: ContextManager[Any] | None = None,
    pin_memory: bool | None = None,
    micro_batch_size: int | None = None,
    model_path: str | None = None,
    loader_class: type[ImageLoader] | None = None,
) -> ImageLoader:
    """Build an :class:`ImageLoader` over JSONL (image paths) or Parquet (image bytes) image-text shards.

    Args:
        config: An :class:`~zephon_loader.config.ImageLoaderConfig`, its
            YAML mapping, or a YAML path (its ``dataloader`` section).
        packing_contract: The model's contract; ``None`` uses the YAML's
            ``contract`` (default: block-causal, no metadata).
        processor: A record processor object (:mod:`zephon_loader.processors`);
            ``None``: the YAML's ``processor``.
        get_rope_index: The model's ``get_rope_index``; when given, positions of
            every record come from it (the processor must have ``bind_get_rope_index``).
        dp_rank: As for :func:`build_text_loader`.
        dp_world_size: As for :func:`build_text_loader`.
        dp_group: As for :func:`build_text_loader`.
        collate_wrapper: AutoModel-style wrapper applied to each yielded batch.
        dataset_build_context: Entered while the processor and the Zephon pipeline are built.
        pin_memory: ``None`` = pin when CUDA is available.
        micro_batch_size: ``B`` when the YAML leaves it unset (the recipe's batch
            size); both given must agree.
        model_path: The recipe's model folder: the built-in processor's folder
            when the YAML names none (a hub id is refused).
        loader_class: An :class:`ImageLoader` subclass to build (default: that class).

    Raises:
        TypeError/ValueError: Bad configuration, contract or processor, before anything starts.
    """
    cfg = read_loader_config(config, ImageLoaderConfig)
    with _errors_name_the_file(config):
        stage = ImageStage(cfg, processor=processor, get_rope_index=get_rope_index,
                           micro_batch_size=micro_batch_size, model_path=model_path)
        return build_loader(cfg, stage, packing_contract=packing_contract, dp_rank=dp_rank,  # type: ignore[return-value]
                            dp_world_size=dp_world_size, dp_group=dp_group, collate_wrapper=collate_wrapper,
                            dataset_build_context=dataset_build_context, pin_memory=pin_memory,
                            loader_class=loader_class)


@contextlib.contextmanager
def _errors_name_the_file(config: Any) -> Any:
    """A configuration error (``dataloader.<key>: got ..., expected ...``) raised while building from a YAML
    file names the file first, as the reader's own errors do."""
    try:
        yield
    except (TypeError, ValueError) as error:
        message = str(error)
        if isinstance(config, (str, Path)) and message.startswith("dataloader."):
            raise type(error)(f"{Path(config).expanduser().resolve()}: {message}") from error
        raise


def resolve_contract(config: LoaderConfig, packing_contract: object | None) -> PackingContract:
    """The contract to serve: the model's (``packing_contract``) or the configured one.

    A model contract without ``qkv_format`` (AutoModel 0.7.0's
    ``PackingCapabilities`` has none) takes the YAML's ``qkv_format``: THD is a
    layout the loader adds on top of the mask representation.

    Returns:
        The contract as a frozen :class:`~zephon_loader.packing.PackingContract`:
        the model's is validated here (its one check), the YAML's was when the
        configuration built it. Nothing downstream validates it again.

    Raises:
        TypeError/ValueError: The model's contract is malformed, or both are
            given and disagree on mask type or metadata (the model's contract
            wins only when the YAML leaves ``contract`` unset).
    """
    if packing_contract is None:
        return config.packing_contract()
    model = PackingContract.of(packing_contract)
    if model.cp_size > 1 and config.cp_multiple != model.cp_padding:
        raise ValueError(
            f"dataloader.contract.cp_size: the model's contract declares cp_size {model.cp_size} but the YAML "
            f"{'does not' if not config.cp_multiple else 'declares ' + str(config.cp_multiple // 2)}; set "
            f"contract.cp_size: {model.cp_size} (the pipeline pads documents before packing, so it must know)"
        )
    if config.contract is None:
        return model
    configured = config.packing_contract()
    if not hasattr(packing_contract, "qkv_format") and configured.qkv_format != model.qkv_format:
        model = dataclasses.replace(model, qkv_format=configured.qkv_format)
    # The loader-side options (seq_idx, cp_size) come from the YAML when the model's contract does not name them.
    loader_side = {name: getattr(configured, name) for name in ("seq_idx", "cp_size")
                   if not hasattr(packing_contract, name)}
    if loader_side:
        model = dataclasses.replace(model, **loader_side)
    if model != configured:
        raise ValueError(
            f"dataloader.contract: the YAML asks for {configured} but the model requires {model}; remove 'contract' from the YAML to follow the model, or make them agree"
        )
    return model


def stream_fingerprint(
    cfg: LoaderConfig, shards: Mapping[str, Any], dp: DataParallel, contract: object, micro_batch_size: int, specific: Mapping[str, Any]
) -> dict[str, Any]:
    """What fixes a loader's batch stream, as JSON: a state saved under another one is refused.

    The keys every loader shares (sources and their shard contents, lanes, shapes,
    order, contract), then the builder's own (``specific``: tokenizer, processor,
    packing, label masking, ...). Shard contents, not paths: a run may resume
    where the data is mounted elsewhere (:mod:`zephon_loader.fingerprint`).
    ``mixture``, ``passes`` and ``flush_every_records`` are named only when not their defaults
    (``flush_every_records: 0``, Zephon's cadence, counts as its default: the stream states saved
    before the default window was shortened were saved with), so states saved before those keys
    existed still load.
    """
    fingerprint = {
        "sources": [[source.name, source.weight] for source in cfg.sources],
        "shards": dict(shards),
        "canonical_replicas": cfg.distributed.canonical_replicas or dp.size,
        "sequence_length": cfg.sequence_length,
        "micro_batch_size": micro_batch_size,
        "seed": cfg.seed,
        "shuffle": cfg.shuffle,
        "chunk_size": cfg.chunk_size,
        "contract": list(validate_packing_contract(contract)),
        "xdoc": cfg.xdoc,
        **specific,
    }
    for key, defaults in (("mixture", ("repeat",)), ("passes", (1,)), ("flush_every_records", (None, 0))):
        if key == "mixture" and cfg.schedule is not None:
            continue  # the builder adds the schedule's phases (schedule.schedule_fingerprint)
        if getattr(cfg, key) not in defaults:
            fingerprint[key] = getattr(cfg, key)
    return fingerprint


def data_parallel(
    cfg: LoaderConfig, dp_rank: int | None, dp_world_size: int | None, dp_group: Any = None
) -> DataParallel:
    """This rank's DP coordinates: the ones passed, else ``dp_group``'s, else torch.distributed's default
    group's, else the launcher's (:func:`launcher_coordinates`: torchrun's ``RANK``/``WORLD_SIZE``, for a
    loader built before the trainer initializes the group), else one rank.

    ``dp_group`` is the data-parallel ``ProcessGroup``, or a 1-D ``DeviceMesh``
    (e.g. ``mesh["dp"]``): its rank and size are the coordinates.

    When torch.distributed is initialized (coordinates passed or not), the
    aggregation store defaults to ``torch://`` (the process group's
    rendezvous) unless the YAML sets one. With several
    ranks the run id defaults to one derived from the config, identical on
    every rank that reads the same configuration.

    Raises:
        ValueError: Only one of the two passed; bad values; ``canonical_replicas``
            not a multiple of the DP size.
    """
    if (dp_rank is None) != (dp_world_size is None):
        raise ValueError(
            f"dp_rank/dp_world_size: got {dp_rank!r}/{dp_world_size!r}, expected both or neither "
            "(neither: taken from dp_group, or from torch.distributed when it is initialized)"
        )
    if dp_group is not None and dp_rank is not None:
        raise ValueError("dp_group: got a group and dp_rank/dp_world_size; expected one of them (the group's rank "
                         "and size are the coordinates)")
    import torch.distributed as dist

    configured = cfg.distributed
    explicit = dp_rank is not None
    initialized = dist.is_available() and dist.is_initialized()
    launched = None if initialized else launcher_coordinates()
    if dp_group is not None:
        dp_rank, dp_world_size = _group_coordinates(dp_group)
    elif dp_rank is None:
        if initialized:
            dp_rank, dp_world_size = dist.get_rank(), dist.get_world_size()
        else:
            dp_rank, dp_world_size = launched or (0, 1)
    # With a process group (also when the recipe passes DP coordinates under TP/CP, or when a launcher
    # started the ranks and the group comes later, before the first state), Zephon can meet at its
    # rendezvous store; without one, the YAML must name a shared folder or store.
    store = ("torch://" if (initialized or launched) and dp_world_size > 1  # type: ignore[operator]
             and configured.aggregate_dir is None and configured.aggregate_store is None else None)
    # Zephon's default run id is derived from the pipeline, which names per-process folders (the
    # work folder): ranks would not meet at the first checkpoint. Derive one from the config.
    run_id = f"zephon_loader-{_config_digest(cfg)}" if configured.run_id is None and dp_world_size > 1 else None
    # One rank only because nothing (arguments, group, process group, launcher) said otherwise: the loader
    # refuses to run if a process group of several ranks appears later.
    defaulted = dp_group is None and not initialized and launched is None and not explicit
    dp = DataParallel(dp_rank, dp_world_size, aggregate_store=store, run_id=run_id,  # type: ignore[arg-type]
                      defaulted=defaulted)
    replicas = cfg.distributed.canonical_replicas
    if replicas is not None and replicas % dp.size:
        raise ValueError(
            f"dataloader.distributed.canonical_replicas: got {replicas}, expected a multiple of the data-parallel "
            f"size {dp.size}. Pick one divisible by every DP size you will run or resume with (e.g. 8 for 1, 2, 4, 8)."
        )
    return dp


def launcher_coordinates() -> tuple[int, int] | None:
    """``(RANK, WORLD_SIZE)`` from the environment a launcher such as ``torchrun`` sets for each process, or
    ``None`` (unset, one process, or not integers in range)."""
    import os

    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return (rank, world) if world > 1 and 0 <= rank < world else None


def _group_coordinates(group: Any) -> tuple[int, int]:
    """``(rank, size)`` in a data-parallel ``ProcessGroup`` or 1-D ``DeviceMesh``."""
    import torch.distributed as dist

    if hasattr(group, "get_local_rank") and hasattr(group, "size"):  # a DeviceMesh
        if getattr(group, "ndim", 1) != 1:
            raise ValueError(f"dp_group: got a {group.ndim}-D DeviceMesh, expected its data-parallel dimension "
                             "(e.g. mesh['dp'])")
        return int(group.get_local_rank()), int(group.size())
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("dp_group: got a process group but torch.distributed is not initialized")
    try:
        return int(dist.get_rank(group)), int(dist.get_world_size(group))
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"dp_group: got {type(group).__name__}, expected a torch.distributed ProcessGroup this "
                         f"rank belongs to, or a 1-D DeviceMesh ({error})") from error


def _config_digest(cfg: LoaderConfig) -> str:
    """A short hash of the config (the same on every rank that reads the same YAML)."""
    return hashlib.sha256(repr(cfg).encode()).hexdigest()[:16]


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of ``epoch``: ``seed`` itself for epoch 0, then a hash of ``(seed, epoch)``.

    Deterministic: the same on every run, rank and data-parallel size.
    """
    if epoch == 0:
        return seed
    return int.from_bytes(hashlib.sha256(f"zephon_loader.epoch:{seed}:{epoch}".encode()).digest()[:4], "big")


def epoch_run_id_suffix(epoch: int) -> str:
    """Suffix of the aggregation run id per epoch: a new pipeline's rounds never meet the last epoch's files."""
    return "" if epoch == 0 else f".epoch{epoch}"


def _remove(folders: list[str]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def _close(folders: list[str], stage: Stage, digests: PendingShards | None = None) -> None:
    """What a loader (or a failed build) leaves: the hashing of its shard digests, its folders, and what its
    stage holds (Ray)."""
    try:
        if digests is not None:
            digests.cancel()
        stage.release()
    finally:
        _remove(folders)
