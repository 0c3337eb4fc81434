"""``build_gateway``: the OpenAI server with tenants, API keys, per-tenant adapters and quotas.

It is ``build_app`` with the gateway's pieces plugged in:

- the ``TenantGate`` (``tenant_gate``): every ``/v1`` call authenticates with a tenant's API key,
  ``model`` resolves per caller, requests pass the tenant's quotas, usage is recorded;
- the routers ``/v1/adapters`` (tenant uploads) and ``/admin/api`` (operators);
- at start-up (lifespan): database migrations under a lock (replicas may start together), the
  adapter store opened, the ``local`` tenant when auth="open"; at shutdown: pending usage
  written, the limiter and the database closed. The engine belongs to the caller.

Quotas go through Redis when ``redis_url`` is set (one limit for every replica), else through an
in-process limiter. ``GatewaySettings`` refuses unsafe bindings before any of this runs.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from loraplex.adapters import BaseModelSpec
from loraplex.platform.api.adapter_catalog import AdapterCatalog
from loraplex.platform.api.adapter_files import AdapterFileStore, AdapterValidator
from loraplex.platform.api.app import build_app
from loraplex.platform.api.auth import local_tenant
from loraplex.platform.api.background import BackgroundWork
from loraplex.platform.api.engine_adapters import EngineAdapters
from loraplex.platform.api.gateway_errors import install_gateway_error_handlers
from loraplex.platform.api.limits import ServerLimits
from loraplex.platform.api.quotas import make_quota_limiter
from loraplex.platform.api.routes import adapters, admin
from loraplex.platform.api.settings import GatewaySettings
from loraplex.platform.api.tenancy import GatewayState
from loraplex.platform.api.tenant_gate import TenantGate
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.storage.db import Database, upgrade_to_head

logger = logging.getLogger(__name__)

UPLOAD_PATH = "/v1/adapters"
_MULTIPART_SLACK_BYTES = 1 << 20
"""Room for the multipart framing and text fields on top of ``max_upload_bytes`` of files."""
_DRAIN_S = 10.0


def build_gateway(
    engine: AsyncEngine,
    settings: GatewaySettings,
    served_model_name: str,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """The multi-tenant gateway over ``engine`` (see the module docstring)."""
    llm = engine.engine
    files = AdapterFileStore(settings.adapter_store_dir)
    validator = AdapterValidator(
        BaseModelSpec.from_hf_config(llm.hf_config), llm.config.max_lora_rank, llm.info.dtype
    )
    db = Database(settings.database_url_or_default)
    limiter = make_quota_limiter(settings.redis_url, settings.quota_settings())
    engine_adapters = EngineAdapters(llm, files)
    background = BackgroundWork()
    state = GatewayState(
        settings=settings,
        db=db,
        limiter=limiter,
        files=files,
        engine_adapters=engine_adapters,
        catalog=AdapterCatalog(db, files, validator, served_model_name, engine_adapters),
        background=background,
        served_model_name=served_model_name,
    )
    gate = TenantGate(db, settings.auth, limiter, engine, engine_adapters, served_model_name, background)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        revision = await upgrade_to_head(db.engine)
        files.open()
        if settings.auth == "open":
            await local_tenant(db)
        logger.info(
            "gateway ready: database at revision %s, adapter store %s, quotas %s, auth %s",
            revision,
            files.root,
            "in Redis" if settings.redis_url else "in process",
            settings.auth,
        )
        try:
            yield
        finally:
            await background.drain(_DRAIN_S)
            await limiter.aclose()
            await db.dispose()

    app = build_app(
        engine,
        served_model_name,
        None,
        limits,
        gate=gate,
        lifespan=lifespan,
        body_limits={UPLOAD_PATH: settings.max_upload_bytes + _MULTIPART_SLACK_BYTES},
    )
    app.state.gateway = state
    install_gateway_error_handlers(app)
    app.include_router(adapters.router)
    app.include_router(admin.router)
    return app
