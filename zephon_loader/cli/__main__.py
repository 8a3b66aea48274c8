"""``python -m zephon_loader.cli``: the ``zephon-loader`` command."""

from zephon_loader.cli.commands import main

raise SystemExit(main())
