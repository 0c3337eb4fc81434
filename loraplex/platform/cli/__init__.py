"""The ``loraplex`` command line (typer): ``serve`` and the operators' ``tenants``, ``keys``, ``adapters``,
``db``.

| module | owns |
|---|---|
| ``app`` | the root typer app that lists every command |
| ``serve`` | ``loraplex serve``: settings -> engine -> app -> uvicorn; ``--print-settings`` |
| ``admin`` | ``loraplex tenants|keys|adapters|db ...`` on the gateway's database and adapter store |
| ``flags`` | one option per setting, made from the settings' fields and docstrings |
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``loraplex`` command; returns its exit code (2 for a usage error)."""
    from loraplex.platform.cli.app import app
    from loraplex.platform.cli.flags import spread_list_options
    from loraplex.platform.cli.serve import LIST_SETTINGS

    args = spread_list_options(list(sys.argv[1:] if argv is None else argv), LIST_SETTINGS)
    # Standalone mode: typer prints usage errors itself (exit code 2) and ends with SystemExit,
    # whose code is the command's exit code.
    try:
        app(args=args, prog_name="loraplex")
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0
