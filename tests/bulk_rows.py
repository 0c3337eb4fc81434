"""A big gateway database, fast: tenants and keys inserted with SQL in a few statements.

``fill(db, num_tenants, num_keys, whale_keys)`` makes tenants ``t00000``...; the first one (the
"whale", ``WHALE``) owns ``whale_keys`` of the keys, the rest are dealt round the others. Rows
go in with multi-row INSERTs in one transaction (SQLAlchemy's insertmanyvalues): 100,000 keys
take seconds, not the minutes one ORM flush per row would.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import insert, select

from loraplex.storage.db import ApiKey, Database, Tenant

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
