"""``zephon_loader.hf``: the documented import path of :mod:`zephon_loader.integrations.hf`."""

from zephon_loader.integrations.hf import *  # noqa: F401,F403
from zephon_loader.integrations.hf import __all__  # noqa: F401
