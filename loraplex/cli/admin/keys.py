"""``loraplex keys``: tenants' API keys.

    loraplex keys create TENANT [--name TEXT] [--expires-in-days N]   (prints the key, once)
    loraplex keys list [TENANT] | revoke ID

A new key is printed once on stdout (its id and prefix on stderr) and stored only as a hash.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

import typer

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
from loraplex.platform.api.services import keys, tenants
from loraplex.platform.api.services.pages import DEFAULT_LIMIT, PageRequest
from loraplex.platform.api.tenancy import replica_events
from loraplex.storage.db import Database
from loraplex.storage.db.models import utcnow

keys_app = operator_group("Tenants' API keys.")


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

    typer.echo(run_on_database(ctx, work))


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
            echo_row(cells + ["-" if t is None else t.isoformat() for t in when])
        echo_more(found)

    run_on_database(ctx, work)


@keys_app.command("revoke")
def keys_revoke(ctx: typer.Context, key_id: int) -> None:
    """Revoke a key by id: it stops authenticating at once."""

    async def work(db: Database) -> None:
        async with db.transaction(write=True) as session:
            key = await keys.revoke_key(session, key_id)
        await tell_replicas(group_settings(ctx), replica_events.KeyRevoked(key.id, key.tenant_id))

    run_on_database(ctx, work)
    typer.echo(f"revoked key id {key_id}")
