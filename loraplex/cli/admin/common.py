"""What the operators' command groups share: the settings options, the database, the replicas, pages.

``operator_group`` makes a group whose callback takes the server's settings as options before the
subcommand (the same names as ``loraplex serve``'s); a subcommand reads them with
``group_settings`` and runs its work on the migrated database with ``run_on_database``.
``tell_replicas`` publishes a committed change to the running servers; ``echo_row`` and
``echo_more`` print a page of rows (tab-separated) and how to get the next one.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import typer
from pydantic import ValidationError

from loraplex.adapters import AdapterValidationError
from loraplex.cli.flags import given, settings_options
from loraplex.cli.serve import fail, settings_error
from loraplex.platform.api.gateway import pool_settings
from loraplex.platform.api.services.errors import ServiceError
from loraplex.platform.api.services.pages import MAX_LIMIT, Page
from loraplex.platform.api.tenancy import replica_events
from loraplex.platform.settings import ServerSettings, load_settings
from loraplex.storage.db import Database, DatabaseUnavailable, upgrade_database

T = TypeVar("T")

_GROUP_OPTIONS = ("database_url", "data_dir", "adapter_store", "redis_url", "quota_key_prefix")
"""The settings every group takes as options before its subcommand (Redis: to tell the running
replicas of a change, as the admin API does)."""


@dataclass(frozen=True)
class _GroupState:
    """What a group's options gave: the flags themselves (a subcommand may add more) and the settings."""

    flags: dict[str, Any]
    settings: ServerSettings


def _load(flags: dict[str, Any]) -> ServerSettings:
    try:
        settings = load_settings(flags).settings
    except (ValidationError, ValueError) as exc:
        raise fail(settings_error(exc)) from None
    # As `serve` does: `adapters upload` reads the base model, a GGUF file through the cache.
    settings.process.apply()
    return settings


def _settings_options(ctx: typer.Context, **values: Any) -> None:
    flags = given(values)
    ctx.obj = _GroupState(flags, _load(flags))


_settings_options.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
        *settings_options(_GROUP_OPTIONS),
        inspect.Parameter(
            "config_file",
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[
                str | None,
                typer.Option(
                    "--config-file", help="TOML settings file (env LORAPLEX_CONFIG_FILE)", metavar="PATH"
                ),
            ],
        ),
    ]
)


def operator_group(help_text: str) -> typer.Typer:
    """A command group (``loraplex tenants``, ...) that takes the settings before its subcommand."""
    group = typer.Typer(help=help_text, no_args_is_help=True)
    group.callback()(_settings_options)
    return group


def group_settings(ctx: typer.Context, **more: Any) -> ServerSettings:
    """The group's settings, with the subcommand's own setting options over them."""
    state: _GroupState = ctx.obj
    extra = given(more)
    return _load({**state.flags, **extra}) if extra else state.settings


def run_on_database(ctx: typer.Context, work: Callable[[Database], Awaitable[T]]) -> T:
    """Migrate the database, run ``work`` on it; a service error is a message and exit code 1."""
    settings = group_settings(ctx)

    async def main() -> T:
        # The server's timeouts: an unreachable database is a message, not a command that hangs.
        db = Database(settings.gateway.database_url_or_default, pool=pool_settings(settings.gateway))
        try:
            await upgrade_database(db)
            return await work(db)
        finally:
            await db.dispose()

    try:
        return asyncio.run(main())
    except (ServiceError, AdapterValidationError) as exc:
        typer.echo(f"loraplex: {exc}", err=True)
        raise typer.Exit(1) from None
    except DatabaseUnavailable as exc:
        typer.echo(f"loraplex: {exc.reason}", err=True)
        raise typer.Exit(1) from None


async def tell_replicas(settings: ServerSettings, event: replica_events.ReplicaEvent) -> None:
    """Publish ``event`` (a committed change) on the replicas' channel when Redis is configured, so
    running servers drop what they cached of it at once, as when the admin API made the change;
    without Redis (or when it is down: logged) they see it within ``auth_cache_ttl_s``."""
    gateway = settings.gateway
    if gateway.redis_url is None:
        return
    events = replica_events.ReplicaEvents.from_url(gateway.redis_url, gateway.quota_key_prefix)
    try:
        await events.publish(event)
    finally:
        await events.aclose()


LimitOption = Annotated[int, typer.Option(min=1, max=MAX_LIMIT, help="rows per page")]
AfterOption = Annotated[str | None, typer.Option(help="go on after this cursor (a page's last id)")]


def echo_row(cells: Iterable[str]) -> None:
    """Print one row of a listing: its cells separated by tabs."""
    typer.echo("\t".join(cells))


def echo_more(found: Page[Any]) -> None:
    """Tell (on stderr) how to get the next page, when there is one."""
    if found.has_more:
        typer.echo(f"more: --after {found.last_id}", err=True)
