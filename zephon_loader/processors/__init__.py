"""Image-text processors: the interface, the built-in Qwen2-VL-style processor, and mRoPE positions.

* :mod:`.base`: :class:`ImageTextRecord` (what a processor gets),
  :class:`ProcessedRecord` (what it returns), :class:`RecordProcessor` (the
  attributes the loader reads) and :func:`check_processed`.
* :mod:`.qwen2_vl`: :class:`Qwen2VLRecordProcessor`, built on ``transformers``'
  Qwen2-VL image processor, loaded from a local folder.
* :mod:`.rope`: Qwen2-VL's multimodal RoPE rule, vectorized, and the adapter
  that calls a model's own ``get_rope_index`` on one record.
"""

from zephon_loader.processors.base import ImageTextRecord, ProcessedRecord, RecordProcessor, check_processed
from zephon_loader.processors.qwen2_vl import Qwen2VLRecordProcessor
from zephon_loader.processors.rope import RopeIndex, qwen2_vl_positions

__all__ = [
    "ImageTextRecord",
    "ProcessedRecord",
    "Qwen2VLRecordProcessor",
    "RecordProcessor",
    "RopeIndex",
    "check_processed",
    "qwen2_vl_positions",
]
