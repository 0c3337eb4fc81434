"""``GET /ready``: 200 only when the engine serves, the database answers at the migrations' head,
and quotas can be checked (per the failure policy); 503 with the reason otherwise. Real
databases (SQLite, and a PostgreSQL database dropped under the server), a real Redis killed."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import sqlalchemy as sa
from support.databases import create_database, drop_database
from support.gateway import make_gateway, serving, settings_for
from support.redis import RedisProcess

from loraplex.platform.api.app import build_app
from loraplex.platform.api.state import app_state
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.settings import ServerSettings


@pytest.mark.asyncio
async def test_ready_follows_the_migrations_and_draining(gateway_engine: AsyncEngine, tmp_path: Path) -> None:
    app = make_gateway(gateway_engine, settings_for(tmp_path, f"sqlite+aiosqlite:///{tmp_path / 'g.db'}"))
    gateway = app_state(app).gateway
    assert gateway is not None
    async with serving(app) as client:
        r = await client.get("/ready")
        assert r.status_code == 200, r.text
        assert r.json()["checks"] == {
            "draining": "no",
            "engine": "ok",
            "database": "ok",
            "migrations": "ok",
            "quotas": "in process",
        }
        async with gateway.db.transaction(write=True) as session:  # as if an older release migrated it
            await session.execute(sa.text("UPDATE alembic_version SET version_num = 'older'"))
        r = await client.get("/ready")
        assert r.status_code == 503 and r.json()["error"]["code"] == "migrations_not_at_head", r.text
        assert (await client.get("/health")).status_code == 200  # liveness is the engine's alone
        async with gateway.db.transaction(write=True) as session:
            await session.execute(
                sa.text("UPDATE alembic_version SET version_num = :v"), {"v": gateway.head_revision}
            )
        assert (await client.get("/ready")).status_code == 200
        app_state(app).lifecycle.begin_drain()
        r = await client.get("/ready")
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert r.headers["Retry-After"] == "1"


@pytest.mark.asyncio
async def test_ready_is_503_when_the_database_goes_away(
    gateway_engine: AsyncEngine, tmp_path: Path, postgres_server: str
) -> None:
    name = f"loraplex_ready_{secrets.token_hex(6)}"
    url = await create_database(postgres_server, name)
    app = make_gateway(gateway_engine, settings_for(tmp_path, url))
    try:
        async with serving(app) as client:
            assert (await client.get("/ready")).status_code == 200
            await drop_database(postgres_server, name)  # WITH (FORCE): its connections end too
            r = await client.get("/ready")
            assert r.status_code == 503 and r.json()["error"]["code"] == "database_unavailable", r.text
            assert r.json()["checks"]["database"].startswith("down")
    finally:
        await drop_database(postgres_server, name)


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
async def test_ready_reports_redis_down_and_follows_the_failure_policy(
    gateway_engine: AsyncEngine, tmp_path: Path, redis_process: RedisProcess, policy: str
) -> None:
    settings = settings_for(
        tmp_path, f"sqlite+aiosqlite:///{tmp_path / 'g.db'}", redis_process.url, quota_failure_policy=policy
    )
    async with serving(make_gateway(gateway_engine, settings)) as client:
        r = await client.get("/ready")
        assert r.status_code == 200 and r.json()["checks"]["quotas"] == "ok", r.text
        redis_process.kill()
        r = await client.get("/ready")
        if policy == "fail_closed":  # every limited request would be refused: not ready
            assert r.status_code == 503 and r.json()["error"]["code"] == "quota_backend_down", r.text
        else:  # served uncounted, as the policy says: ready, and the outage reported
            assert r.status_code == 200, r.text
        assert r.json()["checks"]["quotas"].startswith("down")


@pytest.mark.asyncio
async def test_a_single_tenant_server_is_ready_while_its_engine_serves(gateway_engine: AsyncEngine) -> None:
    app = build_app(gateway_engine, ServerSettings(served_model_name="tiny", single_tenant=True))
    async with serving(app) as client:
        r = await client.get("/ready")
        assert r.status_code == 200 and r.json()["checks"] == {"draining": "no", "engine": "ok"}
        assert (await client.get("/metrics")).status_code == 200
