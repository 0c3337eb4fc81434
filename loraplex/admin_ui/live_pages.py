"""The dashboard and its numbers, usage records, and the playground.

| route | does |
|---|---|
| ``GET /admin/dashboard`` | the page; its script polls ``/admin/ui/stats`` every 2 s |
| ``GET /admin/ui/stats`` | JSON of ``AsyncEngine.stats`` and ``Gateway.stats()`` (a tenant: its own only) |
| ``GET /admin/usage`` | totals and a page of usage records, newest first |
| ``GET /admin/playground`` | the prompt form |
| ``POST /admin/ui/completions[?tenant=]`` | ``/v1/completions`` as the tenant signed in (or picked) |

The stats are the same snapshots ``/metrics`` reads: the engine's after its last step, the
gateway's on the event loop; counters are cumulative, so the page derives rates from two polls.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from starlette.responses import JSONResponse, Response

from loraplex.admin_ui.adapter_pages import owner_for
from loraplex.admin_ui.security import Viewer, ViewerDep, check_csrf, gateway_of, ui_state
from loraplex.admin_ui.views import SECURITY_HEADERS, render
from loraplex.platform.api.deps import PageDep, get_state
from loraplex.platform.api.openai.completion import complete
from loraplex.platform.api.services import adapters, tenants, usage
from loraplex.platform.api.services.pages import PageRequest
from loraplex.platform.api.services.tenants import engine_tenant_id
from loraplex.platform.api.tenancy.tenant_gate import TenantCall
from loraplex.platform.engine.stats import EngineStats, TenantUsage
from loraplex.storage.db.models import USAGE_STATUSES, UsageStatus, utcnow

router = APIRouter(prefix="/admin", include_in_schema=False)

CHART_WINDOW = timedelta(hours=1)
CHART_TTL_S = 10.0
"""The tokens-per-tenant chart is read from the usage records at most this often (seconds)."""


@router.get("/dashboard")
async def dashboard(request: Request, viewer: ViewerDep) -> Response:
    return render(request, "dashboard.html", viewer)


def _tier(name: str, used: int, total: int, hits: int, lookups: int) -> dict[str, Any]:
    return {
        "tier": name,
        "used_blocks": used,
        "total_blocks": total,
        "hit_rate": None if lookups == 0 else hits / lookups,
    }


def _engine_numbers(stats: EngineStats) -> dict[str, Any]:
    kv = stats.kv
    tiers = [
        _tier(
            "accelerator",
            kv.num_used_device_blocks,
            kv.num_device_blocks,
            stats.prefix_cache.num_hit_blocks,
            stats.prefix_cache.num_hit_blocks + stats.prefix_cache.num_miss_blocks,
        )
    ]
    capacity = {
        "host": (kv.num_used_host_blocks, kv.num_host_blocks),
        "disk": (kv.num_used_disk_blocks, kv.num_disk_blocks),
    }
    for tier in stats.tiers:
        used, total = capacity.get(tier.tier, (tier.used_blocks, tier.capacity_blocks))
        tiers.append(_tier(tier.tier, used, total, tier.hits, tier.hits + tier.misses))
    a = stats.adapters
    resident = (
        None
        if a is None
        else [
            {"tier": "accelerator", "adapters": a.num_on_device, "capacity": a.max_loras},
            {"tier": "host", "adapters": a.num_in_host, "capacity": a.host_capacity},
            {"tier": "store", "adapters": a.num_registered, "capacity": None},
        ]
    )
    return {
        "step": stats.step,
        "running": stats.num_running,
        "waiting": stats.num_waiting,
        "preemptions": stats.num_preemptions,
        "kv_tiers": tiers,
        "adapters": resident,
    }


def _usage_numbers(usages: dict[str, TenantUsage]) -> dict[str, Any]:
    return {
        name: {
            "requests": u.num_requests,
            "prompt_tokens": u.prompt_tokens,
            "generated_tokens": u.generated_tokens,
            "failed": u.num_failed,
        }
        for name, u in sorted(usages.items())
    }


def _by_name(engine_tenants: dict[str, TenantUsage]) -> dict[str, TenantUsage]:
    """Engine tenant ids (``id:name:created``) to names; a name used twice (deleted, created
    again) sums its two ids' counters."""
    named: dict[str, TenantUsage] = {}
    for engine_id, u in engine_tenants.items():
        parts = engine_id.split(":")
        name = parts[1] if len(parts) == 3 else (engine_id or "(none)")
        before = named.get(name, TenantUsage())
        named[name] = TenantUsage(
            before.num_requests + u.num_requests,
            before.prompt_tokens + u.prompt_tokens,
            before.cached_tokens + u.cached_tokens,
            before.generated_tokens + u.generated_tokens,
            before.num_finished + u.num_finished,
            before.num_failed + u.num_failed,
        )
    return named


