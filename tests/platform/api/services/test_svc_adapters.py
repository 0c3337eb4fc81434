"""The adapter registry: versions, the per-tenant ACL and the adapter quotas (issue 15,
acceptance 2: tenant B cannot see, use or delete A's private adapter, but can use A's public one)."""

from __future__ import annotations

import dataclasses

import pytest
from support.rows import make_tenant, new_adapter

from loraplex.adapters import AdapterNotFoundError
from loraplex.platform.api.services import adapters, tenants
from loraplex.platform.api.services.adapters import NewAdapter, model_name
from loraplex.platform.api.services.errors import Conflict, InvalidInput, NotFound, QuotaExceeded
from loraplex.storage.db import Adapter, Database, Tenant

pytestmark = pytest.mark.asyncio


async def _register(db: Database, owner: Tenant, new: NewAdapter) -> Adapter:
    async with db.transaction(write=True) as session:
        return await adapters.register_adapter(session, owner, new)


async def _resolve(db: Database, caller: Tenant, model: str) -> Adapter:
    async with db.transaction() as session:
        return await adapters.resolve_adapter(session, caller, model)


async def _not_found(db: Database, caller: Tenant, model: str) -> str:
    with pytest.raises(AdapterNotFoundError) as error:
        await _resolve(db, caller, model)
    assert error.value.name == model
    return str(error.value)


async def test_an_owner_resolves_its_adapter_by_name(database: Database) -> None:
    acme = await make_tenant(database, "acme")
    registered = await _register(database, acme, new_adapter("sql"))
    resolved = await _resolve(database, acme, "sql")
    assert resolved.id == registered.id
    assert (resolved.owner.name, resolved.version, resolved.rank) == ("acme", new_adapter("sql").version, 8)
    assert resolved.target_modules == ["q_proj", "v_proj"]
    assert (await _resolve(database, acme, "acme/sql")).id == registered.id  # its own, spelt in full


async def test_a_reupload_is_a_new_version_and_the_newest_is_served(database: Database) -> None:
    acme = await make_tenant(database, "acme")
    v1 = await _register(database, acme, new_adapter("sql", "v1"))
    v2 = await _register(database, acme, new_adapter("sql", "v2"))
    assert v1.version != v2.version
    assert (await _resolve(database, acme, "sql")).version == v2.version
    # The newest content again: nothing changes.
    assert (await _register(database, acme, new_adapter("sql", "v2"))).id == v2.id
    # An older version's content: refused, with what to do instead.
    with pytest.raises(Conflict, match="older version"):
        await _register(database, acme, new_adapter("sql", "v1"))
    async with database.transaction() as session:
        versions = await adapters.list_versions(session, acme, "sql")
    assert [v.version for v in versions] == [v2.version, v1.version]
    # Deleting the newest version serves the previous one again.
    async with database.transaction(write=True) as session:
        removed = await adapters.delete_adapter(session, acme, "sql", v2.version)
    assert [(r.owner, r.name, r.version) for r in removed] == [("acme", "sql", v2.version)]
    assert (await _resolve(database, acme, "sql")).version == v1.version


async def test_another_tenants_private_adapter_looks_missing(database: Database) -> None:
    acme, beta = await make_tenant(database, "acme"), await make_tenant(database, "beta")
    await _register(database, acme, new_adapter("sql"))
    private = await _not_found(database, beta, "acme/sql")
    missing = await _not_found(database, beta, "acme/nothing-here")
    # The same answer for another tenant's private adapter and a missing one, but for the name asked.
    assert private == "The model 'acme/sql' does not exist."
    assert missing == "The model 'acme/nothing-here' does not exist."
    await _not_found(database, beta, "sql")  # a bare name is the caller's own namespace
    await _not_found(database, beta, "nobody/sql")
    await _not_found(database, beta, "a/b/c")
    async with database.transaction() as session:
        assert await adapters.list_visible(session, beta) == []
        with pytest.raises(NotFound):
            await adapters.get_adapter(session, beta, "sql")
    async with database.transaction(write=True) as session:
        with pytest.raises(NotFound):
            await adapters.delete_adapter(session, beta, "sql")
    assert (await _resolve(database, acme, "sql")).owner.name == "acme"  # still there


async def test_another_tenants_public_adapter_is_usable_as_owner_slash_name(database: Database) -> None:
    acme, beta = await make_tenant(database, "acme"), await make_tenant(database, "beta")
    public = await _register(database, acme, new_adapter("sql", visibility="public"))
    await _register(database, acme, new_adapter("secret"))
    own = await _register(database, beta, new_adapter("chat"))
    assert (await _resolve(database, beta, "acme/sql")).id == public.id
    await _not_found(database, beta, "sql")  # not under a bare name: that is beta's namespace
    async with database.transaction() as session:
        visible = await adapters.list_visible(session, beta)
    assert [model_name(beta, a) for a in visible] == ["acme/sql", "chat"]
    assert [a.id for a in visible] == [public.id, own.id]
    # Using is not owning: beta cannot delete it.
    async with database.transaction(write=True) as session:
        with pytest.raises(NotFound):
            await adapters.delete_adapter(session, beta, "sql")


