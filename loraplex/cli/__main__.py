"""``python -m loraplex.cli``: the same as the ``loraplex`` command."""

from loraplex.cli import main

raise SystemExit(main())
