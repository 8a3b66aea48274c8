"""``zephon_loader.accelerate``: the documented import path of :mod:`zephon_loader.integrations.accelerate`."""

from zephon_loader.integrations.accelerate import *  # noqa: F401,F403
from zephon_loader.integrations.accelerate import __all__  # noqa: F401
