"""Issue 28 in process: the auth cache, the usage buffer, ``Gateway.stats()`` and ``database_ready()``
while a throwaway PostgreSQL is stopped and started again (the end-to-end tests with server
processes are ``tests/e2e/test_database_outage.py``)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio
from sqlalchemy import func, select
from support.databases import PostgresServer, create_database
from support.gateway import BASE as BASE_MODEL
from support.gateway import Admin, bearer, completion_body, make_gateway, serving, settings_for

from loraplex.platform.api.gateway import Gateway
from loraplex.platform.api.services import tenants, usage
from loraplex.platform.api.state import app_state
from loraplex.platform.api.usage_buffer import UsageBuffer
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.storage.db import (
    Database,
    DatabaseUnavailable,
    Tenant,
    UsageRecord,
    is_unavailable,
    upgrade_to_head,
)
from loraplex.storage.db.models import utcnow


@pytest_asyncio.fixture
async def pg_url(postgres_process: PostgresServer) -> str:
    return await create_database(postgres_process.url, f"gw_{secrets.token_hex(4)}")


@pytest_asyncio.fixture
async def halted(postgres_process: PostgresServer) -> AsyncIterator[Callable[[], None]]:
    """Call it to stop the server; it is started again after the test, whatever happened."""
    stopped = []

    def halt() -> None:
        postgres_process.halt()
        stopped.append(True)

    yield halt
    if stopped:
        await asyncio.to_thread(postgres_process.resume)


async def _eventually(check: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await _result(check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.1)


async def _result(value: object) -> object:
    return await value if asyncio.iscoroutine(value) else value


def _usage(request_id: str) -> usage.Usage:
    return usage.Usage(request_id, 3, 0, 2, 1.0, "ok")


async def _count_usage(db: Database) -> int:
    async with db.transaction() as session:
        return int(await session.scalar(select(func.count(UsageRecord.id))) or 0)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_stats_and_readiness_follow_the_database(
    gateway_engine: AsyncEngine,
    tmp_path: Path,
    pg_url: str,
    postgres_process: PostgresServer,
    halted: Callable[[], None],
) -> None:
    settings = settings_for(tmp_path, pg_url, auth_cache_ttl_s=60, database_connect_timeout_s=1)
    app = make_gateway(gateway_engine, settings)
    gateway = app_state(app).gateway
    assert isinstance(gateway, Gateway)
    async with serving(app) as client:
        key = await Admin(client).tenant_with_key("acme")
        for _ in range(2):
            r = await client.post("/v1/completions", json=completion_body(BASE_MODEL), headers=bearer(key))
            assert r.status_code == 200, r.text
        stats = gateway.stats()
        assert (stats.num_auth_cache_hits, stats.database_down, stats.num_database_errors) == (1, False, 0)
        assert await gateway.database_ready() == (True, "")

        halted()
        ready, reason = await gateway.database_ready()
        assert not ready and "database is unreachable" in reason, reason
        r = await client.post("/v1/completions", json=completion_body(BASE_MODEL), headers=bearer(key))
        assert r.status_code == 200, r.text  # within the TTL: no database needed
        unknown = await client.get("/v1/models", headers=bearer("lpx-" + "x" * 43))
        assert unknown.status_code == 503 and unknown.headers["retry-after"] == "1", unknown.text
        await _eventually(lambda: gateway.stats().num_usage_pending >= 1, 10, "the outage's usage buffered")
        stats = gateway.stats()
        assert stats.database_down and stats.num_database_errors >= 1 and stats.num_database_outages == 1
        assert stats.num_auth_cache_hits == 2 and stats.num_usage_dropped == 0

        await asyncio.to_thread(postgres_process.resume)
        await _eventually(lambda: gateway.stats().num_usage_pending == 0, 20, "the buffer written")
        assert await gateway.database_ready() == (True, "")
        assert not gateway.stats().database_down
        assert await _count_usage(gateway.db) == 3


@pytest.mark.slow
@pytest.mark.asyncio
async def test_known_keys_are_served_for_ttl_plus_stale_only(
    gateway_engine: AsyncEngine,
    tmp_path: Path,
    pg_url: str,
    postgres_process: PostgresServer,
    halted: Callable[[], None],
) -> None:
    settings = settings_for(tmp_path, pg_url, auth_cache_ttl_s=0.5, auth_cache_stale_s=1.5)
    app = make_gateway(gateway_engine, settings)
    gateway = app_state(app).gateway
    assert isinstance(gateway, Gateway)
    async with serving(app) as client:
        key = await Admin(client).tenant_with_key("acme")
        assert (await client.get("/v1/models", headers=bearer(key))).status_code == 200
        checked_s = time.monotonic()
        halted()
        await asyncio.sleep(0.6)  # past the TTL: the database is asked, the stale entry answers
        assert (await client.get("/v1/models", headers=bearer(key))).status_code == 503  # /v1/models needs it
        r = await client.post("/v1/completions", json=completion_body(BASE_MODEL), headers=bearer(key))
        assert r.status_code == 200, r.text
        assert gateway.stats().num_auth_cache_outage_hits >= 1
        await asyncio.sleep(max(0.0, checked_s + 2.1 - time.monotonic()))
        r = await client.post("/v1/completions", json=completion_body(BASE_MODEL), headers=bearer(key))
        assert r.status_code == 503 and r.json()["error"]["code"] == "database_unavailable", r.text
        await asyncio.to_thread(postgres_process.resume)  # so that shutdown writes the usage at once


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_cached_key_expires_on_time(gateway_engine: AsyncEngine, tmp_path: Path) -> None:
    """The TTL bounds revocation; a key's own expiry is exact even when its check is cached."""
    settings = settings_for(tmp_path, f"sqlite+aiosqlite:///{tmp_path / 'g.db'}", auth_cache_ttl_s=600)
    async with serving(make_gateway(gateway_engine, settings)) as client:
        admin = Admin(client)
        await admin.tenant("acme")
        key = await admin.key("acme", expires_at=(utcnow() + timedelta(seconds=1.5)).isoformat())
        body = completion_body(BASE_MODEL)
        assert (await client.post("/v1/completions", json=body, headers=bearer(key))).status_code == 200
        await asyncio.sleep(1.6)
        assert (await client.post("/v1/completions", json=body, headers=bearer(key))).status_code == 401


