"""``GET /v1/models``, ``GET /v1/models/{id}`` and ``GET /health``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from loraplex.platform.api.deps import ServerState, StateDep
from loraplex.platform.api.errors import to_api_error
from loraplex.platform.engine.errors import EngineDeadError, UnknownAdapterError

router = APIRouter(tags=["models"])


def _entries(state: ServerState) -> list[dict[str, Any]]:
    base = {
        "id": state.served_model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "loraplex",
        "root": state.served_model_name,
        "parent": None,
        "max_model_len": state.max_model_len,
    }
    adapters = [
        {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "loraplex",
            "root": name,
            "parent": state.served_model_name,
            "max_model_len": state.max_model_len,
        }
        for name in sorted(state.loras)
    ]
    return [base, *adapters]


@router.get("/v1/models")
async def list_models(state: StateDep) -> dict[str, Any]:
    """The base model, then every adapter clients can name in ``model``."""
    return {"object": "list", "data": _entries(state)}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, state: StateDep) -> dict[str, Any]:
    for entry in _entries(state):
        if entry["id"] == model_id:
            return entry
    raise UnknownAdapterError(model_id)


@router.get("/health", response_model=None)
async def health(state: StateDep) -> dict[str, str] | JSONResponse:
    """200 while the engine serves; 503 once it has stopped (the process is exiting)."""
    if not state.engine.is_alive:
        err = to_api_error(EngineDeadError("the engine has stopped; the server is exiting"))
        return JSONResponse(err.body(), status_code=err.status)
    return {"status": "ok"}
