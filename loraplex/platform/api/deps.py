"""What every route shares: the server's state, as a FastAPI dependency (``StateDep``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request

from loraplex.adapters import LoRARequest
from loraplex.platform.api.limits import ServerLimits
from loraplex.platform.api.logprobs import TokenText
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.errors import UnknownAdapterError


@dataclass(frozen=True)
class ServerState:
    """The engine, what it serves under which names, and the request limits."""

    engine: AsyncEngine
    served_model_name: str
    loras: Mapping[str, LoRARequest]
    limits: ServerLimits
    created: int
    """Unix time the server started (``created`` of the /v1/models entries)."""
    text_of: TokenText
    """Single-token texts for logprobs, cached across requests."""

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.info.max_model_len

    def resolve_model(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names, None for the base model; ``UnknownAdapterError`` otherwise."""
        if model is None or model == self.served_model_name:
            return None
        lora = self.loras.get(model)
        if lora is None:
            raise UnknownAdapterError(model)
        return lora


def app_state(app: FastAPI) -> ServerState:
    state = app.state.loraplex
    assert isinstance(state, ServerState), "build_app sets app.state.loraplex"
    return state


def get_state(request: Request) -> ServerState:
    return app_state(request.app)


StateDep = Annotated[ServerState, Depends(get_state)]
