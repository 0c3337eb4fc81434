"""The ``loraplex`` command line (typer): ``serve`` and the operators' ``tenants``, ``keys``, ``adapters``,
``db``.

| module | owns |
|---|---|
| ``app`` | the root typer app that lists every command |
| ``server_app`` | ``build_server_app``: the composition root, the API with the admin UI mounted |
| ``serve`` | ``loraplex serve``: settings -> engine -> app -> uvicorn; ``--print-settings`` |
| ``admin/`` | ``loraplex tenants|keys|adapters|db ...``: one module per group, their shared plumbing |
| ``flags`` | one option per setting, made from the settings' fields and docstrings |
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import typer

# typer vendors click; its public ``BadParameter`` derives from click's UsageError and
# ClickException, reached here without importing typer's private modules.
_CLICK = {cls.__name__: cls for cls in typer.BadParameter.__mro__}
_UsageError: type[Exception] = _CLICK["UsageError"]
_ClickException: type[Exception] = _CLICK["ClickException"]
_GROUP_FLAGS = ("--database-url", "--data-dir", "--adapter-store", "--config-file")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``loraplex`` command; returns its exit code (2 for a usage error)."""
    from loraplex.cli.app import app
    from loraplex.cli.flags import spread_list_options
    from loraplex.cli.serve import LIST_SETTINGS

    args = spread_list_options(list(sys.argv[1:] if argv is None else argv), LIST_SETTINGS)
    # Not standalone: a usage error comes back as an exception and is printed as one line that
    # names the command's --help, instead of typer's framed box; Exit codes come back as values.
    try:
        result = app(args=args, prog_name="loraplex", standalone_mode=False)
    except _UsageError as exc:
        ctx = getattr(exc, "ctx", None)
        if type(exc).__name__ == "NoArgsIsHelpError" and ctx is not None:
            typer.echo(ctx.get_help(), err=True)
            return 2
        where = ctx.command_path if ctx is not None else "loraplex"
        message = exc.format_message()  # type: ignore[attr-defined]
        misplaced = next((f for f in _GROUP_FLAGS if message == f"No such option: {f}"), None)
        if misplaced is not None and ctx is not None and ctx.parent is not None:
            # The operators' groups take the settings before the subcommand.
            group = ctx.parent.command_path
            typer.echo(
                f"loraplex: {misplaced} goes before the subcommand: "
                f"{group} {misplaced} ... {ctx.info_name} ...",
                err=True,
            )
        else:
            typer.echo(f"loraplex: {message} (see '{where} --help')", err=True)
        return 2
    except _ClickException as exc:
        typer.echo(f"loraplex: {exc.format_message()}", err=True)  # type: ignore[attr-defined]
        return int(getattr(exc, "exit_code", 1))
    except typer.Abort:
        return 1
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return result if isinstance(result, int) else 0
