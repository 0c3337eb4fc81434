"""``loraplex tenants``: tenants, their quotas and fair-share weights.

    loraplex tenants create NAME [--rpm N] [--tpm N] [--max-concurrency N] [--max-adapters N]
                                 [--max-adapter-bytes N] [--weight W]
    loraplex tenants update NAME [--weight W] [--rpm N] [...]   (only the options given change)
    loraplex tenants list | disable NAME [--enable]

Quotas left out are unlimited; byte sizes take units (``10MiB``, ``1e9``). An update or a disable
reaches the running servers at once when Redis is configured, else within ``auth_cache_ttl_s``.
"""

from __future__ import annotations

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
from loraplex.cli.serve import fail
from loraplex.platform.api.services import tenants
from loraplex.platform.api.services.errors import ServiceError
from loraplex.platform.api.services.pages import DEFAULT_LIMIT, PageRequest
from loraplex.platform.api.services.tenants import QUOTA_FIELDS, QuotaField, TenantQuotas
from loraplex.platform.api.tenancy import replica_events
from loraplex.platform.settings.units import parse_bytes
from loraplex.storage.db import Database

tenants_app = operator_group("Tenants and their quotas.")

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

    run_on_database(ctx, work)
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
        await tell_replicas(group_settings(ctx), replica_events.TenantChanged(tenant.id, tenant.disabled))

    run_on_database(ctx, work)
    typer.echo(f"updated tenant {name}")


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
            echo_row([t.name, state, *map(_quota_text, quotas), f"{t.weight:g}"])
        echo_more(found)

    run_on_database(ctx, work)


@tenants_app.command("disable")
def tenants_disable(
    ctx: typer.Context, name: str, enable: Annotated[bool, typer.Option(help="enable it again")] = False
) -> None:
    """Disable a tenant (its keys stop working, its public adapters disappear), or --enable it."""

    async def work(db: Database) -> None:
        async with db.transaction(write=True) as session:
            tenant = await tenants.set_disabled(session, name, not enable)
        await tell_replicas(group_settings(ctx), replica_events.TenantChanged(tenant.id, tenant.disabled))

    run_on_database(ctx, work)
    typer.echo(f"{'enabled' if enable else 'disabled'} tenant {name}")
