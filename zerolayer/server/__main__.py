"""``python -m zerolayer.server``: the ``zl-replica`` command."""

from zerolayer.server.cli import main

raise SystemExit(main())
