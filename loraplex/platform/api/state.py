"""``AppState``: what every route of one app shares, set once by ``build_app``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from loraplex.adapters import LoRARequest
from loraplex.platform.api.lifecycle import Lifecycle
from loraplex.platform.api.tenancy.gate import RequestGate
from loraplex.platform.api.token_text import TokenText
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.settings import ServerLimits, ServerSettings

if TYPE_CHECKING:
    from loraplex.platform.api.gateway import Gateway
    from loraplex.platform.api.observability.metrics import ServerMetrics


@dataclass(frozen=True)
class AppState:
    """The engine, the settings, what is served under which names, and who may call."""

    engine: AsyncEngine
    settings: ServerSettings
    served_model_name: str
    loras: Mapping[str, LoRARequest]
    """Single-tenant ``lora_modules``: model id -> adapter (empty with tenants)."""
    created: int
    """Unix time the server started (``created`` of the /v1/models entries)."""
    text_of: TokenText
    """Single-token texts for logprobs, cached across requests."""
    gate: RequestGate
    """Authenticates callers, resolves ``model`` per caller, admits requests (``tenancy.gate``)."""
    gateway: Gateway | None
    """The multi-tenant services (database, quotas, adapter catalog); None on a single-tenant server."""
    metrics: ServerMetrics
    """The Prometheus registry of ``/metrics``."""
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    """Draining for a shutdown, and the requests in flight."""

    @property
    def limits(self) -> ServerLimits:
        return self.settings.limits

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.limits.max_model_len


def app_state(app: FastAPI) -> AppState:
    state = app.state.loraplex
    assert isinstance(state, AppState), "build_app sets app.state.loraplex"
    return state
