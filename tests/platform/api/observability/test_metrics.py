"""``GET /metrics`` after a mixed load: every family there, and the counts agree with the usage
records and the responses. The tiny engine, a real gateway (SQLite), a PEFT adapter uploaded."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.gateway import (
    ADMIN,
    BASE,
    Admin,
    bearer,
    completion_body,
    make_gateway,
    serving,
    settings_for,
    upload,
    zip_bytes,
)

from loraplex.platform.api.state import app_state
from loraplex.platform.engine.async_engine import AsyncEngine

FAMILIES = (
    "loraplex_time_to_first_token_seconds",
    "loraplex_inter_token_latency_seconds",
    "loraplex_e2e_request_latency_seconds",
    "loraplex_num_requests_running",
    "loraplex_num_requests_waiting",
    "loraplex_kv_blocks_used",
    "loraplex_device_pool_blocks",
    "loraplex_kv_blocks_total",
    "loraplex_kv_window_freed_blocks",
    "loraplex_prefix_cache_queries",
    "loraplex_prefix_cache_hits",
    "loraplex_adapters_resident",
    "loraplex_adapter_loads",
    "loraplex_adapter_evictions",
    "loraplex_adapter_pool_bytes",
    "loraplex_adapter_pages_used",
    "loraplex_requests",
    "loraplex_prompt_tokens",
    "loraplex_generation_tokens",
    "loraplex_rejected_requests",
    "loraplex_kv_tier_hits",
    "loraplex_kv_tier_promotions",
    "loraplex_kv_tier_io_errors",
    "loraplex_kv_tier_checksum_failures",
)
"""Family names as the parser reports them (counters without ``_total``)."""

LONG_PROMPT = [(11 * i) % 90 + 3 for i in range(40)]  # two full blocks and 8 tokens


def scrape(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """family -> {sorted labels (+ sample suffix) -> value}."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        samples = out.setdefault(family.name, {})
        for s in family.samples:
            main = s.name in (family.name, f"{family.name}_total")
            labels = tuple(sorted(s.labels.items())) + ((("sample", s.name),) if not main else ())
            samples[labels] = s.value
    return out


def value(metrics: dict[str, Any], family: str, sample: str | None = None, **labels: str) -> float:
    key = tuple(sorted(labels.items())) + ((("sample", sample),) if sample else ())
    return float(metrics[family].get(key, 0.0))


async def sse_lines(client: httpx.AsyncClient, body: dict[str, Any], key: str) -> list[str]:
    async with client.stream("POST", "/v1/completions", json=body, headers=bearer(key)) as r:
        assert r.status_code == 200
        return [line async for line in r.aiter_lines() if line.startswith("data: ")]


