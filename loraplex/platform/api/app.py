"""The OpenAI-compatible FastAPI application over the async engine.

``/v1/completions``, ``/v1/chat/completions`` (both streamed with SSE, with
``stream_options.include_usage``), ``/v1/models``, ``/health``. Every error is OpenAI's
error body (``errors``); request limits are ``ServerLimits`` (``limits``). Who may call and
what (API keys, per-tenant adapters, quotas) is the ``gate``: ``StaticGate`` here, the
gateway's ``TenantGate`` from ``build_gateway``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Lifespan, Receive, Scope, Send

from loraplex.adapters import LoRARequest
from loraplex.platform.api.body import BodySizeLimit
from loraplex.platform.api.deps import ServerState
from loraplex.platform.api.errors import install_error_handlers
from loraplex.platform.api.gating import RequestGate, StaticGate
from loraplex.platform.api.limits import ServerLimits
from loraplex.platform.api.logprobs import TokenText
from loraplex.platform.api.routes import chat, completions, models
from loraplex.platform.engine.async_engine import AsyncEngine


class BodyLimits:
    """ASGI middleware: ``BodySizeLimit``, with a limit of their own for some paths (uploads)."""

    def __init__(self, app: ASGIApp, default_bytes: int, by_path: Mapping[str, int]) -> None:
        self.default = BodySizeLimit(app, default_bytes)
        self.by_path = {path: BodySizeLimit(app, limit) for path, limit in by_path.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limiter = self.by_path.get(scope.get("path", ""), self.default) if scope["type"] == "http" else None
        await (limiter or self.default)(scope, receive, send)


def build_app(
    engine: AsyncEngine,
    served_model_name: str,
    loras: Mapping[str, LoRARequest] | None = None,
    limits: ServerLimits | None = None,
    *,
    gate: RequestGate | None = None,
    lifespan: Lifespan[Any] | None = None,
    body_limits: Mapping[str, int] | None = None,
) -> FastAPI:
    """The FastAPI application serving ``engine`` under ``served_model_name``.

    ``loras`` maps model ids to ``LoRARequest``s: a request whose ``model`` names an
    adapter runs on it (vLLM's ``--lora-modules`` semantics). ``gate`` replaces that
    single-tenant ``StaticGate`` (the gateway passes its own), ``lifespan`` runs around
    the server's life, and ``body_limits`` raises the request body limit for some paths.
    """
    adapters = dict(loras or {})
    if served_model_name in adapters:
        raise ValueError(
            f"adapter name {served_model_name!r} is also the served model name, so the adapter could never "
            "be selected; rename the adapter or pass another --served-model-name"
        )
    app = FastAPI(title="loraplex", version="0.1.0", lifespan=lifespan)
    app.state.loraplex = ServerState(
        engine=engine,
        served_model_name=served_model_name,
        loras=adapters,
        limits=limits or ServerLimits(),
        created=int(time.time()),
        text_of=TokenText(engine.engine.tokenizer),
        gate=gate or StaticGate(served_model_name, adapters),
    )
    install_error_handlers(app)
    app.add_middleware(
        BodyLimits,
        default_bytes=app.state.loraplex.limits.max_request_body_bytes,
        by_path=dict(body_limits or {}),
    )
    for module in (completions, chat, models):
        app.include_router(module.router)
    return app
