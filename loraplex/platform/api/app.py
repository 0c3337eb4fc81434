"""``build_app``: the one FastAPI application over the async engine, with tenants or without.

``/v1/completions``, ``/v1/chat/completions`` (both streamed with SSE, with
``stream_options.include_usage``), ``/v1/models`` and ``/health`` always; with tenants (the
default) also ``/v1/adapters`` (tenant uploads) and ``/admin/api`` (operators). The served app
(``loraplex.cli.server_app``) mounts the admin web UI (``loraplex.admin_ui``, a client of this
layer) under ``/admin`` on top. Every error is OpenAI's error body (``errors``); per-request
limits are ``ServerLimits``. Who may call and what is the ``gate``: a single-tenant server has a
``StaticGate`` (no auth, the ``lora_modules`` names, no quotas, no database); with tenants the
``Gateway``'s ``TenantGate`` (API keys, per-tenant adapters, quotas, usage) and the gateway's
start-up and shutdown run in the app's lifespan. Around every request but the probes, the
``RequestObserver`` (``observability``) feeds ``/metrics`` and the access log and refuses new
work while the server drains (``lifecycle``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from importlib.metadata import version

from fastapi import FastAPI

from loraplex.adapters import LoRARequest
from loraplex.platform.api.gateway import Gateway
from loraplex.platform.api.lifecycle import Lifecycle
from loraplex.platform.api.middleware import BodyLimits, NoSniff
from loraplex.platform.api.observability.access_log import log_access
from loraplex.platform.api.observability.error_handlers import install_error_handlers
from loraplex.platform.api.observability.kv_events_metrics import KVEventsCollector
from loraplex.platform.api.observability.metrics import ServerMetrics
from loraplex.platform.api.observability.metrics_listener import MetricsListener
from loraplex.platform.api.observability.observer import RequestObserver
from loraplex.platform.api.observability.record import RequestRecord
from loraplex.platform.api.observability.vllm_metrics import VLLMCollector
from loraplex.platform.api.open_mode import OpenModeGuard
from loraplex.platform.api.routes import (
    adapters,
    admin,
    chat,
    completions,
    health,
    lora_adapters,
    metrics,
    models,
)
from loraplex.platform.api.state import AppState
from loraplex.platform.api.tenancy.gate import StaticGate
from loraplex.platform.api.token_text import TokenText
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.settings import ServerSettings

_MULTIPART_SLACK_BYTES = 1 << 20
"""Room for the multipart framing and text fields on top of ``max_upload_bytes`` of files."""


def build_app(
    engine: AsyncEngine,
    settings: ServerSettings,
    loras: Mapping[str, LoRARequest] | None = None,
    upload_paths: Sequence[str] = (),
) -> FastAPI:
    """The application serving ``engine`` with ``settings`` (see the module docstring).

    ``loras`` maps model ids to registered ``LoRARequest``s on a single-tenant server: a
    request whose ``model`` names one runs on it (vLLM's ``--lora-modules``). ``upload_paths``:
    routes mounted on the app later that take adapter uploads too (the admin UI's form), so
    their bodies are capped at the upload limit, not the request limit.
    """
    name = settings.serving.served_model_name or engine.limits.model_name
    named = dict(loras or {})
    if name in named:
        raise ValueError(
            f"adapter name {name!r} is also the served model name, so the adapter could never "
            "be selected; rename the adapter or pass another --served-model-name"
        )
    if named and not settings.serving.single_tenant:
        raise ValueError("lora_modules are served by a single-tenant server (--single-tenant)")
    gateway = None if settings.serving.single_tenant else Gateway(engine, settings.gateway, name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        listener = None
        if settings.serving.metrics_port is not None:  # routers and Prometheus, inside the cluster
            listener = MetricsListener(
                server_metrics.render, settings.serving.host, settings.serving.metrics_port
            )
            await listener.start()
        try:
            if gateway is None:
                yield
                return
            await gateway.start()
            try:
                yield
            finally:
                await gateway.stop()
        finally:
            if listener is not None:
                await listener.stop()

    # The API's description lists the admin routes too: public only where nobody needs a key.
    docs = gateway is None or settings.gateway.api_docs_on
    app = FastAPI(
        title="loraplex",
        version=version("loraplex"),
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    serving = settings.serving
    server_metrics = ServerMetrics(
        engine,
        None if gateway is None else gateway.stats,
        engine.limits.block_size,
        serving.metrics_tenant_label,
        serving.metrics_max_tenants,
    )
    if gateway is not None:
        gateway.on_tenant_deleted.append(server_metrics.forget_tenant)
    server_metrics.registry.register(
        VLLMCollector(
            engine, name, settings.engine.gpu_memory_utilization, settings.engine.enable_prefix_caching
        )
    )
    server_metrics.registry.register(KVEventsCollector(engine))
    lifecycle = Lifecycle()
    app.state.loraplex = AppState(
        engine=engine,
        settings=settings,
        served_model_name=name,
        loras=named,
        created=int(time.time()),
        text_of=TokenText(engine.tokenizer),
        gate=StaticGate(name, named) if gateway is None else gateway.gate,
        gateway=gateway,
        metrics=server_metrics,
        lifecycle=lifecycle,
    )
    install_error_handlers(app)
    by_path, shown_by_path = {}, {}
    if gateway is not None:
        by_path[adapters.UPLOAD_PATH] = gateway.max_upload_bytes + _MULTIPART_SLACK_BYTES
        # Every 413 of an upload quotes max_upload_bytes, as the upload form's does.
        shown_by_path[adapters.UPLOAD_PATH] = gateway.max_upload_bytes
        for path in upload_paths:
            by_path[path] = gateway.max_upload_bytes + _MULTIPART_SLACK_BYTES
            shown_by_path[path] = gateway.max_upload_bytes
    app.add_middleware(
        BodyLimits,
        default_bytes=settings.limits.max_request_body_bytes,
        by_path=by_path,
        shown_by_path=shown_by_path,
    )
    if gateway is not None and settings.gateway.auth == "open":
        app.add_middleware(OpenModeGuard, bound_host=settings.serving.host)

    def on_close(record: RequestRecord) -> None:
        server_metrics.observe(record)
        if serving.access_log:
            log_access(record, serving.access_log_prompts)

    # Added last, so it runs first: it sees the 413 of BodyLimits and the draining refusal.
    app.add_middleware(RequestObserver, lifecycle=lifecycle, on_close=on_close)
    app.add_middleware(NoSniff)  # outermost: every response, the observer's own included
    for module in (completions, chat, models, health, metrics):
        app.include_router(module.router)
    if gateway is not None:
        app.include_router(adapters.router)
        app.include_router(lora_adapters.router)
        app.include_router(admin.router)
    return app
