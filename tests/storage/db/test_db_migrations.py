"""Migrations: an empty database of each backend reaches head, matches the models, and several
replicas migrating at once are safe (issue 15, acceptance 4)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path

import pytest
from alembic import command
from alembic.operations import Operations
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, func, inspect, select, table, text

from loraplex.storage.db import (
    ApiKey,
    Base,
    Database,
    Tenant,
    current_revision,
    head_revision,
    schema_diff,
    upgrade_to_head,
)
from loraplex.storage.db.migrate import alembic_config, migration_lock

pytestmark = pytest.mark.asyncio


def _table_names(connection: Connection) -> set[str]:
    return set(inspect(connection).get_table_names())


@asynccontextmanager
async def _migrated(url: str) -> AsyncIterator[Database]:
    db = Database(url)
    try:
        await upgrade_to_head(db.engine)
        yield db
    finally:
        await db.dispose()


async def test_an_empty_database_upgrades_to_head_without_drift(database_url: str) -> None:
    db = Database(database_url)
    try:
        assert await current_revision(db.engine) is None
        assert await upgrade_to_head(db.engine) == head_revision()
        assert await current_revision(db.engine) == head_revision()
        async with db.engine.connect() as connection:
            tables = await connection.run_sync(_table_names)
        assert tables == {*Base.metadata.tables, "alembic_version"}
        assert await schema_diff(db.engine) == []
        # A second start-up finds nothing to do.
        assert await upgrade_to_head(db.engine) == head_revision()
        assert await schema_diff(db.engine) == []
    finally:
        await db.dispose()


async def test_the_drift_check_sees_a_schema_that_differs(database_url: str) -> None:
    async with _migrated(database_url) as db:
        async with db.engine.begin() as connection:
            await connection.execute(text("DROP INDEX ix_api_keys_tenant_id_id"))
        diff = await schema_diff(db.engine)
    assert [entry[0] for entry in diff if isinstance(entry, tuple)] == ["add_index"], diff


def _downgrade_to_base(connection: Connection) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection
    command.downgrade(config, "base")


@pytest.mark.slow
async def test_downgrade_to_base_and_upgrade_again(database_url: str) -> None:
    async with _migrated(database_url) as db:
        async with migration_lock(db.engine) as connection:
            await connection.run_sync(_downgrade_to_base)
            assert await connection.run_sync(_table_names) == {"alembic_version"}
        assert await current_revision(db.engine) is None
        assert await upgrade_to_head(db.engine) == head_revision()
        assert await schema_diff(db.engine) == []


async def test_replicas_starting_at_once_migrate_once(database_url: str) -> None:
    replicas = [Database(database_url) for _ in range(3)]
    try:
        revisions = await asyncio.gather(*(upgrade_to_head(db.engine) for db in replicas))
        assert revisions == [head_revision()] * 3
        async with replicas[0].engine.connect() as connection:
            versions = await connection.scalar(select(func.count()).select_from(table("alembic_version")))
        assert versions == 1
        assert await schema_diff(replicas[0].engine) == []
    finally:
        for db in replicas:
            await db.dispose()


@pytest.mark.slow
async def test_an_upgrade_waits_while_another_replica_holds_the_lock(database_url: str) -> None:
    first, second = Database(database_url), Database(database_url)
    try:
        async with migration_lock(first.engine):
            upgrade = asyncio.create_task(upgrade_to_head(second.engine))
            await asyncio.sleep(0.5)
            assert not upgrade.done(), "the upgrade ran while another replica held the migration lock"
            assert await current_revision(second.engine) is None
        assert await asyncio.wait_for(upgrade, timeout=30) == head_revision()
    finally:
        await first.dispose()
        await second.dispose()


def _rebuild_tenants(connection: Connection) -> None:
    # What Alembic's batch mode does to change a SQLite table: copy it, DROP it, rename the copy.
    with Operations(MigrationContext.configure(connection)).batch_alter_table("tenants", recreate="always"):
        pass


async def test_a_sqlite_table_rebuild_in_a_migration_keeps_the_child_rows(tmp_path: Path) -> None:
    # With foreign keys on, the DROP of ``tenants`` would cascade into ``api_keys``.
    async with _migrated(f"sqlite:///{tmp_path}/gateway.db") as db:
        async with db.transaction() as session:
            session.add(ApiKey(tenant=Tenant(name="acme"), key_hash="0" * 64, prefix="lpx-00000000"))
        async with migration_lock(db.engine) as connection:
            assert await connection.scalar(text("PRAGMA foreign_keys")) == 0
            await connection.run_sync(_rebuild_tenants)
        async with db.engine.connect() as connection:  # the pool hands out foreign keys on again
            assert await connection.scalar(text("PRAGMA foreign_keys")) == 1
            assert await connection.scalar(text("SELECT count(*) FROM api_keys")) == 1


async def test_a_sqlite_migration_that_breaks_a_foreign_key_is_rolled_back(tmp_path: Path) -> None:
    async with _migrated(f"sqlite:///{tmp_path}/gateway.db") as db:
        async with db.transaction() as session:
            session.add(ApiKey(tenant=Tenant(name="acme"), key_hash="0" * 64, prefix="lpx-00000000"))
        with pytest.raises(RuntimeError, match="1 rows breaking foreign keys"):
            async with migration_lock(db.engine) as connection:
                await connection.exec_driver_sql("DELETE FROM tenants")
        async with db.engine.connect() as connection:
            assert await connection.scalar(text("SELECT count(*) FROM tenants")) == 1


def _upgrade_to(revision: str) -> Callable[[Connection], None]:
    def run(connection: Connection) -> None:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.upgrade(config, revision)

    return run


def _downgrade_to(revision: str) -> Callable[[Connection], None]:
    def run(connection: Connection) -> None:
        config = alembic_config()
        config.attributes["connection"] = connection
        command.downgrade(config, revision)

    return run


async def test_tenants_of_the_first_schema_get_weight_one_and_keep_their_rows(database_url: str) -> None:
    db = Database(database_url)
    try:
        async with migration_lock(db.engine) as connection:
            await connection.run_sync(_upgrade_to("0001"))
            await connection.execute(
                text("INSERT INTO tenants (name, disabled, created_at) VALUES ('acme', false, :t)"),
                {"t": datetime(2026, 12, 1, tzinfo=UTC)},
            )
        assert await upgrade_to_head(db.engine) == head_revision()
        async with db.engine.connect() as connection:
            assert (await connection.execute(text("SELECT name, weight FROM tenants"))).all() == [
                ("acme", 1.0)
            ]
        assert await schema_diff(db.engine) == []
        async with migration_lock(db.engine) as connection:
            await connection.run_sync(_downgrade_to("0002"))
            columns = {
                c["name"] for c in await connection.run_sync(lambda c: inspect(c).get_columns("tenants"))
            }
            assert "weight" not in columns
            assert await connection.scalar(text("SELECT count(*) FROM tenants")) == 1
    finally:
        await db.dispose()
