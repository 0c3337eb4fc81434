"""The gateway's dependencies, as ``Annotated`` aliases the routes declare (the FastAPI template's ``deps``).

| alias | gives | refuses |
|---|---|---|
| ``GatewayDep`` | the ``GatewayState`` (database, limiter, store, engine adapters) | |
| ``SessionDep`` | a session in a transaction, committed before the response is sent | |
| ``CurrentTenant`` | the tenant of the request's API key (``local`` with auth="open") | 401 |
| ``AdminDep`` | nothing: the request carries the admin token | 401, 403 if none is set |

``SessionDep`` opens a write transaction (``BEGIN IMMEDIATE`` on SQLite) for methods other than
GET, since those read and then write. Long work (an upload) opens its own short transaction
instead of holding one for the whole request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, FastAPI, Request
from sqlalchemy.ext.asyncio import AsyncSession

from loraplex.platform.api.adapter_catalog import AdapterCatalog
from loraplex.platform.api.adapter_files import AdapterFileStore
from loraplex.platform.api.auth import authenticate_tenant, check_admin
from loraplex.platform.api.background import BackgroundWork
from loraplex.platform.api.engine_adapters import EngineAdapters
from loraplex.platform.api.quotas import QuotaLimiter
from loraplex.platform.api.settings import GatewaySettings
from loraplex.storage.db import Database, Tenant


@dataclass(frozen=True)
class GatewayState:
    """What the gateway's routes share, besides the OpenAI server's ``ServerState``."""

    settings: GatewaySettings
    db: Database
    limiter: QuotaLimiter
    files: AdapterFileStore
    engine_adapters: EngineAdapters
    catalog: AdapterCatalog
    background: BackgroundWork
    served_model_name: str


def gateway_state(app: FastAPI) -> GatewayState:
    state = app.state.gateway
    assert isinstance(state, GatewayState), "build_gateway sets app.state.gateway"
    return state


def get_gateway(request: Request) -> GatewayState:
    return gateway_state(request.app)


GatewayDep = Annotated[GatewayState, Depends(get_gateway)]


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    async with get_gateway(request).db.transaction(write=request.method != "GET") as session:
        yield session


# scope="function": the transaction commits before the response goes out, so a failed commit
# is the client's error response and never a success followed by a lost write.
SessionDep = Annotated[AsyncSession, Depends(get_session, scope="function")]


async def current_tenant(request: Request) -> Tenant:
    gateway = get_gateway(request)
    return await authenticate_tenant(gateway.db, gateway.settings.auth, request)


CurrentTenant = Annotated[Tenant, Depends(current_tenant)]


def require_admin(request: Request) -> None:
    check_admin(get_gateway(request).settings.admin_token, request)


AdminDep = Annotated[None, Depends(require_admin)]
