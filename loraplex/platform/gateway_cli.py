"""Operators' commands on the gateway's database (typer): tenants, API keys, adapters.

    loraplex tenants create NAME [--rpm N] [--tpm N] [--max-concurrency N] [--max-adapters N]
                                 [--max-adapter-bytes N]
    loraplex tenants list | disable NAME [--enable]
    loraplex keys create TENANT [--name TEXT] [--expires-in-days N]   (prints the key, once)
    loraplex keys list [TENANT] | revoke ID
    loraplex adapters upload TENANT NAME PATH [--visibility private|public] [--model M] [--max-lora-rank R]
    loraplex adapters list [TENANT] | delete TENANT NAME [--version SHA256]

Every command takes the gateway's settings as options before the subcommand (``loraplex
tenants --database-url ... list``) or from ``LORAPLEX_*`` / the config file, the same names as
the server's, so both work on the same database and adapter store. The database is migrated
to the newest schema first. A running server unloads a deleted adapter when it next resolves
its name (the files are gone, the row is gone).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import typing
from collections.abc import Awaitable, Callable, Collection, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import click
import typer

from loraplex.adapters import AdapterValidationError, BaseModelSpec
from loraplex.adapters.layout import CONFIG_NAME, WEIGHTS_NAME
from loraplex.platform.api.adapter_catalog import AdapterCatalog, parse_visibility
from loraplex.platform.api.adapter_files import AdapterFileStore, AdapterValidator, UploadedFile
from loraplex.platform.api.services import adapters, keys, tenants
from loraplex.platform.api.services.errors import ServiceError
from loraplex.platform.api.services.tenants import TenantQuotas
from loraplex.platform.api.settings import GatewaySettings
from loraplex.platform.engine.config import EngineConfig, parse_dtype
from loraplex.storage.db import Database, upgrade_to_head
from loraplex.storage.db.models import utcnow

T = TypeVar("T")

app = typer.Typer(help="Manage the gateway's tenants, API keys and adapters.", no_args_is_help=True)
tenants_app = typer.Typer(help="Tenants and their quotas.", no_args_is_help=True)
keys_app = typer.Typer(help="Tenants' API keys.", no_args_is_help=True)
adapters_app = typer.Typer(help="Tenants' LoRA adapters.", no_args_is_help=True)

Quota = Annotated[int | None, typer.Option(min=0, help="unset: unlimited")]


def _settings_options(
    ctx: typer.Context,
    database_url: Annotated[str | None, typer.Option(help="LORAPLEX_DATABASE_URL")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="LORAPLEX_DATA_DIR")] = None,
    adapter_store: Annotated[Path | None, typer.Option(help="LORAPLEX_ADAPTER_STORE")] = None,
    config_file: Annotated[Path | None, typer.Option(help="LORAPLEX_CONFIG_FILE")] = None,
) -> None:
    flags: dict[str, Any] = dict(
        database_url=database_url, data_dir=data_dir, adapter_store=adapter_store, config_file=config_file
    )
    ctx.obj = GatewaySettings(**{k: v for k, v in flags.items() if v is not None})


for _group in (tenants_app, keys_app, adapters_app):
    _group.callback()(_settings_options)
app.add_typer(tenants_app, name="tenants")
app.add_typer(keys_app, name="keys")
app.add_typer(adapters_app, name="adapters")


def _run(ctx: typer.Context, work: Callable[[Database], Awaitable[T]]) -> T:
    """Migrate the database, run ``work`` on it; a service error is a message and exit code 1."""
    settings: GatewaySettings = ctx.obj

    async def main() -> T:
        db = Database(settings.database_url_or_default)
        try:
            await upgrade_to_head(db.engine)
            return await work(db)
        finally:
            await db.dispose()

    try:
        return asyncio.run(main())
    except (ServiceError, AdapterValidationError) as exc:
        typer.echo(f"loraplex: {exc}", err=True)
        raise typer.Exit(1) from None


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
    max_adapter_bytes: Quota = None,
) -> None:
    """Create a tenant with its quotas."""
    quotas = TenantQuotas(rpm, tpm, max_concurrency, max_adapters, max_adapter_bytes)

    async def work(db: Database) -> None:
        async with db.transaction(write=True) as session:
            await tenants.create_tenant(session, name, quotas)

    _run(ctx, work)
    typer.echo(f"created tenant {name}")


@tenants_app.command("list")
def tenants_list(ctx: typer.Context) -> None:
    """Every tenant: name, state, rpm, tpm, concurrency, adapters, adapter bytes."""

    async def work(db: Database) -> None:
        async with db.transaction() as session:
            for t in await tenants.list_tenants(session):
                quotas = (t.rpm, t.tpm, t.max_concurrency, t.max_adapters, t.max_adapter_bytes)
                state = "disabled" if t.disabled else "enabled"
                typer.echo("\t".join([t.name, state, *map(_quota_text, quotas)]))

    _run(ctx, work)


@tenants_app.command("disable")
def tenants_disable(
    ctx: typer.Context, name: str, enable: Annotated[bool, typer.Option(help="enable it again")] = False
) -> None:
    """Disable a tenant (its keys stop working, its public adapters disappear), or --enable it."""

    async def work(db: Database) -> None:
        async with db.transaction(write=True) as session:
            await tenants.set_disabled(session, name, not enable)

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
def keys_list(ctx: typer.Context, tenant: Annotated[str | None, typer.Argument()] = None) -> None:
    """Keys (of one tenant, or all): id, tenant, prefix, name, expiry, revoked, last use."""

    async def work(db: Database) -> None:
        async with db.transaction() as session:
            owner = None if tenant is None else await tenants.get_tenant(session, tenant)
            for k in await keys.list_keys(session, owner):
                when = (k.expires_at, k.revoked_at, k.last_used_at)
                cells = [str(k.id), k.tenant.name, k.prefix, k.name or "-"]
                typer.echo("\t".join(cells + ["-" if t is None else t.isoformat() for t in when]))

    _run(ctx, work)


@keys_app.command("revoke")
def keys_revoke(ctx: typer.Context, key_id: int) -> None:
    """Revoke a key by id: it stops authenticating at once."""

    async def work(db: Database) -> None:
        async with db.transaction(write=True) as session:
            await keys.revoke_key(session, key_id)

    _run(ctx, work)
    typer.echo(f"revoked key id {key_id}")


def _validator(model: str | None, max_lora_rank: int, dtype: str) -> AdapterValidator:
    """The checks the server runs on uploads, from the base model's config (no weights loaded)."""
    import torch

    from loraplex.platform.model.loader import load_hf_config
    from loraplex.platform.model.source import resolve_model_dir

    spec = BaseModelSpec.from_hf_config(load_hf_config(resolve_model_dir(model)))
    return AdapterValidator(spec, max_lora_rank, parse_dtype(dtype, torch.device("cpu")))


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


