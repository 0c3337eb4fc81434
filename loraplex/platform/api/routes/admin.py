"""``/admin/api``: tenants, their keys, every adapter, usage (``Authorization: Bearer <admin token>``).

| route | does |
|---|---|
| ``POST /tenants``, ``GET /tenants``, ``GET /tenants/{name}`` | create (quotas in the body), list, read |
| ``PATCH /tenants/{name}`` | change quotas (absent: unchanged, null: unlimited), ``disabled`` |
| ``DELETE /tenants/{name}`` | the tenant, its keys, adapters (files too), usage and cached KV |
| ``POST /tenants/{name}/keys`` | a new key: the answer holds ``key``, shown this once |
| ``GET /tenants/{name}/keys`` | its keys, by prefix |
| ``DELETE /keys/{id}`` | revoke a key |
| ``GET /adapters[?tenant=]``, ``DELETE /adapters/{tenant}/{name}[?version=]`` | every adapter version |
| ``GET /usage[?tenant=&adapter=&status=&since=&until=&limit=]`` | totals and the newest records |
| ``POST /prefix-cache/reset`` | forget every cached KV block, every tier (409 while requests run) |
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query
from pydantic import AwareDatetime

from loraplex.platform.api.deps import GatewayDep, SessionDep, forget_cached_auth, require_admin
from loraplex.platform.api.schemas import (
    AdapterDeleted,
    AdapterPublic,
    KeyCreate,
    KeyCreated,
    KeyPublic,
    ListOf,
    TenantCreate,
    TenantPublic,
    TenantUpdate,
    UsageReport,
)
from loraplex.platform.api.services import adapters, keys, tenants, usage
from loraplex.platform.api.services.tenants import TenantQuotas
from loraplex.storage.db import UsageStatus

# The admin token is checked once, for every route of this router; a change forgets cached keys.
router = APIRouter(
    prefix="/admin/api",
    tags=["admin"],
    dependencies=[Depends(require_admin), Depends(forget_cached_auth, scope="function")],
)


@router.post("/tenants", status_code=201)
async def create_tenant(body: TenantCreate, session: SessionDep) -> TenantPublic:
    quotas = TenantQuotas(
        rpm=body.rpm,
        tpm=body.tpm,
        max_concurrency=body.max_concurrency,
        max_adapters=body.max_adapters,
        max_adapter_bytes=body.max_adapter_bytes,
    )
    return TenantPublic.of(await tenants.create_tenant(session, body.name, quotas, disabled=body.disabled))


@router.get("/tenants")
async def list_tenants(session: SessionDep) -> ListOf[TenantPublic]:
    return ListOf[TenantPublic](data=[TenantPublic.of(t) for t in await tenants.list_tenants(session)])


@router.get("/tenants/{name}")
async def get_tenant(name: str, session: SessionDep) -> TenantPublic:
    return TenantPublic.of(await tenants.get_tenant(session, name))


@router.patch("/tenants/{name}")
async def update_tenant(name: str, body: TenantUpdate, session: SessionDep) -> TenantPublic:
    tenant = await tenants.update_quotas(session, name, body.quota_changes())
    if body.disabled is not None:
        tenant = await tenants.set_disabled(session, name, body.disabled)
    return TenantPublic.of(tenant)


@router.delete("/tenants/{name}")
async def delete_tenant(name: str, gateway: GatewayDep) -> dict[str, object]:
    deleted = await gateway.delete_tenant(name)
    return {
        "object": "tenant.deleted",
        "name": deleted.name,
        "deleted": True,
        "adapters_removed": deleted.adapters_removed,
        "kv_blocks_purged": deleted.kv_blocks_purged,
    }


@router.post("/tenants/{name}/keys", status_code=201)
async def create_key(name: str, body: KeyCreate, session: SessionDep) -> KeyCreated:
    tenant = await tenants.get_tenant(session, name)
    return KeyCreated.created(
        await keys.create_key(session, tenant, name=body.name, expires_at=body.expires_at)
    )


@router.get("/tenants/{name}/keys")
async def list_keys(name: str, session: SessionDep) -> ListOf[KeyPublic]:
    tenant = await tenants.get_tenant(session, name)
    return ListOf[KeyPublic](data=[KeyPublic.of(k) for k in await keys.list_keys(session, tenant)])


_MAX_ROW_ID = (1 << 63) - 1
"""Largest id a database integer holds: a larger one is a 400, never a driver overflow (500)."""


@router.delete("/keys/{key_id}")
async def revoke_key(key_id: Annotated[int, Path(ge=1, le=_MAX_ROW_ID)], session: SessionDep) -> KeyPublic:
    return KeyPublic.of(await keys.revoke_key(session, key_id))


@router.get("/adapters")
async def list_adapters(session: SessionDep, tenant: str | None = None) -> ListOf[AdapterPublic]:
    owner = None if tenant is None else await tenants.get_tenant(session, tenant)
    return ListOf[AdapterPublic](
        data=[AdapterPublic.of(a) for a in await adapters.list_adapters(session, owner)]
    )


@router.delete("/adapters/{tenant}/{name}")
async def delete_adapter(
    tenant: str, name: str, gateway: GatewayDep, version: str | None = None
) -> AdapterDeleted:
    async with gateway.db.transaction() as session:
        owner = await tenants.get_tenant(session, tenant)
    refs = await gateway.catalog.delete(owner, name, version)
    return AdapterDeleted(owner=tenant, name=name, versions=[ref.version for ref in refs])


@router.get("/usage")
async def usage_report(
    session: SessionDep,
    tenant: str | None = None,
    adapter: str | None = None,
    status: UsageStatus | None = None,
    since: AwareDatetime | None = None,
    until: AwareDatetime | None = None,
    limit: Annotated[int, Query(ge=1, le=usage.MAX_QUERY_ROWS)] = 100,
) -> UsageReport:
    owner = None if tenant is None else await tenants.get_tenant(session, tenant)
    where = usage.UsageFilter(tenant=owner, since=since, until=until, adapter_name=adapter, status=status)
    totals = await usage.usage_totals(session, where)
    return UsageReport.of(totals, await usage.query_usage(session, where, limit=limit))


@router.post("/prefix-cache/reset")
async def reset_prefix_cache(gateway: GatewayDep) -> dict[str, object]:
    """Drop every cached KV block (device, host, disk records erased). The engine does it only
    when idle, so a busy server answers 409 with ``Retry-After``: new requests keep coming."""
    await gateway.reset_prefix_cache()
    return {"object": "prefix_cache.reset", "reset": True}
