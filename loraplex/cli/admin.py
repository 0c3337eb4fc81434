"""Operators' commands on the gateway's database and adapter store: tenants, API keys, adapters.

    loraplex tenants create NAME [--rpm N] [--tpm N] [--max-concurrency N] [--max-adapters N]
                                 [--max-adapter-bytes N] [--weight W]
    loraplex tenants update NAME [--weight W] [--rpm N] [...]   (only the options given change)
    loraplex tenants list | disable NAME [--enable]
    loraplex keys create TENANT [--name TEXT] [--expires-in-days N]   (prints the key, once)
    loraplex keys list [TENANT] | revoke ID
    loraplex adapters upload TENANT NAME PATH [--visibility private|public] [--model M] [--max-lora-rank R]
    loraplex adapters list [TENANT] | delete TENANT NAME [--version SHA256]
    loraplex db upgrade                 (migrate to the newest schema and exit: a deployment's hook)

Every group reads the server's settings (``LORAPLEX_*``, the config file) and takes the ones it
needs as options before the subcommand (``loraplex tenants --database-url ... list``), with the
same names as ``loraplex serve``, so both work on the same database and adapter store. The
database is migrated to the newest schema first. A running server unloads a deleted adapter
when it next resolves its name (the files are gone, the row is gone).
"""

from __future__ import annotations

import asyncio
import inspect
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import ValidationError

from loraplex.adapters import AdapterValidationError, BaseModelSpec
from loraplex.adapters.layout import CONFIG_NAME, WEIGHTS_NAME
from loraplex.adapters.store import AdapterStore
from loraplex.adapters.uploads import AdapterValidator, UploadedFile
from loraplex.cli.flags import given, settings_options
from loraplex.cli.serve import fail, settings_error
from loraplex.platform.api.catalog.catalog import AdapterCatalog, parse_visibility
from loraplex.platform.api.gateway import pool_settings
from loraplex.platform.api.services import adapters, keys, tenants
from loraplex.platform.api.services.errors import ServiceError
from loraplex.platform.api.services.pages import DEFAULT_LIMIT, MAX_LIMIT, Page, PageRequest
from loraplex.platform.api.services.tenants import QUOTA_FIELDS, QuotaField, TenantQuotas
from loraplex.platform.api.tenancy import replica_events
from loraplex.platform.engine.config import parse_dtype
from loraplex.platform.settings import ServerSettings, load_settings
from loraplex.platform.settings.units import parse_bytes
from loraplex.storage.db import Database, DatabaseUnavailable, current_revision, upgrade_database
from loraplex.storage.db.models import utcnow

T = TypeVar("T")

tenants_app = typer.Typer(help="Tenants and their quotas.", no_args_is_help=True)
keys_app = typer.Typer(help="Tenants' API keys.", no_args_is_help=True)
adapters_app = typer.Typer(help="Tenants' LoRA adapters.", no_args_is_help=True)
db_app = typer.Typer(help="The gateway's database.", no_args_is_help=True)

Quota = Annotated[int | None, typer.Option(min=1, help="unset: unlimited")]


def _byte_size(value: str) -> int:
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


ByteQuota = Annotated[
    int | None, typer.Option(parser=_byte_size, metavar="BYTES", help="unset: unlimited; 10MiB, 1e9, ...")
]
Weight = Annotated[
    float, typer.Option(help="fair-share weight, in (0, 1000]: the tenant's share under load, relative")
]
NewQuota = Annotated[int | None, typer.Option(min=1, help="unset: unchanged")]
NewByteQuota = Annotated[
    int | None, typer.Option(parser=_byte_size, metavar="BYTES", help="unset: unchanged; 10MiB, 1e9, ...")
]

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


def _settings(ctx: typer.Context, **more: Any) -> ServerSettings:
    """The group's settings, with the subcommand's own setting options over them."""
    state: _GroupState = ctx.obj
    extra = given(more)
    return _load({**state.flags, **extra}) if extra else state.settings


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
for _group in (tenants_app, keys_app, adapters_app, db_app):
    _group.callback()(_settings_options)


