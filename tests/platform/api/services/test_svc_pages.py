"""Keyset pagination of every list: pages join up, filters hold, cursors reveal nothing more, and
a page deep into 100,000 keys costs what the first page does (SQLite and PostgreSQL)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import pytest
from support.rows import WHALE, fill, make_tenant, new_adapter

from loraplex.platform.api.services import adapters, keys, tenants, usage
from loraplex.platform.api.services.errors import InvalidInput, NotFound
from loraplex.platform.api.services.pages import Page, PageRequest, encode_cursor
from loraplex.storage.db import Database, Tenant

T0 = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


async def record(db: Database, tenant: Tenant, request_id: str, at: datetime) -> None:
    async with db.transaction() as session:
        done = usage.Usage(
            request_id, prompt_tokens=3, cached_tokens=0, completion_tokens=2, latency_ms=1.0, status="ok"
        )
        await usage.record_usage(session, tenant, done, at=at)


pytestmark = pytest.mark.asyncio


async def every_page(fetch: Callable[[PageRequest], Awaitable[Page[object]]], limit: int) -> list[object]:
    """All rows, following ``last_id`` page after page; checks the pages' cursors on the way."""
    rows: list[object] = []
    after = None
    while True:
        page = await fetch(PageRequest(limit, after))
        assert len(page.items) <= limit and len(page.cursors) == len(page.items)
        rows.extend(page.items)
        if not page.has_more:
            return rows
        assert len(page.items) == limit
        after = page.last_id


async def test_tenants_page_by_name_with_a_prefix(database: Database) -> None:
    names = ["acme", "acme-eu", "beta", "acme_x", "gamma", "acmes"]
    for name in names:
        await make_tenant(database, name)
    async with database.transaction() as session:
        for limit in (1, 2, 5, 100):
            got = await every_page(lambda p: tenants.page_tenants(session, p), limit)
            assert [t.name for t in got] == sorted(names)  # type: ignore[attr-defined]
        acme = await every_page(lambda p: tenants.page_tenants(session, p, name_prefix="acme"), 2)
        assert [t.name for t in acme] == ["acme", "acme-eu", "acme_x", "acmes"]  # type: ignore[attr-defined]
        # '_' and '%' are literal in a prefix, not LIKE wildcards
        assert (await tenants.page_tenants(session, PageRequest(), name_prefix="acme_")).cursors == ["acme_x"]
        assert (await tenants.page_tenants(session, PageRequest(), name_prefix="a%")).items == []
        first = await tenants.page_tenants(session, PageRequest(limit=2))
        assert (first.first_id, first.last_id, first.has_more) == ("acme", "acme-eu", True)


async def test_keys_page_within_their_tenant(database: Database) -> None:
    acme = await make_tenant(database, "acme")
    beta = await make_tenant(database, "beta")
    async with database.transaction(write=True) as session:
        made = [await keys.create_key(session, acme if i % 3 else beta) for i in range(12)]
    acme_ids = [k.id for k in made if k.tenant == "acme"]
    async with database.transaction() as session:
        got = await every_page(lambda p: keys.page_keys(session, p, acme), 3)
        assert [k.id for k in got] == acme_ids  # type: ignore[attr-defined]
        # beta's cursor in acme's list: still only acme's keys after that id
        beta_id = next(k.id for k in made if k.tenant == "beta")
        after_beta = await keys.page_keys(session, PageRequest(100, str(beta_id)), acme)
        assert [k.id for k in after_beta.items] == [i for i in acme_ids if i > beta_id]
        everyone = await every_page(lambda p: keys.page_keys(session, p), 5)
        assert len(everyone) == 12
        one = made[4]
        by_prefix = await keys.page_keys(session, PageRequest(), prefix=one.prefix)
        assert [k.id for k in by_prefix.items] == [one.id]
        for bad in ["x", "-1", "1.5", "٣", "9" * 30]:
            with pytest.raises(InvalidInput, match="after"):
                await keys.page_keys(session, PageRequest(after=bad), acme)


async def test_adapters_page_newest_versions_and_every_version(database: Database) -> None:
    acme = await make_tenant(database, "acme")
    beta = await make_tenant(database, "beta")
    async with database.transaction(write=True) as session:
        for name in ["sql", "chat", "math", "code"]:
            await adapters.register_adapter(session, acme, new_adapter(name))
        await adapters.register_adapter(session, acme, new_adapter("sql", "v2"))
        await adapters.register_adapter(session, acme, new_adapter("sql", "v3"))
        await adapters.register_adapter(session, beta, new_adapter("beta-only"))
    async with database.transaction() as session:
        newest = await every_page(lambda p: adapters.page_newest(session, acme, p), 3)
        assert [a.name for a in newest] == ["chat", "code", "math", "sql"]  # type: ignore[attr-defined]
        assert newest[-1].version == new_adapter("sql", "v3").version  # type: ignore[attr-defined]
        assert [
            a.name for a in (await adapters.page_newest(session, acme, PageRequest(), name_prefix="c")).items
        ] == [
            "chat",
            "code",
        ]
        versions = await every_page(lambda p: adapters.page_versions(session, acme, "sql", p), 1)
        assert [a.version for a in versions] == [  # type: ignore[attr-defined]
            new_adapter("sql", c).version for c in ("v3", "v2", "v1")
        ]
        with pytest.raises(NotFound):
            await adapters.page_versions(session, acme, "beta-only", PageRequest())
        all_rows = await every_page(lambda p: adapters.page_adapters(session, p), 2)
        assert len(all_rows) == 7
        only_acme = await every_page(lambda p: adapters.page_adapters(session, p, acme), 4)
        assert {a.owner_id for a in only_acme} == {acme.id}  # type: ignore[attr-defined]
        assert len((await adapters.page_adapters(session, PageRequest(), name_prefix="sq")).items) == 3
        for bad in ["not-a-cursor", encode_cursor("x"), encode_cursor(1, 2), "!!"]:
            with pytest.raises(InvalidInput, match="after"):
                await adapters.page_adapters(session, PageRequest(after=bad))


