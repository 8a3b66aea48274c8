"""The loader schema: one :class:`LoaderConfig` with the fields every loader shares, its sections, and the text
loader's record section (:class:`TextLoaderConfig`; the image-text one is :mod:`zephon_loader.config.image`).

The schema is closed and typed: each section is a frozen dataclass, unknown
keys are refused with their path (``dataloader.packing.algo: unknown key``),
and every value is type-checked and range-checked here, once, before any
Zephon source or worker starts. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping

from zephon_loader.config.reader import (
    LOADER_SECTION,
    _convert,
    from_mapping,
    load_yaml,
    names_this_package,
    resolve_target,
)
from zephon_loader.contract import DEFAULT_BLOCK_MASK_BUDGET_BYTES, PackingContract, contract_for_attention

PACKING_ALGORITHMS = ("first_fit", "best_fit", "wrap", "best_fit_wrap")
#: A path starting with this prefix resolves inside the installed package's ``data/`` folder.
PACKAGE_DATA_PREFIX = "pkg://"
#: ``distributed.canonical_replicas`` above this is refused, above :data:`WARN_CANONICAL_REPLICAS` warned: each
#: lane adds to every state and to the first batch (measured: 10,000 lanes, an 8.5 MB state and 113 s before the
#: first batch on 2 CPU cores).
MAX_CANONICAL_REPLICAS = 4096
WARN_CANONICAL_REPLICAS = 1024
_LANE_COST = ("Each lane costs about 0.85 kB in every saved state and 11 ms before the first batch (measured: "
              "10,000 lanes gave an 8.5 MB state and a first batch after 113 s).")
#: Default ``max_record_bytes``: 4 MiB of text, about 1M tokens of a real tokenizer (longer than any context)
#: and about 5 s of tokenizing in one call that nothing interrupts (a 50 MB record made no progress in 900 s).
DEFAULT_MAX_RECORD_BYTES = 4 * 1024 * 1024
#: Most tokens one batch may hold (``micro_batch_size * sequence_length``): 2**27, about 4.4 GB per batch.
MAX_BATCH_TOKENS = 2**27
#: Bytes per token of a delivered text batch: ``input_ids``, ``labels``, ``position_ids`` and
#: ``document_ids`` as int64, ``padding_mask`` as bool.
BATCH_BYTES_PER_TOKEN = 4 * 8 + 1


#: The ``sources[i].format`` values read (what each is: :mod:`zephon_loader.pipeline.formats`).
SOURCE_FORMATS = ("jsonl", "parquet", "litdata", "lance", "vortex")
#: Formats Zephon 0.2 has a reader for that a source cannot be: why, and what to do instead.
UNREAD_FORMATS = {
    "mds": ("Zephon reads MDS through mosaicml-streaming, which cannot be installed beside this loader: it pins "
            "transformers<5 (the loader needs transformers 5); its fork streaming-community 0.14.2 lifts that pin "
            "but, like it, imports torchvision on 'import streaming', whose PyPI wheel (the CUDA build) fails "
            "against a CPU torch ('operator torchvision::nms does not exist'). Convert the shards once (read them "
            "with streaming.StreamingDataset, write the rows with pyarrow.parquet.write_table) and set format: parquet"),
    "hf": ("Zephon's Hugging Face reader serves hf:// Hub URLs only (resolved online), and no Zephon format reads "
           "the Arrow files of a save_to_disk folder. Convert it once: "
           "datasets.load_from_disk(path).to_parquet('<folder>/part-00000.parquet'), then point the source at "
           "that folder (format: parquet)"),
}


@dataclass(frozen=True)
class SourceConfig:
    """One weighted source: a folder of JSONL or Parquet shards, a LitData or Lance dataset, or Vortex files.

    Attributes:
        name: Unique name (Zephon's dataset name).
        path: Directory holding ``*.jsonl``/``*.parquet`` shards, or a prefix on object
            storage (``s3://bucket/prefix``, ``gs://``, ``az://``: "Data on object storage");
            relative paths resolve against the YAML file's folder, ``pkg://`` inside the package.
        weight: Mixture weight, > 0.
        format: ``jsonl``, ``parquet``, ``litdata`` (``litdata.optimize``
            output), ``lance`` (a Lance dataset, its latest version) or
            ``vortex`` (``*.vortex`` files); ``None``: recognised by the folder's
            files (LitData's ``index.json``, Lance's ``_versions/``, else the
            shard suffixes). ``litdata``/``lance``/``vortex`` need the extra of
            that name (``pip install 'zephon-loader[lance]'``). MDS and
            Hugging Face ``save_to_disk`` folders are refused, with the conversion to use.
    """

    name: str
    path: str
    weight: float = 1.0
    format: str | None = None


@dataclass(frozen=True)
class MixturePhase:
    """One phase of a mixture schedule: the weights it reads with and where it ends.

    Attributes:
        weights: Weight of every source by name (each a finite number > 0): they replace ``sources[i].weight``
            while the phase lasts.
        until_steps: The phase ends after this many steps from the start of the stream: batches of each Zephon
            lane, which is the trainer's step when each rank reads one lane (``canonical_replicas`` unset or
            equal to the DP size); with ``canonical_replicas: L`` at DP size ``d`` a rank reads ``L / d`` lanes,
            so ``until_steps * L / d`` batches.
        until_tokens: The phase ends at the first step whose token slots from the start of the stream reach this
            many: ``lanes * micro_batch_size * sequence_length`` per step (padding included, every lane), so at
            step ``ceil(until_tokens / (lanes * B * S))``: exact and the same on every rank and DP size.

    Every phase but the last sets one of ``until_steps``/``until_tokens`` (all phases the same one, increasing);
    the last sets neither and lasts to the end of the stream.
    """

    weights: dict[str, float]
    until_steps: int | None = None
    until_tokens: float | None = None


@dataclass(frozen=True)
class MixtureSchedule:
    """``mixture: {schedule: [...]}``: weights that change at steps or token counts (docs/training-data.md, "Mixture schedules").

    Attributes:
        schedule: The phases in order (see :class:`MixturePhase`). Each phase is its own Zephon stream with its
            own weights, switched exactly at the boundary on every lane; the stream is endless (``passes: null``).
    """

    schedule: tuple[MixturePhase, ...]


@dataclass(frozen=True)
class TokenizerConfig:
    """How records become tokens: exactly one of ``path``, ``pretokenized_field``, ``chat_field``
    (``path`` is also required with ``chat_field``, for the chat template).

    Attributes:
        path: Local Hugging Face tokenizer folder (never a hub id: it cannot
            resolve offline). ``None`` with a text source means "use the
            tokenizer the training recipe passes".
        text_field: Record field holding raw text.
        pretokenized_field: Record field already holding token ids.
        chat_field: Record field holding chat messages (``tokenize_chat``, loss on assistant turns).
        chat_template: Jinja text or file overriding the tokenizer's chat template.
        chat_loss_scope: Zephon's ``loss_scope``: ``all_assistant`` (default),
            ``last_span`` or ``after_last_user``.
        special_tokens: Zephon's text bracketing: ``bos_eos`` (default: every
            document is ``BOS ... EOS``), ``bos``, ``eos``, ``none``, or
            ``tokenizer_default`` (the tokenizer's own post-processor).

    Text documents are bracketed ``BOS ... EOS`` by Zephon; pretokenized ones are
    used as they are; chat ones end each assistant turn with EOS.
    """

    path: str | None = None
    text_field: str = "text"
    pretokenized_field: str | None = None
    chat_field: str | None = None
    chat_template: str | None = None
    chat_loss_scope: Literal["all_assistant", "last_span", "after_last_user"] | None = None
    special_tokens: Literal["bos_eos", "bos", "eos", "none", "tokenizer_default"] = "bos_eos"


@dataclass(frozen=True)
class PackingOptions:
    """Zephon ``pack_flat`` options.

    Attributes:
        algorithm: ``first_fit``/``best_fit`` (drop records longer than the
            row), ``wrap``/``best_fit_wrap`` (split them across rows).
        num_bins: Open bins kept by ``first_fit``/``best_fit`` (``None``: Zephon
            loader default); must be unset for the wrap algorithms.

    Zephon drops records longer than the row with ``first_fit``/``best_fit``,
    and uncapped ``wrap`` drops the trailing partial row at the end of the
    stream; the final partial batch is dropped too (fixed ``B``).
    """

    algorithm: Literal["first_fit", "best_fit", "wrap", "best_fit_wrap"] = "first_fit"
    num_bins: int | None = None


def available_cores() -> int:
    """CPU cores this process may run on: its affinity mask (what ``taskset``, cgroups' cpusets and Slurm
    give it), ``os.cpu_count()`` where the platform has none."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


#: ``runner: auto`` runs Zephon ``inline`` on at most this many cores (its worker threads would compete with the
#: loader's for the GIL: 152k vs 244k tokens/s direct on 2 cores, docs/benchmarks.md, "Loader overhead"), ``threads`` above.
INLINE_MAX_CORES = 2


@dataclass(frozen=True)
class RunnerOptions:
    """Zephon runtime options every loader has (``Pipeline.options``); each kind adds its stage's parallelism.

    Attributes:
        runner: ``auto`` (default: ``inline`` on 1 or 2 cores, ``threads`` on more; the cores this process
            may use), ``threads``, ``inline``, or ``process``
            (spawned workers; scripts need an ``if __name__ == "__main__"`` guard).
        max_workers: Zephon worker count (``None``: Zephon's default).
        prefetch_batches: Zephon's own consumer-side prefetch (exactly accounted in its checkpoints).
    """

    runner: Literal["auto", "threads", "inline", "process"] = "auto"
    max_workers: int | None = None
    prefetch_batches: int | None = None

    #: Keys applied to the kind's own stage rather than to Zephon's ``RuntimeOptions``.
    STAGE_KEYS: ClassVar[tuple[str, ...]] = ()

    def options(self) -> dict[str, Any]:
        """The non-default values of Zephon ``RuntimeOptions`` fields, as keyword arguments (``runner: auto``
        resolved from the cores: :data:`INLINE_MAX_CORES`)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in self.STAGE_KEYS and getattr(self, f.name) not in (None, "auto")}
        if self.runner == "auto":
            out["runner"] = "inline" if available_cores() <= INLINE_MAX_CORES else "threads"
        return out


@dataclass(frozen=True)
class RuntimeConfig(RunnerOptions):
    """Zephon runtime options of a text loader: :class:`RunnerOptions` and the tokenize stage's parallelism.

    Attributes:
        runner: ``auto`` (default: ``inline`` on 1 or 2 cores, ``threads`` on more; the
            cores this process may use), ``threads``, ``inline``, ``process``
            (spawned workers; scripts need an ``if __name__ == "__main__"`` guard),
            or ``ray``: the tokenize stage on Zephon's experimental Ray runner
            (``tokenize_parallelism`` actors), the rest on threads; same batches
            and resume as ``threads``; needs ``pip install 'zephon-loader[ray]'``
            and text or chat input. The loader uses the process's Ray
            (``ray.init(address=...)`` before building it; never shut down by the
            loader), else starts a local instance sized to this process's cores,
            listening on 127.0.0.1 only, and shuts it down when its last loader
            closes (also at exit, before Ray's own shutdown, for a loader left
            open; SIGTERM shuts it down and ends the process by SIGTERM, status
            143, where the process had the default handler). The text tokenizer
            reaches the actors inside the operator; in chat mode Zephon loads the
            tokenizer folder on each actor, so on a cluster of several machines it
            must be readable at the same path on every node.
        tokenize_parallelism: Tokenizing calls Zephon keeps in flight, of 8 records
            each (``None``: from the cores this process may use, half of them,
            1 to 4: 1 on 2 cores). Fewer calls: the first batch waits for fewer
            documents and less text is held in memory (see docs/benchmarks.md, "Memory and
            first batch"). Each call runs on one thread on 1 or 2 cores: there
            the loader switches the ``tokenizers`` library's own thread pool off
            for the process (``TOKENIZERS_PARALLELISM=false``) unless the
            environment sets that variable (docs/benchmarks.md, "Loader overhead and the Zephon runner").
    """

    runner: Literal["auto", "threads", "inline", "process", "ray"] = "auto"
    tokenize_parallelism: int | None = None

    def tokenize_calls(self) -> int:
        """``tokenize_parallelism``, or the default from the cores: ``max(1, min(4, cores // 2))``."""
        if self.tokenize_parallelism is not None:
            return int(self.tokenize_parallelism)
        return max(1, min(4, available_cores() // 2))

    STAGE_KEYS: ClassVar[tuple[str, ...]] = ("tokenize_parallelism",)

    def options(self) -> dict[str, Any]:
        """As :meth:`RunnerOptions.options`; ``ray`` is no Zephon runner name: it leaves Zephon's runner ``auto``,
        which runs the stage the pipeline places ``remote`` (tokenize) on Ray and the others on threads."""
        options = super().options()
        if options.get("runner") == "ray":
            del options["runner"]
        return options


@dataclass(frozen=True)
class ContractConfig:
    """The model's packing contract, by attention name or by explicit fields.

    Attributes:
        attn_implementation: AutoModel attention name (``sdpa``, ``fa4``,
            ``flash_attention_2``, ``te``, ...), mapped like AutoModel's
            ``get_packing_capabilities``; or ``hf`` for a stock Hugging Face
            model (transformers >= 5, any kernel): no ``attention_mask``,
            ``position_ids`` restarting at 0 per document, from which the
            model derives the packed mask itself (packed mask type
            ``position_ids``; no eligibility, no metadata).
        packed_mask_type: Explicit mask type (overrides the mapping where AutoModel lets the model decide).
        requires_packed_sequence_metadata: The model consumes the gathered-token bundle.
        qkv_format: ``bshd`` or ``thd`` (TE).
        seq_idx: Also yield ``seq_idx`` int32 ``[B, S]``, transformers' flattening collator's
            document index (0, 1, ... over the batch, -1 at padding) for Mamba-2 / linear-attention layers.
        cp_size: Context-parallel size; above 1 (``qkv_format: thd`` only) every document is padded to a
            multiple of ``2 * cp_size`` before packing (padding counted in ``stats()``), ``sequence_length``
            must be a multiple of ``2 * cp_size``, and the wrap algorithms are refused.
    """

    attn_implementation: str | None = None
    packed_mask_type: Literal["block_causal", "document_ids", "flash_varlen", "position_ids"] | None = None
    requires_packed_sequence_metadata: bool = False
    qkv_format: Literal["bshd", "thd"] = "bshd"
    seq_idx: bool = False
    cp_size: int = 1

    def build(self) -> PackingContract:
        """The contract these fields describe.

        Raises:
            ValueError/TypeError: An unknown attention name or a combination no contract has, as
                ``dataloader.contract.<key>: got ..., expected ...``.
        """
        try:
            return self._build()
        except (TypeError, ValueError) as error:
            raise type(error)(f"{LOADER_SECTION}.contract.{error}") from None

    def _build(self) -> PackingContract:
        if self.attn_implementation is not None:
            return contract_for_attention(
                self.attn_implementation,
                requires_packed_sequence_metadata=self.requires_packed_sequence_metadata,
                packed_mask_type=self.packed_mask_type,
                qkv_format=self.qkv_format,
                seq_idx=self.seq_idx,
                cp_size=self.cp_size,
            )
        return PackingContract(
            packed_mask_type=self.packed_mask_type or "block_causal",
            requires_packed_sequence_metadata=self.requires_packed_sequence_metadata,
            qkv_format=self.qkv_format,
            seq_idx=self.seq_idx,
            cp_size=self.cp_size,
        )


@dataclass(frozen=True)
class DistributedConfig:
    """Zephon data-parallel lanes (``Pipeline.options``); unset values come from the run.

    Attributes:
        canonical_replicas: Zephon's canonical lane count; every DP size used
            for elastic resume must divide it. ``None``: the DP size. At most
            4096; above 1024 a warning gives the cost (each lane adds ~0.85 kB
            to every state and ~11 ms before the first batch).
        aggregate_dir: Shared folder for Zephon's cross-rank aggregation.
        aggregate_store: Alternative to ``aggregate_dir``, e.g. ``"torch://"``.
        run_id: Names this run in the aggregate store.
        even_passes: With several ranks in a process group and a finite
            ``passes``, every rank yields the same number of batches per pass:
            the pass ends for all at the shortest rank's count, and what the
            others had left comes first in the next epoch (one small
            ``all_reduce`` per up to 8 batches away from a pass end, on the
            process group when it takes CPU tensors). ``false``: each rank's pass ends with
            its own lanes (train by steps then). With it, every rank of the
            process group iterates the loader (else ``AgreementError`` at the
            first batch) and has a batch in each pass (else ``EmptyRankError``):
            build a loader read on some ranks only with ``dp_world_size=1``.
        state_scope: What ``state_dict()`` holds. ``job`` (default): every
            lane, the same on every rank (a collective; any rank's state
            resumes any rank, as Lightning and Accelerate's
            ``register_for_checkpointing`` need: one rank saves). ``rank``: the
            lanes this rank owns, no collective, O(lanes / ranks) bytes; every
            rank saves its own (AutoModel's per-DP-rank files, ZephonTrainer,
            ``checkpoint_loaders``, ``torch.distributed.checkpoint`` with a key
            per rank, ``save_state("...{dp_rank}...")``); at another DP size
            load every rank's state (docs/distributed.md).
    """

    canonical_replicas: int | None = None
    aggregate_dir: str | None = None
    aggregate_store: str | None = None
    run_id: str | None = None
    even_passes: bool = True
    state_scope: Literal["job", "rank"] = "job"


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """What every loader config holds (the YAML ``dataloader`` section), declared once.

    A kind of loader (:class:`TextLoaderConfig`,
    :class:`~zephon_loader.config.image.ImageLoaderConfig`) adds its record
    section: how records become tokens (``tokenizer`` or ``processor``), its
    ``packing`` and ``runtime`` options. Constructing a config from plain YAML
    values coerces and checks every field (wrong types raise ``TypeError``
    naming ``dataloader.<field>``; values out of range ``ValueError``).

    Attributes:
        sources: One or more weighted shard folders.
        sequence_length: Model sequence length ``S``.
        micro_batch_size: Rows per batch ``B``; ``B * S`` is at most 2**27 tokens
            (a batch holds 33 bytes per token: 4.4 GB at that bound).
        contract: The model's contract; ``None`` = AutoModel's default (block-causal).
        xdoc: Cross-document attention inside each row.
        return_packed_sequence_metadata: Also yield the gathered-token bundle.
        return_source_ids: Also yield ``source_ids``, int64 ``[B, S]``: the mixture source each input token
            came from (its index in ``sources``; ``-1`` at padding), for per-source loss (docs/training-data.md, "Per-source loss").
        mask_cross_document_labels: Mask the label at each subdocument's last
            token (its target is the next document). ``None``: on unless xdoc.
        seed: Zephon mixture/shuffle seed.
        shuffle: Shuffle records within Zephon's work chunks.
        mixture: What a pass reads. ``repeat`` (default): every record of every
            source at least once, the weights held all the pass (smaller or
            lighter sources repeat until the slowest is read once). ``once``:
            every record of every source exactly once; the weights hold until a
            source runs out, then the others share its share (evaluation, or one
            exact epoch). ``{schedule: [{until_steps: N, weights: {...}}, ...,
            {weights: {...}}]}`` (or ``until_tokens``): weights that change at
            exact boundaries of an endless stream (``passes: null``); see
            :class:`MixturePhase`.
        passes: Passes over the sources in one stream, each reshuffled by
            Zephon (``mixture: repeat`` only); an epoch of the loader is this
            stream (with several ranks in a process group: the same number of
            batches on every rank, see ``distributed.even_passes``). ``null``:
            endless, for training by steps.
        chunk_size: Zephon work-chunk size in records; ``None`` picks one that fits the smallest source.
        flush_every_records: Records (per lane) between Zephon's flushes of packing and batching. A
            resume re-reads and re-tokenizes what came since the last flush (Zephon rebuilds its
            packing that way), so this bounds a resume's wait for its first batch; each flush pads
            the open rows and delivers a short batch (padded to ``micro_batch_size``). ``None``
            (default): Zephon's cadence at the largest chunk size, 8 chunks of up to 16,384 records,
            for text shortened to about 1,024 batches of shard bytes (one token a byte) when an epoch
            is longer (docs/benchmarks.md, "Resume: the first batch after load_state_dict"). ``0``: Zephon's cadence, never shortened (resumes a state
            saved before that default).
        read_ahead: Batches collated and finalized ahead of the training loop
            in a background thread (0 = none); resume stays exact.
        block_mask_budget_bytes: Largest block-causal ``[B, 1, S, S]`` mask allowed.
        on_bad_record: ``error`` (default: stop at the first malformed record,
            naming source, shard file and line/row) or ``skip`` (leave it out,
            counted by reason in ``loader.stats()``); see :mod:`zephon_loader.pipeline.records`.
        max_record_tokens: Records with more tokens are bad records (``None``: no limit).
        distributed: See :class:`DistributedConfig`.
        base_dir: Folder relative paths resolve against (set by the YAML reader).
    """

    sources: tuple[SourceConfig, ...]
    sequence_length: int
    micro_batch_size: int
    contract: ContractConfig | None = None
    xdoc: bool = False
    return_packed_sequence_metadata: bool = False
    return_source_ids: bool = False
    mask_cross_document_labels: bool | None = None
    seed: int = 0
    shuffle: bool = True
    mixture: Literal["repeat", "once"] | MixtureSchedule = "repeat"
    passes: int | None = 1
    chunk_size: int | None = None
    flush_every_records: int | None = None
    read_ahead: int = 2
    block_mask_budget_bytes: int = DEFAULT_BLOCK_MASK_BUDGET_BYTES
    on_bad_record: Literal["error", "skip"] = "error"
    max_record_tokens: int | None = None
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    base_dir: str = "."

    #: Whether this kind lays rows out for context parallelism (``contract.cp_size > 1``).
    SUPPORTS_CP: ClassVar[bool] = False
    #: The bundled example the YAML reader points to.
    EXAMPLE_CONFIG: ClassVar[str] = "configs/demo.yaml"
    #: The ``_target_`` a YAML node of this schema names.
    YAML_TARGET: ClassVar[str] = "zephon_loader.ZephonDataloaderConfig"

    @classmethod
    def prepare_node(cls, node: dict[str, Any]) -> dict[str, Any]:
        """The YAML node before :func:`~zephon_loader.config.reader.from_mapping` reads it (a hook for fields
        with their own readers)."""
        return node

    def __post_init__(self) -> None:
        # Typed coercion of every field (a no-op for values already typed), so that
        # Config(**plain_yaml_values) is as strict as from_mapping.
        hints = typing.get_type_hints(type(self))
        for spec in dataclasses.fields(self):
            value = _convert(getattr(self, spec.name), hints[spec.name], f"{LOADER_SECTION}.{spec.name}")
            object.__setattr__(self, spec.name, value)
        self._check_sources_and_lanes()
        self._check_ranges()
        self._check_record_section()

    def _check_sources_and_lanes(self) -> None:
        if not self.sources:
            raise ValueError("dataloader.sources: got an empty list, expected at least one source")
        names = [source.name for source in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"dataloader.sources: duplicate names in {names}; expected unique names")
        for index, source in enumerate(self.sources):
            if not source.name:
                raise ValueError(f"dataloader.sources[{index}].name: got '', expected a non-empty name")
            if not (math.isfinite(source.weight) and source.weight > 0):
                raise ValueError(f"dataloader.sources[{index}].weight: got {source.weight}, expected a finite number > 0")
            if source.format is not None and source.format not in SOURCE_FORMATS:
                fix = UNREAD_FORMATS.get(source.format, "Set one of them, or null to recognise the folder's files")
                raise ValueError(f"dataloader.sources[{index}].format: got {source.format!r}, expected one of "
                                 f"{', '.join(map(repr, SOURCE_FORMATS))} or null. {fix}.")
        distributed = self.distributed
        lanes = distributed.canonical_replicas
        if lanes is not None and not 0 < lanes <= MAX_CANONICAL_REPLICAS:
            raise ValueError(f"dataloader.distributed.canonical_replicas: got {lanes}, expected an int in "
                             f"[1, {MAX_CANONICAL_REPLICAS}] or null. {_LANE_COST} Pick the least common multiple of "
                             "the DP sizes you will resume with (e.g. 8 for 1, 2, 4, 8), or null for the DP size.")
        if lanes is not None and lanes > WARN_CANONICAL_REPLICAS:
            warnings.warn(f"dataloader.distributed.canonical_replicas: {lanes} lanes (above "
                          f"{WARN_CANONICAL_REPLICAS}). {_LANE_COST} Expect about {lanes * 0.85 / 1000:.1f} MB per "
                          f"state and {lanes * 0.011:.0f} s before the first batch; use the least common multiple of "
                          "the DP sizes you will resume with.", RuntimeWarning, stacklevel=4)
        _check_package_paths(self)
        if distributed.run_id == "":
            raise ValueError("dataloader.distributed.run_id: got '', expected a non-empty run id or null")

    def positive_ints(self) -> dict[str, int | None]:
        """The settings that must be an int > 0 (or null where optional), by dotted key; a kind adds its own."""
        runtime = self.runtime  # type: ignore[attr-defined]  # every kind has a RunnerOptions section
        return {
            "sequence_length": self.sequence_length, "micro_batch_size": self.micro_batch_size,
            "block_mask_budget_bytes": self.block_mask_budget_bytes, "chunk_size": self.chunk_size,
            "max_record_tokens": self.max_record_tokens,
            "packing.num_bins": self.packing.num_bins,  # type: ignore[attr-defined]
            **{f"runtime.{f.name}": getattr(runtime, f.name) for f in dataclasses.fields(runtime)
               if f.name not in ("runner",)},
        }

    def _check_ranges(self) -> None:
        hints = typing.get_type_hints(type(self))
        for name, value in self.positive_ints().items():
            if value is not None and value <= 0:
                optional = "." in name or type(None) in typing.get_args(hints.get(name))
                raise ValueError(f"dataloader.{name}: got {value}, expected an int > 0" + (" or null" if optional else ""))
        self._check_batch_size()
        self._check_context_parallel()
        if self.passes is not None and self.passes <= 0:
            raise ValueError(f"dataloader.passes: got {self.passes}, expected an int > 0 or null (endless)")
        self._check_schedule()
        if self.mixture == "once" and self.passes != 1:
            raise ValueError(f"dataloader.passes: got {self.passes} with mixture: once, expected 1 (once reads every "
                             "record exactly once; use mixture: repeat for several or endless passes)")
        if self.seed < 0:
            raise ValueError(f"dataloader.seed: got {self.seed}, expected an int >= 0")
        if self.read_ahead < 0:
            raise ValueError(f"dataloader.read_ahead: got {self.read_ahead}, expected an int >= 0")
        if self.flush_every_records is not None and self.flush_every_records < 0:
            raise ValueError(f"dataloader.flush_every_records: got {self.flush_every_records}, expected an int > 0, "
                             "0 (Zephon's cadence, never shortened) or null (the default)")

    def _check_schedule(self) -> None:
        """A mixture schedule: phases naming every source, one kind of boundary, increasing, the last open."""
        schedule = self.schedule
        if schedule is None:
            return
        where = "dataloader.mixture.schedule"
        if not schedule:
            raise ValueError(f"{where}: got an empty list, expected at least one phase ({{weights: {{...}}}})")
        if self.passes is not None:
            raise ValueError(f"dataloader.passes: got {self.passes} with a mixture schedule, expected null (a "
                             "schedule's phases end at steps or tokens of one endless stream; train by steps)")
        names = [source.name for source in self.sources]
        kinds = set()
        previous = 0.0
        for index, phase in enumerate(schedule):
            at = f"{where}[{index}]"
            if set(phase.weights) != set(names):
                missing, unknown = sorted(set(names) - set(phase.weights)), sorted(set(phase.weights) - set(names))
                raise ValueError(f"{at}.weights: got {sorted(phase.weights)}, expected a weight for every source "
                                 f"{names}" + (f" (missing {missing})" if missing else "")
                                 + (f" (unknown {unknown})" if unknown else ""))
            for name, weight in phase.weights.items():
                if not (math.isfinite(weight) and weight > 0):
                    raise ValueError(f"{at}.weights.{name}: got {weight}, expected a finite number > 0")
            ends = {key: value for key in ("until_steps", "until_tokens")
                    if (value := getattr(phase, key)) is not None}
            last = index == len(schedule) - 1
            if last and ends:
                raise ValueError(f"{at}: got {', '.join(ends)} on the last phase, expected none (the last phase "
                                 "lasts to the end of the stream)")
            if not last and len(ends) != 1:
                raise ValueError(f"{at}: got {sorted(ends) or 'no end'}, expected exactly one of until_steps or "
                                 "until_tokens (every phase but the last ends somewhere)")
            for key, value in ends.items():
                kinds.add(key)
                if len(kinds) > 1:
                    raise ValueError(f"{at}.{key}: got {key} after phases ending by {sorted(kinds - {key})[0]}, "
                                     "expected every phase to end by the same one (steps or tokens)")
                if not (math.isfinite(value) and value > previous):
                    raise ValueError(f"{at}.{key}: got {value:g}, expected a number > {previous:g} (the phases' "
                                     "ends count from the start of the stream and increase)")
                previous = float(value)

    @property
    def schedule(self) -> tuple[MixturePhase, ...] | None:
        """The mixture schedule's phases, or ``None`` when ``mixture`` is ``repeat``/``once``."""
        return self.mixture.schedule if isinstance(self.mixture, MixtureSchedule) else None

    def with_weights(self, weights: Mapping[str, float]) -> "LoaderConfig":
        """This config with each source's weight from ``weights`` and no schedule: one phase's stream."""
        sources = tuple(dataclasses.replace(source, weight=float(weights[source.name])) for source in self.sources)
        return dataclasses.replace(self, sources=sources, mixture="repeat")

    def _check_context_parallel(self) -> None:
        """``contract.cp_size > 1`` against the rest of the config (the contract's own fields: ``contract.py``)."""
        cp_size = self.contract.cp_size if self.contract is not None else 1
        if cp_size <= 1:
            return
        multiple = 2 * cp_size
        where = f"dataloader.contract.cp_size: got {cp_size}"
        if not self.SUPPORTS_CP:
            raise ValueError(f"{where} for an image-text loader, expected 1: context-parallel padding is laid out "
                             "for text rows only")
        if self.sequence_length % multiple:
            raise ValueError(f"{where} with sequence_length {self.sequence_length}, expected a sequence_length that "
                             f"is a multiple of 2 * cp_size = {multiple} (every document and the row's padding span a "
                             f"multiple of it); use e.g. {self.sequence_length + multiple - self.sequence_length % multiple}")
        if self.xdoc:
            raise ValueError(f"{where} with xdoc: true, expected xdoc: false; TE's THD + CP attends within each "
                             "padded document, a joined row is not one")
        algorithm = self.packing.algorithm  # type: ignore[attr-defined]
        if algorithm not in ("first_fit", "best_fit"):
            raise ValueError(f"{where} with packing.algorithm {algorithm!r}, expected first_fit or best_fit: a "
                             "document wrapped across rows leaves a piece that is not a multiple of 2 * cp_size")

    def _check_batch_size(self) -> None:
        """Refuse a batch no machine holds (``10**9`` tokens failed only at the first batch, in the allocator).

        An image config may leave ``micro_batch_size`` to the recipe: then only ``sequence_length`` is bounded.
        """
        tokens = (self.micro_batch_size or 1) * self.sequence_length
        if tokens > MAX_BATCH_TOKENS:
            size = tokens * BATCH_BYTES_PER_TOKEN
            raise ValueError(
                f"dataloader.micro_batch_size * sequence_length: got {self.micro_batch_size} * {self.sequence_length}"
                f" = {tokens} tokens per batch, expected at most {MAX_BATCH_TOKENS} (2**27): one batch holds "
                f"{BATCH_BYTES_PER_TOKEN} bytes per token (input_ids, labels, position_ids, document_ids as int64, "
                f"padding_mask as bool), {size / 2**30:.1f} GiB here, and read_ahead and Zephon's prefetch keep "
                "several in memory. Lower sequence_length or micro_batch_size."
            )

    def _check_record_section(self) -> None:
        """The checks of the kind's own fields (combinations the typed reader cannot see)."""

    @property
    def labels_mask_cross_document(self) -> bool:
        """``mask_cross_document_labels`` resolved: on unless xdoc, when unset."""
        masked = self.mask_cross_document_labels
        return masked if masked is not None else not self.xdoc

    @property
    def cp_multiple(self) -> int:
        """What every document is padded to before packing: ``2 * contract.cp_size``, or 0 (no context parallelism).

        Read from the configured field (the model's contract never names ``cp_size``: the YAML's applies)."""
        cp_size = self.contract.cp_size if self.contract is not None else 1
        return 2 * cp_size if cp_size > 1 else 0

    def packing_contract(self) -> PackingContract:
        """The configured contract, or AutoModel's default (block-causal, no metadata)."""
        return (self.contract or ContractConfig()).build()

    def resolve_path(self, value: str) -> Path:
        """A configured path as an absolute path (``pkg://`` → package data, relative → ``base_dir``)."""
        if value.startswith(PACKAGE_DATA_PREFIX):
            return package_data_path(value, "a pkg:// path")
        path = Path(value).expanduser()
        return path if path.is_absolute() else (Path(self.base_dir) / path).resolve()


@dataclass(frozen=True, kw_only=True)
class TextLoaderConfig(LoaderConfig):
    """A text loader's config: :class:`LoaderConfig` and the text record section (text, chat or pretokenized).

    Zephon packs ``S + 1`` tokens per row; collate shifts them into ``S``
    inputs and their next-token labels.

    Attributes:
        sequence_length: Model sequence length ``S`` (Zephon packs ``S + 1``).
        tokenizer: See :class:`TokenizerConfig`.
        packing: See :class:`PackingOptions`.
        eligibility_field: Per-token 0/1 record field marking tokens that may attend.
        eos_mask_loss: Mask labels whose target is ``eos_token_id``.
        eos_token_id: Required with ``eos_mask_loss``.
        pad_token_id: Pad id for packing (default: the tokenizer's pad, else its
            EOS); needed for pretokenized input without a tokenizer.
        max_record_bytes: Texts larger than this many UTF-8 bytes are bad records,
            refused before tokenizing (default 4 MiB, about 1M tokens and 5 s of
            tokenizing in one call; ``None``: no limit, a 50 MB text then takes minutes).
        runtime: See :class:`RuntimeConfig`.
    """

    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    packing: PackingOptions = field(default_factory=PackingOptions)
    eligibility_field: str | None = None
    eos_mask_loss: bool = False
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    max_record_bytes: int | None = DEFAULT_MAX_RECORD_BYTES
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    SUPPORTS_CP: ClassVar[bool] = True

    def positive_ints(self) -> dict[str, int | None]:
        return {**super().positive_ints(), "max_record_bytes": self.max_record_bytes}

    def _check_record_section(self) -> None:
        for name in ("pad_token_id", "eos_token_id"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"dataloader.{name}: got {getattr(self, name)}, expected an int >= 0")
        if self.packing.num_bins is not None and self.packing.algorithm not in ("first_fit", "best_fit"):
            raise ValueError(
                f"dataloader.packing.num_bins: got {self.packing.num_bins} with algorithm "
                f"{self.packing.algorithm!r}, expected null (bins apply to first_fit/best_fit only)"
            )
        if self.eos_mask_loss and self.eos_token_id is None:
            raise ValueError("dataloader.eos_token_id: got null with eos_mask_loss: true; expected the EOS token id")
        tokenizer = self.tokenizer
        modes = [m for m in ("pretokenized_field", "chat_field") if getattr(tokenizer, m) is not None]
        if len(modes) > 1:
            raise ValueError(f"dataloader.tokenizer: got both {modes}; expected at most one of them")
        if tokenizer.chat_field is not None and tokenizer.path is None:
            raise ValueError("dataloader.tokenizer.path: chat_field needs a local tokenizer folder for the chat template")
        for name in ("text_field", "pretokenized_field", "chat_field"):
            if getattr(tokenizer, name) == "":
                raise ValueError(f"dataloader.tokenizer.{name}: got '', expected a record field name")
        if self.runtime.runner == "ray" and self.input_mode == "pretokenized":
            raise ValueError(
                "dataloader.runtime.runner: got 'ray' with pretokenized input, expected 'threads' (ray runs the "
                "tokenize stage, and pretokenized records have none)"
            )
        if self.eligibility_field is not None and tokenizer.pretokenized_field is None:
            raise ValueError(
                f"dataloader.eligibility_field: got {self.eligibility_field!r} with {self.input_mode} input, expected "
                "it only with tokenizer.pretokenized_field (tokenizing text adds and merges tokens, so a stored "
                "per-token column cannot stay aligned; store token ids and eligibility together)"
            )

    @property
    def input_mode(self) -> Literal["text", "pretokenized", "chat"]:
        """How records become tokens: ``pretokenized``, ``chat`` or (default) ``text``."""
        if self.tokenizer.pretokenized_field is not None:
            return "pretokenized"
        return "chat" if self.tokenizer.chat_field is not None else "text"


def package_data_path(value: str, where: str) -> Path:
    """``pkg://NAME`` as the path of ``NAME`` in the package's ``data/`` folder.

    Raises:
        ValueError: ``NAME`` absolute or with a ``..`` part (it would name a file outside the package's data),
            naming ``where``.
    """
    name = value[len(PACKAGE_DATA_PREFIX):]
    if not name or name.startswith(("/", "\\", "~")) or ".." in re.split(r"[/\\]", name):
        raise ValueError(f"{where}: got {value!r}, expected pkg://NAME with NAME a file or folder inside the "
                         "package's data folder (relative, without '..'); for any other file give its path "
                         "without pkg://")
    return package_data_dir() / name


def _check_package_paths(node: Any, where: str = LOADER_SECTION) -> None:
    """Every ``pkg://`` string of a config (any field, at any depth) names something inside the package's data."""
    if dataclasses.is_dataclass(node):
        for spec in dataclasses.fields(node):
            _check_package_paths(getattr(node, spec.name), f"{where}.{spec.name}")
    elif isinstance(node, (list, tuple)):
        for index, item in enumerate(node):
            _check_package_paths(item, f"{where}[{index}]")
    elif isinstance(node, Mapping):
        for key, item in node.items():
            _check_package_paths(item, f"{where}.{key}")
    elif isinstance(node, str) and node.startswith(PACKAGE_DATA_PREFIX):
        package_data_path(node, where)


def package_data_dir() -> Path:
    """Folder of the bundled demo corpus, tokenizer and YAML."""
    return Path(__file__).resolve().parents[1] / "data"


def default_config_path() -> Path:
    """The bundled default YAML (``zephon-loader run`` without a config)."""
    return package_data_dir() / "demo.yaml"


def text_loader_config(**kwargs: Any) -> TextLoaderConfig:
    """A :class:`TextLoaderConfig` from keyword arguments (plain YAML values)."""
    return from_mapping(TextLoaderConfig, kwargs)


def read_loader_config(config: Any, cls: type = TextLoaderConfig) -> Any:
    """The one reader of loader configurations: a ``cls`` instance, its mapping, or a YAML file.

    Used by every builder and by the CLI, so a YAML file means the same thing
    everywhere:

    * A file must hold a ``dataloader`` mapping (AutoModel's recipe layout).
      Relative paths in it resolve against the file's folder (``base_dir``).
    * ``_target_`` is optional. When present it must name ``cls`` or a
      subclass (e.g. ``zephon_loader.ZephonDataloaderConfig``): a node meant
      for another class is refused rather than silently read as this one.

    Args:
        config: ``cls`` instance (returned as is), mapping, or YAML path.
        cls: The schema dataclass to build (default :class:`TextLoaderConfig`).

    Raises:
        FileNotFoundError / ValueError / TypeError: one line naming the file,
        the key, what was seen and what was expected.
    """
    if isinstance(config, cls):
        return config
    where = LOADER_SECTION
    if isinstance(config, (str, Path)):
        path = Path(config).expanduser().resolve()
        data = load_yaml(path)
        node = data.get(LOADER_SECTION)
        if not isinstance(node, Mapping):
            seen = f"top-level keys {sorted(data)}" if node is None else type(node).__name__
            raise ValueError(
                f"{path}: {LOADER_SECTION}: got {seen}, expected a '{LOADER_SECTION}' mapping "
                f"(see {getattr(cls, 'EXAMPLE_CONFIG', 'configs/demo.yaml')})"
            )
        node = dict(node)
        node.setdefault("base_dir", str(path.parent))
        where = f"{path}: {LOADER_SECTION}"
    elif isinstance(config, Mapping):
        node = dict(config)
    else:
        raise TypeError(
            f"config: got {type(config).__name__}, expected a {cls.__name__}, a mapping, or a YAML path"
        )
    target = node.pop("_target_", None)
    if target is not None:
        # Checked on the dotted name first: nothing outside this package is imported for a dataloader node, nor a
        # module's __main__ (resolve_target refuses it before importing: it would run the command line).
        try:
            built = resolve_target(target, f"{where}._target_") if names_this_package(target) else None
        except ValueError:
            built = None  # refused by what it names or is: the message below says what is expected
        if not (isinstance(built, type) and issubclass(built, cls)):
            raise ValueError(
                f"{where}._target_: got {target!r}, expected {getattr(cls, 'YAML_TARGET', cls.__name__)} "
                f"(or another {cls.__name__}); this reader builds a {cls.__name__}"
            )
    try:
        prepare = getattr(cls, "prepare_node", None)
        return from_mapping(cls, prepare(node) if prepare is not None else node, LOADER_SECTION)
    except (TypeError, ValueError) as error:
        if where == LOADER_SECTION:
            raise
        raise type(error)(f"{where.split(': ')[0]}: {error}") from None
