"""The ``zephon-loader`` command: ``run`` (the report) and ``inspect`` (the picture), for text and image configs."""

from zephon_loader.cli.commands import main

__all__ = ["main"]
