"""Tenants: create, read, change quotas and fair-share weight, disable, delete.

A tenant is addressed by its name everywhere outside the database (admin API paths, the CLI,
``owner/name`` adapter references). Quotas are NULL for unlimited; ``TenantQuotas`` is the
validated value the routes and the limiter pass around. The weight (default 1, never NULL) is
the tenant's share of the engine under load, relative to the other tenants' (fair scheduling).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.api.services.adapters import AdapterRef
from loraplex.platform.api.services.errors import Conflict, InvalidInput, NotFound
from loraplex.platform.api.services.names import check_tenant_name
from loraplex.platform.api.services.pages import Page, PageRequest, make_page
from loraplex.storage.db.models import Adapter, Tenant

QuotaField = Literal["rpm", "tpm", "max_concurrency", "max_adapters", "max_adapter_bytes"]
QUOTA_FIELDS: tuple[QuotaField, ...] = ("rpm", "tpm", "max_concurrency", "max_adapters", "max_adapter_bytes")

_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
# (smallest, largest) accepted. A rate limit of 0 would be "disabled" under another name (the
# tenant has a flag for that); 0 adapters or bytes means "may not upload", a real setting.
# The largest values are the columns' (INTEGER / BIGINT) so PostgreSQL never refuses one.
_RANGE: dict[QuotaField, tuple[int, int]] = {
    "rpm": (1, _INT32_MAX),
    "tpm": (1, _INT64_MAX),
    "max_concurrency": (1, _INT32_MAX),
    "max_adapters": (0, _INT32_MAX),
    "max_adapter_bytes": (0, _INT64_MAX),
}


@dataclass(frozen=True)
class TenantQuotas:
    """A tenant's limits; None means unlimited."""

    rpm: int | None = None
    """Requests per minute."""
    tpm: int | None = None
    """Tokens (prompt + completion) per minute."""
    max_concurrency: int | None = None
    """Requests in flight at once."""
    max_adapters: int | None = None
    """Adapter names the tenant may own."""
    max_adapter_bytes: int | None = None
    """Bytes of all stored versions of all the tenant's adapters."""

    def __post_init__(self) -> None:
        for field in QUOTA_FIELDS:
            _check_quota(field, getattr(self, field))

    @classmethod
    def of(cls, tenant: Tenant) -> TenantQuotas:
        """The quotas stored on ``tenant``."""
        return cls(**{field: getattr(tenant, field) for field in QUOTA_FIELDS})

    def updated(self, changes: Mapping[QuotaField, int | None]) -> TenantQuotas:
        """These quotas with ``changes`` applied (a key present with None: now unlimited)."""
        unknown = set(changes) - set(QUOTA_FIELDS)
        if unknown:
            raise InvalidInput(sorted(unknown)[0], f"not a quota; quotas are {', '.join(QUOTA_FIELDS)}")
        return dataclasses.replace(self, **{str(field): value for field, value in changes.items()})


def _check_quota(field: QuotaField, value: int | None) -> None:
    if value is None:
        return
    low, high = _RANGE[field]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidInput(field, f"must be an integer from {low} to {high}, or null for unlimited")


MAX_WEIGHT = 1000.0
"""Largest weight (the engine's own bound): a 1000:1 share is already starvation in practice."""


def check_weight(weight: float) -> float:
    """``weight`` as a float if in (0, ``MAX_WEIGHT``]; ``InvalidInput`` otherwise."""
    if (
        isinstance(weight, bool)
        or not isinstance(weight, int | float)
        or not math.isfinite(weight)
        or not 0 < weight <= MAX_WEIGHT
    ):
        raise InvalidInput("weight", f"must be a number greater than 0 and at most {MAX_WEIGHT:g}")
    return float(weight)


def engine_tenant_id(tenant: Tenant) -> str:
    """The tenant as the engine sees it (the prefix-cache salt): never reused by another tenant,
    since it binds the row id and the creation time, not only the name."""
    return f"{tenant.id}:{tenant.name}:{int(tenant.created_at.timestamp() * 1_000_000)}"


