"""The OpenAI-compatible FastAPI application over the async engine.

``/v1/completions``, ``/v1/chat/completions`` (both streamed with SSE, with
``stream_options.include_usage``), ``/v1/models``, ``/health``. Every error is OpenAI's
error body (``errors``); request limits are ``ServerLimits`` (``limits``). Tenancy (API
keys, quotas) arrives with the gateway.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from fastapi import FastAPI

from loraplex.adapters import LoRARequest
from loraplex.platform.api.body import BodySizeLimit
from loraplex.platform.api.deps import ServerState
from loraplex.platform.api.errors import install_error_handlers
from loraplex.platform.api.limits import ServerLimits
from loraplex.platform.api.logprobs import TokenText
from loraplex.platform.api.routes import chat, completions, models
from loraplex.platform.engine.async_engine import AsyncEngine


def build_app(
    engine: AsyncEngine,
    served_model_name: str,
    loras: Mapping[str, LoRARequest] | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """The FastAPI application serving ``engine`` under ``served_model_name``.

    ``loras`` maps model ids to ``LoRARequest``s: a request whose ``model`` names an
    adapter runs on it (vLLM's ``--lora-modules`` semantics).
    """
    adapters = dict(loras or {})
    if served_model_name in adapters:
        raise ValueError(
            f"adapter name {served_model_name!r} is also the served model name, so the adapter could never "
            "be selected; rename the adapter or pass another --served-model-name"
        )
    app = FastAPI(title="loraplex", version="0.1.0")
    app.state.loraplex = ServerState(
        engine=engine,
        served_model_name=served_model_name,
        loras=adapters,
        limits=limits or ServerLimits(),
        created=int(time.time()),
        text_of=TokenText(engine.engine.tokenizer),
    )
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=app.state.loraplex.limits.max_request_body_bytes)
    for module in (completions, chat, models):
        app.include_router(module.router)
    return app