@pytest.mark.asyncio
async def test_metrics_after_a_mixed_load_agree_with_usage_and_responses(
    gateway_engine: AsyncEngine, peft_adapter_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="loraplex.access")
    app = make_gateway(gateway_engine, settings_for(tmp_path, f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"))
    state = app_state(app)
    gateway = state.gateway
    assert gateway is not None
    before = scrape(await _raw_metrics(app))
    async with serving(app) as client:
        admin = Admin(client)
        acme = await admin.tenant_with_key("acme")
        beta = await admin.tenant_with_key("beta", rpm=2)
        up = await upload(client, acme, "fr", zip_bytes(peft_adapter_dir))
        assert up.status_code == 201, up.text

        answers: list[tuple[str, int, dict[str, Any] | None]] = []  # tenant, status, usage

        async def call(tenant: str, key: str, body: dict[str, Any]) -> httpx.Response:
            r = await client.post("/v1/completions", json=body, headers=bearer(key))
            answers.append((tenant, r.status_code, r.json().get("usage")))
            return r

        # acme: the base model twice on the same long prompt (the second hits the prefix cache)
        first = await call("acme", acme, completion_body(BASE, prompt=LONG_PROMPT))
        second = await call("acme", acme, completion_body(BASE, prompt=LONG_PROMPT))
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32, second.text
        assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # acme: its adapter, streamed with usage
        lines = await sse_lines(
            client,
            completion_body("fr", stream=True, stream_options={"include_usage": True}, max_tokens=6),
            acme,
        )
        stream_usage = json.loads(lines[-2][6:])["usage"]
        answers.append(("acme", 200, stream_usage))
        # acme: an invalid request (400)
        assert (await call("acme", acme, completion_body(BASE, max_tokens=0))).status_code == 400
        # beta: rpm=2, the third is refused (429)
        for _ in range(2):
            assert (await call("beta", beta, completion_body(BASE))).status_code == 200
        refused = await call("beta", beta, completion_body(BASE))
        assert refused.status_code == 429 and "Retry-After" in refused.headers
        # a wrong key (401), and a request while the server drains (503)
        assert (await call("unknown", "sk-wrong", completion_body(BASE))).status_code == 401
        state.lifecycle.begin_drain()
        # refused before the key is read: counted under tenant "unknown"
        assert (await call("unknown", acme, completion_body(BASE))).status_code == 503
        assert (await client.get("/ready")).status_code == 503
        state.lifecycle.draining = False

        await gateway.background.drain(10)  # usage records are written in the background
        assert await gateway.usage.written(10)  # then by the usage buffer's writer
        assert (await client.get("/metrics")).status_code == 401  # keys mode: the admin's, by default
        r = await client.get("/metrics", headers=ADMIN)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        metrics = scrape(r.text)
        usage_by_tenant = {}
        for tenant in ("acme", "beta"):
            report = await client.get(f"/admin/api/usage?tenant={tenant}", headers=ADMIN)
            assert report.status_code == 200, report.text
            usage_by_tenant[tenant] = report.json()

    for family in FAMILIES:
        assert family in metrics, f"{family} missing from /metrics"
    # the database's families (issue 28): up, every key check after the first from the cache
    assert value(metrics, "loraplex_database_up") == 1
    assert value(metrics, "loraplex_auth_cache_hits", kind="fresh") > 0
    assert value(metrics, "loraplex_auth_cache_hits", kind="outage") == 0
    assert value(metrics, "loraplex_quota_refusals") == 1

    # requests per tenant and status = the responses
    statuses: dict[tuple[str, int], int] = {}
    for tenant, status, _ in answers:
        statuses[tenant, status] = statuses.get((tenant, status), 0) + 1
    for (tenant, status), count in statuses.items():
        assert value(metrics, "loraplex_requests", tenant=tenant, status=str(status)) == count, (
            tenant,
            status,
        )
    assert sum(
        metrics["loraplex_requests"][k] for k in metrics["loraplex_requests"] if "sample" not in dict(k)
    ) == len(answers)

    # tokens per tenant = the usage records = the responses' usage
    for tenant in ("acme", "beta"):
        report = usage_by_tenant[tenant]
        from_responses = [u for t, s, u in answers if t == tenant and s == 200 and u is not None]
        assert value(metrics, "loraplex_prompt_tokens", tenant=tenant) == report["prompt_tokens"]
        assert report["prompt_tokens"] == sum(u["prompt_tokens"] for u in from_responses)
        assert value(metrics, "loraplex_generation_tokens", tenant=tenant) == report["completion_tokens"]
        assert report["completion_tokens"] == sum(u["completion_tokens"] for u in from_responses)
        assert value(metrics, "loraplex_cached_prompt_tokens", tenant=tenant) == report["cached_tokens"]
    assert usage_by_tenant["acme"]["cached_tokens"] == 32

    # rejections per reason = the refusals
    reasons = {"rate_limit": 1, "invalid": 1, "unauthorized": 1, "shutting_down": 1, "token_limit": 0}
    for reason, count in reasons.items():
        assert value(metrics, "loraplex_rejected_requests", reason=reason) == count, reason

    # latency histograms: one TTFT and one e2e per request that ran (6), ITL per later token
    ran = sum(1 for _, s, u in answers if s == 200)
    assert (
        value(metrics, "loraplex_time_to_first_token_seconds", "loraplex_time_to_first_token_seconds_count")
        == ran
    )
    assert (
        value(metrics, "loraplex_e2e_request_latency_seconds", "loraplex_e2e_request_latency_seconds_count")
        == ran
    )
    later_tokens = sum(u["completion_tokens"] - 1 for _, s, u in answers if s == 200 and u is not None)
    assert (
        value(metrics, "loraplex_inter_token_latency_seconds", "loraplex_inter_token_latency_seconds_count")
        == later_tokens
    )

    # engine snapshots: the pool, the cache hit, the adapter in a slot
    assert value(metrics, "loraplex_kv_blocks_total", tier="device") == 128
    assert value(metrics, "loraplex_kv_blocks_total", tier="disk") == 0
    hits = value(metrics, "loraplex_prefix_cache_hits", tier="device")
    assert hits - value(before, "loraplex_prefix_cache_hits", tier="device") >= 32
    assert value(metrics, "loraplex_prefix_cache_queries") > value(before, "loraplex_prefix_cache_queries")
    assert value(metrics, "loraplex_adapters_resident", tier="device") >= 1
    assert value(metrics, "loraplex_adapter_pool_bytes", kind="used") > 0
    # one device pool: the adapter's pages sit in blocks lent from it, beside KV and free ones
    lent = value(metrics, "loraplex_device_pool_blocks", holder="adapters")
    assert lent > 0
    assert value(metrics, "loraplex_adapter_pool_bytes", kind="allocated") >= value(
        metrics, "loraplex_adapter_pool_bytes", kind="used"
    )
    assert (
        lent
        + value(metrics, "loraplex_device_pool_blocks", holder="kv")
        + value(metrics, "loraplex_device_pool_blocks", holder="free")
        == 128
    )
    assert value(metrics, "loraplex_adapter_pages_used", group="qkv") >= 1
    assert value(metrics, "loraplex_adapter_loads") >= 1
    assert value(metrics, "loraplex_quota_backend_up", backend="local") == 1

    # the access log: one JSON line per request, no prompt text
    entries = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "loraplex.access"]
    completions = [e for e in entries if e["path"] == "/v1/completions"]
    assert len(completions) == len(answers)
    streamed = [e for e in completions if e["stream"]]
    assert len(streamed) == 1 and streamed[0]["adapter"] == "fr" and streamed[0]["tenant"] == "acme"
    assert streamed[0]["generated_tokens"] == 6 and streamed[0]["ttft_s"] > 0
    assert sorted(e["status"] for e in completions) == sorted(s for _, s, _ in answers)
    assert all("prompts" not in e for e in entries)
    assert any(e["cached_tokens"] == 32 for e in completions)


async def _raw_metrics(app: Any) -> str:
    return app_state(app).metrics.render().decode()


@pytest.mark.asyncio
async def test_metrics_without_the_tenant_label_and_behind_the_admin_token(
    gateway_engine: AsyncEngine, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="loraplex.access")
    settings = settings_for(
        tmp_path,
        f"sqlite+aiosqlite:///{tmp_path / 'g.db'}",
        metrics_require_admin=True,
        metrics_tenant_label=False,
        access_log_prompts=True,
        max_request_body_bytes=2048,
    )
    async with serving(make_gateway(gateway_engine, settings)) as client:
        key = await Admin(client).tenant_with_key("acme")
        r = await client.post("/v1/completions", json=completion_body(BASE), headers=bearer(key))
        assert r.status_code == 200, r.text
        too_large = completion_body(BASE, prompt="x" * 4000)  # refused by the body-size middleware
        assert (await client.post("/v1/completions", json=too_large, headers=bearer(key))).status_code == 413
        assert (await client.get("/metrics")).status_code == 401
        scraped = await client.get("/metrics", headers=ADMIN)
        assert scraped.status_code == 200
    metrics = scrape(scraped.text)
    assert value(metrics, "loraplex_requests", status="200") == 1
    assert value(metrics, "loraplex_requests", status="413") == 1
    assert value(metrics, "loraplex_rejected_requests", reason="invalid") == 1
    assert value(metrics, "loraplex_prompt_tokens") == 3
    entry = next(
        json.loads(r.getMessage())
        for r in caplog.records
        if r.name == "loraplex.access" and "v1/c" in r.getMessage()
    )
    assert entry["prompts"] == [[5, 6, 7]]


@pytest.mark.asyncio
async def test_per_tenant_series_are_bounded_and_leave_with_their_tenant(
    gateway_engine: AsyncEngine, tmp_path: Path
) -> None:
    """Issue 43 (6): at most ``metrics_max_tenants`` tenants get series of their own, the rest count
    under tenant="(other)"; deleting a tenant removes its series and frees its place."""
    settings = settings_for(tmp_path, f"sqlite+aiosqlite:///{tmp_path / 'g.db'}", metrics_max_tenants=2)
    async with serving(make_gateway(gateway_engine, settings)) as client:
        admin = Admin(client)
        keys = {name: await admin.tenant_with_key(name) for name in ("t1", "t2", "t3", "t4")}

        async def call(name: str) -> None:
            r = await client.post("/v1/completions", json=completion_body(BASE), headers=bearer(keys[name]))
            assert r.status_code == 200, r.text

        async def scraped() -> dict[str, Any]:
            r = await client.get("/metrics", headers=ADMIN)
            assert r.status_code == 200
            return scrape(r.text)

        for name in ("t1", "t2", "t3", "t4"):
            await call(name)
        metrics = await scraped()
        tenants = {dict(labels).get("tenant") for labels in metrics["loraplex_requests"]}
        assert tenants == {"t1", "t2", "(other)"}, tenants
        assert value(metrics, "loraplex_requests", tenant="(other)", status="200") == 2
        assert value(metrics, "loraplex_generation_tokens", tenant="(other)") > 0

        assert (await client.delete("/admin/api/tenants/t1", headers=ADMIN)).status_code in (200, 204)
        metrics = await scraped()
        for family in ("loraplex_requests", "loraplex_prompt_tokens", "loraplex_generation_tokens"):
            assert all(dict(labels).get("tenant") != "t1" for labels in metrics[family]), family
        await call("t4")  # t1's place is free: the next tenant seen takes it
        metrics = await scraped()
        assert value(metrics, "loraplex_requests", tenant="t4", status="200") == 1
        assert value(metrics, "loraplex_requests", tenant="(other)", status="200") == 2
