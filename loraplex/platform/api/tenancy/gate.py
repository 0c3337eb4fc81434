"""Who may run what: the contract between the OpenAI routes and the tenancy that guards them.

Every OpenAI route talks to a ``RequestGate`` in this order::

    call = await gate.open(request)           # who asks (the gateway answers 401 here)
    target = await call.resolve(body.model)   # base model or an adapter the caller may use, else 404
    admission = await call.admit(request_id, target, prompts, params)   # quotas: 429 / 503
                                              # (prompts may be deferred: a ``PromptSource``)
    ... submit admission.prompts as admission.tenant_id, read the streams ...
    admission.close(last_outputs, end)        # exactly once, however the request ended

``admit`` counts the request (rpm, concurrency) *before* it tokenizes or renders anything:
a route passes prompts that cost CPU to produce (a chat template) as a coroutine function, so a
caller over its quota costs a few dictionary operations, not a tokenizer run.

``close`` never blocks and never raises: settling a quota and writing a usage record are
I/O, so the gate runs them in the background (an answer to the client is not delayed by
them, and a handler being cancelled cannot skip them).

| gate | used by | does |
|---|---|---|
| ``StaticGate`` | a single-tenant app | no auth, the ``lora_modules`` names, no quotas |
| ``TenantGate`` (``tenant_gate``) | an app with tenants | API keys, per-tenant adapters, quotas, usage |
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from starlette.requests import Request

from loraplex.adapters import AdapterNotFoundError, LoRARequest
from loraplex.platform.engine.inputs import PromptType
from loraplex.platform.engine.outputs import RequestOutput
from loraplex.platform.engine.request_stream import RequestStream
from loraplex.platform.engine.sampling_params import SamplingParams

PromptSource = list[PromptType] | Callable[[], Awaitable[list[PromptType]]]
"""The prompts of a request, or the coroutine function that makes them (CPU work the gate runs
only once the request is admitted)."""


async def prompts_of(source: PromptSource) -> list[PromptType]:
    """The prompts a ``PromptSource`` stands for."""
    return source if isinstance(source, list) else await source()


RequestEnd = Literal["ok", "aborted", "error"]
"""How an admitted request ended: finished, the client left first, failed (refused or broken)."""


@dataclass(frozen=True)
class ModelTarget:
    """What a request's ``model`` names, for this caller."""

    model: str
    """As the client wrote it (the base model's name when it wrote none)."""
    lora: LoRARequest | None
    """The adapter to run on; None for the base model."""
    adapter_version: str | None = None
    """The adapter's content version (sha256), when the gate knows it."""


@dataclass(frozen=True)
class ModelCard:
    """One entry of ``/v1/models``."""

    id: str
    owned_by: str
    parent: str | None
    """The base model an adapter applies to; None for the base model itself."""


class Admission(Protocol):
    """An admitted request: what to submit, as whom, and how to report its end."""

    @property
    def tenant_id(self) -> str | None:
        """The engine's tenant (the prefix cache salts with it); None on a single-tenant server."""
        ...

    @property
    def tenant_weight(self) -> float:
        """The tenant's fair-share weight (1 on a single-tenant server)."""
        ...

    @property
    def prompts(self) -> list[PromptType]:
        """The prompts to submit (the gateway hands back text prompts tokenized, as it counted them)."""
        ...

    def bind(self, streams: Sequence[RequestStream]) -> None:
        """The streams the request runs as: the gate may end them with an error (its caller was
        deleted or disabled meanwhile)."""
        ...

    def close(self, outputs: Sequence[RequestOutput | None], end: RequestEnd) -> None:
        """The request ended: ``outputs`` are the last output read from each submitted prompt
        (None where none arrived). Idempotent, never blocks, never raises."""
        ...


LOCAL_TENANT = "local"
"""The tenant name of a single-tenant server's callers (as the open-mode tenant is named)."""


class GatedCall(Protocol):
    """One authenticated caller, for the length of one HTTP request."""

    @property
    def tenant_name(self) -> str:
        """Who calls, for metrics and access logs (``local`` on a single-tenant server)."""
        ...

    async def resolve(self, model: str | None) -> ModelTarget:
        """The model ``model`` names for this caller; ``AdapterNotFoundError`` (404) otherwise."""
        ...

    async def models(self) -> list[ModelCard]:
        """Exactly the models this caller may name, the base model first."""
        ...

    async def admit(
        self, request_id: str, target: ModelTarget, prompts: PromptSource, params: SamplingParams
    ) -> Admission:
        """Count the request against the caller's quotas, or raise the refusal (429 / 503); the
        prompts are made (and tokenized) only after the request counts."""
        ...


class RequestGate(Protocol):
    """Opens a ``GatedCall`` for each request."""

    async def open(self, request: Request) -> GatedCall:
        """Authenticate the request's caller; raises the refusal (401) for a wrong or missing key."""
        ...


@dataclass(frozen=True)
class _OpenAdmission:
    """Admission without accounting: the single-tenant server."""

    prompts: list[PromptType]
    tenant_id: str | None = None
    tenant_weight: float = 1.0

    def bind(self, streams: Sequence[RequestStream]) -> None:
        return None

    def close(self, outputs: Sequence[RequestOutput | None], end: RequestEnd) -> None:
        return None


class StaticGate:
    """The single-tenant server's gate: everyone may use the base model and the named adapters."""

    def __init__(self, served_model_name: str, loras: Mapping[str, LoRARequest]) -> None:
        self.served_model_name = served_model_name
        self.loras = dict(loras)

    @property
    def tenant_name(self) -> str:
        return LOCAL_TENANT

    async def open(self, request: Request) -> StaticGate:
        return self

    async def resolve(self, model: str | None) -> ModelTarget:
        if model is None or model == self.served_model_name:
            return ModelTarget(self.served_model_name, None)
        lora = self.loras.get(model)
        if lora is None:
            raise AdapterNotFoundError.for_model(model)
        return ModelTarget(model, lora)

    async def models(self) -> list[ModelCard]:
        base = ModelCard(self.served_model_name, "loraplex", None)
        return [base, *(ModelCard(name, "loraplex", self.served_model_name) for name in sorted(self.loras))]

    async def admit(
        self, request_id: str, target: ModelTarget, prompts: PromptSource, params: SamplingParams
    ) -> Admission:
        return _OpenAdmission(await prompts_of(prompts))
