"""Rows in a gateway database: a tenant or an adapter's metadata at a time, or a big database at once.

make_tenant(db, name, **quotas)   a committed tenant with quotas
new_adapter(name, content)        metadata of an upload (``NewAdapter``); ``version_of`` its stand-in version

A big gateway database, fast: tenants and keys inserted with SQL in a few statements.

``fill(db, num_tenants, num_keys, whale_keys)`` makes tenants ``t00000``...; the first one (the
"whale", ``WHALE``) owns ``whale_keys`` of the keys, the rest are dealt round the others. Rows
go in with multi-row INSERTs in one transaction (SQLAlchemy's insertmanyvalues): 100,000 keys
take seconds, not the minutes one ORM flush per row would.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

from sqlalchemy import insert, select

from loraplex.platform.api.services import tenants
from loraplex.platform.api.services.adapters import NewAdapter
from loraplex.platform.api.services.tenants import TenantQuotas
from loraplex.storage.db import ApiKey, Database, Tenant, Visibility

WHALE = "t00000"
_CREATED = datetime(2026, 1, 1, tzinfo=UTC)
_CHUNK = 10_000


def tenant_name(i: int) -> str:
    return f"t{i:05d}"


async def fill(db: Database, num_tenants: int, num_keys: int, whale_keys: int) -> dict[str, int]:
    """Insert the rows; returns the tenants' ids by name."""
    async with db.transaction(write=True) as session:
        rows = [
            {"name": tenant_name(i), "disabled": False, "created_at": _CREATED} for i in range(num_tenants)
        ]
        for start in range(0, len(rows), _CHUNK):
            await session.execute(insert(Tenant), rows[start : start + _CHUNK])
        ids = {name: id_ for id_, name in await session.execute(select(Tenant.id, Tenant.name))}
        whale = ids[WHALE]
        others = [ids[tenant_name(i)] for i in range(1, num_tenants)] or [whale]
        keys = [
            {
                "tenant_id": whale if i < whale_keys else others[i % len(others)],
                "key_hash": f"{i:064x}",
                "prefix": f"lpx-{i:08x}",
                "created_at": _CREATED,
            }
            for i in range(num_keys)
        ]
        for start in range(0, len(keys), _CHUNK):
            await session.execute(insert(ApiKey), keys[start : start + _CHUNK])
    return ids


async def make_tenant(db: Database, name: str, **quotas: int | None) -> Tenant:
    """A committed tenant with the given quotas."""
    async with db.transaction(write=True) as session:
        return await tenants.create_tenant(session, name, TenantQuotas(**quotas))


def version_of(content: str) -> str:
    """A stand-in content version: sha256 hex of ``content``."""
    return hashlib.sha256(content.encode()).hexdigest()


def new_adapter(
    name: str, content: str = "v1", *, visibility: Visibility = "private", nbytes: int = 1000, path: str = ""
) -> NewAdapter:
    """Metadata of an upload named ``name`` whose content is ``content``."""
    version = version_of(f"{name}:{content}")
    return NewAdapter(
        name=name,
        version=version,
        base_model="HuggingFaceTB/SmolLM2-135M",
        rank=8,
        target_modules=("q_proj", "v_proj"),
        nbytes=nbytes,
        path=path or f"sha256/{version}",
        visibility=visibility,
    )
