"""What every route shares: the server's state (``StateDep``) and the gate's caller (``CallDep``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request

from loraplex.adapters import LoRARequest
from loraplex.platform.api.gating import GatedCall, RequestGate
from loraplex.platform.api.limits import ServerLimits
from loraplex.platform.api.logprobs import TokenText
from loraplex.platform.engine.async_engine import AsyncEngine


@dataclass(frozen=True)
class ServerState:
    """The engine, what it serves under which names, the request limits, and who may call."""

    engine: AsyncEngine
    served_model_name: str
    loras: Mapping[str, LoRARequest]
    limits: ServerLimits
    created: int
    """Unix time the server started (``created`` of the /v1/models entries)."""
    text_of: TokenText
    """Single-token texts for logprobs, cached across requests."""
    gate: RequestGate
    """Authenticates callers, resolves ``model`` per caller, admits requests (``gating``)."""

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.info.max_model_len


def app_state(app: FastAPI) -> ServerState:
    state = app.state.loraplex
    assert isinstance(state, ServerState), "build_app sets app.state.loraplex"
    return state


def get_state(request: Request) -> ServerState:
    return app_state(request.app)


StateDep = Annotated[ServerState, Depends(get_state)]


async def open_call(request: Request) -> GatedCall:
    """The caller of ``request``, authenticated by the server's gate (401 from the gateway)."""
    return await get_state(request).gate.open(request)


CallDep = Annotated[GatedCall, Depends(open_call)]
