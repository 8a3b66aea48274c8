"""The built-in processor: Qwen2-VL style tokens, pixels and mRoPE positions, from a local folder.

The folder (never a hub id: it must load offline) holds a Hugging Face
tokenizer with the vision special tokens ``<|vision_start|>``,
``<|vision_end|>`` and ``<|image_pad|>``, and a Qwen2-VL image processor config
(``preprocessor_config.json``); ``zephon_loader/data/image_processor`` is one.
Pixels come from ``transformers``' Qwen2-VL image processor (resize, rescale,
normalize, patchify: nothing hand-written), so ``pixel_values`` and
``image_grid_thw`` are exactly what ``Qwen2VLProcessor`` produces.

A record's tokens, in order: the text before the first marker, then for each
image ``<|vision_start|>`` + ``<|image_pad|>`` × ``t·h·w / merge²`` +
``<|vision_end|>`` (+ fillers, below) + the text after it, then EOS
(``append_eos``). Text is tokenized with ``split_special_tokens=True``: a
special-token string inside the data (``"<|image_pad|>"``) stays ordinary text,
so a control token never comes from data. Supervision (``loss_mask``): text and
EOS tokens are targets; vision tokens and fillers are not.

``image_token_alignment: k`` pads every image span (``<|vision_start|>`` ...
``<|vision_end|>``) with synthetic filler tokens (the pad id) after
``<|vision_end|>`` up to a multiple of ``k`` tokens. Fillers are ineligible
(``attention_eligibility`` False: they neither attend nor are attended) and
never targets; positions skip them (:mod:`zephon_loader.processors.rope`), so
every other token computes exactly as without them. Without the option every
token is eligible and no eligibility is emitted.

Positions: the model's ``get_rope_index`` when bound
(:meth:`Qwen2VLRecordProcessor.bind_get_rope_index`), else Qwen2-VL's rule
(:func:`~zephon_loader.processors.rope.qwen2_vl_positions`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Literal

import numpy as np

from zephon_loader.errors import field_error
from zephon_loader.processors.base import ImageTextRecord, ProcessedRecord
from zephon_loader.processors.rope import RopeIndex, qwen2_vl_positions

__all__ = ["VISION_END", "VISION_START", "IMAGE_PAD", "Qwen2VLRecordProcessor"]

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
#: File the image processor config lives in (``ImageProcessingMixin.save_pretrained``).
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"

# Token kinds while a record is assembled.
_TEXT, _START, _IMAGE, _END, _FILLER = range(5)


class Qwen2VLRecordProcessor:
    """``ImageTextRecord -> ProcessedRecord`` for Qwen2-VL-style models.

    Args:
        path: Local processor folder (tokenizer + ``preprocessor_config.json``).
        image_token_alignment: ``k``: pad each image span to a multiple of ``k``
            tokens with ineligible fillers; ``None``: no fillers, no eligibility.
        append_eos: End every record with the tokenizer's EOS (a target).
        min_pixels, max_pixels: Override the image processor's resize bounds
            (``size.shortest_edge`` / ``size.longest_edge``, in pixels).
        backend: ``transformers`` image-processing backend: ``pil`` (default:
            the same pixels with or without torchvision) or ``torchvision``.
        get_rope_index: The model's ``get_rope_index``; ``None`` = Qwen2-VL's rule.

    Attributes:
        tokenizer: The Hugging Face tokenizer (``split_special_tokens=True``).
        image_processor: ``transformers``' Qwen2-VL image processor.
        pad_token_id, eos_token_id, image_token_id, vision_start_token_id,
        vision_end_token_id: Token ids.
        spatial_merge_size: The image processor's ``merge_size``.
        attention_eligibility: ``image_token_alignment is not None``.

    Raises:
        ValueError: Not a local folder, a missing file or special token, a bad option.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        image_token_alignment: int | None = None,
        append_eos: bool = True,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        backend: Literal["pil", "torchvision"] = "pil",
        get_rope_index: Callable[..., Any] | RopeIndex | None = None,
    ) -> None:
        from zephon_loader.tokenizing import check_tokenizer_dir, load_tokenizer, pad_token_id_of

        folder = check_tokenizer_dir("processor.path", Path(path))
        if not (folder / IMAGE_PROCESSOR_FILE).is_file():
            raise ValueError(field_error("processor.path", str(folder), f"a folder with {IMAGE_PROCESSOR_FILE}",
                                         "Save the Qwen2-VL image processor into it with save_pretrained(folder)."))
        for name, value in (("image_token_alignment", image_token_alignment), ("min_pixels", min_pixels),
                            ("max_pixels", max_pixels)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(field_error(f"processor.{name}", value, "an int >= 1 or null", f"Fix {name}."))
        if not isinstance(append_eos, bool):
            raise TypeError(field_error("processor.append_eos", append_eos, "a bool", "Set true or false."))
        if backend not in ("pil", "torchvision"):
            raise ValueError(field_error("processor.backend", backend, "'pil' or 'torchvision'", "Use 'pil'."))
        self.path = folder
        self.options = {"image_token_alignment": image_token_alignment, "append_eos": append_eos,
                        "min_pixels": min_pixels, "max_pixels": max_pixels, "backend": backend}
        self.tokenizer = load_tokenizer(folder, split_special_tokens=True)
        self.image_processor = _load_image_processor(folder, backend, min_pixels, max_pixels)
        vocab = self.tokenizer.get_vocab()
        ids = {}
        for token in (VISION_START, VISION_END, IMAGE_PAD):
            if token not in vocab:
                raise ValueError(field_error("processor.path", str(folder), f"a tokenizer with the token {token!r}",
                                             "Add the Qwen2-VL vision special tokens to the tokenizer."))
            ids[token] = int(vocab[token])
        self.vision_start_token_id = ids[VISION_START]
        self.vision_end_token_id = ids[VISION_END]
        self.image_token_id = ids[IMAGE_PAD]
        pad = pad_token_id_of(self.tokenizer)
        if pad is None:
            raise ValueError(field_error("processor.path", str(folder), "a tokenizer with a pad or eos token",
                                         "Set pad_token in tokenizer_config.json."))
        self.pad_token_id = int(pad)
        self.eos_token_id = self.tokenizer.eos_token_id
        if append_eos and self.eos_token_id is None:
            raise ValueError(field_error("processor.append_eos", True, "a tokenizer with an eos token",
                                         "Set append_eos: false, or add eos_token to the tokenizer."))
        self.spatial_merge_size = int(self.image_processor.merge_size)
        self.image_token_alignment = image_token_alignment
        self.append_eos = append_eos
        self.attention_eligibility = image_token_alignment is not None
        self._rope = (get_rope_index if isinstance(get_rope_index, RopeIndex) or get_rope_index is None
                      else RopeIndex(get_rope_index))

    # -- the interface ------------------------------------------------------------------------
    def __call__(self, record: ImageTextRecord) -> ProcessedRecord:
        """Tokens, supervision, eligibility, positions and pixels of one record (shapes: :mod:`.base`).

        Raises:
            ValueError: The marker count differs from the image count (the
                loader checks this first and names the record).
        """
        pieces = record.pieces()
        images = list(record.images)
        if len(pieces) != len(images) + 1:
            raise ValueError(f"text has {len(pieces) - 1} {record.marker!r} markers but the record has "
                             f"{len(images)} images; expected one marker per image")
        encoded = self._encode(pieces)
        if images:
            # One image-processor call per record: its PIL loop is transformers' own.
            features = self.image_processor(images=images, return_tensors="np")
            pixel_values = np.asarray(features["pixel_values"], dtype=np.float32)
            grid = np.asarray(features["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
        else:
            pixel_values = np.zeros((0, self.patch_dim), dtype=np.float32)
            grid = np.zeros((0, 3), dtype=np.int64)
        image_tokens = grid.prod(axis=1) // (self.spatial_merge_size ** 2)
        span = image_tokens + 2
        fillers = (-span) % self.image_token_alignment if self.image_token_alignment else np.zeros_like(span)
        # Segment table: (kind, length) in record order; lengths sum to n. One np.repeat builds the kinds.
        kinds: list[int] = []
        lengths: list[int] = []
        for index, piece in enumerate(encoded):
            kinds.append(_TEXT)
            lengths.append(len(piece))
            if index < len(images):
                kinds += [_START, _IMAGE, _END, _FILLER]
                lengths += [1, int(image_tokens[index]), 1, int(fillers[index])]
        kind = np.repeat(np.asarray(kinds, dtype=np.int8), lengths)
        if self.append_eos:
            kind = np.append(kind, np.int8(_TEXT))
        text = np.fromiter((token for piece in encoded for token in piece), dtype=np.int64,
                           count=sum(len(piece) for piece in encoded))
        if self.append_eos:
            text = np.append(text, np.int64(self.eos_token_id))
        input_ids = np.select(
            [kind == _START, kind == _IMAGE, kind == _END, kind == _FILLER],
            [self.vision_start_token_id, self.image_token_id, self.vision_end_token_id, self.pad_token_id], 0,
        ).astype(np.int64)
        input_ids[kind == _TEXT] = text
        if input_ids.size == 0:
            raise ValueError("the record has no text and no image; expected at least one token")
        mm_token_type_ids = (kind == _IMAGE).astype(np.int64)
        eligibility = (kind != _FILLER) if self.attention_eligibility else None
        if self._rope is not None:
            positions = self._rope(input_ids, mm_token_type_ids, grid, eligibility)
        else:
            positions = qwen2_vl_positions(mm_token_type_ids, grid, self.spatial_merge_size, eligibility)
        return ProcessedRecord(
            input_ids=input_ids,
            loss_mask=kind == _TEXT,
            mm_token_type_ids=mm_token_type_ids,
            pixel_values=pixel_values,
            image_grid_thw=grid,
            attention_eligibility=eligibility,
            position_ids=positions,
        )

    def _encode(self, pieces: list[str]) -> list[list[int]]:
        """Token ids of each text piece (no special tokens added; special-token strings stay text).

        A fast tokenizer's Rust backend is called piece by piece: its
        ``encode_batch`` (what ``tokenizer(list)`` uses) fans a few short
        pieces out to a thread pool, which costs milliseconds per record when
        several Zephon workers call it at once, and ``tokenizer.__call__``
        adds Python argument handling per record. Same ids (the backend has
        ``encode_special_tokens`` set by ``split_special_tokens=True``).
        """
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or not getattr(backend, "encode_special_tokens", False):
            return self.tokenizer(pieces, add_special_tokens=False)["input_ids"]
        return [backend.encode(piece, add_special_tokens=False).ids if piece else [] for piece in pieces]

    def bind_get_rope_index(self, get_rope_index: Callable[..., Any]) -> "Qwen2VLRecordProcessor":
        """A copy of this processor whose positions come from the model's ``get_rope_index``."""
        bound = object.__new__(Qwen2VLRecordProcessor)
        bound.__dict__.update(self.__dict__)
        bound._rope = RopeIndex(get_rope_index)
        return bound

    @property
    def uses_get_rope_index(self) -> bool:
        """Whether positions come from a model's ``get_rope_index`` (else Qwen2-VL's rule)."""
        return self._rope is not None

    @property
    def patch_dim(self) -> int:
        """Width of a ``pixel_values`` row: channels × temporal patch × patch²."""
        ip = self.image_processor
        return 3 * int(ip.temporal_patch_size) * int(ip.patch_size) ** 2

    def fingerprint(self) -> dict[str, Any]:
        """What must match for a saved loader state to resume: the folder's files and the options."""
        from zephon_loader.fingerprint import tokenizer_fingerprint

        return {"processor": type(self).__name__, "files": tokenizer_fingerprint(str(self.path)), **self.options}

    def save_pretrained(self, folder: str | os.PathLike[str]) -> None:
        """Save the tokenizer and the image processor config (a folder this class loads again)."""
        self.tokenizer.save_pretrained(str(folder))
        self.image_processor.save_pretrained(str(folder))

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.options.items() if v is not None)
        return f"Qwen2VLRecordProcessor({str(self.path)!r}, {options})"


def _load_image_processor(folder: Path, backend: str, min_pixels: int | None, max_pixels: int | None) -> Any:
    """``transformers``' Qwen2-VL image processor from ``folder`` (offline), resize bounds overridden if given."""
    try:
        from transformers import AutoImageProcessor
    except Exception as error:  # pragma: no cover - optional extra
        raise ImportError("the image loader needs transformers: pip install 'zephon-loader[hf]'") from error
    try:
        processor = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True, backend=backend)
    except Exception as error:
        raise ValueError(field_error("processor.path", str(folder),
                                     "a folder AutoImageProcessor.from_pretrained can load offline",
                                     f"It failed with {type(error).__name__}: {error}.")) from error
    if not all(hasattr(processor, name) for name in ("merge_size", "patch_size", "temporal_patch_size")):
        raise ValueError(field_error("processor.path", str(folder), "a Qwen2-VL image processor config",
                                     f"It holds a {type(processor).__name__}; save a Qwen2VLImageProcessor there."))
    if min_pixels is not None or max_pixels is not None:
        size = dict(processor.size)
        if min_pixels is not None:
            size["shortest_edge"] = min_pixels
        if max_pixels is not None:
            size["longest_edge"] = max_pixels
        processor = type(processor)(**{**processor.to_dict(), "size": size})
    return processor

