"""``Gateway.stats()``: the gateway's own counters (quotas backend, usage writes), on the event loop."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.gateway import BASE as BASE_MODEL
from support.gateway import Admin, bearer, completion_body, make_gateway, serving, settings_for
from support.redis import RedisProcess

from loraplex.platform.api.state import app_state
from loraplex.platform.engine.async_engine import AsyncEngine


@pytest.mark.asyncio
async def test_gateway_stats_follow_the_quota_backend(
    gateway_engine: AsyncEngine, tmp_path: Path, redis_process: RedisProcess
) -> None:
    database = f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"
    local = make_gateway(gateway_engine, settings_for(tmp_path / "local", database))
    gateway = app_state(local).gateway
    assert gateway is not None
    stats = gateway.stats()
    assert (stats.quota_backend, stats.quota_backend_down, stats.num_usage_write_failures) == (
        "local",
        False,
        0,
    )

    app = make_gateway(
        gateway_engine, settings_for(tmp_path / "redis", database, redis_url=redis_process.url)
    )
    gateway = app_state(app).gateway
    assert gateway is not None
    async with serving(app) as client:
        key = await Admin(client).tenant_with_key("acme", rpm=100)
        ok = await client.post("/v1/completions", json=completion_body(BASE_MODEL), headers=bearer(key))
        assert ok.status_code == 200, ok.text
        assert gateway.stats().quota_backend == "redis" and not gateway.stats().quota_backend_down
        redis_process.kill()
        down = await client.post("/v1/completions", json=completion_body(BASE_MODEL), headers=bearer(key))
        assert down.status_code == 503, down.text  # fail_closed, the default
        stats = gateway.stats()
        assert stats.quota_backend_down and stats.num_quota_backend_outages == 1
        assert stats.num_quota_backend_failures >= 1


def test_recent_latencies_percentiles_and_window() -> None:
    from loraplex.platform.api.tenancy.latencies import RecentLatencies, time_to_first_token
    from loraplex.platform.engine.outputs import RequestOutput

    recent = RecentLatencies(max_items=100, window_s=60)
    assert recent.percentiles((0.5, 0.99)) is None
    for ms in range(1, 101):
        recent.add(ms / 1000)
    assert recent.percentiles((0.5, 0.99)) == [0.05, 0.099]
    recent.add(5.0)  # the oldest (1 ms) falls out by count
    assert recent.percentiles((0.0, 1.0)) == [0.002, 5.0]
    aged = RecentLatencies(window_s=0.001)
    aged.add(1.0)
    time.sleep(0.01)
    assert aged.percentiles((0.5,)) is None  # older than the window

    def out(**metrics: float) -> RequestOutput:
        return RequestOutput(
            request_id="r", prompt=None, prompt_token_ids=[1], outputs=[], finished=True, metrics=metrics
        )

    assert time_to_first_token([out(arrival_time=10.0, first_token_time=10.25), None]) == 0.25
    assert time_to_first_token([out(arrival_time=10.0), None]) is None
