"""Tenants: create, read, quotas with PATCH semantics, disable, delete with everything it owns."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select
from support.rows import make_tenant, new_adapter

from loraplex.platform.api.services import adapters, keys, tenants, usage
from loraplex.platform.api.services.errors import Conflict, InvalidInput, NotFound
from loraplex.platform.api.services.tenants import TenantQuotas
from loraplex.storage.db import Adapter, ApiKey, Database, UsageRecord

pytestmark = pytest.mark.asyncio


async def test_create_get_list(database: Database) -> None:
    await make_tenant(database, "beta")
    await make_tenant(
        database, "acme", rpm=60, tpm=10_000, max_concurrency=4, max_adapters=3, max_adapter_bytes=10**9
    )
    async with database.transaction() as session:
        acme = await tenants.get_tenant(session, "acme")
        assert TenantQuotas.of(acme) == TenantQuotas(
            rpm=60, tpm=10_000, max_concurrency=4, max_adapters=3, max_adapter_bytes=10**9
        )
        assert not acme.disabled
        assert [t.name for t in await tenants.list_tenants(session)] == ["acme", "beta"]
        beta = await tenants.get_tenant(session, "beta")
        assert TenantQuotas.of(beta) == TenantQuotas()  # all unlimited


async def test_a_taken_name_is_a_conflict(database: Database) -> None:
    await make_tenant(database, "acme")
    with pytest.raises(Conflict, match="tenant 'acme' already exists"):
        await make_tenant(database, "acme")


@pytest.mark.slow
async def test_bad_names_are_refused(database: Database) -> None:
    for name in ["", "Acme", "a/b", "-lead", "a b", "x" * 65, "acme\n"]:
        with pytest.raises(InvalidInput) as error:
            await make_tenant(database, name)
        assert error.value.field == "name", name
    async with database.transaction() as session:
        assert await tenants.list_tenants(session) == []


async def test_missing_tenant_is_not_found(database: Database) -> None:
    async with database.transaction() as session:
        with pytest.raises(NotFound, match="tenant 'nobody' not found"):
            await tenants.get_tenant(session, "nobody")


async def test_quota_updates_change_only_what_is_given(database: Database) -> None:
    await make_tenant(database, "acme", rpm=60, tpm=1000)
    async with database.transaction(write=True) as session:
        await tenants.update_quotas(session, "acme", {"rpm": 120, "max_adapters": 5})
    async with database.transaction(write=True) as session:
        updated = await tenants.update_quotas(session, "acme", {"tpm": None})  # None: now unlimited
    assert TenantQuotas.of(updated) == TenantQuotas(rpm=120, max_adapters=5)
    async with database.transaction() as session:
        assert TenantQuotas.of(await tenants.get_tenant(session, "acme")) == TenantQuotas(
            rpm=120, max_adapters=5
        )


async def test_bad_quotas_are_refused(database: Database) -> None:
    await make_tenant(database, "acme", rpm=60)
    bad: list[tuple[str, object]] = [
        ("rpm", 0),
        ("tpm", -1),
        ("max_concurrency", True),
        ("max_adapters", -1),
        ("rpm", 2**31),
        ("tpm", 1.5),
    ]
    for field, value in bad:
        with pytest.raises(InvalidInput) as error:
            async with database.transaction(write=True) as session:
                await tenants.update_quotas(session, "acme", {field: value})  # type: ignore[dict-item]
        assert error.value.field == field, (field, value)
    async with database.transaction() as session:
        assert TenantQuotas.of(await tenants.get_tenant(session, "acme")) == TenantQuotas(rpm=60)


async def test_zero_adapters_is_a_quota_and_unknown_fields_are_refused(database: Database) -> None:
    assert TenantQuotas(max_adapters=0, max_adapter_bytes=0).max_adapters == 0
    with pytest.raises(InvalidInput, match="not a quota"):
        TenantQuotas().updated({"rps": 3})  # type: ignore[dict-item]


async def test_disable_and_enable(database: Database) -> None:
    await make_tenant(database, "acme")
    async with database.transaction(write=True) as session:
        assert (await tenants.set_disabled(session, "acme", True)).disabled
    async with database.transaction(write=True) as session:
        assert (await tenants.get_tenant(session, "acme")).disabled
        assert not (await tenants.set_disabled(session, "acme", False)).disabled


async def test_delete_takes_keys_adapters_and_usage_with_it(database: Database) -> None:
    acme = await make_tenant(database, "acme")
    beta = await make_tenant(database, "beta")
    async with database.transaction(write=True) as session:
        for tenant in (acme, beta):
            await keys.create_key(session, tenant)
            await adapters.register_adapter(session, tenant, new_adapter("sql"))
            await usage.record_usage(session, tenant, usage.Usage("req-1", 10, 0, 5, 12.5, "ok"))
        await adapters.register_adapter(session, acme, new_adapter("sql", "v2"))
    async with database.transaction(write=True) as session:
        removed = await tenants.delete_tenant(session, "acme")
    assert sorted((ref.owner, ref.name, ref.version) for ref in removed) == sorted(
        ("acme", "sql", new_adapter("sql", content).version) for content in ("v1", "v2")
    )
    async with database.transaction() as session:
        with pytest.raises(NotFound):
            await tenants.get_tenant(session, "acme")
        for model in (ApiKey, Adapter, UsageRecord):
            owners = await session.scalar(select(func.count()).select_from(model))
            assert owners == 1, model.__name__  # beta's row is all that is left


async def test_ensure_tenant_creates_once(database: Database) -> None:
    async with database.transaction(write=True) as session:
        first = await tenants.ensure_tenant(session, "local")
    async with database.transaction(write=True) as session:
        again = await tenants.ensure_tenant(session, "local")
    assert first.id == again.id
