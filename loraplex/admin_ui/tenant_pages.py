"""Tenants and their keys (the operator), and a tenant's own key prefixes.

| route | does |
|---|---|
| ``GET /admin/tenants`` | a page of tenants (``name_prefix``, ``after``), the create form |
| ``POST /admin/tenants`` | create one (quotas: empty is unlimited) |
| ``GET /admin/tenants/{name}`` | its quotas, state, a page of its keys (``prefix``, ``after``) |
| ``POST /admin/tenants/{name}/quotas`` / ``state`` / ``delete`` | edit, disable / enable, delete |
| ``POST /admin/tenants/{name}/keys`` | a new key, shown on the answer page only |
| ``POST /admin/keys/{id}/revoke`` | revoke a key |
| ``GET /admin/keys`` | a tenant's own keys, by prefix (read only) |

Forms post back to the page; a refused value is shown next to its field (status 400).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from starlette.responses import RedirectResponse, Response

from loraplex.admin_ui.security import OperatorDep, Viewer, ViewerDep, check_csrf, gateway_of, ui_state
from loraplex.admin_ui.views import SECURITY_HEADERS, render
from loraplex.platform.api.deps import PageDep, forget_cached_auth
from loraplex.platform.api.services import keys, tenants
from loraplex.platform.api.services.errors import Conflict, InvalidInput, ServiceError
from loraplex.platform.api.services.pages import PageRequest
from loraplex.platform.api.services.tenants import QUOTA_FIELDS, QuotaField, TenantQuotas
from loraplex.storage.db.models import utcnow

# A change here (a key revoked, a tenant disabled, an adapter deleted) drops this replica's cached
# key checks and adapter resolutions at once, as the admin API does.
router = APIRouter(
    prefix="/admin", include_in_schema=False, dependencies=[Depends(forget_cached_auth, scope="function")]
)

QUOTA_LABELS: dict[QuotaField, str] = {
    "rpm": "Requests per minute",
    "tpm": "Tokens per minute",
    "max_concurrency": "Requests at once",
    "max_adapters": "Adapters",
    "max_adapter_bytes": "Adapter bytes",
}


def _quotas_from_form(form: dict[str, str]) -> dict[QuotaField, int | None]:
    """The quota fields of a form: empty is unlimited; ``InvalidInput`` names a bad one."""
    values: dict[QuotaField, int | None] = {}
    for field in QUOTA_FIELDS:
        raw = form.get(field, "").strip().replace(",", "").replace("_", "")
        if not raw:
            values[field] = None
            continue
        if not raw.isascii() or not raw.isdigit():
            raise InvalidInput(field, "must be a whole number, or empty for unlimited")
        values[field] = int(raw)
    return values


def _weight_from_form(form: dict[str, str]) -> float:
    """The form's fair-share weight: empty is 1; ``InvalidInput`` for anything but a number."""
    raw = form.get("weight", "").strip()
    if not raw:
        return 1.0
    try:
        return tenants.check_weight(float(raw))
    except ValueError:
        raise InvalidInput("weight", "must be a number greater than 0, e.g. 1 or 2.5") from None


def _expiry(days: str) -> datetime | None:
    """``expires_in_days`` of the key form: empty is never; else a positive number of days."""
    days = days.strip()
    if not days:
        return None
    try:
        value = float(days)
    except ValueError:
        raise InvalidInput("expires_at", "a number of days, or empty for never") from None
    if not 0 < value <= 36_500:
        raise InvalidInput("expires_at", "a number of days from 0 to 36500, or empty for never")
    return utcnow() + timedelta(days=value)


async def _form(request: Request, viewer: Viewer) -> dict[str, str]:
    form = await request.form()
    fields = {k: v for k, v in form.items() if isinstance(v, str)}
    check_csrf(request, viewer, fields.get("csrf_token"))
    return fields


def _errors_of(exc: ServiceError, default_field: str = "name") -> dict[str, str]:
    if isinstance(exc, InvalidInput):
        return {exc.field: exc.detail}
    if isinstance(exc, Conflict):
        return {default_field: "is taken already"}
    return {"": str(exc)}


async def _tenants_page(
    request: Request,
    viewer: Viewer,
    page: PageRequest,
    name_prefix: str | None,
    status: int = 200,
    **context: Any,
) -> Response:
    async with gateway_of(request).db.transaction() as session:
        found = await tenants.page_tenants(session, page, name_prefix=name_prefix)
    return render(
        request,
        "tenants.html",
        viewer,
        status=status,
        found=found,
        name_prefix=name_prefix or "",
        limit=page.limit,
        quota_labels=QUOTA_LABELS,
        **context,
    )


@router.get("/tenants")
async def tenants_page(
    request: Request,
    viewer: OperatorDep,
    page: PageDep,
    name_prefix: Annotated[str | None, Query(max_length=64)] = None,
) -> Response:
    return await _tenants_page(request, viewer, page, name_prefix, errors={}, values={})


@router.post("/tenants")
async def create_tenant(request: Request, viewer: OperatorDep) -> Response:
    form = await _form(request, viewer)
    name = form.get("name", "").strip()
    try:
        quotas = TenantQuotas(**_quotas_from_form(form))
        weight = _weight_from_form(form)
        async with gateway_of(request).db.transaction(write=True) as session:
            await tenants.create_tenant(session, name, quotas, weight=weight)
    except ServiceError as exc:
        return await _tenants_page(
            request, viewer, PageRequest(), None, status=400, errors=_errors_of(exc), values=form
        )
    return RedirectResponse(f"/admin/tenants/{name}", status_code=303, headers=SECURITY_HEADERS)


