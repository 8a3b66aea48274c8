"""The record-operator base class and the text record checks.

:class:`RecordOperator` is a Zephon ``process_many`` callable that looks at
each record once (it sees Zephon's ``SampleRecord``, so every message names the
record's source, shard file and line/row) and keeps it, refuses it or leaves it
out. Its subclasses each implement :meth:`RecordOperator.process` for one
record:

* :class:`CheckRawRecords` before tokenization (text and chat input): the
  record is a JSON object, the text (or messages) field is there and has the
  right type and is valid UTF-8 (an undecodable shard byte or a JSON-escaped
  lone surrogate is ``not_utf8``, see :mod:`~zephon_loader.pipeline.jsonl_text`),
  chat contents hold no special-token strings, the record is not larger than
  ``max_record_bytes`` (default 4 MiB: a larger text would take the tokenizer
  many seconds to minutes, in one call that nothing can interrupt).
* :class:`CheckTokens` after tokenization (every mode): token ids are a
  non-empty 1-D integer list inside the vocabulary, per-token fields (loss
  mask, eligibility) are as long as the tokens, the record is not longer than
  ``max_record_tokens``; then it keeps only the fields packing needs. With
  ``first_fit``/``best_fit`` it also drops (and counts, never errors) records
  longer than a row, before Zephon's packer would drop them with only a log line.
* :class:`~zephon_loader.pipeline.image_records.ProcessImageRecords` for
  image-text records.

Policy (``on_bad_record``):

* ``"error"`` (default): the first bad record stops the stream with a
  :class:`~zephon_loader.errors.BadRecordError` naming the source, shard file,
  line (JSONL, 1-based) or row (Parquet, 0-based), the field, what was seen and
  what was expected.
* ``"skip"``: the record is left out (Zephon gets a tombstone, so its
  checkpoints stay exact), counted by reason in the
  :class:`~zephon_loader.pipeline.provenance.DropLog`, and logged once per
  reason with its first location.

A record longer than a row (:data:`LONGER_THAN_ROW`) follows ``oversized``
instead: ``"drop"`` (the text checks always drop it) or ``"error"``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from zephon_loader import fields as F
from zephon_loader.errors import BadRecordError
from zephon_loader.pipeline import jsonl_text
from zephon_loader.pipeline.provenance import DropLog, ShardTable
from zephon_loader.zephon_compat import ZEPHON_LOSS_MASK_KEY, ZEPHON_TOKENS_KEY

__all__ = [
    "BAD_RECORD_POLICIES",
    "LONGER_THAN_ROW",
    "OVERSIZED_POLICIES",
    "REASONS",
    "CheckRawRecords",
    "CheckTokens",
    "Problem",
    "RecordOperator",
    "VALIDATION_KEY",
    "describe",
    "missing_field",
    "source_marks",
    "utf8_size",
]

logger = logging.getLogger("zephon_loader.pipeline.records")

# Zephon's JSONL reader decodes undecodable bytes as lone surrogates (instead of raising at build, without a
# location): the text checks below name such records and follow on_bad_record. Here, so that Zephon's worker
# processes (which import this module to unpickle the checks) read shards the same way.
jsonl_text.install()

#: What ``on_bad_record`` may say about a bad record.
BAD_RECORD_POLICIES = ("error", "skip")
#: What ``oversized`` may say about a record longer than a row.
OVERSIZED_POLICIES = ("drop", "error")

#: Why a text record can be bad: reason -> what it means (the ``stats()`` keys).
REASONS: dict[str, str] = {
    "not_an_object": "the record is not a JSON object (null, a number, a string or a list)",
    "missing_field": "the configured field is absent",
    "wrong_type": "the field holds the wrong type",
    "special_token_text": "chat text contains a special-token string of the tokenizer",
    "token_out_of_range": "a pretokenized id is negative or not below the vocabulary size",
    "misaligned_field": "a per-token field is not as long as the token ids",
    "empty": "nothing to train on (empty text or no token ids)",
    "not_utf8": "the text is not valid UTF-8 (an undecodable byte in the shard, or a JSON-escaped lone surrogate)",
    "too_many_bytes": "the text is larger than max_record_bytes",
    "too_many_tokens": "the record has more tokens than max_record_tokens",
}
#: A record longer than a row: ``first_fit``/``best_fit`` cannot split it, and images are never split.
LONGER_THAN_ROW = "longer_than_row"

#: Marks the records the operators make for Zephon's operator validator (run at the first ``iter()``
#: on each operator's ``validation_samples``): one the configuration refuses (a small
#: ``max_record_tokens``, say) is left out without raising or being counted as a drop.
VALIDATION_KEY = "_zephon_loader_validation_sample"

#: What a check found wrong with a record: ``(reason, field, seen, expected, fix)``.
Problem = tuple[str, str, Any, str, str]

#: (log path, reason) pairs already logged by this process: "logged once per reason".
_LOGGED: set[tuple[str, str]] = set()


def describe(value: Any) -> str:
    """``null``, ``42 (int)``, ``["a", "b"] (list)``: the value as JSON, cut to 60 characters, and its type."""
    if value is None:
        return "null"
    try:
        text = json.dumps(value, default=repr, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def missing_field(payload: Mapping[str, Any], field: str, fix: str) -> Problem:
    """The ``missing_field`` problem of a record that lacks ``field`` (naming its first 8 keys)."""
    return ("missing_field", field, f"a record with keys {sorted(map(str, payload))[:8]}",
            f"a record containing {field!r}", fix)


class RecordOperator:
    """A Zephon ``process_many`` operator: each record is processed, then kept, refused or left out.

    Subclasses implement :meth:`process` (one record) and :meth:`sample_payload`
    (a valid one, for Zephon's operator validator). Instances are plain
    picklable objects (Zephon deep-copies them per worker thread and
    cloudpickles them for the ``process`` runner).

    Args:
        shards: Names a record's source, shard file and line/row.
        policy: ``on_bad_record``: ``error`` or ``skip``.
        log: Drop events (read by ``loader.stats()``).
        oversized: ``drop`` or ``error`` for a record longer than a row (:data:`LONGER_THAN_ROW`).
    """

    #: Names the records in the one warning per drop reason.
    records_name = "records"
    #: A value for a message (see :func:`describe`).
    describe = staticmethod(describe)

    def __init__(self, *, shards: ShardTable, policy: str, log: DropLog, oversized: str = "drop") -> None:
        if policy not in BAD_RECORD_POLICIES:
            raise ValueError(f"on_bad_record: got {policy!r}, expected one of {list(BAD_RECORD_POLICIES)}")
        if oversized not in OVERSIZED_POLICIES:
            raise ValueError(f"packing.oversized: got {oversized!r}, expected one of {list(OVERSIZED_POLICIES)}")
        self.shards = shards
        self.policy = policy
        self.log = log
        self.oversized = oversized

    def process(self, payload: Any, sample_id: Any) -> tuple[Any, Problem | None]:  # pragma: no cover
        """One record: ``(new payload, None)``, or ``(partial payload or None, problem)``."""
        raise NotImplementedError

    def sample_payload(self) -> dict[str, Any]:  # pragma: no cover
        """A valid payload of the shape :meth:`process` expects (for Zephon's operator validator)."""
        raise NotImplementedError

    def validation_samples(self) -> list[Any]:
        """Valid records on two lanes for Zephon's operator validator (its synthetic ones would be bad records).

        Each is marked with :data:`VALIDATION_KEY`, so one the configuration refuses is never counted as a drop.
        """
        from zephon.types import SampleMeta, SampleRecord

        return [
            SampleRecord(meta=SampleMeta(sample_id=(0, 0, i), lane_id=i % 2, chunk_id=0, chunk_offset=i),
                         payload={**self.sample_payload(), VALIDATION_KEY: True})
            for i in range(4)
        ]

    def __call__(self, elems: list[Any]) -> list[Any]:
        """Zephon's ``process_many``: ``SampleRecord`` s in (tombstones pass through), kept records out.

        A kept record gets its new payload; a bad one is refused (raises) or
        left out as tombstones (Zephon's checkpoints stay exact) and counted,
        except Zephon's validator samples (:data:`VALIDATION_KEY`), which are
        left out uncounted.
        """
        from zephon.ops.children import tombstones_for_record

        out: list[Any] = []
        for elem in elems:
            meta = elem.meta
            if meta.tombstone:
                out.append(elem)
                continue
            raw = elem.payload
            payload, problem = self.process(raw, meta.sample_id)
            if problem is None:
                elem.payload = payload
                out.append(elem)
                continue
            if not (isinstance(raw, Mapping) and VALIDATION_KEY in raw):
                self.refuse_or_count(meta, problem, payload)
            out.extend(tombstones_for_record(elem))
        return out

    def refuse_or_count(self, meta: Any, problem: Problem, payload: Any) -> None:
        """Raise :class:`BadRecordError` for a refused record, or append its drop event and warn once per reason.

        Args:
            meta: The record's Zephon ``SampleMeta`` (its cursor key identifies the event).
            problem: ``(reason, field, seen, expected, fix)``.
            payload: What :meth:`process` returned with the problem (its token count is logged, if known).
        """
        reason, field, seen, expected, fix = problem
        where = self.shards.where(meta.sample_id)
        if (self.oversized if reason == LONGER_THAN_ROW else self.policy) == "error":
            hint = ("" if reason == LONGER_THAN_ROW else
                    " (or set on_bad_record: skip to leave such records out, counted in loader.stats())")
            presence = getattr(self.shards, "field_presence", None)
            if reason == "missing_field" and presence is not None and (presence := presence(meta.sample_id, field)):
                seen = f"{seen} ({presence})"
            raise BadRecordError(f"{where}: field {field!r} got {seen}, expected {expected}. {fix}{hint}")
        self.log.append({
            "key": [int(meta.lane_id), int(meta.chunk_id), int(meta.chunk_offset), list(meta.lineage)],
            "sample": [int(x) for x in meta.sample_id],
            "source": self.shards.source_name(meta.sample_id),
            "reason": reason,
            "tokens": _token_count(payload),
            "where": where,
        })
        if (self.log.path, reason) not in _LOGGED:
            _LOGGED.add((self.log.path, reason))
            logger.warning("zephon_loader: dropping %s (%s), first at %s: field %r got %s, expected %s",
                           self.records_name, reason, where, field, seen, expected)

    def require_field(self, payload: Any, field: str, fix: str, *, expected: str | None = None,
                      object_fix: str = "Write one JSON object per record.") -> Problem | None:
        """``not_an_object`` / ``missing_field`` for a payload that is not a mapping holding ``field``, else ``None``.

        Args:
            fix: How to fix a missing field.
            expected: What the record should be (default: a JSON object with a ``field`` field).
            object_fix: How to fix a record that is not an object.
        """
        if not isinstance(payload, Mapping):
            return ("not_an_object", "<record>", self.describe(payload),
                    expected or f"a JSON object with a {field!r} field", object_fix)
        if field not in payload:
            return missing_field(payload, field, fix)
        return None


def _token_count(payload: Any) -> int | None:
    """The length of a payload's token field, or ``None`` when there is none."""
    if isinstance(payload, Mapping) and ZEPHON_TOKENS_KEY in payload:
        try:
            return int(len(payload[ZEPHON_TOKENS_KEY]))
        except TypeError:
            return None
    return None


# ----------------------------------------------------------------------------- the text checks


class CheckRawRecords(RecordOperator):
    """Before tokenization: the record is an object whose text / messages field is well typed.

    Args:
        mode: ``"text"`` (``field`` holds a str) or ``"chat"`` (``field`` holds
            a list of ``{"role": str, "content": str}``).
        field: The text or messages field.
        max_record_bytes: Largest UTF-8 size of the text (chat: of all contents); ``None`` = no limit.
        special_strings: The tokenizer's special-token strings; refused inside chat
            contents (the rendered chat template is tokenized with them as control tokens).
        **kwargs: ``shards``, ``policy``, ``log`` (:class:`RecordOperator`).
    """

    def __init__(self, *, mode: str, field: str, max_record_bytes: int | None, special_strings: Sequence[str] = (),
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.mode = mode
        self.field = field
        setting = "tokenizer.text_field" if mode == "text" else "tokenizer.chat_field"
        self.missing_fix = (f"Set {setting} to the field that holds the {'text' if mode == 'text' else 'messages'} "
                            f"({setting} is {field!r} now), or add {field!r} to every record.")
        self.max_record_bytes = max_record_bytes
        self.special_strings = tuple(s for s in special_strings if s)

    def process(self, payload: Any, sample_id: Any) -> tuple[Any, Problem | None]:
        """The record unchanged, or ``(None, problem)``."""
        field = self.field
        problem = self.require_field(payload, field, self.missing_fix)
        if problem is not None:
            return None, problem
        value = payload[field]
        if self.mode == "text":
            if not isinstance(value, str):
                return None, ("wrong_type", field, self.describe(value), "a string",
                              "Store the document text as one JSON string.")
            size, problem = utf8_size(field, value)
            if problem is not None:
                return None, problem
            if not value.strip():
                return None, ("empty", field, self.describe(value), "non-blank text", "Remove empty records.")
        else:
            problem = self._check_messages(value)
            if problem is not None:
                return None, problem
            size = 0
            for i, message in enumerate(value):
                n, problem = utf8_size(f"{field}[{i}].content", message["content"])
                if problem is not None:
                    return None, problem
                size += n
        if self.max_record_bytes is not None and size > self.max_record_bytes:
            return None, ("too_many_bytes", field, f"{size} bytes", f"at most max_record_bytes={self.max_record_bytes}",
                          "Split the document, or raise max_record_bytes (null: no limit; tokenizing takes about "
                          "1-2 s per MB of text, on one core, in one call).")
        return payload, None

    def sample_payload(self) -> dict[str, Any]:
        if self.mode == "text":
            return {self.field: "a valid document"}
        return {self.field: [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}

    def _check_messages(self, value: Any) -> Problem | None:
        field = self.field
        expected = "a non-empty list of {'role': str, 'content': str}"
        if not isinstance(value, list):
            return ("wrong_type", field, self.describe(value), expected, "Store the chat as a list.")
        if not value:
            return ("empty", field, "[]", expected, "Remove empty conversations.")
        for i, message in enumerate(value):
            if (not isinstance(message, Mapping) or not isinstance(message.get("role"), str)
                    or not isinstance(message.get("content"), str)):
                return ("wrong_type", f"{field}[{i}]", self.describe(message), "{'role': str, 'content': str}",
                        "Give every message a string role and content.")
            for special in self.special_strings:
                if special in message["content"]:
                    return ("special_token_text", f"{field}[{i}].content", f"text containing {special!r}",
                            "no special-token strings of the tokenizer inside message text",
                            "The chat template is tokenized with special tokens as control ids, so this text would "
                            "become a control token; clean the data.")
        return None


class CheckTokens(RecordOperator):
    """After tokenization (or on pretokenized records): keep what packing needs, checked.

    ``pack_flat`` slices every payload value that has a length as if it were
    per-token (the Parquet pitfall), so only the token field (renamed to
    Zephon's ``input_ids``, int64 ``[n]``), the chat loss mask (uint8 ``[n]``)
    and the eligibility field (renamed to ``fields.ATTENTION_ELIGIBILITY``,
    bool ``[n]``) are kept.

    Args:
        tokens_field: Token id field (``input_ids`` after Zephon's tokenizer, or the pretokenized column).
        vocab_size: Ids must be ``< vocab_size`` (``None``: only ``>= 0`` is checked).
        max_record_tokens: Largest token count (``None`` = no limit).
        row_capacity: With ``first_fit``/``best_fit``, ``L + 1``: longer records are
            dropped and counted as :data:`LONGER_THAN_ROW`; ``None`` for the wrap algorithms.
        eligibility_field, loss_mask_field: Optional per-token fields to keep.
        cp_multiple: Context-parallel padding (``2 * cp_size``; 0: none): a kept record's tokens are
            followed by ``pad_token_id`` up to the next multiple of it, the loss mask by 0s, and every
            record gets ``fields.CP_PADDING`` (uint8 ``[n]``, 1 at those pad tokens), so that Zephon's packer
            counts the padding as the record's room (a padded record that no longer fits the open row goes
            to another row, as any record does). ``row_capacity`` is then ``S``: a record of ``S + 1`` tokens
            would span ``S + 2 * cp_size``.
        pad_token_id: The pad id (with ``cp_multiple``).
        source_marks: Give every kept record ``fields.SOURCE_MARKS`` (:func:`source_marks`, its padding included),
            which Zephon's packer slices with the tokens (``return_source_ids``).
        **kwargs: ``shards``, ``policy``, ``log`` (:class:`RecordOperator`).
    """

    def __init__(self, *, tokens_field: str, vocab_size: int | None, max_record_tokens: int | None,
                 row_capacity: int | None, eligibility_field: str | None = None, loss_mask_field: str | None = None,
                 cp_multiple: int = 0, pad_token_id: int = 0, source_marks: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tokens_field = tokens_field
        self.vocab_size = vocab_size
        self.max_record_tokens = max_record_tokens
        self.row_capacity = row_capacity
        self.eligibility_field = eligibility_field
        self.loss_mask_field = loss_mask_field
        self.cp_multiple = cp_multiple
        self.pad_token_id = pad_token_id
        self.source_marks = source_marks

    def process(self, payload: Any, sample_id: Any) -> tuple[Any, Problem | None]:
        """The kept fields as numpy arrays, with the problem of a record that is too long (or ``(None, problem)``)."""
        field = self.tokens_field
        problem = self.require_field(payload, field, "Set pretokenized_field to the column of token ids.")
        if problem is not None:
            return None, problem
        raw = payload[field]
        tokens = _int_array(raw)
        if tokens is None:
            return None, ("wrong_type", field, self.describe(raw), "a list of integer token ids",
                          "Store one list of ints per record.")
        if tokens.size == 0:
            return None, ("empty", field, "[]", "at least one token id", "Remove empty records.")
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or (self.vocab_size is not None and high >= self.vocab_size):
            bad = low if low < 0 else high
            return None, ("token_out_of_range", field, f"id {bad}",
                          f"ids in [0, {self.vocab_size})" if self.vocab_size is not None else "ids >= 0",
                          "Tokenize with this tokenizer (or fix the vocabulary).")
        out: dict[str, Any] = {ZEPHON_TOKENS_KEY: tokens}
        for src, dst, dtype in (
            (self.loss_mask_field, ZEPHON_LOSS_MASK_KEY, np.uint8),
            (self.eligibility_field, F.ATTENTION_ELIGIBILITY, np.bool_),
        ):
            if src is None:
                continue
            if src not in payload:
                return None, missing_field(payload, src, "Add the per-token field to every record or unset it.")
            values = np.asarray(payload[src])
            if values.shape != tokens.shape:
                return None, ("misaligned_field", src, f"shape {values.shape}", f"one value per token, {tokens.shape}",
                              "Make the per-token field as long as the token field.")
            out[dst] = values.astype(dtype, copy=False)
        n = int(tokens.size)
        if self.max_record_tokens is not None and n > self.max_record_tokens:
            return out, ("too_many_tokens", field, f"{n} tokens", f"at most max_record_tokens={self.max_record_tokens}",
                         "Split the document, or raise max_record_tokens.")
        if self.row_capacity is not None and n > self.row_capacity:
            fix = ("With contract.cp_size > 1 a row holds S tokens of padded documents: split the document, or "
                   "raise sequence_length." if self.cp_multiple else "Use packing.algorithm: wrap to split long "
                   "documents.")
            return out, (LONGER_THAN_ROW, field, f"{n} tokens", f"at most {self.row_capacity} (one row)", fix)
        if self.cp_multiple:
            out = self._cp_padded(out, n)
        if self.source_marks:
            out[F.SOURCE_MARKS] = source_marks(sample_id, len(out[ZEPHON_TOKENS_KEY]))
        return out, None

    def _cp_padded(self, out: dict[str, Any], n: int) -> dict[str, Any]:
        """``out`` with every per-token field padded to the next multiple of ``cp_multiple`` and the marker."""
        pad = -n % self.cp_multiple
        marker = np.zeros(n + pad, dtype=np.uint8)
        marker[n:] = 1
        padded: dict[str, Any] = {F.CP_PADDING: marker}
        for name, values in out.items():
            fill = self.pad_token_id if name == ZEPHON_TOKENS_KEY else 0
            padded[name] = np.concatenate([values, np.full(pad, fill, dtype=values.dtype)]) if pad else values
        return padded

    def sample_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {self.tokens_field: [0, 0, 0]}
        for name in (self.loss_mask_field, self.eligibility_field):
            if name is not None:
                payload[name] = [1, 1, 1]
        return payload


def source_marks(sample_id: Any, n: int) -> np.ndarray:
    """``fields.SOURCE_MARKS`` of a record of ``n`` tokens: int32 ``[n]``, its source index + 1 everywhere.

    The source index is the dataset of Zephon's ``sample_id = (dataset, shard, index)``: the work source lists
    the datasets in the order of ``sources`` (the index :class:`~zephon_loader.pipeline.provenance.ShardTable`
    names a record's source by). Zephon's packer keeps only per-row totals per mixture component
    (``component_sample_counts``/``component_token_counts``) and, per piece, the record's cursor, not its length
    in the row; a per-token field is sliced with the tokens by every packing algorithm (a piece of a wrapped
    record keeps its marks) and padded with 0, so ``collate`` reads each input token's source exactly.
    """
    return np.full(n, int(sample_id[0]) + 1, dtype=np.int32)


def utf8_size(field: str, text: str) -> tuple[int, Problem | None]:
    """``(UTF-8 size of text, None)``, or ``(0, not_utf8 problem)`` for text holding a lone surrogate.

    A lone surrogate comes from a JSON escape of half a UTF-16 pair (``"\\ud800"``), or, with
    :mod:`~zephon_loader.pipeline.jsonl_text` installed, from a shard byte that is not UTF-8
    (``0xNN`` read as ``U+DCNN``); neither can be encoded, so the tokenizer would fail on it.
    """
    try:
        return len(text.encode("utf-8")), None
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        if 0xDC80 <= code <= 0xDCFF:
            seen = (f"the byte 0x{code - 0xDC00:02x} at character {error.start}, which is not UTF-8 "
                    f"(or a JSON escape \\u{code:04x} there)")
        else:
            seen = f"a lone surrogate \\u{code:04x} at character {error.start} (a JSON escape of half a UTF-16 pair)"
        return 0, ("not_utf8", field, seen, "text that is valid UTF-8",
                   "Re-encode the shard as UTF-8 (e.g. iconv -f <its encoding> -t utf-8) and write JSON escapes of "
                   "whole surrogate pairs only, or remove the record.")


def _int_array(raw: Any) -> np.ndarray | None:
    """``raw`` as a 1-D int64 array, or ``None`` when it is not a list/array of integers (bools refused)."""
    if isinstance(raw, (str, bytes, Mapping)) or raw is None:
        return None
    try:
        array = np.asarray(raw)
    except (ValueError, TypeError):
        return None
    if array.ndim != 1:
        return None
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_:
        return None
    return array.astype(np.int64, copy=False)
