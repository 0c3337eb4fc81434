"""API key lifecycle: created once in clear, stored as a hash, then authenticate until revoked,
expired or the tenant is disabled (issue 15, acceptance 2: the SQL part)."""

from __future__ import annotations

import hashlib
import logging
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select, text
from support.rows import make_tenant

from loraplex.platform.api.services import keys, tenants
from loraplex.platform.api.services.errors import InvalidInput, NotFound
from loraplex.storage.db import ApiKey, Database, Tenant

pytestmark = pytest.mark.asyncio


async def _create(db: Database, tenant: Tenant, **kwargs: object) -> keys.CreatedKey:
    async with db.transaction() as session:
        return await keys.create_key(session, tenant, **kwargs)  # type: ignore[arg-type]


async def _authenticate(db: Database, key: str, now: datetime | None = None) -> Tenant | None:
    async with db.transaction() as session:
        return await keys.authenticate(session, key, now=now)


async def test_the_key_is_shown_once_and_only_its_hash_is_stored(database: Database) -> None:
    acme = await make_tenant(database, "acme")
    created = await _create(database, acme, name="ci")
    assert created.key.startswith("lpx-") and len(created.key) == len("lpx-") + 43
    assert created.prefix == created.key[:12]
    assert created.tenant == "acme" and created.name == "ci"
    assert created.key not in repr(created)
    async with database.transaction() as session:
        rows = (await session.execute(text("SELECT * FROM api_keys"))).all()
    assert len(rows) == 1
    stored = [str(value) for value in rows[0]]
    assert hashlib.sha256(created.key.encode()).hexdigest() in stored
    assert not any(created.key in value or created.key[12:] in value for value in stored)


async def test_keys_are_random(database: Database) -> None:
    acme = await make_tenant(database, "acme")
    created = [await _create(database, acme) for _ in range(5)]
    assert len({c.key for c in created}) == 5
    assert len({c.prefix for c in created}) == 5


async def test_a_valid_key_authenticates_and_records_its_use(database: Database) -> None:
    acme = await make_tenant(database, "acme")
    created = await _create(database, acme)
    tenant = await _authenticate(database, created.key)
    assert tenant is not None and tenant.name == "acme"
    async with database.transaction() as session:
        [row] = await keys.list_keys(session, acme)
    assert row.last_used_at is not None
    assert datetime.now(UTC) - row.last_used_at < timedelta(minutes=1)


async def test_last_use_is_written_at_most_once_a_minute(database: Database) -> None:
    acme = await make_tenant(database, "acme")
    created = await _create(database, acme)
    t0 = datetime.now(UTC)
    for now, expected in [(t0, t0), (t0 + timedelta(seconds=30), t0), (t0 + timedelta(seconds=61), None)]:
        assert await _authenticate(database, created.key, now=now) is not None
        async with database.transaction() as session:
            [row] = await keys.list_keys(session, acme)
        assert row.last_used_at == (expected or now)


async def test_a_wrong_key_is_refused(database: Database) -> None:
    acme = await make_tenant(database, "acme")
    created = await _create(database, acme)
    wrong = {
        "random": "lpx-" + "A" * 43,
        "one_char_off": created.key[:-1] + ("A" if created.key[-1] != "A" else "B"),
        "no_prefix": created.key[4:],
        "empty": "",
        "huge": "lpx-" + "A" * 100_000,
        "the_hash": hashlib.sha256(created.key.encode()).hexdigest(),
        "the_prefix": created.prefix,
    }
    for kind, key in wrong.items():
        assert await _authenticate(database, key) is None, kind
    assert await _authenticate(database, created.key) is not None


async def test_a_revoked_key_is_refused(database: Database) -> None:
    acme = await make_tenant(database, "acme")
    created = await _create(database, acme)
    other = await _create(database, acme)
    async with database.transaction(write=True) as session:
        revoked = await keys.revoke_key(session, created.id)
    first_revocation = revoked.revoked_at
    assert first_revocation is not None
    assert await _authenticate(database, created.key) is None
    assert await _authenticate(database, other.key) is not None  # only that key
    async with database.transaction(write=True) as session:  # again: idempotent, the first time stays
        again = await keys.revoke_key(session, created.id, now=datetime.now(UTC) + timedelta(hours=1))
    assert again.revoked_at == first_revocation