async def create_tenant(
    session: AsyncSession,
    name: str,
    quotas: TenantQuotas | None = None,
    *,
    disabled: bool = False,
    weight: float = 1.0,
) -> Tenant:
    """A new tenant; ``Conflict`` if the name is taken, ``InvalidInput`` for a bad name or weight."""
    check_tenant_name(name)
    weight = check_weight(weight)
    if await _find(session, name) is not None:
        raise Conflict("tenant", name)
    tenant = Tenant(name=name, disabled=disabled, weight=weight)
    _store_quotas(tenant, quotas or TenantQuotas())
    session.add(tenant)
    try:
        await session.flush()
    except IntegrityError:  # created by someone else since _find: the unique name index says so
        raise Conflict("tenant", name) from None
    return tenant


async def ensure_tenant(session: AsyncSession, name: str) -> Tenant:
    """The tenant called ``name``, created (no quotas) if missing; safe when replicas race."""
    tenant = await _find(session, name)
    if tenant is not None:
        return tenant
    check_tenant_name(name)
    try:
        async with session.begin_nested():
            tenant = Tenant(name=name, disabled=False, weight=1.0)
            session.add(tenant)
        return tenant
    except IntegrityError:  # another replica created it first; the savepoint kept our transaction
        return await get_tenant(session, name)


async def get_tenant(session: AsyncSession, name: str) -> Tenant:
    """The tenant called ``name``; ``NotFound`` otherwise."""
    tenant = await _find(session, name)
    if tenant is None:
        raise NotFound("tenant", name)
    return tenant


async def list_tenants(session: AsyncSession) -> list[Tenant]:
    """Every tenant, by name (all at once: for small databases and tests; lists page)."""
    return list(await session.scalars(select(Tenant).order_by(Tenant.name)))


async def page_tenants(
    session: AsyncSession, page: PageRequest, *, name_prefix: str | None = None
) -> Page[Tenant]:
    """One page of tenants by name; the cursor is the last name shown.

    Walks the unique index on ``name`` from the cursor (or from ``name_prefix``: every name
    that starts with it sorts at or after it), so any page costs the same.
    """
    query = select(Tenant).order_by(Tenant.name).limit(page.limit + 1)
    if name_prefix:
        query = query.where(Tenant.name >= name_prefix, Tenant.name.startswith(name_prefix, autoescape=True))
    if page.after is not None:
        query = query.where(Tenant.name > page.after)
    return make_page(list(await session.scalars(query)), page, lambda t: t.name)


async def update_quotas(session: AsyncSession, name: str, changes: Mapping[QuotaField, int | None]) -> Tenant:
    """Apply ``changes`` (PATCH semantics: absent = unchanged, None = unlimited)."""
    tenant = await get_tenant(session, name)
    _store_quotas(tenant, TenantQuotas.of(tenant).updated(changes))
    await session.flush()
    return tenant


async def set_weight(session: AsyncSession, name: str, weight: float) -> Tenant:
    """Change the fair-share weight (the tenant's next requests carry it to the engine)."""
    weight = check_weight(weight)
    tenant = await get_tenant(session, name)
    tenant.weight = weight
    await session.flush()
    return tenant


async def set_disabled(session: AsyncSession, name: str, disabled: bool) -> Tenant:
    """Disable (every key stops authenticating, public adapters disappear) or re-enable."""
    tenant = await get_tenant(session, name)
    tenant.disabled = disabled
    await session.flush()
    return tenant


async def delete_tenant(session: AsyncSession, name: str) -> list[AdapterRef]:
    """Delete the tenant with its keys, adapters and usage records (ON DELETE CASCADE).

    Returns the adapters that went with it: the caller unloads them from the engine and
    removes from the store the files no other adapter row still references.
    """
    tenant = await get_tenant(session, name)
    adapters = await session.scalars(select(Adapter).where(Adapter.owner_id == tenant.id))
    removed = [AdapterRef.of(adapter) for adapter in adapters]
    await session.delete(tenant)
    await session.flush()
    return removed


async def _find(session: AsyncSession, name: str) -> Tenant | None:
    return await session.scalar(select(Tenant).where(Tenant.name == name))


def _store_quotas(tenant: Tenant, quotas: TenantQuotas) -> None:
    for field in QUOTA_FIELDS:
        setattr(tenant, field, getattr(quotas, field))
