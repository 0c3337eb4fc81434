"""Every dependency the routes declare, as ``Annotated`` aliases (the FastAPI template's ``deps``).

| alias | gives | refuses |
|---|---|---|
| ``StateDep`` | the app's ``AppState`` (engine, settings, gate) | |
| ``CallDep`` | the caller, authenticated by the gate (a tenant, or anyone single-tenant) | 401 |
| ``GatewayDep`` | the ``Gateway`` (database, quotas, adapter catalog) | |
| ``SessionDep`` | a session in a transaction, committed before the response is sent | |
| ``CurrentTenant`` | the tenant of the request's API key (``local`` with auth="open"), cached | 401, 503 |
| ``require_admin`` | nothing: the request carries the admin token (once, on the admin router) | 401, 403 |
| ``forget_cached_auth`` | nothing; after a non-GET admin call, the cached key checks dropped | |
| ``PageDep`` | the page a list asks for: ``?limit=`` (1-100, default 20) and ``?after=`` | 400 |

``SessionDep`` opens a write transaction (``BEGIN IMMEDIATE`` on SQLite) for methods other than
GET, since those read and then write. Long work (an upload) opens its own short transaction
instead of holding one for the whole request. The gateway's dependencies exist only on a
server with tenants: its routers are not mounted on a single-tenant one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Query, Request
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.api.gateway import Gateway
from loraplex.platform.api.observability.record import record_of
from loraplex.platform.api.services.pages import DEFAULT_LIMIT, MAX_LIMIT, PageRequest
from loraplex.platform.api.state import AppState, app_state
from loraplex.platform.api.tenancy.auth import check_admin
from loraplex.platform.api.tenancy.gate import GatedCall
from loraplex.storage.db import Tenant


def get_state(request: Request) -> AppState:
    return app_state(request.app)


StateDep = Annotated[AppState, Depends(get_state)]


async def open_call(request: Request) -> GatedCall:
    """The caller of ``request``, authenticated by the server's gate (401 from the gateway)."""
    call = await get_state(request).gate.open(request)
    record = record_of(request.scope)
    if record is not None:
        record.tenant = call.tenant_name
    return call


CallDep = Annotated[GatedCall, Depends(open_call)]


def get_gateway(request: Request) -> Gateway:
    gateway = get_state(request).gateway
    assert gateway is not None, "the gateway's routes are only mounted on a server with tenants"
    return gateway


GatewayDep = Annotated[Gateway, Depends(get_gateway)]


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    async with get_gateway(request).db.transaction(write=request.method != "GET") as session:
        yield session


# scope="function": the transaction commits before the response goes out, so a failed commit
# is the client's error response and never a success followed by a lost write.
SessionDep = Annotated[AsyncSession, Depends(get_session, scope="function")]


async def current_tenant(request: Request) -> Tenant:
    return await get_gateway(request).gate.authenticator.tenant(request)


CurrentTenant = Annotated[Tenant, Depends(current_tenant)]


def require_admin(request: Request) -> None:
    """Pass when the request carries the admin token (401 otherwise; 403 when none is set)."""
    check_admin(get_gateway(request).settings.admin_token, request)


async def forget_cached_auth(request: Request) -> AsyncIterator[None]:
    """After an admin call that may change keys or tenants, this replica's cached key checks go:
    a revocation, a disabled tenant or new quotas apply here at once (elsewhere within the TTL)."""
    yield
    if request.method != "GET":
        get_gateway(request).gate.authenticator.forget()


def page_request(
    limit: Annotated[int, Query(ge=1, le=MAX_LIMIT)] = DEFAULT_LIMIT,
    after: Annotated[str | None, Query(min_length=1, max_length=512)] = None,
) -> PageRequest:
    """The page a list request asks for (OpenAI's ``limit`` and ``after``)."""
    return PageRequest(limit=limit, after=after)


PageDep = Annotated[PageRequest, Depends(page_request)]
