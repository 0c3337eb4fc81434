"""The ``loraplex`` command: one typer app, every command listed by ``loraplex --help``."""

from __future__ import annotations

import typer

from loraplex.cli.admin.adapters import adapters_app
from loraplex.cli.admin.db import db_app
from loraplex.cli.admin.keys import keys_app
from loraplex.cli.admin.tenants import tenants_app
from loraplex.cli.serve import serve_command

app = typer.Typer(
    name="loraplex",
    help="Multi-tenant LoRA serving: an OpenAI-compatible server and its operators' commands.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("serve", help=serve_command.__doc__)(serve_command)
app.add_typer(tenants_app, name="tenants")
app.add_typer(keys_app, name="keys")
app.add_typer(adapters_app, name="adapters")
app.add_typer(db_app, name="db")
