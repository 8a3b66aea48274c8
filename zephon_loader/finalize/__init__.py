"""The final map: the last stage between Zephon and the training loop.

It turns a collated :class:`~zephon_loader.attention.TrainingBatch` (``[B, S]``
tokens, labels, positions, padding mask and document ids) into the batch the
model receives, with AutoModel's names and the fields the model's packing
contract asks for (an indexed or 4D ``attention_mask``, flash varlen offsets,
the gathered-token metadata, Transformer Engine THD lengths);
``docs/contract.md`` says what each field holds.

* :class:`FinalizeSettings`: what the final map needs, validated once per loader.
* :func:`finalize_collated`: the transform of a batch ``collate`` built (trusted).
* :func:`finalize_batch`: the same for a batch from anywhere, validated first.
* :class:`FinalMap`: the stage as the loader runs it (finalize, the recipe's
  ``collate_wrapper``, pinning).
"""

from zephon_loader.finalize.final_map import FinalizeSettings, FinalMap, finalize_batch, finalize_collated

__all__ = ["FinalMap", "FinalizeSettings", "finalize_batch", "finalize_collated"]
