"""``TenantGate``: the gateway's ``RequestGate`` (see ``gating``): keys, per-tenant models, quotas, usage.

    open(request)    the API key's tenant (401 otherwise; ``local`` with auth="open")
    resolve(model)   base model | own adapter ``name`` | another tenant's public ``owner/name``;
                     a private adapter of another tenant and a missing name: the same 404
    admit(...)       text prompts tokenized and counted; reserve prompt + max_tokens * n per
                     prompt (max_tokens unset: up to the context); 429 / 503 when refused
    close(...)       settle with the tokens really used, write the usage record (background)

The engine's tenant (the prefix cache salts with it) is derived here, from the tenant's id,
name and creation time, so a client can never choose it and a tenant re-created under an old
name never shares cached blocks with its predecessor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from starlette.requests import Request

from loraplex.platform.api.background import BackgroundWork
from loraplex.platform.api.catalog.engine_adapters import EngineAdapters
from loraplex.platform.api.errors import quota_refusal
from loraplex.platform.api.openai.protocol import Prompt
from loraplex.platform.api.services import adapters, usage
from loraplex.platform.api.services.errors import NotFound
from loraplex.platform.api.services.tenants import engine_tenant_id
from loraplex.platform.api.tenancy.auth import authenticate_tenant
from loraplex.platform.api.tenancy.gate import Admission, ModelCard, ModelTarget, RequestEnd
from loraplex.platform.api.tenancy.quotas import Quota, QuotaLimiter, Reservation
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.errors import InvalidParameterError, UnknownAdapterError
from loraplex.platform.engine.outputs import RequestOutput
from loraplex.platform.engine.sampling_params import SamplingParams
from loraplex.platform.settings import AuthMode
from loraplex.storage.db import Database, Tenant, UsageStatus

logger = logging.getLogger(__name__)


def tokens_used(outputs: Sequence[RequestOutput | None]) -> tuple[int, int, int]:
    """(prompt, cached, completion) tokens of the last output of each prompt (None: nothing ran)."""
    prompt = cached = completion = 0
    for out in outputs:
        if out is None:
            continue
        prompt += len(out.prompt_token_ids)
        cached += min(out.num_cached_tokens, len(out.prompt_token_ids))
        completion += sum(len(c.token_ids) for c in out.outputs)
    return prompt, cached, completion


@dataclass
class TenantAdmission:
    """One admitted request of a tenant: its reservation until ``close``."""

    gate: TenantGate
    tenant: Tenant
    target: ModelTarget
    request_id: str
    prompts: list[Prompt]
    reservation: Reservation
    started_s: float = field(default_factory=time.monotonic)
    closed: bool = False

    @property
    def tenant_id(self) -> str:
        return engine_tenant_id(self.tenant)

    def close(self, outputs: Sequence[RequestOutput | None], end: RequestEnd) -> None:
        if self.closed:
            return
        self.closed = True
        latency_ms = (time.monotonic() - self.started_s) * 1000.0
        self.gate.background.spawn(self._settle(list(outputs), end, latency_ms), f"settle {self.request_id}")

    async def _settle(self, outputs: list[RequestOutput | None], end: RequestEnd, latency_ms: float) -> None:
        prompt, cached, completion = tokens_used(outputs)
        await self.gate.limiter.settle(self.reservation, prompt + completion)
        await self.gate.record(
            self.tenant, self.target, self.request_id, (prompt, cached, completion), latency_ms, end
        )


class TenantCall:
    """One request of one tenant (``GatedCall``)."""

    def __init__(self, gate: TenantGate, tenant: Tenant) -> None:
        self.gate = gate
        self.tenant = tenant

    @property
    def tenant_name(self) -> str:
        return self.tenant.name

    async def resolve(self, model: str | None) -> ModelTarget:
        gate = self.gate
        if model is None or model == gate.served_model_name:
            return ModelTarget(gate.served_model_name, None)
        try:
            async with gate.db.transaction() as session:
                adapter = await adapters.resolve_adapter(session, self.tenant, model)
        except NotFound:
            raise UnknownAdapterError(model) from None
        lora = await gate.engine_adapters.ensure(adapter)
        return ModelTarget(model, lora, adapter.version)

    async def models(self) -> list[ModelCard]:
        gate = self.gate
        async with gate.db.transaction() as session:
            visible = await adapters.list_visible(session, self.tenant)
        cards = [ModelCard(gate.served_model_name, "loraplex", None)]
        cards += [
            ModelCard(adapters.model_name(self.tenant, a), a.owner.name, gate.served_model_name)
            for a in visible
        ]
        return cards

    async def admit(
        self, request_id: str, target: ModelTarget, prompts: list[Prompt], params: SamplingParams
    ) -> Admission:
        gate = self.gate
        token_prompts = [await gate.tokenize(p) for p in prompts]
        max_len = gate.engine.limits.max_model_len
        reserve = sum(
            len(p)
            + params.n * (params.max_tokens if params.max_tokens is not None else max(0, max_len - len(p)))
            for p in token_prompts
        )
        quota = Quota(rpm=self.tenant.rpm, tpm=self.tenant.tpm, max_concurrency=self.tenant.max_concurrency)
        decision = await gate.limiter.admit(self.tenant.name, quota, reserve, request_id)
        if not decision.allowed or decision.reservation is None:
            gate.background.spawn(
                gate.record(self.tenant, target, request_id, (0, 0, 0), 0.0, "rejected"),
                f"usage {request_id}",
            )
            raise quota_refusal(decision)
        prompts_out: list[Prompt] = list(token_prompts)
        return TenantAdmission(gate, self.tenant, target, request_id, prompts_out, decision.reservation)


class TenantGate:
    """Authenticates API keys and runs each tenant's requests under its adapters and quotas."""

    def __init__(
        self,
        db: Database,
        auth: AuthMode,
        limiter: QuotaLimiter,
        engine: AsyncEngine,
        engine_adapters: EngineAdapters,
        served_model_name: str,
        background: BackgroundWork,
    ) -> None:
        self.db = db
        self.auth = auth
        self.limiter = limiter
        self.engine = engine
        self.engine_adapters = engine_adapters
        self.served_model_name = served_model_name
        self.background = background
        self.num_usage_write_failures = 0

    async def open(self, request: Request) -> TenantCall:
        return TenantCall(self, await authenticate_tenant(self.db, self.auth, request))

    async def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, counted the way the engine will (text: off the event loop)."""
        if not isinstance(prompt, str):
            return prompt
        if not prompt:
            raise InvalidParameterError("prompt must not be empty", param="prompt")
        return await self.engine.tokenize(prompt)

    async def record(
        self,
        tenant: Tenant,
        target: ModelTarget,
        request_id: str,
        tokens: tuple[int, int, int],
        latency_ms: float,
        status: UsageStatus,
    ) -> None:
        """Write one usage record; a failure is logged and counted, never raised to a client."""
        prompt, cached, completion = tokens
        record = usage.Usage(
            request_id=request_id[:128],
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=completion,
            latency_ms=latency_ms,
            status=status,
            adapter_name=None if target.lora is None else target.model,
            adapter_version=target.adapter_version,
        )
        try:
            async with self.db.transaction() as session:
                await usage.record_usage(session, tenant, record)
        except Exception:
            self.num_usage_write_failures += 1
            logger.exception("could not record the usage of request %s", request_id)
