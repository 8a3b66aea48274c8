"""Zephon pipeline construction and the torchdata source node.

Two public pieces (SPEC §2):

* :func:`build_pipeline` turns plain typed arguments into a
  ``zephon.Pipeline``: ``WorkSource -> [tokenize | tokenize_chat |
  pretokenized] -> keep token fields -> pack_flat(L + 1) -> batch(B)``. Every
  check that Zephon would otherwise fail late, slowly or *silently wrong* runs
  here, before any worker starts.
* :class:`ZephonSource` is a ``torchdata.nodes.BaseNode`` that yields Zephon's
  ``SampleBatch`` objects. Its state is ``pipeline.checkpoint()`` and resuming
  is ``pipeline.restore(state)`` followed by ``iter(pipeline)``: exact and
  O(1), never the O(N) replay of ``IterableWrapper``.

Do not put a ``torchdata.nodes.Prefetcher`` directly above a
:class:`ZephonSource`: a Prefetcher snapshots its source's state for every
item it pulls (``snapshot_frequency=1`` by default), which would call
``pipeline.checkpoint()`` per batch — a ~100 ms collective across ranks in a
multi-rank job. Zephon already prefetches internally (``prefetch_batches``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from zephon_loader import fields as F

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_NUM_BINS",
    "PACKING_ALGORITHMS",
    "SourceSpec",
    "ZephonKeys",
    "ZephonSource",
    "build_pipeline",
    "choose_chunk_size",
    "pad_token_id_of",
]

#: Zephon's own default ``StaticMixtureWorkSource(chunk_size=...)``; the upper bound we pick from.
DEFAULT_CHUNK_SIZE = 16384
#: Bins kept open by ``first_fit``/``best_fit`` when the caller does not say.
DEFAULT_NUM_BINS = 8
#: ``pack_flat`` algorithms Zephon 0.2.0 implements.
PACKING_ALGORITHMS = ("first_fit", "best_fit", "wrap", "best_fit_wrap")
_BINNED = ("first_fit", "best_fit")


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

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
_JSONL_SUFFIX = ".jsonl"
_PARQUET_SUFFIX = ".parquet"


def _err(where: str, seen: Any, expected: str, fix: str) -> str:
    """One error line in Zephon's style: field, what was seen, what was expected, how to fix."""
    return f"{where}: got {seen!r}, expected {expected}. {fix}"


# ----------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class SourceSpec:
    """One mixture component.

    Attributes:
        name: Component name (unique within the mixture; used in Zephon's state).
        path: Local directory of ``*.jsonl`` (optionally compressed) or ``*.parquet``
            shards — one format per directory.
        weight: Mixture weight, > 0 and finite; weights are normalized by Zephon.
    """

    name: str
    path: str | os.PathLike[str]
    weight: float = 1.0


def _coerce_sources(sources: Any) -> list[SourceSpec]:
    if isinstance(sources, (str, bytes, os.PathLike)) or not isinstance(sources, Sequence):
        raise TypeError(
            _err("sources", type(sources).__name__, "a non-empty list of SourceSpec or {name, path, weight} mappings",
                 "Pass e.g. [SourceSpec('web', '/data/web', 1.0)].")
        )
    if not sources:
        raise ValueError(_err("sources", [], "at least one source", "Add a SourceSpec(name, path, weight)."))
    specs: list[SourceSpec] = []
    for i, src in enumerate(sources):
        if isinstance(src, SourceSpec):
            specs.append(src)
        elif isinstance(src, Mapping):
            unknown = set(src) - {"name", "path", "weight"}
            if unknown or "name" not in src or "path" not in src:
                raise ValueError(
                    _err(f"sources[{i}]", dict(src), "a mapping with keys name, path and optional weight",
                         f"Remove {sorted(unknown)} / add the missing keys." if unknown else "Add the missing keys.")
                )
            specs.append(SourceSpec(src["name"], src["path"], src.get("weight", 1.0)))
        else:
            raise TypeError(
                _err(f"sources[{i}]", type(src).__name__, "SourceSpec or mapping", "Wrap it in SourceSpec(name, path, weight).")
            )
    names: set[str] = set()
    for i, spec in enumerate(specs):
        if not isinstance(spec.name, str) or not spec.name:
            raise ValueError(_err(f"sources[{i}].name", spec.name, "a non-empty str", "Name every source."))
        if spec.name in names:
            raise ValueError(_err(f"sources[{i}].name", spec.name, "a unique name", "Rename one of the duplicated sources."))
        names.add(spec.name)
        w = spec.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise ValueError(
                _err(f"sources[{i}].weight ({spec.name!r})", w, "a finite number > 0",
                     "Give every source a positive weight, or drop the source from the mixture.")
            )
    return specs


