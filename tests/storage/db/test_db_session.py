"""``Database``: URLs, SQLite's connection settings, transactions, UTC timestamps."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import Connection, inspect, select, text
from sqlalchemy.exc import OperationalError, StatementError

from loraplex.storage.db import Database, DatabaseURLError, Tenant, database_url, upgrade_to_head


@pytest.mark.parametrize(
    ("given", "driver"),
    [
        ("sqlite:///x.db", "sqlite+aiosqlite"),
        ("sqlite+aiosqlite:///x.db", "sqlite+aiosqlite"),
        ("postgresql://u@h/db", "postgresql+asyncpg"),
        ("postgresql+asyncpg://u@h/db", "postgresql+asyncpg"),
    ],
)
def test_urls_get_the_async_driver_of_their_backend(given: str, driver: str) -> None:
    assert database_url(given).drivername == driver


@pytest.mark.parametrize("given", ["mysql://u@h/db", "postgresql+psycopg2://u@h/db", "not a url"])
def test_other_urls_are_refused(given: str) -> None:
    with pytest.raises(DatabaseURLError):
        database_url(given)


def test_the_password_stays_out_of_repr() -> None:
    db = Database("postgresql://user:s3cret@127.0.0.1/db")
    assert "s3cret" not in repr(db)


@pytest.mark.asyncio
async def test_a_sqlite_database_gets_its_directory_foreign_keys_and_wal(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path}/new/dir/gateway.db")
    try:
        async with db.engine.connect() as connection:
            assert await connection.scalar(text("PRAGMA foreign_keys")) == 1
            assert await connection.scalar(text("PRAGMA journal_mode")) == "wal"
        assert (tmp_path / "new" / "dir" / "gateway.db").exists()
    finally:
        await db.dispose()


def _tables(connection: Connection) -> list[str]:
    return inspect(connection).get_table_names()


@pytest.mark.asyncio
async def test_ddl_is_transactional(database_url: str) -> None:
    # What makes a migration all-or-nothing; SQLite's driver would autocommit the CREATE.
    db = Database(database_url)
    try:
        async with db.engine.connect() as connection:
            await connection.execute(text("CREATE TABLE scratch (x INTEGER)"))
            await connection.rollback()
            assert "scratch" not in await connection.run_sync(_tables)
    finally:
        await db.dispose()


@pytest.mark.asyncio
async def test_timestamps_come_back_aware_and_in_utc(database: Database) -> None:
    plus_two = timezone(timedelta(hours=2))
    at = datetime(2026, 3, 1, 12, 30, 15, 123456, tzinfo=plus_two)
    async with database.transaction() as session:
        session.add(Tenant(name="acme", created_at=at))
    async with database.transaction() as session:
        tenant = await session.scalar(select(Tenant).where(Tenant.created_at >= at - timedelta(seconds=1)))
    assert tenant is not None
    assert tenant.created_at == at
    assert tenant.created_at.tzinfo == UTC


@pytest.mark.asyncio
async def test_a_naive_timestamp_is_refused(database: Database) -> None:
    with pytest.raises(StatementError, match="naive datetime"):
        async with database.transaction() as session:
            session.add(Tenant(name="acme", created_at=datetime(2026, 3, 1, 12, 0)))


@pytest.mark.asyncio
async def test_sqlite_read_then_write_needs_a_write_transaction(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path}/gateway.db")
    try:
        await upgrade_to_head(db.engine)
        # A plain transaction that read, then another connection commits: the write fails.
        with pytest.raises(OperationalError, match="locked"):
            async with db.transaction() as reader:
                await reader.scalar(select(Tenant))
                async with db.transaction() as other:
                    other.add(Tenant(name="other"))
                reader.add(Tenant(name="late"))
                await reader.flush()

        # write=True takes the lock at BEGIN: the other writer waits for it instead.
        async def other_writer() -> None:
            async with db.transaction() as other:
                other.add(Tenant(name="other2"))

        async with db.transaction(write=True) as writer:
            await writer.scalar(select(Tenant))
            waiting = asyncio.create_task(other_writer())
            await asyncio.sleep(0.2)
            assert not waiting.done(), "the other writer did not wait for the write transaction"
            writer.add(Tenant(name="late2"))
            await writer.flush()
        await asyncio.wait_for(waiting, timeout=30)
        async with db.transaction() as session:
            names = set(await session.scalars(select(Tenant.name)))
        assert names == {"other", "other2", "late2"}
    finally:
        await db.dispose()
