"""``GET /health`` (liveness: the engine serves) and ``GET /ready`` (readiness: send traffic here)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from loraplex.platform.api.deps import StateDep
from loraplex.platform.api.errors import SERVER_ERROR, APIError, to_api_error
from loraplex.platform.api.observability.readiness import check_ready
from loraplex.platform.engine.errors import EngineDeadError

router = APIRouter(tags=["health"])


@router.get("/health", response_model=None)
async def health(state: StateDep) -> dict[str, str] | JSONResponse:
    """200 while the engine serves; 503 once it has stopped (the process is exiting)."""
    if not state.engine.is_alive:
        return to_api_error(EngineDeadError("the engine has stopped; the server is exiting")).response()
    return {"status": "ok"}


@router.get("/ready", response_model=None)
async def ready(state: StateDep) -> dict[str, Any] | JSONResponse:
    """200 when the engine serves, the database answers at the migrations' head and quotas can be
    checked (per the failure policy), and the server is not shutting down; else 503 with the
    reason as ``code`` and every check's state in ``checks``."""
    readiness = await check_ready(state.engine, state.lifecycle, state.gateway)
    if readiness.ready:
        return {"status": "ready", "checks": readiness.checks}
    err = APIError(
        503, readiness.message, code=readiness.reason, err_type=SERVER_ERROR, headers={"Retry-After": "1"}
    )
    return JSONResponse({**err.body(), "checks": readiness.checks}, status_code=503, headers=err.headers)
