"""Usage records: what a request used goes in, and comes back out through the filters."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from support.rows import make_tenant, version_of

from loraplex.platform.api.services import tenants, usage
from loraplex.platform.api.services.errors import InvalidInput, NotFound
from loraplex.platform.api.services.usage import Usage, UsageFilter, UsageTotals
from loraplex.storage.db import Database

pytestmark = pytest.mark.asyncio

T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


async def test_a_record_round_trips(database: Database) -> None:
    acme = await make_tenant(database, "acme")
    sent = Usage(
        request_id="chatcmpl-1",
        prompt_tokens=120,
        cached_tokens=64,
        completion_tokens=33,
        latency_ms=812.5,
        status="ok",
        adapter_name="beta/sql",
        adapter_version=version_of("sql"),
    )
    async with database.transaction() as session:
        await usage.record_usage(session, acme, sent, at=T0)
    async with database.transaction() as session:
        [record] = await usage.query_usage(session)
    got = Usage(
        request_id=record.request_id,
        prompt_tokens=record.prompt_tokens,
        cached_tokens=record.cached_tokens,
        completion_tokens=record.completion_tokens,
        latency_ms=record.latency_ms,
        status=record.status,
        adapter_name=record.adapter_name,
        adapter_version=record.adapter_version,
    )
    assert got == sent
    assert (record.tenant.name, record.created_at) == ("acme", T0)


async def test_filters_and_totals(database: Database) -> None:
    acme, beta = await make_tenant(database, "acme"), await make_tenant(database, "beta")
    rows = [
        (acme, 0, Usage("r0", 10, 0, 5, 10.0, "ok")),
        (acme, 1, Usage("r1", 20, 10, 6, 11.0, "ok", "sql", version_of("sql"))),
        (acme, 2, Usage("r2", 30, 0, 0, 12.0, "aborted", "sql", version_of("sql"))),
        (beta, 3, Usage("r3", 40, 0, 8, 13.0, "error")),
        (acme, 4, Usage("r4", 50, 0, 0, 0.5, "rejected")),
    ]
    async with database.transaction() as session:
        for tenant, minutes, used in rows:
            await usage.record_usage(session, tenant, used, at=T0 + timedelta(minutes=minutes))

    async def ids(where: UsageFilter | None = None, limit: int = 1000) -> list[str]:
        async with database.transaction() as session:
            return [r.request_id for r in await usage.query_usage(session, where, limit=limit)]

    assert await ids() == ["r4", "r3", "r2", "r1", "r0"]  # newest first
    assert await ids(limit=2) == ["r4", "r3"]
    assert await ids(UsageFilter(tenant=acme)) == ["r4", "r2", "r1", "r0"]
    assert await ids(UsageFilter(tenant=beta)) == ["r3"]
    window = UsageFilter(since=T0 + timedelta(minutes=1), until=T0 + timedelta(minutes=3))
    assert await ids(window) == ["r2", "r1"]  # since inclusive, until exclusive
    assert await ids(UsageFilter(adapter_name="sql")) == ["r2", "r1"]
    assert await ids(UsageFilter(tenant=acme, status="ok")) == ["r1", "r0"]
    async with database.transaction() as session:
        totals = await usage.usage_totals(session, UsageFilter(tenant=acme))
        nothing = await usage.usage_totals(session, UsageFilter(since=T0 + timedelta(days=1)))
    assert totals == UsageTotals(num_requests=4, prompt_tokens=110, cached_tokens=10, completion_tokens=11)
    assert nothing == UsageTotals(0, 0, 0, 0)


async def test_bad_records_are_refused(database: Database) -> None:
    acme = await make_tenant(database, "acme")
    bad = [
        ("prompt_tokens", Usage("r", -1, 0, 0, 1.0, "ok")),
        ("cached_tokens", Usage("r", 5, 6, 0, 1.0, "ok")),
        ("latency_ms", Usage("r", 5, 0, 0, float("nan"), "ok")),
        ("status", Usage("r", 5, 0, 0, 1.0, "done")),  # type: ignore[arg-type]
        ("request_id", Usage("", 5, 0, 0, 1.0, "ok")),
    ]
    for field, used in bad:
        with pytest.raises(InvalidInput) as error:
            async with database.transaction() as session:
                await usage.record_usage(session, acme, used)
        assert error.value.field == field, used
    async with database.transaction() as session:
        assert await usage.query_usage(session) == []


async def test_a_record_for_a_deleted_tenant_is_not_found(database: Database) -> None:
    # A request that finishes after its tenant was deleted.
    acme = await make_tenant(database, "acme")
    async with database.transaction(write=True) as session:
        await tenants.delete_tenant(session, "acme")
    with pytest.raises(NotFound, match="tenant 'acme'"):
        async with database.transaction() as session:
            await usage.record_usage(session, acme, Usage("r", 1, 0, 1, 1.0, "ok"))


async def test_query_limits(database: Database) -> None:
    async with database.transaction() as session:
        for limit in (0, usage.MAX_QUERY_ROWS + 1):
            with pytest.raises(InvalidInput):
                await usage.query_usage(session, limit=limit)
