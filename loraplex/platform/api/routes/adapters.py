"""``/v1/adapters``: a tenant uploads, lists, reads and deletes its own adapters.

``POST /v1/adapters`` is multipart: ``name``, ``visibility`` (private by default), and either
``file`` (a .zip / .tar.gz of the PEFT folder) or ``adapter_config`` + ``adapter_model``. The
body streams to a staging folder inside the adapter store (``catalog.upload_form``), is
validated against the base model, and becomes the newest version of ``name``
(``catalog.catalog``). Only the caller's own adapters are visible here: another tenant's is a
404 like a missing one. Lists are pages in OpenAI's list shape (``?limit=``, ``?after=``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from loraplex.platform.api.deps import CurrentTenant, GatewayDep, PageDep, SessionDep
from loraplex.platform.api.schemas import AdapterDeleted, AdapterPublic, ListOf
from loraplex.platform.api.services import adapters

UPLOAD_PATH = "/v1/adapters"
router = APIRouter(prefix=UPLOAD_PATH, tags=["adapters"])


@router.post("", status_code=201)
async def upload_adapter(request: Request, tenant: CurrentTenant, gateway: GatewayDep) -> AdapterPublic:
    """Store a new version of one of the caller's adapters."""
    return AdapterPublic.of(await gateway.receive_upload(request, tenant))


@router.get("")
async def list_adapters(
    tenant: CurrentTenant,
    session: SessionDep,
    page: PageDep,
    name_prefix: Annotated[str | None, Query(max_length=128)] = None,
) -> ListOf[AdapterPublic]:
    """The newest version of each of the caller's adapters, by name, a page at a time."""
    found = await adapters.page_newest(session, tenant, page, name_prefix=name_prefix)
    return ListOf[AdapterPublic].of_page(found.map(AdapterPublic.of))


@router.get("/{name}")
async def get_adapter(name: str, tenant: CurrentTenant, session: SessionDep) -> AdapterPublic:
    """The newest version of the caller's adapter ``name``."""
    return AdapterPublic.of(await adapters.get_adapter(session, tenant, name))


@router.get("/{name}/versions")
async def list_versions(
    name: str, tenant: CurrentTenant, session: SessionDep, page: PageDep
) -> ListOf[AdapterPublic]:
    """The stored versions of the caller's adapter ``name``, newest first, a page at a time."""
    found = await adapters.page_versions(session, tenant, name, page)
    return ListOf[AdapterPublic].of_page(found.map(AdapterPublic.of))


@router.delete("/{name}")
async def delete_adapter(
    name: str, tenant: CurrentTenant, gateway: GatewayDep, version: str | None = None
) -> AdapterDeleted:
    """Delete the caller's adapter ``name`` (every version, or only ``?version=<sha256>``)."""
    refs = await gateway.catalog.delete(tenant, name, version)
    return AdapterDeleted(owner=tenant.name, name=name, versions=[ref.version for ref in refs])
