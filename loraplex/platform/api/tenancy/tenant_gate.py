"""``TenantGate``: the gateway's ``RequestGate`` (see ``gating``): keys, per-tenant models, quotas, usage.

    open(request)    the API key's tenant (401 otherwise; ``local`` with auth="open"), through
                     the ``Authenticator``'s cache (503 when the database cannot tell)
    resolve(model)   base model | own adapter ``name`` | another tenant's public ``owner/name``;
                     a private adapter of another tenant and a missing name: the same 404;
                     while the database is unreachable, the last answer for it (``TTLCache``)
    admit(...)       first the request and its concurrency slots (rpm; max_concurrency counts
                     sequences: n per prompt, so n cannot multiply what a tenant runs), and the
                     per-tenant sequences cap of this process, before any CPU work; then the
                     prompts made, tokenized and reserved (tpm: prompt + max_tokens * n per
                     prompt, max_tokens unset: up to the context); 429 / 503
                     when refused, counted in ``num_quota_refusals`` (no usage row: a refusal
                     must cost nothing but the count)
    close(...)       queue the usage record (``UsageBuffer``: an outage delays it), then settle
                     the reservations with the tokens really used

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

from loraplex.adapters import AdapterNotFoundError
from loraplex.platform.api.background import BackgroundWork
from loraplex.platform.api.catalog.engine_adapters import EngineAdapters
from loraplex.platform.api.errors import APIError
from loraplex.platform.api.services import adapters, usage
from loraplex.platform.api.services.tenants import engine_tenant_id
from loraplex.platform.api.tenancy.auth_cache import Authenticator, TTLCache
from loraplex.platform.api.tenancy.gate import (
    Admission,
    ModelCard,
    ModelTarget,
    PromptSource,
    RequestEnd,
    prompts_of,
)
from loraplex.platform.api.tenancy.latencies import RecentLatencies, time_to_first_token
from loraplex.platform.api.tenancy.quotas import Quota, QuotaDecision, QuotaLimiter, Reservation
from loraplex.platform.api.tenancy.quotas.refusal import quota_refusal
from loraplex.platform.api.usage_buffer import UsageBuffer
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.errors import InvalidParameterError
from loraplex.platform.engine.inputs import PromptType
from loraplex.platform.engine.outputs import RequestOutput
from loraplex.platform.engine.request_stream import RequestStream
from loraplex.platform.engine.sampling_params import SamplingParams
from loraplex.platform.settings import AuthMode
from loraplex.storage.db import Adapter, Database, DatabaseUnavailable, Tenant, UsageStatus

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


@dataclass(eq=False)  # identity: admissions live in sets (``TenantGate.running``)
class TenantAdmission:
    """One admitted request of a tenant: its reservation until ``close``."""

    gate: TenantGate
    tenant: Tenant
    target: ModelTarget
    request_id: str
    prompts: list[PromptType]
    reservation: Reservation
    """The token reservation (tpm)."""
    slot: Reservation | None
    """The request and its concurrency slot (rpm, max_concurrency), taken before tokenizing."""
    extra_slots: list[Reservation] = field(default_factory=list)
    """One more concurrency slot per sequence past the first (n per prompt)."""
    num_sequences: int = 1
    started_s: float = field(default_factory=time.monotonic)
    closed: bool = False
    streams: list[RequestStream] = field(default_factory=list)
    tenant_gone: bool = False
    """Its tenant was deleted while it ran: nothing to write its usage to."""

    def bind(self, streams: Sequence[RequestStream]) -> None:
        self.streams = list(streams)

    @property
    def tenant_id(self) -> str:
        return engine_tenant_id(self.tenant)

    @property
    def tenant_weight(self) -> float:
        return self.tenant.weight

    def close(self, outputs: Sequence[RequestOutput | None], end: RequestEnd) -> None:
        if self.closed:
            return
        self.closed = True
        self.gate.forget(self)
        latency_ms = (time.monotonic() - self.started_s) * 1000.0
        ttft_s = time_to_first_token(outputs)
        if ttft_s is not None:
            self.gate.ttft.add(ttft_s)
        self.gate.background.spawn(self._settle(list(outputs), end, latency_ms), f"settle {self.request_id}")

    async def _settle(self, outputs: list[RequestOutput | None], end: RequestEnd, latency_ms: float) -> None:
        prompt, cached, completion = tokens_used(outputs)
        # Queued first: a failed settle (Redis down) must not lose the usage record. A tenant
        # deleted while this ran has nothing to write it to.
        if not self.tenant_gone:
            self.gate.record(
                self.tenant, self.target, self.request_id, (prompt, cached, completion), latency_ms, end
            )
        await self.gate.limiter.settle(self.reservation, prompt + completion)
        for slot in ([] if self.slot is None else [self.slot]) + self.extra_slots:
            await self.gate.limiter.settle(slot, 0)


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
        adapter = await gate.resolve_adapter(self.tenant, model)
        lora = await gate.engine_adapters.ensure(adapter)
        return ModelTarget(model, lora, adapter.version)

    async def models(self) -> list[ModelCard]:
        gate = self.gate
        async with gate.db.transaction() as session:
            visible = await adapters.list_visible(session, self.tenant)
        own = frozenset(a.name for a in visible if a.owner_id == self.tenant.id)
        cards = [ModelCard(gate.served_model_name, "loraplex", None)]
        cards += [
            ModelCard(
                adapters.model_name(self.tenant, a, gate.shared_tenant, own),
                a.owner.name,
                gate.served_model_name,
            )
            for a in visible
        ]
        return cards

    async def admit(
        self, request_id: str, target: ModelTarget, prompts: PromptSource, params: SamplingParams
    ) -> Admission:
        gate = self.gate
        tenant = self.tenant
        # Phase 1, before any CPU work: the request (rpm) and its concurrency slots, one per
        # sequence (a deferred source, a chat template, is one prompt).
        num_seqs = params.n * (len(prompts) if isinstance(prompts, list) else 1)
        gate.check_sequences(tenant, num_seqs)
        slot: Reservation | None = None
        extra: list[Reservation] = []
        gate.add_sequences(tenant.id, num_seqs)
        try:
            if tenant.rpm is not None or tenant.max_concurrency is not None:
                slot = await gate.take_slot(
                    tenant, Quota(rpm=tenant.rpm, max_concurrency=tenant.max_concurrency), request_id
                )
            if tenant.max_concurrency is not None:
                for i in range(1, num_seqs):
                    quota = Quota(max_concurrency=tenant.max_concurrency)
                    extra.append(await gate.take_slot(tenant, quota, f"{request_id}/{i}"))
        except BaseException:
            gate.add_sequences(tenant.id, -num_seqs)
            for taken in ([] if slot is None else [slot]) + extra:
                gate.background.spawn(gate.limiter.settle(taken, 0), f"release {request_id}")
            raise
        try:
            token_prompts = [await gate.tokenize(p) for p in await prompts_of(prompts)]
            max_len = gate.engine.limits.max_model_len
            reserve = sum(
                len(p)
                + params.n
                * (params.max_tokens if params.max_tokens is not None else max(0, max_len - len(p)))
                for p in token_prompts
            )
            # Phase 2: the tokens (tpm only: the request itself counted in phase 1).
            reservation = await gate.take_slot(tenant, Quota(tpm=tenant.tpm), request_id, reserve)
        except BaseException:
            gate.add_sequences(tenant.id, -num_seqs)
            for taken in ([] if slot is None else [slot]) + extra:
                gate.background.spawn(gate.limiter.settle(taken, 0), f"release {request_id}")
            raise
        prompts_out: list[PromptType] = list(token_prompts)
        admission = TenantAdmission(
            gate, tenant, target, request_id, prompts_out, reservation, slot, extra, num_seqs
        )
        gate.running.setdefault(tenant.id, set()).add(admission)
        return admission


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
        authenticator: Authenticator,
        usage_buffer: UsageBuffer,
        shared_tenant: str | None = None,
        max_sequences_per_tenant: int | None = None,
    ) -> None:
        self.db = db
        self.max_sequences_per_tenant = max_sequences_per_tenant
        self._sequences: dict[int, int] = {}
        """Sequences admitted and not closed yet, by tenant id (this process)."""
        self.auth = auth
        self.limiter = limiter
        self.engine = engine
        self.engine_adapters = engine_adapters
        self.served_model_name = served_model_name
        self.background = background
        self.authenticator = authenticator
        self.usage_buffer = usage_buffer
        self.shared_tenant = shared_tenant
        """The operator's tenant, whose public adapters answer to their bare name too."""
        self.resolutions: TTLCache[tuple[int, str], tuple[Adapter, int]] = TTLCache(authenticator.cache.size)
        """(tenant id, model) -> the adapter version it last resolved to, with the name's epoch then:
        an outage's fallback."""
        self._adapter_epochs: dict[tuple[str, str], int] = {}
        """(owner, name) -> bumped when the adapter changes (``drop_resolutions``)."""
        self._num_adapter_drops = 0
        self.num_resolution_outage_hits = 0
        self.num_quota_refusals = 0
        """Requests (and uploads) refused by a quota: counted here, never written one row each."""
        self.running: dict[int, set[TenantAdmission]] = {}
        """Admitted requests not closed yet, by tenant id (what ``revoke`` ends)."""
        self.ttft = RecentLatencies()
        """Time to first token of the latest requests (the admin dashboard's p50 / p99)."""

    @property
    def num_usage_write_failures(self) -> int:
        """Usage records the database refused (tenant deleted meanwhile); logged each."""
        return self.usage_buffer.num_failed

    async def open(self, request: Request) -> TenantCall:
        return TenantCall(self, await self.authenticator.tenant(request))

    async def resolve_adapter(self, tenant: Tenant, model: str) -> Adapter:
        """The adapter version ``model`` names for ``tenant``; ``AdapterNotFoundError`` (404) if none.

        Always from the database while it answers (an upload or a deletion takes effect at
        once); while it is unreachable, the last answer up to the auth cache's TTL + stale
        window old, so a tenant's adapters keep serving; else ``DatabaseUnavailable`` (503).
        """
        key = (tenant.id, model)
        drops = self._num_adapter_drops  # a change while the database answers: cached as stale
        try:
            async with self.db.transaction() as session:
                adapter = await adapters.resolve_adapter(session, tenant, model, self.shared_tenant)
        except AdapterNotFoundError:
            self.resolutions.discard(key)
            raise
        except DatabaseUnavailable:
            cached = self.resolutions.get(key, self.authenticator.ttl_s + self.authenticator.stale_s)
            if cached is None or cached[1] != self._epoch_of(cached[0]):
                raise
            self.num_resolution_outage_hits += 1
            return cached[0]
        epoch = self._epoch_of(adapter) if drops == self._num_adapter_drops else -1
        self.resolutions.put(key, (adapter, epoch))
        return adapter

    def drop_resolutions(self, owner: str, name: str) -> None:
        """Cached resolutions to ``owner``'s ``name`` are stale from now on (a new version, or gone)."""
        self._adapter_epochs[(owner, name)] = self._adapter_epochs.get((owner, name), 0) + 1
        self._num_adapter_drops += 1

    def _epoch_of(self, adapter: Adapter) -> int:
        return self._adapter_epochs.get((adapter.owner.name, adapter.name), 0)

    def check_sequences(self, tenant: Tenant, num_seqs: int) -> None:
        """Refuse (429) a request whose sequences can never fit the tenant's max_concurrency, or that
        would take the tenant past ``max_sequences_per_tenant`` in this process."""
        cap = tenant.max_concurrency
        if cap is not None and num_seqs > cap:
            self.num_quota_refusals += 1
            detail = (
                f"this request runs {num_seqs} sequences (n per prompt), over the concurrency limit of "
                f"{cap}: lower n"
            )
            raise quota_refusal(QuotaDecision.refused("concurrency", None, detail))
        limit = self.max_sequences_per_tenant
        in_flight = self._sequences.get(tenant.id, 0)
        if limit is not None and in_flight + num_seqs > limit:
            self.num_quota_refusals += 1
            detail = (
                f"sequence limit reached: {in_flight} in flight, this request adds {num_seqs} (limit {limit})"
            )
            raise quota_refusal(QuotaDecision.refused("concurrency", 1.0, detail))

    def add_sequences(self, tenant_id: int, delta: int) -> None:
        """Count ``delta`` more (or fewer) sequences in flight for ``tenant_id``."""
        left = self._sequences.get(tenant_id, 0) + delta
        if left > 0:
            self._sequences[tenant_id] = left
        else:
            self._sequences.pop(tenant_id, None)

    def forget(self, admission: TenantAdmission) -> None:
        """``admission`` has closed."""
        self.add_sequences(admission.tenant.id, -admission.num_sequences)
        live = self.running.get(admission.tenant.id)
        if live is not None:
            live.discard(admission)
            if not live:
                del self.running[admission.tenant.id]

    def revoke(self, tenant_id: int, deleted: bool) -> int:
        """End every running request of the tenant ``tenant_id`` (deleted or disabled): streams get
        an error event, whole answers an error; returns how many requests were ended."""
        what = "deleted" if deleted else "disabled"
        live = list(self.running.get(tenant_id, ()))
        for admission in live:
            admission.tenant_gone = admission.tenant_gone or deleted
            error = APIError(
                403, f"The tenant was {what} by an operator; this request was stopped.", code=f"tenant_{what}"
            )
            for stream in admission.streams:
                stream.fail(error)
        if live:
            logger.info("stopped %d running request(s) of a %s tenant (id %d)", len(live), what, tenant_id)
        return len(live)

    async def take_slot(self, tenant: Tenant, quota: Quota, request_id: str, reserve: int = 0) -> Reservation:
        """Admit ``request_id`` under ``quota`` (limits left None are not counted), or raise the
        refusal (429 / 503) and count it."""
        decision = await self.limiter.admit(tenant.name, quota, reserve, request_id)
        if not decision.allowed or decision.reservation is None:
            self.num_quota_refusals += 1
            raise quota_refusal(decision)
        return decision.reservation

    async def tokenize(self, prompt: PromptType) -> list[int]:
        """Token ids of a prompt, counted the way the engine will (text: off the event loop)."""
        if not isinstance(prompt, str):
            return prompt
        if not prompt:
            raise InvalidParameterError("prompt must not be empty", param="prompt")
        return await self.engine.tokenize(prompt)

    def record(
        self,
        tenant: Tenant,
        target: ModelTarget,
        request_id: str,
        tokens: tuple[int, int, int],
        latency_ms: float,
        status: UsageStatus,
    ) -> None:
        """Queue one usage record for the database (``UsageBuffer``); never waits, never raises."""
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
        self.usage_buffer.add(tenant, record)