def _run(ctx: typer.Context, work: Callable[[Database], Awaitable[T]]) -> T:
    """Migrate the database, run ``work`` on it; a service error is a message and exit code 1."""
    settings = _settings(ctx)

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


async def _tell_replicas(settings: ServerSettings, event: replica_events.ReplicaEvent) -> None:
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


def _quota_text(value: int | None) -> str:
    return "-" if value is None else str(value)


@tenants_app.command("create")
def tenants_create(
    ctx: typer.Context,
    name: str,
    rpm: Quota = None,
    tpm: Quota = None,
    max_concurrency: Quota = None,
    max_adapters: Quota = None,
    max_adapter_bytes: ByteQuota = None,
    weight: Weight = 1.0,
) -> None:
    """Create a tenant with its quotas and fair-share weight."""
    try:
        quotas = TenantQuotas(rpm, tpm, max_concurrency, max_adapters, max_adapter_bytes)
    except ServiceError as exc:
        raise fail(str(exc)) from None

    async def work(db: Database) -> None:
        async with db.transaction(write=True) as session:
            await tenants.create_tenant(session, name, quotas, weight=weight)

    _run(ctx, work)
    typer.echo(f"created tenant {name}")


@tenants_app.command("update")
def tenants_update(
    ctx: typer.Context,
    name: str,
    weight: Annotated[float | None, typer.Option(help="a new fair-share weight, in (0, 1000]")] = None,
    rpm: NewQuota = None,
    tpm: NewQuota = None,
    max_concurrency: NewQuota = None,
    max_adapters: NewQuota = None,
    max_adapter_bytes: NewByteQuota = None,
) -> None:
    """Change a tenant's weight or quotas (only the options given; the admin API's PATCH can also
    make a quota unlimited)."""
    given_quotas = dict(
        rpm=rpm,
        tpm=tpm,
        max_concurrency=max_concurrency,
        max_adapters=max_adapters,
        max_adapter_bytes=max_adapter_bytes,
    )
    changes: dict[QuotaField, int | None] = {
        field: given_quotas[field] for field in QUOTA_FIELDS if given_quotas[field] is not None
    }

    async def work(db: Database) -> None:
        async with db.transaction(write=True) as session:
            tenant = await tenants.get_tenant(session, name)  # NotFound before anything changes
            if changes:
                await tenants.update_quotas(session, name, changes)
            if weight is not None:
                await tenants.set_weight(session, name, weight)
        await _tell_replicas(_settings(ctx), replica_events.TenantChanged(tenant.id, tenant.disabled))

    _run(ctx, work)
    typer.echo(f"updated tenant {name}")


LimitOption = Annotated[int, typer.Option(min=1, max=MAX_LIMIT, help="rows per page")]
AfterOption = Annotated[str | None, typer.Option(help="go on after this cursor (a page's last id)")]


def _more(found: Page[Any]) -> None:
    """Tell (on stderr) how to get the next page, when there is one."""
    if found.has_more:
        typer.echo(f"more: --after {found.last_id}", err=True)


@tenants_app.command("list")
def tenants_list(
    ctx: typer.Context,
    limit: LimitOption = DEFAULT_LIMIT,
    after: AfterOption = None,
    name_prefix: Annotated[str | None, typer.Option(help="only names starting so")] = None,
) -> None:
    """One page of tenants by name: name, state, rpm, tpm, concurrency, adapters, adapter bytes,
    weight."""

    async def work(db: Database) -> None:
        async with db.transaction() as session:
            found = await tenants.page_tenants(session, PageRequest(limit, after), name_prefix=name_prefix)
        for t in found.items:
            quotas = (t.rpm, t.tpm, t.max_concurrency, t.max_adapters, t.max_adapter_bytes)
            state = "disabled" if t.disabled else "enabled"
            typer.echo("\t".join([t.name, state, *map(_quota_text, quotas), f"{t.weight:g}"]))
        _more(found)

    _run(ctx, work)


