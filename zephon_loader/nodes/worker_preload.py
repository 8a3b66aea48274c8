"""What the fork server imports once for all the Zephon workers it forks (``workers.FORKSERVER_PRELOAD``).

Every worker imports Zephon (and torch with it) and this package (its
operators); Zephon's tokenize operators load tokenizers with transformers. A
transformers that fails to import is left to the worker that needs it, which
raises the real error: the fork server stops at the first exception other than
``ImportError`` in a preloaded module, and every later worker start would then
fail with an ``EOFError`` that names nothing.
"""

import zephon  # noqa: F401
import zephon_loader  # noqa: F401

try:
    import transformers  # noqa: F401
except Exception:  # raised again, with its cause, in the worker that needs it
    pass
