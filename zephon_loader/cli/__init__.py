"""The ``zephon-loader`` command: ``run`` (the report) and ``inspect`` (the picture), for text and image configs;
``index`` (a source folder's shard digest manifest).

* :mod:`~zephon_loader.cli.commands`: the parser, :func:`main`, the ``run`` report, ``index`` and the one-line
  errors.
* :mod:`~zephon_loader.cli.inspect`: the ``inspect`` figures of a text and of an image-text batch.
* :mod:`~zephon_loader.cli.configs`: which kind of loader a YAML file describes, and building it.

Imports run one way: ``commands`` → ``inspect`` → ``configs``.
"""

from zephon_loader.cli.commands import main

__all__ = ["main"]
