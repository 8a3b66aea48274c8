"""The ``torchdata.nodes`` graph between Zephon and the training loop.

* :mod:`~zephon_loader.nodes.source`: the source node over the Zephon pipeline (state = Zephon's checkpoint).
* :mod:`~zephon_loader.nodes.readahead`: collate and final map ahead in a thread; the state is cut before it.
* :mod:`~zephon_loader.nodes.lanes`: which Zephon lanes a data-parallel rank owns.
* :mod:`~zephon_loader.nodes.workers`: containment of Zephon's process-runner workers.
"""
