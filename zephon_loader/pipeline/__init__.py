"""The Zephon pipeline of a loader, built stage by stage from a validated config (nothing starts here).

* :mod:`~zephon_loader.pipeline.work_source`: shard folders, whole passes, this rank's lanes.
* :mod:`~zephon_loader.pipeline.provenance`: where a record came from; the log of records left out.
* :mod:`~zephon_loader.pipeline.records`: the record-operator base and the text checks.
* :mod:`~zephon_loader.pipeline.text`: text, chat or pretokenized records → ``pack_flat(S + 1)`` → ``batch(B)``.
* :mod:`~zephon_loader.pipeline.image_records`, :mod:`~zephon_loader.pipeline.image`: image-text records
  → processor → ``pack_sequences(S)`` → ``batch(B)``.
"""
