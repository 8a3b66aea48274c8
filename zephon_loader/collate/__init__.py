"""Collate: a Zephon ``SampleBatch`` → a TrainingBatch of CPU tensors with internal names (``docs/contract.md`` §4).

* :mod:`~zephon_loader.collate.text`: ``pack_flat`` rows (``to_training`` shift, document ids from positions).
* :mod:`~zephon_loader.collate.image`: ``pack_sequences`` rows of whole image-text records (mRoPE, pixels).
"""