@adapters_app.command("upload")
def adapters_upload(
    ctx: typer.Context,
    tenant: str,
    name: str,
    path: Path,
    visibility: Annotated[str, typer.Option(help="private or public")] = "private",
    model: Annotated[str | None, typer.Option(help="base model the server runs (folder or HF id)")] = None,
    served_model_name: Annotated[str | None, typer.Option()] = None,
    max_lora_rank: Annotated[int, typer.Option(min=1)] = EngineConfig.max_lora_rank,
    dtype: Annotated[str, typer.Option(help="serving dtype the weights must fit")] = "float32",
) -> None:
    """Validate an adapter (folder, .zip or .tar.gz) against the base model and store it for TENANT."""
    settings: GatewaySettings = ctx.obj
    files = AdapterFileStore(settings.adapter_store_dir)
    validator = _validator(model, max_lora_rank, dtype)
    base_name = served_model_name or (model.rstrip("/").split("/")[-1] if model else "SmolLM2-135M-Instruct")

    async def work(db: Database) -> str:
        files.open()
        staging = files.new_staging()
        try:
            uploaded = _staged_upload(path, staging)
            async with db.transaction() as session:
                owner = await tenants.get_tenant(session, tenant)
            catalog = AdapterCatalog(db, files, validator, base_name)
            adapter = await catalog.upload(owner, uploaded, staging, name, parse_visibility(visibility))
            return adapter.version
        finally:
            files.discard(staging)

    typer.echo(f"stored adapter {tenant}/{name} version {_run(ctx, work)}")


