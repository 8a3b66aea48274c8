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

:class:`ProcessImageRecords` (a
:class:`~zephon_loader.pipeline.records.RecordOperator`) runs inside Zephon's
workers on every record: check the record, decode its images with Pillow, call
the processor (:mod:`zephon_loader.processors`), check what it returned, fill
missing positions, and hand packing a payload of numpy arrays
(:data:`PAYLOAD_FIELDS`). A record longer than a row cannot be packed whole
(images are never split): ``oversized: drop`` drops it and counts it
(``longer_than_row`` in ``loader.stats()``, logged once with its location),
``oversized: error`` stops the stream naming it. Bad records follow
``on_bad_record`` (``error``: stop with a
:class:`~zephon_loader.errors.BadRecordError`; ``skip``: leave out, count by
reason). A processor that returns malformed output is a bug, not a bad record:
``TypeError``/``ValueError`` naming the processor, the field and the record.
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np

from zephon_loader import fields as F
from zephon_loader.pipeline.object_store import is_url
from zephon_loader.processors.base import ImageTextRecord, ProcessedRecord, check_processed
from zephon_loader.processors.rope import qwen2_vl_positions
from zephon_loader.pipeline.provenance import DropLog, ShardTable
from zephon_loader.pipeline.records import LONGER_THAN_ROW, Problem, RecordOperator, describe, source_marks
from zephon_loader.zephon_compat import ZephonKeys

__all__ = ["IMAGE_REASONS", "PAYLOAD_FIELDS", "ProcessImageRecords", "RecordFormat", "decode_image", "describe_entry"]

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


def describe_entry(value: Any) -> str:
    """:func:`~zephon_loader.pipeline.records.describe`, but encoded bytes as ``b'...'... (12 bytes)``.

    Bytes show their first 12 bytes and their size (an image's bytes are no use in a message).
    """
    if isinstance(value, (bytes, bytearray)):
        return f"{bytes(value[:12])!r}... ({len(value)} bytes)"
    return describe(value)


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
        seen = repr(data) if isinstance(data, str) else describe_entry(data)
        return None, ("image_unreadable", field, f"{seen} that Pillow cannot decode ({type(error).__name__}: "
                      f"{str(error)[:80]})", "an image Pillow can decode (PNG, JPEG, ...)",
                      "Re-encode or remove the image.")
    return image, None


class ProcessImageRecords(RecordOperator):
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
        source_marks: Give every kept record ``fields.SOURCE_MARKS``
            (:func:`~zephon_loader.pipeline.records.source_marks`; ``return_source_ids``).
    """

    records_name = "image-text records"
    describe = staticmethod(describe_entry)

    def __init__(self, *, processor: Any, record_format: RecordFormat, shards: ShardTable, policy: str,
                 oversized: str, row_capacity: int, max_record_tokens: int | None, log: DropLog,
                 source_marks: bool = False) -> None:
        super().__init__(shards=shards, policy=policy, log=log, oversized=oversized)
        self.processor = processor
        self.format = record_format
        self.row_capacity = int(row_capacity)
        self.max_record_tokens = max_record_tokens
        self.owner = type(processor).__name__
        self.eligibility = bool(processor.attention_eligibility)
        self.source_marks = source_marks

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
        if self.source_marks:
            payload[F.SOURCE_MARKS] = source_marks(sample_id, n)
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
        problem = self.require_field(raw, fmt.text_field, f"Add {fmt.text_field!r} to every record.",
                                     expected=f"an object with {fmt.text_field!r} and {fmt.images_field!r}",
                                     object_fix="Write one object per record.")
        if problem is not None:
            return None, problem
        text = raw[fmt.text_field]
        if not isinstance(text, str):
            return None, ("wrong_type", fmt.text_field, self.describe(text), "a string",
                          f"Store the text as a string with one {fmt.image_marker!r} per image.")
        entries = raw.get(fmt.images_field)
        entries = [] if entries is None else entries
        if isinstance(entries, np.ndarray):
            entries = entries.tolist()
        if not isinstance(entries, (list, tuple)):
            return None, ("wrong_type", fmt.images_field, self.describe(entries), "a list (one entry per marker)",
                          "Store the images as a list.")
        markers = text.count(fmt.image_marker)
        if markers != len(entries):
            return None, ("marker_mismatch", fmt.images_field, f"{len(entries)} images for {markers} "
                          f"{fmt.image_marker!r} markers in {fmt.text_field!r}", "one image per marker",
                          "Add or remove markers or images so that they match.")
        if not entries and not text.strip():
            return None, ("empty", fmt.text_field, self.describe(text), "text or at least one image",
                          "Remove empty records.")
        kind, folder = self._shard_kind(sample_id)
        images = []
        for index, entry in enumerate(entries):
            field = f"{fmt.images_field}[{index}]"
            if kind == "parquet":
                if not isinstance(entry, (bytes, bytearray)):
                    return None, ("wrong_type", field, self.describe(entry), "the encoded image bytes (Parquet shards)",
                                  "Store images as a list<binary> column of PNG/JPEG bytes.")
                data: bytes | str = bytes(entry)
            else:
                if not isinstance(entry, str) or not entry:
                    return None, ("wrong_type", field, self.describe(entry), "an image file path (JSONL shards)",
                                  "Store each image as a path relative to the shard's folder.")
                if is_url(folder) and not os.path.isabs(entry):
                    return None, ("wrong_type", field, self.describe(entry), "an image this machine can open",
                                  "Paths relative to a shard on object storage are not fetched; store the images "
                                  "as bytes in Parquet shards (a list<binary> column).")
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

    def sample_payload(self) -> dict[str, Any]:
        """A valid raw record (text only) for Zephon's operator validator."""
        return {self.format.text_field: "a", self.format.images_field: []}