def _check_source_dir(index: int, spec: SourceSpec) -> Path:
    where = f"sources[{index}].path ({spec.name!r})"
    if not isinstance(spec.path, (str, os.PathLike)):
        raise TypeError(_err(where, type(spec.path).__name__, "a local directory path (str or PathLike)", "Pass a path."))
    raw = os.fspath(spec.path)
    if "://" in raw:
        raise ValueError(_err(where, raw, "a local directory", "Download the shards and pass the local directory."))
    path = Path(raw)
    if not path.exists():
        raise ValueError(_err(where, raw, "an existing directory of .jsonl or .parquet shards", "Check the path."))
    if not path.is_dir():
        raise ValueError(_err(where, raw, "a directory (not a file)", "Pass the directory that holds the shards."))
    names = [p.name for p in path.iterdir() if p.is_file()]
    jsonl = [n for n in names if n.endswith(_jsonl_suffixes())]
    parquet = [n for n in names if n.endswith(_PARQUET_SUFFIX)]
    if not jsonl and not parquet:
        raise ValueError(
            _err(where, raw, "a directory containing *.jsonl or *.parquet shards (none found)",
                 "Point the source at the folder that holds the shard files.")
        )
    if jsonl and parquet:
        # Zephon would silently read only the JSONL files.
        raise ValueError(
            _err(where, f"{len(jsonl)} .jsonl and {len(parquet)} .parquet files", "one shard format per directory",
                 "Zephon reads only the JSONL files of a mixed directory; split the formats into two sources.")
        )
    return path


def _jsonl_suffixes() -> tuple[str, ...]:
    try:
        from zephon._internal.io.suffixes import JSONL_SUFFIXES

        return tuple(JSONL_SUFFIXES)
    except Exception:  # pragma: no cover - private module moved
        return (_JSONL_SUFFIX,)


def _liveness_required(share: float, chunk_size: int) -> int:
    """Zephon 0.2.0's repeat-policy bound (``StaticMixtureWorkSource`` validate_liveness)."""
    quota = share * chunk_size
    if quota.is_integer():
        return int(quota)
    return min(math.ceil(quota) + 1, chunk_size)


#: File name of the drop log inside ``build_pipeline``'s ``work_dir``.
DROP_LOG_NAME = "drops.jsonl"

#: With ``chunk_size=None`` and several DP lanes, the chunk size leaves at least this many chunks per lane.
CHUNKS_PER_LANE = 8
#: Zephon 0.2.0 flushes its packing (and batching) state every this many chunks per lane by default
#: (``RuntimeOptions.flush_every_k_chunks``); each flush pads out the open rows.
ZEPHON_FLUSH_EVERY_K_CHUNKS = 8
#: Most chunks between flushes we ask for: every chunk between two flushes is kept in flight,
#: saved in the checkpoint (about 170 bytes each: 1.4 MB and ~0.1 s per state at chunk size 1,
#: like Zephon's default 8 chunks of 16384 records) and replayed on restore.
MAX_FLUSH_EVERY_K_CHUNKS = 8192


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


def pad_token_id_of(tokenizer: Any) -> int | None:
    """The pad id a tokenizer implies for packing: its pad token, else its EOS; None when it has neither."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


# ----------------------------------------------------------------------------- tokenizer


def _check_tokenizer_dir(tokenizer: Any) -> Path:
    where = "tokenizer"
    if not isinstance(tokenizer, (str, os.PathLike)):
        raise TypeError(
            _err(where, type(tokenizer).__name__, "a local tokenizer directory (str or PathLike)",
                 "Save the tokenizer with save_pretrained(dir) and pass dir.")
        )
    raw = os.fspath(tokenizer)
    path = Path(raw)
    if not path.is_dir():
        hint = (
            "A hub id cannot resolve offline (Zephon would retry with backoff, then fail); "
            "download it once and pass the local directory written by save_pretrained(dir)."
            if not path.exists()
            else "Pass the directory that holds tokenizer.json / tokenizer_config.json."
        )
        raise ValueError(_err(where, raw, "an existing local tokenizer directory", hint))
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            _err(where, raw, f"a directory containing one of {list(_TOKENIZER_FILES)}",
                 "Write it with transformers' save_pretrained(dir).")
        )
    return path


def _load_tokenizer(path: Path, **options: Any) -> Any:
    """Load in the driver, offline: to validate, read special-token ids, and hand to Zephon's ``tokenize``."""
    try:
        from transformers import AutoTokenizer
    except Exception as exc:  # pragma: no cover - optional extra
        raise ImportError("tokenizer directories need transformers: pip install 'zephon-loader[hf]'") from exc
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, use_fast=True, **options)
    except Exception as exc:
        raise ValueError(
            _err("tokenizer", str(path), "a directory AutoTokenizer.from_pretrained can load offline",
                 f"It failed with {type(exc).__name__}: {exc}. Re-save it with save_pretrained(dir).")
        ) from exc