@tenants_app.command("disable")
def tenants_disable(
    ctx: typer.Context, name: str, enable: Annotated[bool, typer.Option(help="enable it again")] = False
) -> None:
    """Disable a tenant (its keys stop working, its public adapters disappear), or --enable it."""

    async def work(db: Database) -> None:
        async with db.transaction(write=True) as session:
            tenant = await tenants.set_disabled(session, name, not enable)
        await _tell_replicas(_settings(ctx), replica_events.TenantChanged(tenant.id, tenant.disabled))

    _run(ctx, work)
    typer.echo(f"{'enabled' if enable else 'disabled'} tenant {name}")


@keys_app.command("create")
def keys_create(
    ctx: typer.Context,
    tenant: str,
    name: Annotated[str | None, typer.Option(help="a label for the key")] = None,
    expires_in_days: Annotated[float | None, typer.Option(min=0.0)] = None,
) -> None:
    """Create an API key and print it: it is shown this once and stored only as a hash."""

    async def work(db: Database) -> str:
        expires_at = None if expires_in_days is None else utcnow() + timedelta(days=expires_in_days)
        async with db.transaction(write=True) as session:
            owner = await tenants.get_tenant(session, tenant)
            created = await keys.create_key(session, owner, name=name, expires_at=expires_at)
        typer.echo(f"created key id {created.id} ({created.prefix}...) for tenant {tenant}", err=True)
        return created.key

    typer.echo(_run(ctx, work))


@keys_app.command("list")
def keys_list(
    ctx: typer.Context,
    tenant: Annotated[str | None, typer.Argument()] = None,
    limit: LimitOption = DEFAULT_LIMIT,
    after: AfterOption = None,
    prefix: Annotated[str | None, typer.Option(help="only keys starting so")] = None,
) -> None:
    """One page of keys (of one tenant, or all): id, tenant, prefix, name, expiry, revoked, last use."""

    async def work(db: Database) -> None:
        async with db.transaction() as session:
            owner = None if tenant is None else await tenants.get_tenant(session, tenant)
            found = await keys.page_keys(session, PageRequest(limit, after), owner, prefix=prefix)
        for k in found.items:
            when = (k.expires_at, k.revoked_at, k.last_used_at)
            cells = [str(k.id), k.tenant.name, k.prefix, k.name or "-"]
            typer.echo("\t".join(cells + ["-" if t is None else t.isoformat() for t in when]))
        _more(found)

    _run(ctx, work)


@keys_app.command("revoke")
def keys_revoke(ctx: typer.Context, key_id: int) -> None:
    """Revoke a key by id: it stops authenticating at once."""

    async def work(db: Database) -> None:
        async with db.transaction(write=True) as session:
            key = await keys.revoke_key(session, key_id)
        await _tell_replicas(_settings(ctx), replica_events.KeyRevoked(key.id, key.tenant_id))

    _run(ctx, work)
    typer.echo(f"revoked key id {key_id}")


def _validator(settings: ServerSettings) -> AdapterValidator:
    """The checks the server runs on uploads, from the base model's config (no weights loaded):
    the same model, ``max_lora_rank`` and dtype settings as ``loraplex serve``."""
    from loraplex.platform.model.loader import load_hf_config
    from loraplex.platform.model.source import resolve_model_dir

    engine = settings.engine
    spec = BaseModelSpec.from_hf_config(load_hf_config(resolve_model_dir(engine.model)))
    return AdapterValidator(spec, engine.max_lora_rank, parse_dtype(engine.dtype, engine.torch_device()))


def _staged_upload(path: Path, staging: Path) -> dict[str, UploadedFile]:
    """``path`` (a PEFT folder or an archive) copied into ``staging`` as an upload's files."""
    if not path.exists():
        raise typer.BadParameter(f"{path}: no such file or folder")
    if path.is_file():
        shutil.copyfile(path, staging / "file")
        return {"file": UploadedFile("file", path.name, staging / "file", path.stat().st_size)}
    files: dict[str, UploadedFile] = {}
    for field, file_name in (("adapter_config", CONFIG_NAME), ("adapter_model", WEIGHTS_NAME)):
        source = path / file_name
        if source.is_file():
            shutil.copyfile(source, staging / field)
            files[field] = UploadedFile(field, file_name, staging / field, source.stat().st_size)
    return files


_ENGINE_OPTIONS = ("model", "served_model_name", "max_lora_rank", "dtype")
"""Settings of the server that decide whether an adapter fits it (the same names as ``serve``'s)."""