async def test_visibility_belongs_to_the_name(database: Database) -> None:
    acme, beta = await make_tenant(database, "acme"), await make_tenant(database, "beta")
    await _register(database, acme, new_adapter("sql", "v1", visibility="public"))
    await _register(database, acme, new_adapter("sql", "v2"))  # private again, every version
    await _not_found(database, beta, "acme/sql")
    async with database.transaction(write=True) as session:
        await adapters.set_visibility(session, acme, "sql", "public")
    assert (await _resolve(database, beta, "acme/sql")).version == new_adapter("sql", "v2").version
    async with database.transaction() as session:
        assert {v.visibility for v in await adapters.list_versions(session, acme, "sql")} == {"public"}


async def test_a_disabled_tenants_public_adapters_disappear(database: Database) -> None:
    acme, beta = await make_tenant(database, "acme"), await make_tenant(database, "beta")
    await _register(database, acme, new_adapter("sql", visibility="public"))
    async with database.transaction(write=True) as session:
        await tenants.set_disabled(session, "acme", True)
    await _not_found(database, beta, "acme/sql")
    async with database.transaction() as session:
        assert await adapters.list_visible(session, beta) == []


async def test_max_adapters_counts_names_not_versions(database: Database) -> None:
    acme = await make_tenant(database, "acme", max_adapters=1)
    await _register(database, acme, new_adapter("sql", "v1"))
    await _register(database, acme, new_adapter("sql", "v2"))  # a new version of the same name
    with pytest.raises(QuotaExceeded) as error:
        await _register(database, acme, new_adapter("chat"))
    assert (error.value.quota, error.value.limit, error.value.requested) == ("max_adapters", 1, 2)
    async with database.transaction(write=True) as session:
        await adapters.delete_adapter(session, acme, "sql")
    await _register(database, acme, new_adapter("chat"))


async def test_max_adapter_bytes_counts_every_stored_version(database: Database) -> None:
    acme = await make_tenant(database, "acme", max_adapter_bytes=2500)
    await _register(database, acme, new_adapter("sql", "v1", nbytes=1000))
    await _register(database, acme, new_adapter("sql", "v2", nbytes=1000))
    with pytest.raises(QuotaExceeded) as error:
        await _register(database, acme, new_adapter("sql", "v3", nbytes=1000))
    assert (error.value.quota, error.value.limit, error.value.requested) == ("max_adapter_bytes", 2500, 3000)
    async with database.transaction() as session:
        used = await adapters.adapter_usage(session, acme)
    assert (used.num_adapters, used.num_bytes) == (1, 2000)


async def test_quotas_are_read_when_registering(database: Database) -> None:
    acme = await make_tenant(database, "acme")  # this object says: no quota
    async with database.transaction(write=True) as session:
        await tenants.update_quotas(session, "acme", {"max_adapters": 0})
    with pytest.raises(QuotaExceeded):
        await _register(database, acme, new_adapter("sql"))


async def test_deleting_reports_which_files_are_still_referenced(database: Database) -> None:
    acme, beta = await make_tenant(database, "acme"), await make_tenant(database, "beta")
    shared = new_adapter("sql", path="sha256/same-content")
    await _register(database, acme, shared)
    await _register(database, beta, shared)
    async with database.transaction(write=True) as session:
        [ref] = await adapters.delete_adapter(session, acme, "sql")
        assert await adapters.is_path_referenced(session, ref.path)  # beta's row still points there
    async with database.transaction(write=True) as session:
        [ref] = await adapters.delete_adapter(session, beta, "sql")
        assert not await adapters.is_path_referenced(session, ref.path)
        with pytest.raises(NotFound):
            await adapters.delete_adapter(session, beta, "sql")


async def test_list_adapters_for_the_admin(database: Database) -> None:
    acme, beta = await make_tenant(database, "acme"), await make_tenant(database, "beta")
    await _register(database, acme, new_adapter("sql", "v1"))
    await _register(database, acme, new_adapter("sql", "v2"))
    await _register(database, beta, new_adapter("chat"))
    async with database.transaction() as session:
        everything = await adapters.list_adapters(session)
        only_acme = await adapters.list_adapters(session, acme)
    assert [(a.owner.name, a.name) for a in everything] == [
        ("acme", "sql"),
        ("acme", "sql"),
        ("beta", "chat"),
    ]
    assert len(only_acme) == 2


async def test_bad_metadata_is_refused(database: Database) -> None:
    acme = await make_tenant(database, "acme")
    bad: list[tuple[str, dict[str, object]]] = [
        ("name", {"name": "a/b"}),
        ("name", {"name": ""}),
        ("version", {"version": "not-a-sha"}),
        ("version", {"version": "A" * 64}),
        ("visibility", {"visibility": "everyone"}),
        ("rank", {"rank": 0}),
        ("nbytes", {"nbytes": -1}),
    ]
    for field, change in bad:
        with pytest.raises(InvalidInput) as error:
            await _register(database, acme, dataclasses.replace(new_adapter("sql"), **change))  # type: ignore[arg-type]
        assert error.value.field == field, change
    async with database.transaction() as session:
        assert await adapters.list_adapters(session) == []