async def test_usage_pages_newest_first_through_equal_times(database: Database) -> None:
    acme = await make_tenant(database, "acme")
    beta = await make_tenant(database, "beta")
    # Several records at the same instant: the id breaks the tie, none is lost or repeated.
    for i in range(9):
        await record(database, acme if i % 2 else beta, f"r{i}", at=T0 + timedelta(seconds=i // 3))
    async with database.transaction() as session:
        everyone = await every_page(lambda p: usage.page_usage(session, usage.UsageFilter(), p), 2)
        assert [r.request_id for r in everyone] == [f"r{i}" for i in (8, 7, 6, 5, 4, 3, 2, 1, 0)]  # type: ignore[attr-defined]
        mine = await every_page(lambda p: usage.page_usage(session, usage.UsageFilter(tenant=acme), p), 1)
        assert [r.request_id for r in mine] == ["r7", "r5", "r3", "r1"]  # type: ignore[attr-defined]


async def test_what_each_version_served_and_each_tenant_used(database: Database) -> None:
    acme = await make_tenant(database, "acme")
    beta = await make_tenant(database, "beta")
    now = datetime.now(UTC)
    async with database.transaction() as session:
        for tenant, version, at in [
            (acme, "v1", now),
            (beta, "v1", now),
            (acme, "v2", now),
            (acme, "v1", now - timedelta(days=2)),  # before the window
        ]:
            done = usage.Usage(
                f"r-{tenant.name}-{version}-{at.day}",
                3,
                0,
                2,
                1.0,
                "ok",
                adapter_name="x",
                adapter_version=version,
            )
            await usage.record_usage(session, tenant, done, at=at)
    since = now - timedelta(hours=1)
    async with database.transaction() as session:
        served = await usage.served_by_version(session, ["v1", "v2", "v3"], since)
        assert served == {"v1": usage.ServedTotals(2, 10), "v2": usage.ServedTotals(1, 5)}
        assert await usage.served_by_version(session, [], since) == {}
        assert await usage.tokens_by_tenant(session, since) == {"acme": 10, "beta": 5}
        assert await usage.tokens_by_tenant(session, since, beta) == {"beta": 5}


async def test_limits_are_checked() -> None:
    for limit in (0, 101, -1):
        with pytest.raises(InvalidInput, match="limit"):
            PageRequest(limit=limit)
    with pytest.raises(InvalidInput, match="after"):
        PageRequest(after="x" * 1000)


async def _fastest(
    fetch: Callable[[], Awaitable[Page[object]]], repeats: int = 5
) -> tuple[float, Page[object]]:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        page = await fetch()
        best = min(best, time.perf_counter() - start)
    return best, page


@pytest.mark.slow
async def test_a_deep_page_costs_what_the_first_does(database: Database) -> None:
    """10,000 tenants and 100,000 keys (half of them one tenant's): a page at row ~100,000 of the
    key list, and ~50,000 into one tenant's keys, take about the time of the first page; every
    list answers well under a second."""
    ids = await fill(database, num_tenants=10_000, num_keys=100_000, whale_keys=50_000)
    async with database.transaction() as session:
        whale = await tenants.get_tenant(session, WHALE)
        lists: dict[str, tuple[Callable[[PageRequest], Awaitable[Page[object]]], str]] = {
            "tenants": (lambda p: tenants.page_tenants(session, p), "t09979"),
            "all keys": (lambda p: keys.page_keys(session, p), "99979"),
            "whale keys": (lambda p: keys.page_keys(session, p, whale), "49979"),
        }
        report = {}
        for what, (fetch, deep_cursor) in lists.items():
            first_s, first = await _fastest(lambda f=fetch: f(PageRequest(limit=20)))  # type: ignore[misc]
            deep_s, deep = await _fastest(lambda f=fetch, c=deep_cursor: f(PageRequest(20, c)))  # type: ignore[misc]
            report[what] = (round(first_s * 1000, 2), round(deep_s * 1000, 2))
            assert len(first.items) == len(deep.items) == 20, what
            assert first_s < 1.0 and deep_s < 1.0, report
            # The same cost within noise: OFFSET would read ~100,000 rows for the deep one.
            assert deep_s < 3 * first_s + 0.02, report
        assert len(ids) == 10_000
        print(database.backend, "first / deep page, ms:", report)
