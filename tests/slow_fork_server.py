"""Preloaded by the fork server in ``test_signals`` (``PROCESS_TRAINER_PRELOAD``): a slow start or a slow exit.

What torch makes of a fork server on a busy machine, drawn out to
:data:`SLOW_S` so that a server that waits it out is caught by any bound.
``$SLOW_FORK_SERVER`` chooses:

* ``start``: the import prints ``fork server preloading`` (to the trainer's
  output) and sleeps, as an import of torch does under load;
* ``exit``: an object whose ``__del__`` sleeps is left in this module, so
  that tearing down the server's interpreter takes that long.
"""

from __future__ import annotations

import os
import time

#: Seconds of the slow start or exit.
SLOW_S = 600.0


class _SlowTeardown:
    def __del__(self, sleep=time.sleep, seconds=SLOW_S) -> None:  # bound now: teardown clears module globals
        sleep(seconds)


if os.environ.get("SLOW_FORK_SERVER") == "start":
    print("fork server preloading", flush=True)
    time.sleep(SLOW_S)
elif os.environ.get("SLOW_FORK_SERVER") == "exit":
    teardown = _SlowTeardown()
