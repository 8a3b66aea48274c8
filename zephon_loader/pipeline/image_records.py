"""Image-text records: the one accepted format, decoding with Pillow, and the per-record Zephon operator.

Record format (one format; anything else is a bad record naming its source,
shard file and line/row):

* ``text`` (``records.text_field``): a string with one ``"<image>"``
  (``records.image_marker``) where each image goes; any number of images,
  anywhere (start, middle, end, several, none).
* ``images`` (``records.images_field``): a list with one entry per marker, in
  order. JSONL shards: image file paths, relative to the shard's folder (or
  absolute). Parquet shards: the encoded image bytes (PNG, JPEG, ... anything
  Pillow opens), e.g. a ``list<binary>`` column. A record without images may
  leave the field out (JSONL) or hold an empty list / null.

:class:`ProcessImageRecords` runs inside Zephon's workers on every record:
check the record, decode its images with Pillow, call the processor
(:mod:`zephon_loader.processors`), check what it returned, fill missing
positions, and hand packing a payload of numpy arrays (:data:`PAYLOAD_FIELDS`).
A record longer than a row cannot be packed whole (images are never split):
``oversized: drop`` drops it and counts it (``longer_than_row`` in
``loader.stats()``, logged once with its location), ``oversized: error`` stops
the stream naming it. Bad records follow ``on_bad_record`` (``error``: stop
with a :class:`~zephon_loader.pipeline.records.BadRecordError`; ``skip``: leave out,
count by reason). A processor that returns malformed output is a bug, not a bad
record: ``TypeError``/``ValueError`` naming the processor, the field and the record.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from zephon_loader import fields as F
from zephon_loader.processors.base import ImageTextRecord, ProcessedRecord, check_processed
from zephon_loader.processors.rope import qwen2_vl_positions
from zephon_loader.pipeline.records import BAD_RECORD_POLICIES, LONGER_THAN_ROW, VALIDATION_KEY, Problem, check_records, refuse_or_log_drop
from zephon_loader.pipeline.provenance import DropLog, ShardTable
from zephon_loader.zephon_compat import ZephonKeys

__all__ = ["IMAGE_REASONS", "OVERSIZED_POLICIES", "PAYLOAD_FIELDS", "ProcessImageRecords", "RecordFormat"]


#: What ``oversized`` may say about a record longer than a row.
OVERSIZED_POLICIES = ("drop", "error")

#: Why an image-text record can be bad: reason -> meaning (``loader.stats()`` keys, besides ``longer_than_row``).
IMAGE_REASONS: dict[str, str] = {
    "not_an_object": "the record is not a JSON object / row",
    "missing_field": "the text field is absent",
    "wrong_type": "the text is not a string, or images is not a list of paths (JSONL) / bytes (Parquet)",
    "marker_mismatch": "the number of image markers in the text differs from the number of images",
    "image_missing": "an image file named by a JSONL record does not exist",
    "image_unreadable": "Pillow cannot decode an image (corrupt or unsupported bytes)",
    "empty": "no text and no image",
    "processor_error": "the processor refused the record (raised ValueError)",
    "too_many_tokens": "the processed record has more tokens than max_record_tokens",
}

#: Payload of a processed record, as packing and ``image_collate`` see it: name -> (dtype, shape).
PAYLOAD_FIELDS: dict[str, tuple[str, str]] = {
    ZephonKeys.TOKENS: ("int64", "[n]"),
    ZephonKeys.LOSS_MASK: ("bool", "[n]"),
    F.MM_TOKEN_TYPE_IDS: ("int64", "[n]"),
    F.ATTENTION_ELIGIBILITY: ("bool", "[n] (only when the processor emits it)"),
    F.POSITION_IDS: ("int64", "[3, n]"),
    F.PIXEL_VALUES: ("float32", "[patches, D]"),
    F.IMAGE_GRID_THW: ("int64", "[images, 3]"),
}




class RecordFormat:
    """Field names of the record format (``records`` in YAML).

    Args:
        text_field: The text column (default ``text``).
        images_field: The images column (default ``images``).
        image_marker: The marker standing for one image in the text (default ``<image>``).
    """

    def __init__(self, text_field: str = "text", images_field: str = "images", image_marker: str = "<image>") -> None:
        for name, value in (("text_field", text_field), ("images_field", images_field), ("image_marker", image_marker)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"records.{name}: got {value!r}, expected a non-empty string")
        if text_field == images_field:
            raise ValueError(f"records.images_field: got {images_field!r}, the same as text_field; expected two fields")
        self.text_field = text_field
        self.images_field = images_field
        self.image_marker = image_marker


def _describe(value: Any) -> str:
    """``null``, ``42 (int)``, ``b'...' (12 bytes)``: a value for a message, cut short."""
    if value is None:
        return "null"
    if isinstance(value, (bytes, bytearray)):
        return f"{bytes(value[:12])!r}... ({len(value)} bytes)"
    try:
        text = json.dumps(value, default=repr, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return (text if len(text) <= 60 else text[:57] + "...") + f" ({type(value).__name__})"


def decode_image(data: bytes | str, field: str) -> tuple[Any, Problem | None]:
    """One image decoded with Pillow (fully loaded, so a truncated file fails here), or the problem.

    Args:
        data: Encoded bytes, or a file path.
        field: ``images[i]`` for messages.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(data, str) and not os.path.isfile(data):
        return None, ("image_missing", field, repr(data), "an existing image file",
                      "Fix the path (relative to the shard's folder) or add the file.")
    try:
        image = Image.open(data if isinstance(data, str) else io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        seen = repr(data) if isinstance(data, str) else _describe(data)
        return None, ("image_unreadable", field, f"{seen} that Pillow cannot decode ({type(error).__name__}: "
                      f"{str(error)[:80]})", "an image Pillow can decode (PNG, JPEG, ...)",
                      "Re-encode or remove the image.")
    return image, None


class ProcessImageRecords:
    """The Zephon operator (``process_many``): raw records in, processed payloads (or tombstones) out.

    Picklable (Zephon deep-copies it per worker thread and pickles it for the
    ``process`` runner); a bound ``get_rope_index`` is shared, never copied
    (:class:`~zephon_loader.processors.rope.RopeIndex`).

    Args:
        processor: The record processor.
        record_format: Field names and marker.
        shards: Names a record's source, shard file and line/row (JSONL image
            paths resolve against the shard's folder).
        policy: ``on_bad_record``: ``error`` or ``skip``.
        oversized: ``drop`` or ``error`` for records longer than ``row_capacity``.
        row_capacity: Tokens per row (``S``).
        max_record_tokens: Larger records are bad records (``None``: no limit).
        log: Drop events (read by ``loader.stats()``).
    """

    def __init__(self, *, processor: Any, record_format: RecordFormat, shards: ShardTable, policy: str,
                 oversized: str, row_capacity: int, max_record_tokens: int | None, log: DropLog) -> None:
        if policy not in BAD_RECORD_POLICIES:
            raise ValueError(f"on_bad_record: got {policy!r}, expected one of {list(BAD_RECORD_POLICIES)}")
        if oversized not in OVERSIZED_POLICIES:
            raise ValueError(f"packing.oversized: got {oversized!r}, expected one of {list(OVERSIZED_POLICIES)}")
        self.processor = processor
        self.format = record_format
        self.shards = shards
        self.policy = policy
        self.oversized = oversized
        self.row_capacity = int(row_capacity)
        self.max_record_tokens = max_record_tokens
        self.log = log
        self.owner = type(processor).__name__
        self.eligibility = bool(processor.attention_eligibility)

    # -- Zephon's entry point ----------------------------------------------------------------
    def __call__(self, elems: list[Any]) -> list[Any]:
        return check_records(elems, lambda raw, meta: self.process(raw, meta.sample_id), self._refuse_or_count)

    def process(self, raw: Any, sample_id: Any) -> tuple[dict[str, Any] | None, Problem | None]:
        """One record: ``(payload, None)``, or ``(partial payload or None, problem)``."""
        record, problem = self._decode(raw, sample_id)
        if problem is not None:
            return None, problem
        try:
            result = self.processor(record)
        except ValueError as error:
            return None, ("processor_error", "<record>", f"{type(error).__name__}: {str(error)[:160]}",
                          f"a record {self.owner} accepts", "Fix the record or the processor.")
        try:
            processed = check_processed(result, owner=self.owner, eligibility=self.eligibility)
            payload = self._payload(processed)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{self.shards.where(sample_id)}: {error}") from error
        n = int(processed.input_ids.shape[0])
        if self.max_record_tokens is not None and n > self.max_record_tokens:
            return payload, ("too_many_tokens", "<record>", f"{n} tokens", f"at most max_record_tokens="
                             f"{self.max_record_tokens}", "Shorten the record, or raise max_record_tokens.")
        if n > self.row_capacity:
            return payload, (LONGER_THAN_ROW, "<record>", f"{n} tokens ({len(processed.image_grid_thw)} images)",
                             f"at most sequence_length={self.row_capacity} (one row; images are never split)",
                             "Raise sequence_length, lower the processor's max_pixels, or set packing.oversized: drop.")
        return payload, None

    # -- the steps -------------------------------------------------------------------------
    def _decode(self, raw: Any, sample_id: Any) -> tuple[ImageTextRecord | None, Problem | None]:
        fmt = self.format
        if not isinstance(raw, Mapping):
            return None, ("not_an_object", "<record>", _describe(raw),
                          f"an object with {fmt.text_field!r} and {fmt.images_field!r}", "Write one object per record.")
        if fmt.text_field not in raw:
            return None, ("missing_field", fmt.text_field, f"a record with keys {sorted(map(str, raw))[:8]}",
                          f"a record containing {fmt.text_field!r}", f"Add {fmt.text_field!r} to every record.")
        text = raw[fmt.text_field]
        if not isinstance(text, str):
            return None, ("wrong_type", fmt.text_field, _describe(text), "a string",
                          f"Store the text as a string with one {fmt.image_marker!r} per image.")
        entries = raw.get(fmt.images_field)
        entries = [] if entries is None else entries
        if isinstance(entries, np.ndarray):
            entries = entries.tolist()
        if not isinstance(entries, (list, tuple)):
            return None, ("wrong_type", fmt.images_field, _describe(entries), "a list (one entry per marker)",
                          "Store the images as a list.")
        markers = text.count(fmt.image_marker)
        if markers != len(entries):
            return None, ("marker_mismatch", fmt.images_field, f"{len(entries)} images for {markers} "
                          f"{fmt.image_marker!r} markers in {fmt.text_field!r}", "one image per marker",
                          "Add or remove markers or images so that they match.")
        if not entries and not text.strip():
            return None, ("empty", fmt.text_field, _describe(text), "text or at least one image",
                          "Remove empty records.")
        kind, folder = self._shard_kind(sample_id)
        images = []
        for index, entry in enumerate(entries):
            field = f"{fmt.images_field}[{index}]"
            if kind == "parquet":
                if not isinstance(entry, (bytes, bytearray)):
                    return None, ("wrong_type", field, _describe(entry), "the encoded image bytes (Parquet shards)",
                                  "Store images as a list<binary> column of PNG/JPEG bytes.")
                data: bytes | str = bytes(entry)
            else:
                if not isinstance(entry, str) or not entry:
                    return None, ("wrong_type", field, _describe(entry), "an image file path (JSONL shards)",
                                  "Store each image as a path relative to the shard's folder.")
                data = entry if os.path.isabs(entry) else os.path.join(folder, entry)
            image, problem = decode_image(data, field)
            if problem is not None:
                return None, problem
            images.append(image)
        return ImageTextRecord(text=text, images=tuple(images), marker=fmt.image_marker), None

    def _shard_kind(self, sample_id: Any) -> tuple[str, str]:
        """``("jsonl" | "parquet", the shard's folder)`` of a record."""
        dataset = int(sample_id[0])
        source = self.shards.sources[dataset]
        return source.kind, source.folder

    def _payload(self, processed: ProcessedRecord) -> dict[str, Any]:
        positions = processed.position_ids
        if positions is None:
            merge = getattr(self.processor, "spatial_merge_size", None)
            if merge is None:
                raise TypeError(f"{self.owner}: returned no position_ids and has no spatial_merge_size; "
                                "expected one of them (positions follow Qwen2-VL's rule with the merge size)")
            positions = qwen2_vl_positions(processed.mm_token_type_ids, processed.image_grid_thw, int(merge),
                                           processed.attention_eligibility)
        payload = {
            ZephonKeys.TOKENS: processed.input_ids,
            ZephonKeys.LOSS_MASK: processed.loss_mask,
            F.MM_TOKEN_TYPE_IDS: processed.mm_token_type_ids,
            F.POSITION_IDS: positions,
            F.PIXEL_VALUES: processed.pixel_values,
            F.IMAGE_GRID_THW: processed.image_grid_thw,
        }
        if processed.attention_eligibility is not None:
            payload[F.ATTENTION_ELIGIBILITY] = processed.attention_eligibility
        return payload

    def _refuse_or_count(self, meta: Any, problem: Problem, payload: Mapping[str, Any] | None) -> None:
        refuse = (self.oversized if problem[0] == LONGER_THAN_ROW else self.policy) == "error"
        tokens = int(len(payload[ZephonKeys.TOKENS])) if payload is not None else None
        refuse_or_log_drop(self.shards, self.log, meta, problem, tokens, refuse=refuse, what="image-text records")

    def sample_payload(self) -> dict[str, Any]:
        """A valid raw record (text only) for Zephon's operator validator, marked so a refusal is never counted."""
        return {self.format.text_field: "a", self.format.images_field: [], VALIDATION_KEY: True}

    def validation_samples(self) -> list[Any]:
        """Valid records on two lanes for Zephon's operator validator."""
        from zephon.types import SampleMeta, SampleRecord

        return [
            SampleRecord(meta=SampleMeta(sample_id=(0, 0, i), lane_id=i % 2, chunk_id=0, chunk_offset=i),
                         payload=self.sample_payload())
            for i in range(4)
        ]


#: (log path, reason) pairs already logged by this process: logged once per reason.