@adapters_app.command("list")
def adapters_list(ctx: typer.Context, tenant: Annotated[str | None, typer.Argument()] = None) -> None:
    """Adapter versions (of one tenant, or all): owner, name, version, visibility, rank, bytes."""

    async def work(db: Database) -> None:
        async with db.transaction() as session:
            owner = None if tenant is None else await tenants.get_tenant(session, tenant)
            for a in await adapters.list_adapters(session, owner):
                cells = [a.owner.name, a.name, a.version, a.visibility, str(a.rank), str(a.nbytes)]
                typer.echo("\t".join(cells))

    _run(ctx, work)


@adapters_app.command("delete")
def adapters_delete(
    ctx: typer.Context,
    tenant: str,
    name: str,
    version: Annotated[str | None, typer.Option(help="only this version (sha256)")] = None,
) -> None:
    """Delete an adapter (every version, or one) and the files nobody else uses."""
    settings: GatewaySettings = ctx.obj

    async def work(db: Database) -> int:
        async with db.transaction() as session:
            owner = await tenants.get_tenant(session, tenant)
        # No validator: deleting needs no base model, only rows and folders go.
        catalog = AdapterCatalog(db, AdapterFileStore(settings.adapter_store_dir))
        return len(await catalog.delete(owner, name, version))

    typer.echo(f"deleted {_run(ctx, work)} version(s) of {tenant}/{name}")


def add_gateway_flags(parser: argparse.ArgumentParser, skip: Collection[str] = ()) -> None:
    """``--<field-name>`` for every ``GatewaySettings`` field (its docstring as help) on ``loraplex serve``.

    Every default is None, so a flag left out falls back to ``LORAPLEX_<NAME>``, the config file,
    then the field's default; ``skip`` names fields the parser defines already (``host``, ``port``).
    """
    group = parser.add_argument_group("gateway (GatewaySettings; also LORAPLEX_<NAME> and --config-file)")
    for name, field in GatewaySettings.model_fields.items():
        if name in skip:
            continue
        choices = (
            typing.get_args(field.annotation) if typing.get_origin(field.annotation) is Literal else None
        )
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=None,
            choices=choices,
            help=" ".join((field.description or "").split()),
        )


def gateway_settings(args: argparse.Namespace) -> GatewaySettings:
    """The settings the flags of ``add_gateway_flags`` (and the environment, and the file) give;
    raises pydantic's ``ValidationError`` naming the setting and the fix."""
    given = {
        name: getattr(args, name)
        for name in GatewaySettings.model_fields
        if getattr(args, name, None) is not None
    }
    return GatewaySettings(**given)


COMMANDS = ("tenants", "keys", "adapters")
"""The first words of the commands this module serves (``loraplex.platform.cli`` dispatches them here)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit code."""
    try:
        # Without standalone mode click returns a command's exit code instead of calling sys.exit.
        result = app(
            args=list(sys.argv[1:] if argv is None else argv), prog_name="loraplex", standalone_mode=False
        )
    except click.ClickException as exc:  # a usage error: click's own message, exit code 2
        exc.show()
        return exc.exit_code
    except click.Abort:
        return 1
    return result if isinstance(result, int) else 0
