"""``zephon_loader.lightning``: the documented import path of :mod:`zephon_loader.integrations.lightning`."""

from zephon_loader.integrations.lightning import *  # noqa: F401,F403
from zephon_loader.integrations.lightning import __all__  # noqa: F401