def adapters_upload(
    ctx: typer.Context,
    tenant: str,
    name: str,
    path: Path,
    visibility: str = "private",
    **engine_values: Any,
) -> None:
    """Validate an adapter (folder, .zip or .tar.gz) against the base model and store it for TENANT.

    The base model, max_lora_rank and dtype are the server's settings (flags here, or
    LORAPLEX_* and the config file, as for `loraplex serve`).
    """
    settings = _settings(ctx, **engine_values)
    store = AdapterStore(settings.gateway.adapter_store_dir)
    validator = _validator(settings)

    async def work(db: Database) -> str:
        store.open()
        staging = store.new_staging()
        try:
            uploaded = _staged_upload(path, staging)
            async with db.transaction() as session:
                owner = await tenants.get_tenant(session, tenant)
            catalog = AdapterCatalog(db, store, validator, settings.served_model_name)
            catalog.on_change = lambda owner, changed: _tell_replicas(
                settings, replica_events.AdapterChanged(owner, changed)
            )
            adapter = await catalog.upload(owner, uploaded, staging, name, parse_visibility(visibility))
            return adapter.version
        finally:
            store.discard(staging)

    typer.echo(f"stored adapter {tenant}/{name} version {_run(ctx, work)}")


adapters_upload.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context),
        inspect.Parameter("tenant", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str),
        inspect.Parameter("name", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str),
        inspect.Parameter("path", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Path),
        inspect.Parameter(
            "visibility",
            inspect.Parameter.KEYWORD_ONLY,
            default="private",
            annotation=Annotated[str, typer.Option(help="private or public")],
        ),
        *settings_options(_ENGINE_OPTIONS),
    ]
)
adapters_app.command("upload")(adapters_upload)


@adapters_app.command("list")
def adapters_list(
    ctx: typer.Context,
    tenant: Annotated[str | None, typer.Argument()] = None,
    limit: LimitOption = DEFAULT_LIMIT,
    after: AfterOption = None,
    name_prefix: Annotated[str | None, typer.Option(help="only names starting so")] = None,
) -> None:
    """One page of adapter versions (of one tenant, or all): owner, name, version, visibility,
    rank, bytes."""

    async def work(db: Database) -> None:
        async with db.transaction() as session:
            owner = None if tenant is None else await tenants.get_tenant(session, tenant)
            found = await adapters.page_adapters(
                session, PageRequest(limit, after), owner, name_prefix=name_prefix
            )
        for a in found.items:
            cells = [a.owner.name, a.name, a.version, a.visibility, str(a.rank), str(a.nbytes)]
            typer.echo("\t".join(cells))
        _more(found)

    _run(ctx, work)


@adapters_app.command("delete")
def adapters_delete(
    ctx: typer.Context,
    tenant: str,
    name: str,
    version: Annotated[str | None, typer.Option(help="only this version (sha256)")] = None,
) -> None:
    """Delete an adapter (every version, or one) and the files nobody else uses."""
    settings = _settings(ctx)

    async def work(db: Database) -> int:
        async with db.transaction() as session:
            owner = await tenants.get_tenant(session, tenant)
        # No validator: deleting needs no base model, only rows and folders go.
        catalog = AdapterCatalog(db, AdapterStore(settings.gateway.adapter_store_dir))
        catalog.on_change = lambda owner, changed: _tell_replicas(
            settings, replica_events.AdapterChanged(owner, changed)
        )
        return len(await catalog.delete(owner, name, version))

    typer.echo(f"deleted {_run(ctx, work)} version(s) of {tenant}/{name}")


@db_app.command("upgrade")
def db_upgrade(ctx: typer.Context) -> None:
    """Migrate the database to the newest schema and exit.

    Deployments run it once before the replicas start (the Helm chart's pre-install and
    pre-upgrade Job). It takes the same lock as the server's start-up migration, so replicas
    that start meanwhile wait for it and then find nothing left to do.
    """

    async def work(db: Database) -> str | None:
        return await current_revision(db.engine)

    typer.echo(f"database at revision {_run(ctx, work)}")
