"""``GET /health``: whether the engine serves (for load balancers and liveness probes)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from loraplex.platform.api.deps import StateDep
from loraplex.platform.api.errors import to_api_error
from loraplex.platform.engine.errors import EngineDeadError

router = APIRouter(tags=["health"])


@router.get("/health", response_model=None)
async def health(state: StateDep) -> dict[str, str] | JSONResponse:
    """200 while the engine serves; 503 once it has stopped (the process is exiting)."""
    if not state.engine.is_alive:
        return to_api_error(EngineDeadError("the engine has stopped; the server is exiting")).response()
    return {"status": "ok"}