async def test_an_expired_key_is_refused(database: Database) -> None:
    acme = await make_tenant(database, "acme")
    now = datetime.now(UTC)
    created = await _create(database, acme, expires_at=now + timedelta(hours=1))
    assert await _authenticate(database, created.key, now=now + timedelta(minutes=59)) is not None
    assert await _authenticate(database, created.key, now=now + timedelta(hours=1)) is None
    assert await _authenticate(database, created.key, now=now + timedelta(days=3)) is None


async def test_a_disabled_tenants_keys_are_refused(database: Database) -> None:
    acme = await make_tenant(database, "acme")
    created = await _create(database, acme)
    async with database.transaction(write=True) as session:
        await tenants.set_disabled(session, "acme", True)
    assert await _authenticate(database, created.key) is None
    async with database.transaction(write=True) as session:
        await tenants.set_disabled(session, "acme", False)
    assert await _authenticate(database, created.key) is not None


async def test_an_expiry_must_be_aware_and_ahead(database: Database) -> None:
    acme = await make_tenant(database, "acme")
    for expires_at in (datetime.now(UTC) - timedelta(seconds=1), datetime.now() + timedelta(days=1)):
        with pytest.raises(InvalidInput) as error:
            await _create(database, acme, expires_at=expires_at)
        assert error.value.field == "expires_at"


async def test_list_by_tenant_and_prefix(database: Database) -> None:
    acme, beta = await make_tenant(database, "acme"), await make_tenant(database, "beta")
    a1, a2 = await _create(database, acme), await _create(database, acme)
    b1 = await _create(database, beta)
    async with database.transaction(write=True) as session:
        await keys.revoke_key(session, a2.id)
    async with database.transaction() as session:
        assert [k.id for k in await keys.list_keys(session, acme)] == [a1.id, a2.id]
        assert [k.id for k in await keys.list_keys(session, acme, include_revoked=False)] == [a1.id]
        assert [k.id for k in await keys.list_keys(session)] == [a1.id, a2.id, b1.id]
        assert [k.id for k in await keys.list_keys(session, prefix=b1.prefix)] == [b1.id]
        assert [k.prefix for k in await keys.list_keys(session, prefix="lpx-")] == [
            a1.prefix,
            a2.prefix,
            b1.prefix,
        ]
        assert await keys.list_keys(session, prefix="lpx-%") == []  # '%' is not a wildcard


async def test_revoking_another_tenants_key_is_not_found(database: Database) -> None:
    acme, beta = await make_tenant(database, "acme"), await make_tenant(database, "beta")
    created = await _create(database, acme)
    async with database.transaction(write=True) as session:
        with pytest.raises(NotFound, match=f"key '{created.id}' not found"):
            await keys.revoke_key(session, created.id, tenant=beta)
    async with database.transaction(write=True) as session:
        with pytest.raises(NotFound, match="key '999999' not found"):
            await keys.revoke_key(session, 999_999)
    assert await _authenticate(database, created.key) is not None


async def test_no_key_reaches_the_logs(database: Database, caplog: pytest.LogCaptureFixture) -> None:
    # DEBUG on every logger, SQLAlchemy's statement and parameter logs included (SQLAlchemy sets
    # its own loggers to WARNING, so the root level alone would not show them).
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="sqlalchemy.engine")
    acme = await make_tenant(database, "acme")
    created = await _create(database, acme)
    await _authenticate(database, created.key)
    await _authenticate(database, created.key[:-1] + "x")
    async with database.transaction(write=True) as session:
        await keys.revoke_key(session, created.id)
    # The statements and their parameters were logged, so the checks below mean something.
    assert "FROM api_keys" in caplog.text and hashlib.sha256(created.key.encode()).hexdigest() in caplog.text
    assert created.key not in caplog.text
    assert created.key[12:] not in caplog.text


async def test_a_lost_last_use_write_does_not_refuse_the_key(
    database: Database, caplog: pytest.LogCaptureFixture
) -> None:
    # On SQLite a transaction that read before another connection committed cannot write any
    # more; authenticate must still answer, and leave last_used_at to the next request.
    acme = await make_tenant(database, "acme")
    created = await _create(database, acme)
    async with database.transaction() as session:
        await session.scalar(select(ApiKey.id))  # this transaction's snapshot starts here
        async with database.transaction() as other:
            await tenants.create_tenant(other, "beta")
        tenant = await keys.authenticate(session, created.key)
        assert tenant is not None and tenant.name == "acme"
    async with database.transaction() as session:
        [row] = await keys.list_keys(session, acme)
    if database.backend == "sqlite":
        assert row.last_used_at is None
        assert "could not record the use of API key" in caplog.text
    else:
        assert row.last_used_at is not None