@pytest_asyncio.fixture
async def db_with_tenants(pg_url: str) -> AsyncIterator[tuple[Database, Tenant, Tenant]]:
    db = Database(pg_url)
    await upgrade_to_head(db.engine)
    async with db.transaction(write=True) as session:
        kept = await tenants.ensure_tenant(session, "kept")
        gone = await tenants.ensure_tenant(session, "gone")
    try:
        yield db, kept, gone
    finally:
        await db.dispose()


@pytest.mark.slow
@pytest.mark.asyncio
async def test_usage_buffer_overflow_is_counted_and_logged_once(
    db_with_tenants: tuple[Database, Tenant, Tenant],
    postgres_process: PostgresServer,
    halted: Callable[[], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    db, kept, _ = db_with_tenants
    buffer = UsageBuffer(db, capacity=3, retry_s=0.1, max_retry_s=0.2)
    buffer.start()
    halted()
    with caplog.at_level(logging.ERROR, logger="loraplex.platform.api.usage_buffer"):
        for i in range(6):
            buffer.add(kept, _usage(f"r{i}"))
    full = [r for r in caplog.records if "usage buffer is full" in r.getMessage()]
    assert len(full) == 1 and (buffer.num_pending, buffer.num_dropped) == (3, 3)
    await asyncio.sleep(0.5)  # the writer keeps trying, and keeps them
    assert buffer.num_pending == 3
    await asyncio.to_thread(postgres_process.resume)
    await _eventually(lambda: buffer.num_written == 3, 20, "the buffered records written")
    await buffer.flush(5)
    assert await _count_usage(db) == 3


@pytest.mark.asyncio
async def test_usage_buffer_flushes_at_shutdown_and_skips_refused_records(
    db_with_tenants: tuple[Database, Tenant, Tenant],
) -> None:
    db, kept, gone = db_with_tenants
    async with db.transaction(write=True) as session:
        await tenants.delete_tenant(session, "gone")
    buffer = UsageBuffer(db, capacity=100)  # no writer started: flush alone must write them
    buffer.add(kept, _usage("a"))
    buffer.add(gone, _usage("b"))  # its tenant was deleted: refused, and it does not hold up "c"
    buffer.add(kept, _usage("c"))
    await buffer.flush(10)
    assert (buffer.num_written, buffer.num_failed, buffer.num_pending) == (2, 1, 0)
    assert await _count_usage(db) == 2


@pytest.mark.asyncio
async def test_unavailable_database_fails_fast_between_probes(
    pg_url: str, halted: Callable[[], None]
) -> None:
    db = Database(pg_url)
    try:
        await db.ping()
        halted()
        with pytest.raises(DatabaseUnavailable):
            await db.ping()
        start = time.monotonic()
        for _ in range(20):  # within the probe interval: refused without trying
            with pytest.raises(DatabaseUnavailable):
                await db.ping()
        assert time.monotonic() - start < 0.5
        assert db.health.down and db.health.num_outages == 1 and db.health.num_errors >= 21
    finally:
        await db.dispose()


def test_a_connection_lost_mid_statement_is_an_outage() -> None:
    """As SQLAlchemy raises it: a ``DBAPIError`` around asyncpg's adapter ``Error``, caused by
    ``ConnectionDoesNotExistError`` (the server killed under a running statement)."""
    from sqlalchemy.dialects.postgresql.asyncpg import AsyncAdapt_asyncpg_dbapi
    from sqlalchemy.exc import DBAPIError

    lost = asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed in the middle of operation")
    adapted = AsyncAdapt_asyncpg_dbapi.Error(str(lost))
    adapted.__cause__ = lost
    assert is_unavailable(DBAPIError("INSERT ...", None, adapted))
    unique = asyncpg.exceptions.UniqueViolationError("duplicate key")
    refused = AsyncAdapt_asyncpg_dbapi.IntegrityError(str(unique))
    refused.__cause__ = unique
    assert not is_unavailable(DBAPIError("INSERT ...", None, refused))
