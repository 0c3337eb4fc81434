"""Bring a database to the newest schema at start-up, safely when several replicas start at once.

    upgrade_to_head(engine)   take the migration lock, run Alembic ``upgrade head``, commit, release
    upgrade_database(db)      the same for a ``Database``, on an engine without its serving timeouts
    migration_lock(engine)    the lock alone: a connection in a transaction, committed on exit
    schema_diff(engine)       how the database differs from the models (empty list = no drift)

| backend | lock | released |
|---|---|---|
| PostgreSQL | ``pg_advisory_xact_lock``, on the migrating connection | at COMMIT / ROLLBACK, or if it drops |
| SQLite | ``flock`` on ``<database file>.migrate-lock`` | when the file is closed, or the process dies |

The lock is taken *before* Alembic reads the current revision, so the second replica reads the
revision the first one committed and has nothing left to do. The whole upgrade runs in the lock
holder's one transaction, and both backends have transactional DDL (SQLite through the ``BEGIN``
that ``session`` emits): a replica that dies mid-upgrade leaves the old schema behind, whole.
On SQLite, foreign keys are off while a migration runs and checked (``foreign_key_check``)
before it commits, as SQLite prescribes for schema changes. The SQLite lock file is never
deleted: removing it while another process waits on it would let a third process lock a new
file of the same name.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, func, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from loraplex.storage.db.availability import DatabaseUnavailable, describe, is_unavailable
from loraplex.storage.db.models import Base
from loraplex.storage.db.session import Database, PoolSettings, backend_of, create_engine, sqlite_file

logger = logging.getLogger(__name__)

SCRIPT_LOCATION = "loraplex.storage.db:migrations"
# Advisory lock keys are one bigint namespace shared by every application on the server: a
# number derived from this module's name keeps ours apart from theirs.
PG_LOCK_KEY = int.from_bytes(hashlib.sha256(b"loraplex.storage.db.migrate").digest()[:8], "big", signed=True)
_LOCK_POLL_S = 0.05


def alembic_config() -> Config:
    """An Alembic config for the packaged migrations (no alembic.ini needed)."""
    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    return config


def head_revision() -> str:
    """The newest revision in ``migrations/versions``."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no migrations found in {SCRIPT_LOCATION}")
    return head


async def current_revision(engine: AsyncEngine) -> str | None:
    """The revision the database is at; None for a database never migrated."""
    async with engine.connect() as connection:
        return await connection.run_sync(_current_revision)


@asynccontextmanager
async def migration_lock(engine: AsyncEngine) -> AsyncIterator[AsyncConnection]:
    """A connection in a transaction holding the migration lock; commits when the block ends."""
    if backend_of(engine.url) == "postgresql":
        async with engine.begin() as connection:
            await _pg_advisory_lock(connection)
            yield connection
    else:
        async with (
            _file_lock(sqlite_file(engine.url)),
            engine.connect() as connection,
            _sqlite_foreign_keys_deferred(connection),
        ):
            yield connection


@asynccontextmanager
async def _sqlite_foreign_keys_deferred(connection: AsyncConnection) -> AsyncIterator[None]:
    # SQLite's recipe for schema changes (lang_altertable.html): foreign keys off, change, check,
    # commit. With them on, the table rebuild of a batch migration (copy, DROP, rename) would
    # cascade the DROP of a parent table into its children's rows. The pragma does nothing
    # inside a transaction, so it goes to the driver before SQLAlchemy begins one; the
    # connection is then thrown away rather than returned to the pool with the pragma off.
    raw = await connection.get_raw_connection()
    driver = raw.driver_connection
    assert driver is not None, "a fresh checkout has a driver connection"
    await driver.execute("PRAGMA foreign_keys=OFF")
    try:
        async with connection.begin():
            yield
            violations = (await connection.exec_driver_sql("PRAGMA foreign_key_check")).all()
            if violations:
                raise RuntimeError(f"the migration left {len(violations)} rows breaking foreign keys")
    finally:
        await connection.invalidate()


async def upgrade_database(db: Database) -> str:
    """``upgrade_to_head`` for ``db``; ``DatabaseUnavailable`` if it cannot be reached.

    On PostgreSQL through an engine of its own with ``db``'s connect timeout but no statement
    timeout, since waiting for the migration lock (another replica migrating) is expected;
    SQLite has no timeouts to avoid (and an in-memory database exists in one engine only).
    """
    try:
        if db.backend == "sqlite":
            return await upgrade_to_head(db.engine)
        migrating = create_engine(db.url, pool=PoolSettings(connect_timeout_s=db.pool.connect_timeout_s))
        try:
            return await upgrade_to_head(migrating)
        finally:
            await migrating.dispose()
    except Exception as exc:
        if db.backend == "postgresql" and is_unavailable(exc):
            raise DatabaseUnavailable(f"The metadata database is unreachable ({describe(exc)}).") from exc
        raise


async def upgrade_to_head(engine: AsyncEngine) -> str:
    """Migrate the database to the newest revision under the migration lock; returns it."""
    config = alembic_config()
    async with migration_lock(engine) as connection:
        before = await connection.run_sync(_current_revision)
        await connection.run_sync(_upgrade, config)
        after = await connection.run_sync(_current_revision)
    if before != after:
        logger.info("database schema upgraded from %s to %s", before or "empty", after)
    if after is None:
        raise RuntimeError("alembic upgrade left no revision behind")
    return after


async def schema_diff(engine: AsyncEngine) -> list[object]:
    """Alembic's differences between the database and ``Base.metadata``; empty means no drift."""
    async with engine.connect() as connection:
        return await connection.run_sync(_schema_diff)


def _current_revision(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


def _upgrade(connection: Connection, config: Config) -> None:
    # env.py runs on this connection (already in the locked transaction) instead of opening one.
    config.attributes["connection"] = connection
    command.upgrade(config, "head")


def _schema_diff(connection: Connection) -> list[object]:
    context = MigrationContext.configure(connection, opts={"compare_type": True})
    return list(compare_metadata(context, Base.metadata))


async def _pg_advisory_lock(connection: AsyncConnection) -> None:
    if await connection.scalar(select(func.pg_try_advisory_xact_lock(PG_LOCK_KEY))):
        return
    logger.info("waiting for the migration lock: another replica is migrating the database")
    await connection.execute(select(func.pg_advisory_xact_lock(PG_LOCK_KEY)))


@asynccontextmanager
async def _file_lock(database: Path | None) -> AsyncIterator[None]:
    if database is None:  # in-memory: private to this process, nobody to wait for
        yield
        return
    fd = os.open(database.with_name(database.name + ".migrate-lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        # Polled, not a blocking flock: that would stall the event loop, and an open file
        # description (not a process) owns an flock, so a second engine in this same process
        # waits here like another replica does.
        waiting = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waiting:
                    logger.info("waiting for the migration lock on %s", database)
                    waiting = True
                await asyncio.sleep(_LOCK_POLL_S)
        yield
    finally:
        os.close(fd)