async def _tokens_last_hour(request: Request, viewer: Viewer) -> dict[str, int]:
    cache = ui_state(request).chart_cache
    key = None if viewer.tenant is None else viewer.tenant.id
    now = time.monotonic()
    cached = cache.get(key)
    if cached is not None and cached[0] > now:
        return cached[1]
    async with gateway_of(request).db.transaction() as session:
        totals = await usage.tokens_by_tenant(session, utcnow() - CHART_WINDOW, viewer.tenant)
    if len(cache) > 10_000:  # one entry per tenant that looked: bounded all the same
        cache.clear()
    cache[key] = (now + CHART_TTL_S, totals)
    return totals


@router.get("/ui/stats")
async def stats(request: Request, viewer: ViewerDep) -> JSONResponse:
    """The dashboard's numbers now; a tenant sees only its own requests and tokens."""
    gateway = gateway_of(request)
    engine_stats = gateway.engine.stats
    last_hour = await _tokens_last_hour(request, viewer)
    if viewer.tenant is not None:
        own = engine_stats.tenants.get(engine_tenant_id(viewer.tenant))
        body: dict[str, Any] = {
            "timestamp": engine_stats.timestamp,
            "tenants": _usage_numbers({} if own is None else {viewer.tenant.name: own}),
            "tokens_last_hour": last_hour,
        }
    else:
        g = gateway.stats()
        ttft = gateway.gate.ttft.percentiles((0.5, 0.99))
        body = {
            "ttft_ms": None if ttft is None else {"p50": ttft[0] * 1000, "p99": ttft[1] * 1000},
            "timestamp": engine_stats.timestamp,
            "engine": _engine_numbers(engine_stats),
            "tenants": _usage_numbers(_by_name(dict(engine_stats.tenants))),
            "tokens_last_hour": last_hour,
            "gateway": {
                "quota_backend": g.quota_backend,
                "quota_backend_down": g.quota_backend_down,
                "database_down": g.database_down,
                "usage_write_failures": g.num_usage_write_failures,
                "usage_pending": g.num_usage_pending,
            },
        }
    return JSONResponse(body, headers={"Cache-Control": "no-store"})


@router.get("/usage")
async def usage_page(
    request: Request,
    viewer: ViewerDep,
    page: PageDep,
    tenant: Annotated[str | None, Query(max_length=64)] = None,
    status: UsageStatus | None = None,
) -> Response:
    owner = await owner_for(request, viewer, tenant)
    where = usage.UsageFilter(tenant=owner, status=status)
    async with gateway_of(request).db.transaction() as session:
        totals = await usage.usage_totals(session, where)
        found = await usage.page_usage(session, where, page)
    return render(
        request,
        "usage.html",
        viewer,
        totals=totals,
        found=found,
        tenant=tenant or "",
        status_filter=status or "",
        statuses=USAGE_STATUSES,
        limit=page.limit,
    )


@router.get("/playground")
async def playground(
    request: Request, viewer: ViewerDep, tenant: Annotated[str | None, Query(max_length=64)] = None
) -> Response:
    gateway = gateway_of(request)
    owner = await owner_for(request, viewer, tenant)
    async with gateway.db.transaction() as session:
        if owner is None:  # the operator, before choosing: the first tenants to choose from
            choices = (await tenants.page_tenants(session, PageRequest(limit=100))).items
            models: list[str] = []
        else:
            choices = []
            # Its own adapters, the first page of them; another tenant's public one is typed in.
            own = await adapters.page_newest(session, owner, PageRequest(limit=100))
            models = [a.name for a in own.items]
    return render(
        request,
        "playground.html",
        viewer,
        owner=owner,
        choices=choices,
        base_model=gateway.catalog.base_model,
        models=models,
    )


@router.post("/ui/completions", response_model=None)
async def playground_completion(
    request: Request, viewer: ViewerDep, tenant: Annotated[str | None, Query(max_length=64)] = None
) -> Response:
    """``/v1/completions`` run for the signed-in party: the same route, quotas and usage."""
    check_csrf(request, viewer)
    owner = await owner_for(request, viewer, tenant)
    if owner is None:
        return JSONResponse(
            {"error": {"message": "Choose the tenant to run as.", "param": "tenant"}},
            status_code=400,
            headers=SECURITY_HEADERS,
        )
    gateway = gateway_of(request)
    return await complete(request, get_state(request), TenantCall(gateway.gate, owner))
