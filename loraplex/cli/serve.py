"""``loraplex serve``: load the settings, start the engine, serve the app until a signal.

Every setting is a flag (``flags``), and also ``LORAPLEX_<NAME>`` and a key of the config
file; ``--print-settings`` prints the effective values (secrets masked) and where each came
from, then exits. With tenants (the default) the app is the gateway; ``--single-tenant``
serves without a database, optionally with ``--lora-modules NAME=PATH ...``.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import SecretStr, ValidationError

from loraplex.cli.flags import given, settings_options
from loraplex.platform.settings import (
    SECTIONS,
    LoadedSettings,
    ServerSettings,
    all_fields,
    format_bytes,
    load_settings,
)

if TYPE_CHECKING:
    from loraplex.adapters import LoRARequest
    from loraplex.platform.engine.engine import LLMEngine

LIST_SETTINGS = ("lora_modules",)
"""Settings whose flag takes several values (vLLM's ``--lora-modules a=x b=y``)."""

_TRACE = 5  # uvicorn's "trace" level


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``loraplex: message`` on stderr; the ``typer.Exit`` to raise."""
    typer.echo(f"loraplex: {message}", err=True)
    return typer.Exit(code)


def settings_error(exc: ValidationError | ValueError) -> str:
    """A settings error as one line per problem, naming the setting."""
    if not isinstance(exc, ValidationError):
        return str(exc)
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err.get("loc", ()) if p not in SECTIONS)
        message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        lines.append(f"{where}: {message}" if where else message)
    return "invalid settings:\n  " + "\n  ".join(lines)


def load(values: dict[str, Any]) -> LoadedSettings:
    """The settings from the given flags, the environment and the config file; exits on an error."""
    try:
        loaded = load_settings(given(values))
    except (ValidationError, ValueError) as exc:
        raise fail(settings_error(exc)) from None
    if loaded.sources.get("admin_token") == "flag":
        # Any user of the machine reads a process's command line (ps, /proc/<pid>/cmdline).
        print(
            "loraplex: warning: --admin-token on the command line is visible to every user of this "
            "machine (ps); set LORAPLEX_ADMIN_TOKEN or admin_token in the config file instead",
            file=sys.stderr,
        )
    return loaded


def settings_table(loaded: LoadedSettings) -> str:
    """Every setting: section, name, effective value (secrets masked) and its source."""
    rows = [("section", "setting", "value", "source")]
    settings = loaded.settings
    engine = settings.engine_config()  # as the server runs it (LoRA on for tenants)
    effective = settings.model_copy(update={"engine": engine})
    for name, field in all_fields().items():
        value = effective.value(name)
        if isinstance(value, SecretStr):
            text = "**********"
        elif field.is_bytes and isinstance(value, int):
            text = format_bytes(value)
        else:
            text = "unset" if value is None else str(value)
        source = loaded.sources[name]
        if value != settings.value(name):
            source = "derived (tenants and lora_modules need LoRA)"
        elif source == "env":
            source = f"env {field.env}"
        elif source == "file":
            source = f"file {settings.config_file}"
        elif source == "flag":
            source = f"flag {field.flag}"
        rows.append((field.section, name, text, source))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join(
        f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip() for r in rows
    )


def register_lora_modules(engine: LLMEngine, settings: ServerSettings) -> dict[str, LoRARequest]:
    """Validate and register the ``NAME=PATH`` adapters of ``lora_modules``; name -> LoRARequest."""
    from loraplex.adapters import LoRARequest

    loras: dict[str, LoRARequest] = {}
    for i, spec in enumerate(settings.serving.lora_modules, start=1):
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules expects NAME=PATH, got {spec!r}")
        if name in loras:
            raise ValueError(f"lora_modules names {name!r} twice")
        if name == settings.served_model_name:
            raise ValueError(
                f"lora_modules: adapter {name!r} has the served model's name; requests could not reach it"
            )
        lora = LoRARequest(name, i, path)
        engine.add_lora(lora)
        loras[name] = lora
    return loras


def _log_level(name: str) -> int:
    return _TRACE if name == "trace" else int(getattr(logging, name.upper()))


def run_server(settings: ServerSettings) -> int:
    """Start the engine and serve; the process exit code (1 if the engine died)."""
    # The process settings (cache, cpu_kernels, amx, malloc_tuning) reach the layers below the
    # platform through their LORAPLEX_* variables: export them before anything reads them.
    settings.process.apply()
    from loraplex.cli.server_app import build_server_app
    from loraplex.platform.api.server import serve
    from loraplex.platform.engine.async_engine import AsyncEngine
    from loraplex.platform.engine.engine import LLMEngine

    serving = settings.serving
    try:
        engine = LLMEngine(settings.engine_config())
        loras = register_lora_modules(engine, settings)
    except (ValueError, FileNotFoundError) as exc:
        raise fail(str(exc)) from None
    async_engine = AsyncEngine(engine)
    try:
        app = build_server_app(async_engine, settings, loras)
    except ValueError as exc:
        async_engine.shutdown()
        raise fail(str(exc)) from None
    # Returns 1 when the engine died (so a supervisor restarts the process), 0 on a clean stop.
    return serve(app, serving.host, serving.port, serving.log_level)


def serve_command(**values: Any) -> int:
    """Start the OpenAI-compatible server (with tenants, keys and quotas unless --single-tenant)."""
    print_settings = bool(values.pop("print_settings"))
    loaded = load(values)
    if print_settings:
        typer.echo(settings_table(loaded))
        return 0
    settings = loaded.settings
    logging.basicConfig(
        level=_log_level(settings.serving.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    _bare_access_log()
    raise typer.Exit(run_server(settings))


def _bare_access_log() -> None:
    """Access-log lines go to stderr as they are (one JSON object per line, no prefix)."""
    from loraplex.platform.api.observability.access_log import ACCESS_LOGGER

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    access = logging.getLogger(ACCESS_LOGGER)
    access.addHandler(handler)
    access.propagate = False


_PRINT = inspect.Parameter(
    "print_settings",
    inspect.Parameter.KEYWORD_ONLY,
    default=False,
    annotation=Annotated[
        bool,
        typer.Option(
            "--print-settings",
            help="Print every setting's effective value (secrets masked) and where it came from, then exit.",
        ),
    ],
)
CONFIG_FILE_OPTION = inspect.Parameter(
    "config_file",
    inspect.Parameter.KEYWORD_ONLY,
    default=None,
    annotation=Annotated[
        str | None,
        typer.Option(
            "--config-file",
            help="TOML file with more settings (a table per section, or flat keys) "
            "(env LORAPLEX_CONFIG_FILE)",
            metavar="PATH",
        ),
    ],
)
serve_command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [_PRINT, CONFIG_FILE_OPTION, *settings_options()]
)
