"""``python -m loraplex.platform.cli``: the same as the ``loraplex`` command."""

from loraplex.platform.cli import main

raise SystemExit(main())