async def _tenant_page(
    request: Request,
    viewer: Viewer,
    name: str,
    page: PageRequest,
    prefix: str | None,
    status: int = 200,
    **context: Any,
) -> Response:
    async with gateway_of(request).db.transaction() as session:
        tenant = await tenants.get_tenant(session, name)
        found = await keys.page_keys(session, page, tenant, prefix=prefix)
    context = {"errors": {}, "values": {}, **context}
    return render(
        request,
        "tenant.html",
        viewer,
        status=status,
        tenant=tenant,
        found=found,
        prefix=prefix or "",
        limit=page.limit,
        quota_labels=QUOTA_LABELS,
        now=utcnow(),
        **context,
    )


@router.get("/tenants/{name}")
async def tenant_page(
    request: Request,
    name: str,
    viewer: OperatorDep,
    page: PageDep,
    prefix: Annotated[str | None, Query(max_length=16)] = None,
) -> Response:
    return await _tenant_page(request, viewer, name, page, prefix)


@router.post("/tenants/{name}/quotas")
async def update_quotas(request: Request, name: str, viewer: OperatorDep) -> Response:
    form = await _form(request, viewer)
    try:
        quotas, weight = _quotas_from_form(form), _weight_from_form(form)
        async with gateway_of(request).db.transaction(write=True) as session:
            await tenants.update_quotas(session, name, quotas)
            tenant = await tenants.set_weight(session, name, weight)
    except (InvalidInput, Conflict) as exc:
        return await _tenant_page(
            request, viewer, name, PageRequest(), None, status=400, errors=_errors_of(exc), values=form
        )
    await gateway_of(request).tenant_changed(tenant)  # committed: every replica's cached checks go
    return RedirectResponse(f"/admin/tenants/{name}?saved=1", status_code=303, headers=SECURITY_HEADERS)


@router.post("/tenants/{name}/state")
async def set_state(request: Request, name: str, viewer: OperatorDep) -> Response:
    form = await _form(request, viewer)
    gateway = gateway_of(request)
    async with gateway.db.transaction(write=True) as session:
        tenant = await tenants.set_disabled(session, name, form.get("disabled") == "1")
    # Committed: if disabled, its running requests stop now, on every replica, as through the API.
    await gateway.tenant_changed(tenant)
    return RedirectResponse(f"/admin/tenants/{name}", status_code=303, headers=SECURITY_HEADERS)


@router.post("/tenants/{name}/delete")
async def delete_tenant(request: Request, name: str, viewer: OperatorDep) -> Response:
    form = await _form(request, viewer)
    if form.get("confirm_name", "") != name:
        return await _tenant_page(
            request,
            viewer,
            name,
            PageRequest(),
            None,
            status=400,
            errors={"confirm_name": f"type {name} to confirm"},
        )
    deleted = await gateway_of(request).delete_tenant(name)
    ui_state(request).sessions.revoke_tenant(name)
    return await _tenants_page(request, viewer, PageRequest(), None, deleted=deleted, errors={}, values={})


@router.post("/tenants/{name}/keys")
async def create_key(request: Request, name: str, viewer: OperatorDep) -> Response:
    form = await _form(request, viewer)
    label = form.get("name", "").strip() or None
    try:
        expires_at = _expiry(form.get("expires_in_days", ""))
        async with gateway_of(request).db.transaction(write=True) as session:
            tenant = await tenants.get_tenant(session, name)
            created = await keys.create_key(session, tenant, name=label, expires_at=expires_at)
    except InvalidInput as exc:
        return await _tenant_page(
            request, viewer, name, PageRequest(), None, status=400, errors=_errors_of(exc), values=form
        )
    return await _tenant_page(request, viewer, name, PageRequest(), None, created=created)


@router.post("/keys/{key_id}/revoke")
async def revoke_key(request: Request, key_id: int, viewer: OperatorDep) -> Response:
    await _form(request, viewer)
    async with gateway_of(request).db.transaction(write=True) as session:
        row = await keys.revoke_key(session, key_id)
        owner, tenant_id = row.tenant.name, row.tenant_id
    await gateway_of(request).key_revoked(key_id, tenant_id)  # committed: every replica drops it
    return RedirectResponse(f"/admin/tenants/{owner}", status_code=303, headers=SECURITY_HEADERS)


@router.get("/keys")
async def own_keys(
    request: Request,
    viewer: ViewerDep,
    page: PageDep,
    prefix: Annotated[str | None, Query(max_length=16)] = None,
) -> Response:
    """A tenant's own keys (prefixes only); the operator goes to a tenant's page instead."""
    if viewer.tenant is None:
        return RedirectResponse("/admin/tenants", status_code=303, headers=SECURITY_HEADERS)
    async with gateway_of(request).db.transaction() as session:
        found = await keys.page_keys(session, page, viewer.tenant, prefix=prefix)
    return render(
        request, "keys.html", viewer, found=found, prefix=prefix or "", limit=page.limit, now=utcnow()
    )
