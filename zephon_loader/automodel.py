"""``zephon_loader.automodel``: the documented import path of :mod:`zephon_loader.integrations.automodel`."""

from zephon_loader.integrations.automodel import *  # noqa: F401,F403
from zephon_loader.integrations.automodel import __all__  # noqa: F401
