"""``Gateway.stats()``: the gateway's own counters (quotas backend, usage writes), on the event loop."""

from __future__ import annotations

from pathlib import Path

import pytest
from gateway_testlib import BASE as BASE_MODEL
from gateway_testlib import Admin, bearer, completion_body, make_gateway, serving, settings_for
from redis_starter import RedisProcess

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
