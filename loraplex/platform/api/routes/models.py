"""``GET /v1/models``, ``GET /v1/models/{id}`` and ``GET /health``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from loraplex.platform.api.deps import CallDep, ServerState, StateDep
from loraplex.platform.api.errors import to_api_error
from loraplex.platform.api.gating import ModelCard
from loraplex.platform.engine.errors import EngineDeadError, UnknownAdapterError

router = APIRouter(tags=["models"])


def _entry(state: ServerState, card: ModelCard) -> dict[str, Any]:
    return {
        "id": card.id,
        "object": "model",
        "created": state.created,
        "owned_by": card.owned_by,
        "root": card.id,
        "parent": card.parent,
        "max_model_len": state.max_model_len,
    }


@router.get("/v1/models")
async def list_models(state: StateDep, call: CallDep) -> dict[str, Any]:
    """The base model, then every adapter this caller can name in ``model``."""
    return {"object": "list", "data": [_entry(state, card) for card in await call.models()]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, state: StateDep, call: CallDep) -> dict[str, Any]:
    for card in await call.models():
        if card.id == model_id:
            return _entry(state, card)
    raise UnknownAdapterError(model_id)


@router.get("/health", response_model=None)
async def health(state: StateDep) -> dict[str, str] | JSONResponse:
    """200 while the engine serves; 503 once it has stopped (the process is exiting)."""
    if not state.engine.is_alive:
        err = to_api_error(EngineDeadError("the engine has stopped; the server is exiting"))
        return JSONResponse(err.body(), status_code=err.status)
    return {"status": "ok"}
