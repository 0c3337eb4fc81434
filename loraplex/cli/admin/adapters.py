"""``loraplex adapters``: tenants' LoRA adapters, validated against the server's base model.

    loraplex adapters upload TENANT NAME PATH [--visibility private|public] [--model M] [--max-lora-rank R]
    loraplex adapters list [TENANT] | delete TENANT NAME [--version SHA256]

A running server unloads a deleted adapter when it next resolves its name (the files are gone,
the row is gone).
"""

from __future__ import annotations

import inspect
import shutil
from pathlib import Path
from typing import Annotated, Any

import typer

from loraplex.adapters import BaseModelSpec
from loraplex.adapters.layout import CONFIG_NAME, WEIGHTS_NAME
from loraplex.adapters.store import AdapterStore
from loraplex.adapters.uploads import AdapterValidator, UploadedFile
from loraplex.cli.admin.common import (
    AfterOption,
    LimitOption,
    echo_more,
    echo_row,
    group_settings,
    operator_group,
    run_on_database,
    tell_replicas,
)
from loraplex.cli.flags import settings_options
from loraplex.platform.api.catalog.catalog import AdapterCatalog, parse_visibility
from loraplex.platform.api.services import adapters, tenants
from loraplex.platform.api.services.pages import DEFAULT_LIMIT, PageRequest
from loraplex.platform.api.tenancy import replica_events
from loraplex.platform.engine.config import parse_dtype
from loraplex.platform.settings import ServerSettings
from loraplex.storage.db import Database

adapters_app = operator_group("Tenants' LoRA adapters.")


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
    settings = group_settings(ctx, **engine_values)
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
            catalog.on_change = lambda owner, changed: tell_replicas(
                settings, replica_events.AdapterChanged(owner, changed)
            )
            adapter = await catalog.upload(owner, uploaded, staging, name, parse_visibility(visibility))
            return adapter.version
        finally:
            store.discard(staging)

    typer.echo(f"stored adapter {tenant}/{name} version {run_on_database(ctx, work)}")


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
            echo_row([a.owner.name, a.name, a.version, a.visibility, str(a.rank), str(a.nbytes)])
        echo_more(found)

    run_on_database(ctx, work)


@adapters_app.command("delete")
def adapters_delete(
    ctx: typer.Context,
    tenant: str,
    name: str,
    version: Annotated[str | None, typer.Option(help="only this version (sha256)")] = None,
) -> None:
    """Delete an adapter (every version, or one) and the files nobody else uses."""
    settings = group_settings(ctx)

    async def work(db: Database) -> int:
        async with db.transaction() as session:
            owner = await tenants.get_tenant(session, tenant)
        # No validator: deleting needs no base model, only rows and folders go.
        catalog = AdapterCatalog(db, AdapterStore(settings.gateway.adapter_store_dir))
        catalog.on_change = lambda owner, changed: tell_replicas(
            settings, replica_events.AdapterChanged(owner, changed)
        )
        return len(await catalog.delete(owner, name, version))

    typer.echo(f"deleted {run_on_database(ctx, work)} version(s) of {tenant}/{name}")
