"""Adapters: the list, the versions of one, upload and delete.

| route | does |
|---|---|
| ``GET /admin/adapters`` | operator: every version (``tenant``, ``name_prefix``); tenant: its newest |
| ``GET /admin/adapters/{owner}/{name}`` | the versions of one adapter (a tenant: only its own) |
| ``POST /admin/ui/adapters[?tenant=]`` | an upload (the REST API's form: ``name``, ``visibility``, ``file``
  or ``adapter_config`` + ``adapter_model``), answered in JSON; ``Gateway.receive_upload`` |
| ``POST /admin/adapters/{owner}/{name}/delete`` | delete it (every version, or ``version``) |

The upload goes through the same function as ``POST /v1/adapters`` (size cap, staging,
validation, quotas): the page's script only adds a progress bar and shows the answer.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import JSONResponse, RedirectResponse, Response

from loraplex.admin_ui.security import Viewer, ViewerDep, check_csrf, gateway_of
from loraplex.admin_ui.views import SECURITY_HEADERS, render
from loraplex.platform.api.deps import PageDep, forget_cached_auth
from loraplex.platform.api.schemas import AdapterPublic
from loraplex.platform.api.services import adapters, tenants, usage
from loraplex.platform.api.services.errors import NotFound
from loraplex.storage.db import Tenant
from loraplex.storage.db.models import utcnow

# A change here (a key revoked, a tenant disabled, an adapter deleted) drops this replica's cached
# key checks and adapter resolutions at once, as the admin API does.
router = APIRouter(
    prefix="/admin", include_in_schema=False, dependencies=[Depends(forget_cached_auth, scope="function")]
)

UPLOAD_PATH = "/admin/ui/adapters"
SERVED_WINDOW = timedelta(hours=24)
"""The adapter list shows the requests and tokens each version served over this window."""
PLACES = {"device": "accelerator slot", "host": "host cache", "disk": "store"}


async def owner_for(request: Request, viewer: Viewer, name: str | None) -> Tenant | None:
    """The tenant a viewer acts on: a tenant always itself (another name is not found), the
    operator the one named (None: all)."""
    if viewer.tenant is not None:
        if name not in (None, "", viewer.tenant.name):
            raise NotFound("tenant", name or "")
        return viewer.tenant
    if not name:
        return None
    async with gateway_of(request).db.transaction() as session:
        return await tenants.get_tenant(session, name)


@router.get("/adapters")
async def adapters_page(
    request: Request,
    viewer: ViewerDep,
    page: PageDep,
    tenant: Annotated[str | None, Query(max_length=64)] = None,
    name_prefix: Annotated[str | None, Query(max_length=128)] = None,
) -> Response:
    owner = await owner_for(request, viewer, tenant)
    gateway = gateway_of(request)
    async with gateway.db.transaction() as session:
        if viewer.tenant is not None:
            found = await adapters.page_newest(session, viewer.tenant, page, name_prefix=name_prefix)
        else:
            found = await adapters.page_adapters(session, page, owner, name_prefix=name_prefix)
        served = await usage.served_by_version(
            session, [a.version for a in found.items], utcnow() - SERVED_WINDOW
        )
    # The engine registers a version under its row id (catalog.engine_adapters).
    tiers = await gateway.engine.lora_tiers()
    return render(
        request,
        "adapters.html",
        viewer,
        found=found,
        places={a.id: PLACES.get(tiers.get(a.id, ""), "store") for a in found.items},
        served=served,
        tenant=tenant or "",
        name_prefix=name_prefix or "",
        limit=page.limit,
        max_upload_bytes=gateway.max_upload_bytes,
        max_lora_rank=gateway.engine.limits.max_lora_rank,
        base_model=gateway.catalog.base_model,
    )


@router.get("/adapters/{owner}/{name}")
async def versions_page(
    request: Request, owner: str, name: str, viewer: ViewerDep, page: PageDep
) -> Response:
    tenant = await owner_for(request, viewer, owner)
    assert tenant is not None
    async with gateway_of(request).db.transaction() as session:
        found = await adapters.page_versions(session, tenant, name, page)
    return render(request, "versions.html", viewer, found=found, owner=owner, name=name, limit=page.limit)


@router.post(UPLOAD_PATH.removeprefix("/admin"), status_code=201)
async def upload(
    request: Request, viewer: ViewerDep, tenant: Annotated[str | None, Query(max_length=64)] = None
) -> JSONResponse:
    check_csrf(request, viewer)
    owner = await owner_for(request, viewer, tenant)
    if owner is None:
        return JSONResponse(
            {"error": {"message": "Choose the tenant the adapter is for.", "param": "tenant"}},
            status_code=400,
        )
    adapter = await gateway_of(request).receive_upload(request, owner)
    return JSONResponse(AdapterPublic.of(adapter).model_dump(mode="json"), status_code=201)


@router.post("/adapters/{owner}/{name}/delete")
async def delete(request: Request, owner: str, name: str, viewer: ViewerDep) -> Response:
    form = await request.form()
    token = form.get("csrf_token")
    check_csrf(request, viewer, token if isinstance(token, str) else None)
    version = form.get("version")
    tenant = await owner_for(request, viewer, owner)
    assert tenant is not None
    await gateway_of(request).catalog.delete(
        tenant, name, version if isinstance(version, str) and version else None
    )
    target = "/admin/adapters?" + urlencode({"deleted": name})
    return RedirectResponse(target, status_code=303, headers=SECURITY_HEADERS)