def _check_token_id(name: str, value: Any, vocab: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(_err(name, value, "a non-negative int", f"Pass {name}=<id>."))
    if value < 0:
        raise ValueError(_err(name, int(value), "a non-negative int", f"Pass {name}=<id>."))
    if vocab is not None and value >= vocab:
        raise ValueError(_err(name, int(value), f"an id < vocabulary size {vocab}", "Use an id of this tokenizer."))


def _positive_int(name: str, value: Any, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(_err(name, value, "a positive int", fix))
    if value <= 0:
        raise ValueError(_err(name, int(value), "a positive int", fix))
    return int(value)


# ----------------------------------------------------------------------------- payload filter


# ----------------------------------------------------------------------------- pipeline


def _runtime_option_names() -> set[str]:
    from zephon.options import RuntimeOptions

    return {f.name for f in dataclasses.fields(RuntimeOptions)}


def build_pipeline(
    sources: Sequence[SourceSpec | Mapping[str, Any]],
    *,
    seq_len: int,
    micro_batch_size: int,
    tokenizer: str | os.PathLike[str] | None = None,
    text_field: str = "text",
    pretokenized_field: str | None = None,
    chat_field: str | None = None,
    chat_template: str | None = None,
    chat_apply_template: bool = True,
    chat_loss_scope: str | None = None,
    special_tokens: str = "bos_eos",
    packing_algorithm: str = "first_fit",
    num_bins: int | None = None,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    seed: int = 0,
    shuffle: bool = True,
    chunk_size: int | None = None,
    stop_after_passes: int = 1,
    eligibility_field: str | None = None,
    transform: Callable[[Any], Any] | None = None,
    world_size: int = 1,
    global_rank: int = 0,
    dp_degree: int | None = None,
    dp_group_id: int | None = None,
    canonical_replicas: int | None = None,
    aggregate_dir: str | os.PathLike[str] | None = None,
    aggregate_store: str | None = None,
    run_id: str | None = None,
    runtime_options: Mapping[str, Any] | None = None,
    on_bad_record: str = "error",
    max_record_tokens: int | None = None,
    max_record_bytes: int | None = None,
    work_dir: str | os.PathLike[str] | None = None,
) -> Any:
    """Build a ``zephon.Pipeline`` that yields packed ``SampleBatch`` es of ``B`` rows of ``L + 1`` tokens.

    Graph: ``StaticMixtureWorkSource -> [transform] -> tokenize | tokenize_chat |
    (pretokenized) -> CheckTokens -> pack_flat(L + 1, emit_positions=True)
    -> batch(B)``. Nothing starts: workers start at the first ``next()`` of
    ``iter(pipeline)``.

    Input modes (exactly one):

    * text (default): ``tokenizer`` (local dir) tokenizes ``text_field``; with
      ``special_tokens="bos_eos"`` Zephon brackets every record ``BOS ... EOS``.
    * pretokenized: ``pretokenized_field`` names a per-record list of token ids
      (used as is: no BOS/EOS added). ``tokenizer`` is optional and only supplies
      default pad/eos ids.
    * chat: ``chat_field`` names the messages list; ``tokenizer`` is required and
      ``tokenize_chat`` emits a per-token loss mask that ``collate`` turns into
      ``-100`` labels.

    Args:
        sources: Mixture components (:class:`SourceSpec` or ``{name, path, weight}``).
        seq_len: Model sequence length ``L`` (> 0); rows are packed to ``L + 1``.
        micro_batch_size: Rows per batch ``B`` (> 0). Zephon delivers the short batch
            left at each flush and at the end of the stream; ``collate`` pads it to ``B``.
        tokenizer: Local tokenizer directory (``save_pretrained`` output). Hub ids
            are refused (they cannot resolve offline).
        text_field: Text column (text mode).
        pretokenized_field: Token-id column (pretokenized mode).
        chat_field: Messages column (chat mode).
        chat_template: Jinja text or file overriding the tokenizer's template (chat mode).
        chat_apply_template: False concatenates contents and supervises assistant turns.
        chat_loss_scope: Zephon's ``loss_scope`` (``all_assistant`` default,
            ``last_span``, ``after_last_user``).
        special_tokens: Zephon's ``tokenize(special_tokens=)`` (text mode).
        packing_algorithm: One of :data:`PACKING_ALGORITHMS`.
        num_bins: Open bins for ``first_fit``/``best_fit`` (default
            :data:`DEFAULT_NUM_BINS`); must be unset for wrap algorithms.
        pad_token_id: Pad id (default: the tokenizer's pad, else its eos).
            Required: every algorithm pads the last row of each flush.
        bos_token_id: BOS override for text mode bracketing.
        eos_token_id: EOS override for text mode bracketing.
        seed: Seed of Zephon's work source.
        shuffle: Shuffle shard order and samples within shards.
        chunk_size: Work-source chunk size; ``None`` picks the largest size
            (<= :data:`DEFAULT_CHUNK_SIZE`, capped with several DP lanes so each
            lane gets :data:`CHUNKS_PER_LANE` chunks or more) with which every
            pass of every source is read whole (:func:`choose_chunk_size`); an
            explicit size that would skip records is refused. Zephon's flush
            cadence (``flush_every_k_chunks``, overridable in
            ``runtime_options``) is raised for small sizes, up to
            :data:`MAX_FLUSH_EVERY_K_CHUNKS`.
        stop_after_passes: The stream ends once every source was read this many
            times (the smaller sources repeat meanwhile to hold the mixture).
        eligibility_field: Optional per-token bool column (pretokenized mode or
            ``transform`` output) carried through packing as
            ``fields.ATTENTION_ELIGIBILITY`` (0/False at padding).
        transform: Optional payload map run first (e.g. a processor). In text or
            chat mode its output feeds the tokenizer; otherwise it must emit
            ``pretokenized_field``.
        world_size: Total ranks.
        global_rank: This rank.
        dp_degree: Data-parallel groups (default ``world_size``).
        dp_group_id: This rank's DP group (default ``global_rank``).
        canonical_replicas: Logical lanes for elastic resume (default ``dp_degree``);
            must be divisible by every DP size used.
        aggregate_dir: Shared directory for multi-rank checkpoint aggregation.
        aggregate_store: Alternative KV store URI (``"torch://"``).
        run_id: Run id for aggregation.
        runtime_options: Further ``zephon.options.RuntimeOptions`` fields
            (``runner``, ``max_workers``, ``prefetch_batches``, ``mtp_mode``, ...).
        on_bad_record: ``"error"`` (stop at the first malformed record, naming its
            source, shard file and line/row) or ``"skip"`` (leave it out, counted
            in ``work_dir/drops.jsonl``); see :mod:`zephon_loader.records`.
        max_record_tokens: Records with more tokens are bad records (``None``: no limit).
        max_record_bytes: Texts (chat: all contents) larger than this many UTF-8
            bytes are bad records, checked before tokenizing (``None``: no limit).
        work_dir: Existing folder the pipeline writes to, owned (and removed) by
            the caller: ``drops.jsonl``, the drop events the record checks
            append (:mod:`zephon_loader.stats` reads it), and in text mode
            ``text_tokenizer/``, the tokenizer saved with
            ``split_special_tokens=True`` for Zephon to load. ``None``: a fresh
            temporary folder, left for the caller to remove.

    Returns:
        The configured ``zephon.Pipeline``.

    Raises:
        ValueError / TypeError: naming the argument, the value seen, what was
        expected and the fix; raised before any worker starts.
    """
    import zephon

    from zephon_loader.records import BAD_RECORD_POLICIES, CheckRawRecords, CheckTokens, DropLog, ShardTable

    specs = _coerce_sources(sources)
    seq_len = _positive_int("seq_len", seq_len, "Pass the model sequence length L (rows are packed to L + 1).")
    micro_batch_size = _positive_int("micro_batch_size", micro_batch_size, "Pass the number of rows per batch B.")

    # --- input mode -------------------------------------------------------------
    if pretokenized_field is not None and chat_field is not None:
        raise ValueError(
            _err("pretokenized_field/chat_field", (pretokenized_field, chat_field), "at most one of them",
                 "Choose pretokenized input or chat input.")
        )
    mode = "pretokenized" if pretokenized_field is not None else "chat" if chat_field is not None else "text"
    for name, value in (("text_field", text_field), ("pretokenized_field", pretokenized_field),
                        ("chat_field", chat_field), ("eligibility_field", eligibility_field)):
        if value is not None and (not isinstance(value, str) or not value):
            raise TypeError(_err(name, value, "a non-empty column name (str)", f"Pass {name}='<column>'."))
    if transform is not None and not callable(transform):
        raise TypeError(_err("transform", type(transform).__name__, "a callable payload -> payload", "Pass a function."))

    tok = None
    tok_path: Path | None = None
    if tokenizer is None:
        if mode != "pretokenized":
            # Zephon would silently fall back to a hash stub whose ids change per process.
            raise ValueError(
                _err("tokenizer", None, f"a local tokenizer directory for {mode} input",
                     "Pass tokenizer='<dir written by save_pretrained>', or pass pretokenized_field='<token column>'.")
            )
    else:
        tok_path = _check_tokenizer_dir(tokenizer)
        # split_special_tokens changes only how text is split, not ids, vocabulary or special tokens: the one
        # object validates here and, in text mode, is saved for Zephon below.
        tok = _load_tokenizer(tok_path, split_special_tokens=True)
    vocab = len(tok) if tok is not None else None

    if eligibility_field is not None and mode != "pretokenized" and transform is None:
        raise ValueError(
            _err("eligibility_field", eligibility_field, "pretokenized input or a transform that emits per-token values",
                 "Tokenizing text adds/merges tokens, so a stored per-token column cannot stay aligned; "
                 "store token ids and eligibility together and set pretokenized_field.")
        )
    if eligibility_field is not None and mode == "chat":
        raise ValueError(
            _err("eligibility_field", eligibility_field, "unset in chat mode",
                 "tokenize_chat replaces the payload; pretokenize the chat and use pretokenized_field.")
        )

    if special_tokens not in ("bos_eos", "bos", "eos", "none", "tokenizer_default"):
        raise ValueError(
            _err("special_tokens", special_tokens, "one of 'bos_eos', 'bos', 'eos', 'none', 'tokenizer_default'",
                 "Use 'bos_eos' (BOS ... EOS around every document) unless you know otherwise.")
        )
    if mode == "text" and tok is not None:
        needs_bos = special_tokens in ("bos_eos", "bos")
        needs_eos = special_tokens in ("bos_eos", "eos")
        if needs_bos and bos_token_id is None and tok.bos_token_id is None:
            raise ValueError(
                _err("bos_token_id", None, f"a BOS id for special_tokens={special_tokens!r}",
                     "The tokenizer has no bos_token; pass bos_token_id=... or special_tokens='eos'.")
            )
        if needs_eos and eos_token_id is None and tok.eos_token_id is None:
            raise ValueError(
                _err("eos_token_id", None, f"an EOS id for special_tokens={special_tokens!r}",
                     "The tokenizer has no eos_token; pass eos_token_id=... or special_tokens='bos'.")
            )
    for name, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
        if value is not None:
            _check_token_id(name, value, vocab)
            if mode != "text":
                raise ValueError(
                    _err(name, value, "unset outside text mode",
                         "BOS/EOS overrides only apply to Zephon's text tokenizer bracketing; drop it.")
                )
    if mode == "chat" and chat_apply_template and chat_template is None and not getattr(tok, "chat_template", None):
        raise ValueError(
            _err("chat_template", None, "a chat template (the tokenizer has none)",
                 "Pass chat_template='<jinja>' or chat_apply_template=False.")
        )

    # --- packing ------------------------------------------------------------------
    if packing_algorithm not in PACKING_ALGORITHMS:
        raise ValueError(
            _err("packing_algorithm", packing_algorithm, f"one of {list(PACKING_ALGORITHMS)}",
                 "'first_fit' keeps documents whole (drops ones longer than L+1); 'wrap' splits them.")
        )
    if packing_algorithm in _BINNED:
        num_bins = DEFAULT_NUM_BINS if num_bins is None else _positive_int("num_bins", num_bins, "Pass a positive bin count.")
    elif num_bins is not None:
        raise ValueError(
            _err("num_bins", num_bins, f"None for packing_algorithm={packing_algorithm!r}",
                 "Bins only apply to first_fit/best_fit; drop num_bins.")
        )
    if pad_token_id is None and tok is not None:
        pad_token_id = pad_token_id_of(tok)
    if pad_token_id is None:
        # Every algorithm pads: the last row of the stream (and of each Zephon flush) and the
        # all-padding rows that complete the last batch.
        raise ValueError(
            _err("pad_token_id", None, f"a pad id for packing_algorithm={packing_algorithm!r}",
                 "Pass pad_token_id=..., or a tokenizer with a pad or eos token.")
        )
    else:
        _check_token_id("pad_token_id", pad_token_id, vocab)

    # --- work source ----------------------------------------------------------------
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(_err("seed", seed, "a non-negative int", "Pass seed=<int>."))
    if seed < 0:
        raise ValueError(_err("seed", int(seed), "a non-negative int", "Pass seed=<int>."))
    if not isinstance(shuffle, bool):
        raise TypeError(_err("shuffle", shuffle, "a bool", "Pass shuffle=True or False."))
    stop_after_passes = _positive_int("stop_after_passes", stop_after_passes, "Pass the number of passes (>= 1).")
    paths = [_check_source_dir(i, spec) for i, spec in enumerate(specs)]
    datasets = [zephon.Dataset.from_path(spec.name, str(path)) for spec, path in zip(specs, paths, strict=True)]
    counts = [int(ds.total()) for ds in datasets]
    for i, (spec, n) in enumerate(zip(specs, counts, strict=True)):
        if n == 0:
            raise ValueError(
                _err(f"sources[{i}].path ({spec.name!r})", os.fspath(spec.path), "at least one record",
                     "The shards are empty; add data or drop the source.")
            )
    weights = [float(spec.weight) for spec in specs]
    shares = _shares(weights)
    largest = _largest_servable_chunk_size(counts, shares, DEFAULT_CHUNK_SIZE)
    upper = largest
    lanes = canonical_replicas or dp_degree or world_size
    if isinstance(lanes, int) and lanes > 1:
        # Zephon deals whole chunks to lanes: keep several chunks per lane, or
        # with small sources one lane gets everything and the others nothing.
        upper = max(1, min(largest, sum(counts) // (CHUNKS_PER_LANE * lanes)))
    if chunk_size is None:
        chunk_size = choose_chunk_size(counts, weights, upper=upper)
    else:
        chunk_size = _positive_int("chunk_size", chunk_size, "Pass a positive chunk size or None to choose one.")
        if chunk_size > largest:
            short = [
                f"{spec.name!r} has {n} records, needs {_liveness_required(s, chunk_size)}"
                for spec, n, s in zip(specs, counts, shares, strict=True)
                if n < _liveness_required(s, chunk_size)
            ]
            raise ValueError(
                _err("chunk_size", chunk_size, f"at most {largest} for these sources ({'; '.join(short)})",
                     "Pass chunk_size=None to choose the largest size that fits, or add data.")
            )
        split = _split_pass(counts, shares, chunk_size)
        if split is not None:
            index, reason = split
            chosen, below = (choose_chunk_size(counts, weights, upper=u) for u in (upper, chunk_size))
            raise ValueError(
                _err("chunk_size", chunk_size, "a size with which every pass of every source is read whole",
                     f"With it, Zephon can skip the end of a pass of sources[{index}] ({specs[index].name!r}): "
                     f"{reason}. Pass chunk_size=None (picks {chosen} here)"
                     + (f" or chunk_size={below}." if below != chosen else "."))
            )
    # Every K chunks Zephon flushes packing and batching: the open rows are padded and a short batch
    # is delivered (padded to B by collate). Keep the records between flushes near what its default
    # K gives at the largest size the data allows, so small chunk sizes do not flush every few records.
    flush_every_k_chunks = min(MAX_FLUSH_EVERY_K_CHUNKS,
                               max(ZEPHON_FLUSH_EVERY_K_CHUNKS, -(-ZEPHON_FLUSH_EVERY_K_CHUNKS * upper // chunk_size)))
    work_source = zephon.StaticMixtureWorkSource(
        datasets,
        zephon.MixtureSpec({spec.name: float(spec.weight) for spec in specs}),
        chunk_size=chunk_size,
        seed=int(seed),
        shuffle_shards=shuffle,
        shuffle_within_shard=shuffle,
        stop_after_passes=stop_after_passes,
    )

    # --- options --------------------------------------------------------------------
    options = _dp_options(world_size, global_rank, dp_degree, dp_group_id, canonical_replicas,
                          aggregate_dir, aggregate_store, run_id)
    if runtime_options is not None:
        if not isinstance(runtime_options, Mapping):
            raise TypeError(_err("runtime_options", type(runtime_options).__name__, "a mapping", "Pass a dict."))
        known = _runtime_option_names()
        unknown = sorted(set(runtime_options) - known)
        if unknown:  # Zephon only warns and ignores them
            raise ValueError(
                _err("runtime_options", unknown, "fields of zephon.options.RuntimeOptions",
                     f"Remove or fix them (valid: {sorted(known)}).")
            )
        clash = sorted(set(runtime_options) & _DP_OPTION_KEYS)
        if clash:
            raise ValueError(
                _err("runtime_options", clash, "no data-parallel keys", "Pass them as build_pipeline arguments instead.")
            )
        options.update(runtime_options)
    options.setdefault("flush_every_k_chunks", flush_every_k_chunks)

    # --- record checks ------------------------------------------------------------
    if on_bad_record not in BAD_RECORD_POLICIES:
        raise ValueError(
            _err("on_bad_record", on_bad_record, f"one of {list(BAD_RECORD_POLICIES)}",
                 "'error' stops at the first malformed record; 'skip' leaves such records out and counts them.")
        )
    for name, limit in (("max_record_tokens", max_record_tokens), ("max_record_bytes", max_record_bytes)):
        if limit is not None:
            _positive_int(name, limit, f"Pass a positive {name} or None for no limit.")
    if work_dir is None:
        work_dir = tempfile.mkdtemp(prefix="zephon_loader_pipeline_")
    checks = {
        "shards": ShardTable.from_folders([spec.name for spec in specs], paths),
        "policy": on_bad_record,
        "log": DropLog(os.path.join(work_dir, DROP_LOG_NAME)),
    }

    # --- graph ------------------------------------------------------------------------
    pipeline = zephon.Pipeline(work_source)
    if transform is not None:
        pipeline = pipeline.map_transform(transform)
    loss_mask_field = None
    if mode in ("text", "chat"):
        raw_check = CheckRawRecords(
            mode=mode, field=text_field if mode == "text" else chat_field, max_record_bytes=max_record_bytes,
            special_strings=tok.all_special_tokens if mode == "chat" else (), **checks)
        pipeline = pipeline.add_op("zephon_loader.check_raw_records", process_many=raw_check,
                                   validation_samples=raw_check.validation_samples, preserves_cursor_order=True)
    if mode == "text":
        kwargs: dict[str, Any] = {}
        if bos_token_id is not None:
            kwargs["bos_token_id"] = int(bos_token_id)
        if eos_token_id is not None:
            kwargs["eos_token_id"] = int(eos_token_id)
        # Special-token strings inside documents ("<|endoftext|>", the pad token) stay ordinary text:
        # a control id never comes from data. BOS/EOS bracketing is added by id, not by string.
        # Zephon gets a saved folder, not the object: a tokenizer object passed to Zephon's tokenize
        # kept ~0.4 MiB of heap per iter() (measured with bench_soak.py --mode passes).
        text_tokenizer = os.path.join(work_dir, "text_tokenizer")
        tok.save_pretrained(text_tokenizer)
        pipeline = pipeline.tokenize(
            tokenizer_id=text_tokenizer, field=text_field,
            add_attention_mask=False, special_tokens=special_tokens, **kwargs,
        )
        tokens_field = ZEPHON_TOKENS_KEY
    elif mode == "chat":
        chat_kwargs: dict[str, Any] = {"field": chat_field, "apply_chat_template": chat_apply_template}
        if chat_template is not None:
            chat_kwargs["chat_template"] = chat_template
        if chat_loss_scope is not None:
            chat_kwargs["loss_scope"] = chat_loss_scope
        pipeline = pipeline.tokenize_chat(tokenizer_id=str(tok_path), **chat_kwargs)
        tokens_field = ZEPHON_TOKENS_KEY
        loss_mask_field = ZEPHON_LOSS_MASK_KEY
    else:
        assert pretokenized_field is not None
        tokens_field = pretokenized_field
    token_check = CheckTokens(
        tokens_field=tokens_field, vocab_size=vocab, max_record_tokens=max_record_tokens,
        row_capacity=seq_len + 1 if packing_algorithm in _BINNED else None,
        eligibility_field=eligibility_field, loss_mask_field=loss_mask_field, **checks)
    pipeline = pipeline.add_op("zephon_loader.check_tokens", process_many=token_check,
                               validation_samples=token_check.validation_samples, preserves_cursor_order=True)
    pack_kwargs: dict[str, Any] = {"algorithm": packing_algorithm, "tokens_field": ZEPHON_TOKENS_KEY, "emit_positions": True}
    if num_bins is not None:
        pack_kwargs["num_bins"] = num_bins
    if pad_token_id is not None:
        pack_kwargs["pad_token_id"] = int(pad_token_id)
    if packing_algorithm == "wrap":
        # Uncapped wrap drops the partial row left at each flush (every flush_every_k_chunks chunks and
        # the end of the stream). A cap of L + 1 segments never closes a row early (every segment
        # holds a token), but makes Zephon pad that row and emit it instead.
        pack_kwargs["max_sequences_per_bin"] = seq_len + 1
    # drop_last=False: the short batch of each flush is delivered; collate pads it to B rows.
    pipeline = pipeline.pack_flat(seq_len + 1, **pack_kwargs).batch(micro_batch_size, drop_last=False)
    if options:
        pipeline = pipeline.options(**options)
    return pipeline


_DP_OPTION_KEYS = frozenset(
    {"world_size", "global_rank", "dp_degree", "dp_group_id", "canonical_replicas", "aggregate_dir",
     "aggregate_store", "run_id"}
)


def _dp_options(
    world_size: Any, global_rank: Any, dp_degree: Any, dp_group_id: Any, canonical_replicas: Any,
    aggregate_dir: Any, aggregate_store: Any, run_id: Any,
) -> dict[str, Any]:
    world_size = _positive_int("world_size", world_size, "Pass the total number of ranks.")
    if isinstance(global_rank, bool) or not isinstance(global_rank, (int, np.integer)) or not 0 <= global_rank < world_size:
        raise ValueError(_err("global_rank", global_rank, f"an int in [0, {world_size})", "Pass this rank's index."))
    dp = world_size if dp_degree is None else _positive_int("dp_degree", dp_degree, "Pass the number of DP groups.")
    if world_size % dp:
        raise ValueError(_err("dp_degree", dp, f"a divisor of world_size={world_size}", "Fix the parallel layout."))
    group = global_rank if dp_degree is None and dp_group_id is None else dp_group_id
    if group is None:
        raise ValueError(_err("dp_group_id", None, "this rank's DP group when dp_degree is set", "Pass dp_group_id=..."))
    if isinstance(group, bool) or not isinstance(group, (int, np.integer)) or not 0 <= group < dp:
        raise ValueError(_err("dp_group_id", group, f"an int in [0, {dp})", "Pass this rank's DP group index."))
    replicas = dp if canonical_replicas is None else _positive_int(
        "canonical_replicas", canonical_replicas, "Pass the number of logical lanes.")
    if replicas % dp:
        raise ValueError(
            _err("canonical_replicas", replicas, f"a multiple of dp_degree={dp}",
                 "Pick canonical_replicas divisible by every DP size you will resume with.")
        )
    if aggregate_dir is not None and aggregate_store is not None:
        raise ValueError(_err("aggregate_dir/aggregate_store", (aggregate_dir, aggregate_store), "at most one", "Drop one."))
    if world_size > 1 and aggregate_dir is None and aggregate_store is None:
        raise ValueError(
            _err("aggregate_dir", None, f"a shared directory (or aggregate_store) when world_size={world_size}",
                 "Zephon checkpoints are collective across ranks; pass aggregate_dir='<shared fs path>' "
                 "or aggregate_store='torch://'.")
        )
    options: dict[str, Any] = {}
    if world_size > 1 or dp_degree is not None or dp_group_id is not None or canonical_replicas is not None:
        options.update(world_size=world_size, global_rank=int(global_rank), dp_degree=dp,
                       dp_group_id=int(group), canonical_replicas=replicas)
    if aggregate_dir is not None:
        options["aggregate_dir"] = os.fspath(aggregate_dir)
    if aggregate_store is not None:
        options["aggregate_store"] = str(aggregate_store)
    if run_id is not None:
        if not isinstance(run_id, str) or not run_id:
            raise TypeError(_err("run_id", run_id, "a non-empty str", "Pass a run id shared by all ranks."))
        options["run_id"] = run_id
    return options


# ----------------------------------------------------------------------------- torchdata node


def _restorable(state: Mapping[str, Any]) -> dict[str, Any]:
    """Copy of a checkpoint Zephon 0.2.0 can load after a JSON round trip.

    ``Engine.load_state_dict`` looks lanes up with
    ``lane_next_cid.get(str(lane)) or lane_next_cid.get(int(lane))``, so a lane
    whose next chunk id is 0 (no chunk drawn yet, e.g. a state taken before the
    first batch) is reported missing once JSON has turned the int keys into
    strings. The live state uses int keys; convert back to them.
    """
    state = dict(state)
    lane_next = state.get("lane_next_cid")
    if isinstance(lane_next, Mapping):
        fixed: dict[Any, Any] = {}
        for key, value in lane_next.items():
            try:
                fixed[int(key)] = value
            except (TypeError, ValueError):
                fixed[key] = value
        state["lane_next_cid"] = fixed
    return state


class ZephonSource(BaseNode):
    """torchdata node yielding a Zephon pipeline's ``SampleBatch`` objects.

    * ``reset(None)``: stops any running iteration and starts from scratch.
    * ``reset(state)``: ``pipeline.restore(state)`` then ``iter(pipeline)`` —
      Zephon resumes exactly after the last delivered batch.
    * ``get_state()``: ``{"zephon_checkpoint": pipeline.checkpoint()}`` (JSON-able). Called only
      when state is asked for (``state_dict()``), never per batch; in a
      multi-rank job it is a collective, so every rank must ask together.
    * ``close()``: stops Zephon's workers (closes the pipeline iterator, whose
      ``finally`` closes the engine). Idempotent; also on ``with`` exit.
    * Worker processes (``runner: process``) are contained
      (:mod:`zephon_loader.workers`): forked from a preloaded fork server,
      they ignore SIGINT and exit when this process dies; those still alive
      ``workers.WORKER_GRACE_S`` after ``close()`` or a new ``reset()`` began
      are SIGKILLed, and ``close()`` returns with none left.
    * ``cancel()``: from any thread, makes a ``next()`` blocked in Zephon
      return soon (for an owner that joins a reader thread before ``close()``).

    Workers start lazily, at the first ``next()``. The pipeline must not be
    iterated by anyone else while this node owns it.

    Do not place a ``torchdata.nodes.Prefetcher`` directly above this node: it
    snapshots ``state_dict()`` of its source for every item.
    """

    #: The one key of :meth:`get_state` output, holding ``pipeline.checkpoint()``.
    STATE_KEY = "zephon_checkpoint"

    def __init__(self, pipeline: Any, shards: Any = None):
        super().__init__()
        import zephon

        if not isinstance(pipeline, zephon.Pipeline):
            raise TypeError(
                _err("pipeline", type(pipeline).__name__, "a zephon.Pipeline", "Build it with build_pipeline(...).")
            )
        self._pipeline = pipeline
        from zephon_loader.workers import contain_workers

        #: The pipeline's ``mp_context``: registry of its worker processes, bounds their shutdown.
        self._workers = contain_workers(pipeline)
        #: ``records.ShardTable`` of the sources: names the shard and line of a record Zephon cannot parse.
        self._shards = shards
        self._iterator: Iterator[Any] | None = None
        self._closed = False

    @property
    def pipeline(self) -> Any:
        """The wrapped ``zephon.Pipeline``."""
        return self._pipeline

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        if self._closed:
            raise RuntimeError("ZephonSource.reset: the source is closed; build a new pipeline and source.")
        super().reset(initial_state)
        self._stop()
        if initial_state is not None:
            if not isinstance(initial_state, Mapping):
                raise TypeError(
                    _err("initial_state", type(initial_state).__name__, "a dict from ZephonSource.get_state()",
                         "Pass the state saved by state_dict().")
                )
            self._pipeline.restore(_restorable(self._checkpoint_of(initial_state)))
        self._iterator = iter(self._pipeline)

    def next(self) -> Any:
        if self._closed:
            raise RuntimeError("ZephonSource.next: the source is closed.")
        if self._iterator is None:  # pragma: no cover - BaseNode calls reset first
            raise RuntimeError("ZephonSource.next: call reset() first.")
        try:
            return next(self._iterator)
        except json.JSONDecodeError as error:  # raised by Zephon's JSONL reader, without file or line
            if self._shards is None:
                raise
            raise self._shards.unparsable(error) from error

    def get_state(self) -> dict[str, Any]:
        return {self.STATE_KEY: self._pipeline.checkpoint()}

    @classmethod
    def is_state(cls, state: Any) -> bool:
        """Whether ``state`` looks like :meth:`get_state` output (a tagged Zephon checkpoint)."""
        return isinstance(state, Mapping) and set(state) == {cls.STATE_KEY}

    def _checkpoint_of(self, state: Mapping[str, Any]) -> dict[str, Any]:
        checkpoint = state.get(self.STATE_KEY) if self.is_state(state) else None
        if not isinstance(checkpoint, Mapping):
            raise ValueError(
                _err("initial_state", sorted(map(str, state)), f"{{{self.STATE_KEY!r}: <zephon checkpoint>}}",
                     "Pass the state saved by state_dict().")
            )
        return dict(checkpoint)

    def validate_state(self, state: Mapping[str, Any]) -> None:
        """Check a saved state against Zephon's checkpoint schema now, without starting anything.

        Raises:
            ValueError: Not a tagged checkpoint; Zephon's own error for a bad schema.
        """
        from zephon._internal.checkpoint import EngineStateV2

        EngineStateV2.load(_restorable(self._checkpoint_of(state)))

    def cancel(self) -> None:
        """From any thread: stop Zephon's engine so that a ``next()`` blocked in it returns soon.

        For an owner whose reader thread may wait inside :meth:`next` (a
        ``process`` runner's workers can take many seconds to start): cancel,
        join that thread, then :meth:`close` (the source is not meant to be
        read again before a ``reset()``). The ``next()`` in progress ends with
        ``StopIteration`` or Zephon's error; worker processes get the grace
        period. Zephon 0.2.0 has no public call for this: its engine's
        ``close()`` is what Zephon itself calls from another thread than the
        iterating one (its final prefetch buffer's ``on_stop``). Does nothing
        before Zephon built its engine, early in the first ``next()``.
        Idempotent.
        """
        self._workers.shut_down()
        engine = getattr(self._pipeline, "_engine", None)
        if engine is not None:
            engine.close()

    def close(self) -> None:
        """Stop Zephon's worker threads/processes; none is left when it returns. Safe to call more than once."""
        try:
            self._stop()
        finally:
            self._closed = True
            self._workers.kill()  # also after a cancel() whose iteration ended by itself

    def _stop(self) -> None:
        """End the running iteration: Zephon's own shutdown, its worker processes bounded by the grace period."""
        iterator, self._iterator = self._iterator, None
        if iterator is None:
            return
        self._workers.shut_down()  # Zephon joins worker after worker, up to 10 s each
        try:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
        finally:
            self._workers.kill()  # whatever Zephon left running (normally none)

    def __enter__(self) -> "ZephonSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
