"""``/admin/api``: tenants, their keys, every adapter, usage (``Authorization: Bearer <admin token>``).

| route | does |
|---|---|
| ``POST /tenants``, ``GET /tenants/{name}`` | create (quotas, ``weight`` in the body), read |
| ``GET /tenants[?name_prefix=]`` | list, by name |
| ``PATCH /tenants/{name}`` | change quotas (absent: unchanged, null: unlimited), ``disabled``, ``weight`` |
| ``DELETE /tenants/{name}`` | the tenant, its keys, adapters (files too), usage and cached KV |
| ``POST /tenants/{name}/keys`` | a new key: the answer holds ``key``, shown this once |
| ``GET /tenants/{name}/keys[?prefix=]`` | its keys (prefixes, never the keys), oldest first |
| ``DELETE /keys/{id}`` | revoke a key |
| ``GET /adapters[?tenant=&name_prefix=]`` | every adapter version, oldest first |
| ``DELETE /adapters/{tenant}/{name}[?version=]`` | an adapter (every version, or one) |
| ``GET /usage[?tenant=&adapter=&status=&since=&until=]`` | totals, and a page of the records, newest first |
| ``POST /prefix-cache/reset`` | forget every cached KV block, every tier (409 while requests run) |

Every list is one page in OpenAI's list shape (``?limit=`` 1-100, default 20; ``?after=`` the
``last_id`` of the page before; ``has_more``), read with keyset pagination (``services.pages``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query
from pydantic import AwareDatetime

from loraplex.platform.api.deps import GatewayDep, PageDep, SessionDep, forget_cached_auth, require_admin
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
from loraplex.platform.api.services.errors import InvalidInput
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
    tenant = await tenants.create_tenant(
        session, body.name, quotas, disabled=body.disabled, weight=body.weight
    )
    return TenantPublic.of(tenant)


@router.get("/tenants")
async def list_tenants(
    session: SessionDep, page: PageDep, name_prefix: Annotated[str | None, Query(max_length=64)] = None
) -> ListOf[TenantPublic]:
    found = await tenants.page_tenants(session, page, name_prefix=name_prefix)
    return ListOf[TenantPublic].of_page(found.map(TenantPublic.of))


@router.get("/tenants/{name}")
async def get_tenant(name: str, session: SessionDep) -> TenantPublic:
    return TenantPublic.of(await tenants.get_tenant(session, name))


@router.patch("/tenants/{name}")
async def update_tenant(
    name: str, body: TenantUpdate, session: SessionDep, gateway: GatewayDep
) -> TenantPublic:
    tenant = await tenants.update_quotas(session, name, body.quota_changes())
    if body.disabled is not None:
        tenant = await tenants.set_disabled(session, name, body.disabled)
    if "weight" in body.model_fields_set:
        if body.weight is None:
            raise InvalidInput("weight", "must be a number greater than 0 (it cannot be null)")
        tenant = await tenants.set_weight(session, name, body.weight)
    # Committed first: a replica that re-reads the row when it hears of the change must find it
    # changed (and a disabled tenant is disabled for good before its requests are stopped).
    public = TenantPublic.of(tenant)
    await session.commit()
    await gateway.tenant_changed(tenant)
    return public


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
async def list_keys(
    name: str, session: SessionDep, page: PageDep, prefix: Annotated[str | None, Query(max_length=16)] = None
) -> ListOf[KeyPublic]:
    tenant = await tenants.get_tenant(session, name)
    found = await keys.page_keys(session, page, tenant, prefix=prefix)
    return ListOf[KeyPublic].of_page(found.map(KeyPublic.of))


_MAX_ROW_ID = (1 << 63) - 1
"""Largest id a database integer holds: a larger one is a 400, never a driver overflow (500)."""


@router.delete("/keys/{key_id}")
async def revoke_key(
    key_id: Annotated[int, Path(ge=1, le=_MAX_ROW_ID)], session: SessionDep, gateway: GatewayDep
) -> KeyPublic:
    row = await keys.revoke_key(session, key_id)
    public, tenant_id = KeyPublic.of(row), row.tenant_id
    await session.commit()  # before the other replicas hear of it (see update_tenant)
    await gateway.key_revoked(key_id, tenant_id)
    return public


@router.get("/adapters")
async def list_adapters(
    session: SessionDep,
    page: PageDep,
    tenant: str | None = None,
    name_prefix: Annotated[str | None, Query(max_length=128)] = None,
) -> ListOf[AdapterPublic]:
    owner = None if tenant is None else await tenants.get_tenant(session, tenant)
    found = await adapters.page_adapters(session, page, owner, name_prefix=name_prefix)
    return ListOf[AdapterPublic].of_page(found.map(AdapterPublic.of))


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
    page: PageDep,
    tenant: str | None = None,
    adapter: str | None = None,
    status: UsageStatus | None = None,
    since: AwareDatetime | None = None,
    until: AwareDatetime | None = None,
) -> UsageReport:
    owner = None if tenant is None else await tenants.get_tenant(session, tenant)
    where = usage.UsageFilter(tenant=owner, since=since, until=until, adapter_name=adapter, status=status)
    totals = await usage.usage_totals(session, where)
    return UsageReport.of(totals, await usage.page_usage(session, where, page))


@router.post("/prefix-cache/reset")
async def reset_prefix_cache(gateway: GatewayDep) -> dict[str, object]:
    """Drop every cached KV block (device, host, disk records erased). The engine does it only
    when idle, so a busy server answers 409 with ``Retry-After``: new requests keep coming."""
    await gateway.reset_prefix_cache()
    return {"object": "prefix_cache.reset", "reset": True}
