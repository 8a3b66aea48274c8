"""YAML schema and ``_target_`` resolution.

The schema is closed and typed: each section is a frozen dataclass, unknown
keys are refused with their path (``dataloader.packing.algo: unknown key``), and
every value is type-checked before any Zephon source or worker starts.

``_target_`` works the way AutoModel 0.7.0's ``ConfigNode`` resolves it: a
dotted import path (longest importable module prefix, then attributes), called
with the node's other keys as keyword arguments, nested ``_target_`` nodes
instantiated first.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml

from zephon_loader.contract import DEFAULT_BLOCK_MASK_BUDGET_BYTES
from zephon_loader.contract import PackingContract, contract_for_attention

PACKING_ALGORITHMS = ("first_fit", "best_fit", "wrap", "best_fit_wrap")
#: A path starting with this prefix resolves inside the installed package's ``data/`` folder.
PACKAGE_DATA_PREFIX = "pkg://"


@dataclass(frozen=True)
class SourceConfig:
    """One weighted source of JSONL or Parquet shards.

    Attributes:
        name: Unique name (Zephon's dataset name).
        path: Directory holding ``*.jsonl``/``*.parquet`` shards; relative paths
            resolve against the YAML file's folder, ``pkg://`` inside the package.
        weight: Mixture weight, > 0.
    """

    name: str
    path: str
    weight: float = 1.0


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


@dataclass(frozen=True)
class RuntimeConfig:
    """Zephon runtime options (``Pipeline.options``).

    Attributes:
        runner: ``auto``/``threads`` (default), ``inline``, or ``process``
            (spawned workers; scripts need an ``if __name__ == "__main__"`` guard).
        max_workers: Zephon worker count (``None``: Zephon's default).
        prefetch_batches: Zephon's own consumer-side prefetch (exactly accounted in its checkpoints).
        tokenize_parallelism: Tokenizing calls Zephon keeps in flight (``None``:
            Zephon's default, 4 calls of 64 records). Lower it for corpora of
            long documents: the first batch waits for fewer of them and less
            text is held in memory (see README, "Memory and first batch").
    """

    runner: Literal["auto", "threads", "inline", "process"] = "auto"
    max_workers: int | None = None
    prefetch_batches: int | None = None
    tokenize_parallelism: int | None = None

    #: Keys applied to the tokenize stage rather than to ``RuntimeOptions``.
    STAGE_KEYS = ("tokenize_parallelism",)

    def options(self) -> dict[str, Any]:
        """The non-default values of Zephon ``RuntimeOptions`` fields, as keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in self.STAGE_KEYS and getattr(self, f.name) not in (None, "auto")}


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
    """

    attn_implementation: str | None = None
    packed_mask_type: Literal["block_causal", "document_ids", "flash_varlen", "position_ids"] | None = None
    requires_packed_sequence_metadata: bool = False
    qkv_format: Literal["bshd", "thd"] = "bshd"

    def build(self) -> PackingContract:
        """The contract these fields describe."""
        if self.attn_implementation is not None:
            return contract_for_attention(
                self.attn_implementation,
                requires_packed_sequence_metadata=self.requires_packed_sequence_metadata,
                packed_mask_type=self.packed_mask_type,
                qkv_format=self.qkv_format,
            )
        return PackingContract(
            packed_mask_type=self.packed_mask_type or "block_causal",
            requires_packed_sequence_metadata=self.requires_packed_sequence_metadata,
            qkv_format=self.qkv_format,
        )


@dataclass(frozen=True)
class DistributedConfig:
    """Zephon data-parallel lanes (``Pipeline.options``); unset values come from the run.

    Attributes:
        canonical_replicas: Zephon's canonical lane count; every DP size used
            for elastic resume must divide it. ``None``: the DP size.
        aggregate_dir: Shared folder for Zephon's cross-rank aggregation.
        aggregate_store: Alternative to ``aggregate_dir``, e.g. ``"torch://"``.
        run_id: Names this run in the aggregate store.
    """

    canonical_replicas: int | None = None
    aggregate_dir: str | None = None
    aggregate_store: str | None = None
    run_id: str | None = None


class LoaderSchema:
    """What the text and image loader configs share: the YAML reader's hooks, typed coercion,
    the source and distributed checks, and path resolution.

    A subclass is a frozen dataclass with ``sources``, ``distributed``, ``base_dir``,
    ``xdoc`` and ``mask_cross_document_labels`` fields.
    """

    #: The bundled example the YAML reader points to.
    EXAMPLE_CONFIG = "configs/demo.yaml"
    #: The ``_target_`` a YAML node of this schema names.
    YAML_TARGET = "zephon_loader.ZephonDataloaderConfig"

    @classmethod
    def prepare_node(cls, node: dict[str, Any]) -> dict[str, Any]:
        """The YAML node before :func:`from_mapping` reads it (a hook for fields with their own readers)."""
        return node

    def _coerce_fields(self, schema: type) -> None:
        # Typed coercion of every field (a no-op for values already typed), so that
        # Schema(**plain_yaml_values) is as strict as from_mapping.
        hints = typing.get_type_hints(schema)
        for spec in dataclasses.fields(schema):
            value = _convert(getattr(self, spec.name), hints[spec.name], f"{LOADER_SECTION}.{spec.name}")
            object.__setattr__(self, spec.name, value)

    def _check_sources_and_lanes(self) -> None:
        sources = self.sources  # type: ignore[attr-defined]
        if not sources:
            raise ValueError("dataloader.sources: got an empty list, expected at least one source")
        names = [source.name for source in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"dataloader.sources: duplicate names in {names}; expected unique names")
        for index, source in enumerate(sources):
            if not source.name:
                raise ValueError(f"dataloader.sources[{index}].name: got '', expected a non-empty name")
            if not (math.isfinite(source.weight) and source.weight > 0):
                raise ValueError(f"dataloader.sources[{index}].weight: got {source.weight}, expected a finite number > 0")
        distributed = self.distributed  # type: ignore[attr-defined]
        if distributed.canonical_replicas is not None and distributed.canonical_replicas <= 0:
            raise ValueError(f"dataloader.distributed.canonical_replicas: got {distributed.canonical_replicas}, "
                             "expected an int > 0 or null")
        if distributed.run_id == "":
            raise ValueError("dataloader.distributed.run_id: got '', expected a non-empty run id or null")

    @property
    def labels_mask_cross_document(self) -> bool:
        """``mask_cross_document_labels`` resolved: on unless xdoc, when unset."""
        masked = self.mask_cross_document_labels  # type: ignore[attr-defined]
        return masked if masked is not None else not self.xdoc  # type: ignore[attr-defined]

    def resolve_path(self, value: str) -> Path:
        """A configured path as an absolute path (``pkg://`` → package data, relative → ``base_dir``)."""
        if value.startswith(PACKAGE_DATA_PREFIX):
            return package_data_dir() / value[len(PACKAGE_DATA_PREFIX) :]
        path = Path(value).expanduser()
        return path if path.is_absolute() else (Path(self.base_dir) / path).resolve()  # type: ignore[attr-defined]


@dataclass(frozen=True)
class TextLoaderConfig(LoaderSchema):
    """Everything ``build_text_loader`` needs (the YAML ``dataloader`` section).

    Constructing it from plain YAML values coerces and checks every field
    (wrong types raise ``TypeError`` naming ``dataloader.<field>``).

    Attributes:
        sources: One or more weighted shard folders.
        sequence_length: Model sequence length ``S`` (Zephon packs ``S + 1``).
        micro_batch_size: Rows per batch ``B``.
        tokenizer: See :class:`TokenizerConfig`.
        packing: See :class:`PackingOptions`.
        contract: The model's contract; ``None`` = AutoModel's default (block-causal).
        xdoc: Cross-document attention inside each row.
        eligibility_field: Per-token 0/1 record field marking tokens that may attend.
        return_packed_sequence_metadata: Also yield the gathered-token bundle.
        mask_cross_document_labels: Mask the label at each subdocument's last
            token (its target is the next document). ``None``: on unless xdoc.
        eos_mask_loss: Mask labels whose target is ``eos_token_id``.
        eos_token_id: Required with ``eos_mask_loss``.
        pad_token_id: Pad id for packing (default: the tokenizer's pad, else its
            EOS); needed for pretokenized input without a tokenizer.
        seed: Zephon mixture/shuffle seed.
        shuffle: Shuffle records within Zephon's work chunks.
        mixture: What a pass reads. ``repeat`` (default): every record of every
            source at least once, the weights held all the pass (smaller or
            lighter sources repeat until the slowest is read once). ``once``:
            every record of every source exactly once; the weights hold until a
            source runs out, then the others share its share (evaluation, or one
            exact epoch).
        passes: Passes over the sources in one stream, each reshuffled by
            Zephon (``mixture: repeat`` only); an epoch of the loader is this
            stream. ``null``: endless, for training by steps: the stream never
            ends, so data-parallel ranks never reach the end of a pass at
            different steps (their lanes hold different numbers of batches).
        chunk_size: Zephon work-chunk size in records; ``None`` picks one that fits the smallest source.
        read_ahead: Batches collated and finalized ahead of the training loop
            in a background thread (0 = none); resume stays exact.
        block_mask_budget_bytes: Largest block-causal ``[B, 1, S, S]`` mask allowed.
        on_bad_record: ``error`` (default: stop at the first malformed record,
            naming source, shard file and line/row) or ``skip`` (leave it out,
            counted by reason in ``loader.stats()``); see :mod:`zephon_loader.pipeline.records`.
        max_record_tokens: Records with more tokens are bad records (``None``: no limit).
        max_record_bytes: Texts larger than this many UTF-8 bytes are bad records,
            refused before tokenizing (``None``: no limit).
        distributed: See :class:`DistributedConfig`.
        runtime: See :class:`RuntimeConfig`.
        base_dir: Folder relative paths resolve against (set by the YAML reader).
    """

    sources: tuple[SourceConfig, ...]
    sequence_length: int
    micro_batch_size: int
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    packing: PackingOptions = field(default_factory=PackingOptions)
    contract: ContractConfig | None = None
    xdoc: bool = False
    eligibility_field: str | None = None
    return_packed_sequence_metadata: bool = False
    mask_cross_document_labels: bool | None = None
    eos_mask_loss: bool = False
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    seed: int = 0
    shuffle: bool = True
    mixture: Literal["repeat", "once"] = "repeat"
    passes: int | None = 1
    chunk_size: int | None = None
    read_ahead: int = 2
    block_mask_budget_bytes: int = DEFAULT_BLOCK_MASK_BUDGET_BYTES
    on_bad_record: Literal["error", "skip"] = "error"
    max_record_tokens: int | None = None
    max_record_bytes: int | None = None
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    base_dir: str = "."

    def __post_init__(self) -> None:
        self._coerce_fields(TextLoaderConfig)
        self._check_sources_and_lanes()
        for name in ("sequence_length", "micro_batch_size", "block_mask_budget_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"dataloader.{name}: got {getattr(self, name)}, expected an int > 0")
        if self.passes is not None and self.passes <= 0:
            raise ValueError(f"dataloader.passes: got {self.passes}, expected an int > 0 or null (endless)")
        if self.mixture == "once" and self.passes != 1:
            raise ValueError(f"dataloader.passes: got {self.passes} with mixture: once, expected 1 (once reads every "
                             "record exactly once; use mixture: repeat for several or endless passes)")
        for name in ("seed", "pad_token_id", "eos_token_id"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"dataloader.{name}: got {getattr(self, name)}, expected an int >= 0")
        for name in ("max_workers", "prefetch_batches", "tokenize_parallelism"):
            value = getattr(self.runtime, name)
            if value is not None and value <= 0:
                raise ValueError(f"dataloader.runtime.{name}: got {value}, expected an int > 0 or null")
        for name in ("max_record_tokens", "max_record_bytes"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"dataloader.{name}: got {getattr(self, name)}, expected an int > 0 or null")
        if self.packing.num_bins is not None and self.packing.num_bins <= 0:
            raise ValueError(f"dataloader.packing.num_bins: got {self.packing.num_bins}, expected an int > 0 or null")
        if self.packing.num_bins is not None and self.packing.algorithm not in ("first_fit", "best_fit"):
            raise ValueError(
                f"dataloader.packing.num_bins: got {self.packing.num_bins} with algorithm "
                f"{self.packing.algorithm!r}, expected null (bins apply to first_fit/best_fit only)"
            )
        if self.read_ahead < 0:
            raise ValueError(f"dataloader.read_ahead: got {self.read_ahead}, expected an int >= 0")
        if self.chunk_size is not None and self.chunk_size <= 0:
            raise ValueError(f"dataloader.chunk_size: got {self.chunk_size}, expected an int > 0 or null")
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

    def packing_contract(self) -> PackingContract:
        """The configured contract, or AutoModel's default (block-causal, no metadata)."""
        return (self.contract or ContractConfig()).build()


def package_data_dir() -> Path:
    """Folder of the bundled demo corpus, tokenizer and YAML."""
    return Path(__file__).resolve().parents[1] / "data"


def default_config_path() -> Path:
    """The bundled default YAML (``zephon-loader run`` without a config)."""
    return package_data_dir() / "demo.yaml"


# --- the typed reader ----------------------------------------------------------------------


def _type_name(expected: Any) -> str:
    origin = typing.get_origin(expected)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(expected))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(expected))
    if origin is tuple:
        return f"a list of {_type_name(typing.get_args(expected)[0])}"
    if dataclasses.is_dataclass(expected):
        return f"a mapping ({expected.__name__})"
    return {type(None): "null", int: "an int", float: "a number", bool: "a bool", str: "a string"}.get(
        expected, str(expected)
    )


def _convert(value: Any, expected: Any, path: str) -> Any:
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(expected)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, path)
            except (TypeError, ValueError) as error:
                errors.append(error)
        if len(errors) == 1:
            raise errors[0]
        raise TypeError(f"{path}: got {type(value).__name__} {value!r}, expected {_type_name(expected)}")
    if origin is Literal:
        if value not in typing.get_args(expected):
            raise ValueError(f"{path}: got {value!r}, expected {_type_name(expected)}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{path}: got {type(value).__name__}, expected {_type_name(expected)}")
        item = typing.get_args(expected)[0]
        return tuple(_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(expected):
        if isinstance(value, expected):
            return value
        return from_mapping(expected, value, path)
    if expected is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{path}: got {type(value).__name__} {value!r}, expected a bool")
        return value
    if expected is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{path}: got {type(value).__name__} {value!r}, expected an int")
        return value
    if expected is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{path}: got {type(value).__name__} {value!r}, expected a number")
        return float(value)
    if expected is str:
        if not isinstance(value, str):
            raise TypeError(f"{path}: got {type(value).__name__} {value!r}, expected a string")
        return value
    raise TypeError(f"{path}: unsupported schema type {expected!r}")  # pragma: no cover - schema bug


def from_mapping(cls: type, data: Any, path: str = "dataloader") -> Any:
    """Build a schema dataclass from a mapping, refusing unknown keys and wrong types.

    Args:
        cls: A dataclass of this module.
        data: The parsed YAML mapping.
        path: Dotted location of ``data`` in the YAML, used in error messages.

    Raises:
        TypeError: ``data`` not a mapping, or a value of the wrong type.
        ValueError: Unknown or missing keys, or values out of range.
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"{path}: got {type(data).__name__}, expected a mapping ({cls.__name__})")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{path}.{unknown[0]}: unknown key; expected one of {sorted(known)}")
    kwargs = {}
    for name, spec in known.items():
        if name in data:
            kwargs[name] = _convert(data[name], hints[name], f"{path}.{name}")
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            raise ValueError(f"{path}.{name}: missing; expected {_type_name(hints[name])}")
    return cls(**kwargs)


def text_loader_config(**kwargs: Any) -> TextLoaderConfig:
    """A :class:`TextLoaderConfig` from keyword arguments (plain YAML values)."""
    return from_mapping(TextLoaderConfig, kwargs)


# --- _target_ resolution ----------------------------------------------------------------


def resolve_target(dotted_path: str) -> Any:
    """Import ``pkg.module.attr`` by the longest importable module prefix (AutoModel's rule).

    Raises:
        ImportError: No prefix imports, or an attribute is missing; the message names the path.
    """
    if not isinstance(dotted_path, str) or not dotted_path:
        raise TypeError(f"_target_: got {dotted_path!r}, expected a dotted import path string")
    parts = dotted_path.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name is not None and not module_name.startswith(error.name):
                raise  # the module exists but one of its own imports is missing
            continue
        for attribute in parts[cut:]:
            if not hasattr(obj, attribute):
                raise ImportError(f"_target_: module {module_name!r} has no attribute path {'.'.join(parts[cut:])!r} ({dotted_path})")
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(f"_target_: cannot import any module prefix of {dotted_path!r}")


def instantiate(node: Any, **overrides: Any) -> Any:
    """Instantiate a YAML node the way AutoModel's ``ConfigNode.instantiate`` does.

    Mappings with ``_target_`` are called with their other keys (nested
    ``_target_`` nodes instantiated first); other values are returned as they
    are. ``overrides`` are merged into the top-level call.
    """
    if isinstance(node, list):
        return [instantiate(item) for item in node]
    if not isinstance(node, Mapping):
        return node
    if "_target_" not in node:
        return {key: instantiate(value) for key, value in node.items()}
    target = resolve_target(node["_target_"])
    kwargs = {key: instantiate(value) for key, value in node.items() if key != "_target_" and key not in overrides}
    kwargs.update(overrides)
    return target(**kwargs)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML file into a mapping, with a one-line error for a missing or malformed file.

    Raises:
        FileNotFoundError: No such file.
        ValueError: A YAML syntax error, as ``file:line:column: problem``.
        TypeError: The top level is not a mapping.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config: {path} does not exist; expected a YAML file (see configs/demo.yaml)")
    with path.open() as handle:
        try:
            data = yaml.safe_load(handle)
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            context = getattr(error, "context", None)
            raise ValueError(
                f"{where}: YAML syntax error: {problem}" + (f" ({context})" if context else "")
                + "; expected valid YAML (check indentation, quotes and ':' after keys)"
            ) from None
    if not isinstance(data, dict):
        raise TypeError(f"config: {path} holds {type(data).__name__}, expected a mapping at the top level")
    return data


#: The YAML section a loader config lives in (AutoModel's recipe key).
LOADER_SECTION = "dataloader"


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
        built = resolve_target(target)
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
