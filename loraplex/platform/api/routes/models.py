"""``GET /v1/models`` and ``GET /v1/models/{id}``: the base model and the adapters a caller may name."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from loraplex.adapters import AdapterNotFoundError
from loraplex.platform.api.deps import CallDep, StateDep
from loraplex.platform.api.state import AppState
from loraplex.platform.api.tenancy.gate import ModelCard

router = APIRouter(tags=["models"])


def _entry(state: AppState, card: ModelCard) -> dict[str, Any]:
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
    raise AdapterNotFoundError.for_model(model_id)
