"""Helpers for the service tests: tenants in their own committed transaction, adapter metadata."""

from __future__ import annotations

import hashlib

from loraplex.platform.api.services import tenants
from loraplex.platform.api.services.adapters import NewAdapter
from loraplex.platform.api.services.tenants import TenantQuotas
from loraplex.storage.db import Database, Tenant, Visibility


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
