"""Database fixtures: every test that takes one runs on SQLite *and* on PostgreSQL.

    database_url   a fresh, empty database: a file in tmp_path, or a new PostgreSQL database
                   (CREATE DATABASE with a random name, dropped after the test)
    database       a ``Database`` at head with no rows, disposed after the test: a new SQLite
                   file, or the test module's PostgreSQL database, emptied (TRUNCATE)

PostgreSQL is the server named by ``LORAPLEX_TEST_POSTGRES_URL`` (no database part, e.g.
``postgresql+asyncpg://postgres@127.0.0.1:5432``), else the one on 127.0.0.1:5432 (trust auth,
user postgres), else a throwaway one that ``service_starters.start_postgres`` runs for the
session. ``LORAPLEX_TEST_POSTGRES_URL=start`` forces the throwaway server. A PostgreSQL that
cannot be had fails the tests; it never skips them.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import AsyncIterator, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import asyncpg
import pytest
import pytest_asyncio
from service_starters import port_open, start_postgres
from sqlalchemy import make_url, text

from loraplex.storage.db import Base, Database, upgrade_to_head

POSTGRES_ENV = "LORAPLEX_TEST_POSTGRES_URL"
DATABASES = ("sqlite", "postgresql")
T = TypeVar("T")


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[str]:
    """The URL of a PostgreSQL server (no database part) the tests may create databases on."""
    given = os.environ.get(POSTGRES_ENV, "")
    if given and given != "start":
        yield given
        return
    if given != "start" and port_open("127.0.0.1", 5432):
        yield "postgresql+asyncpg://postgres@127.0.0.1:5432"
        return
    server = start_postgres()
    try:
        yield server.url
    finally:
        server.stop()


def _asyncpg_dsn(server: str, database: str) -> str:
    return (
        make_url(server).set(drivername="postgresql", database=database).render_as_string(hide_password=False)
    )


async def _create_database(server: str, name: str) -> str:
    admin = await asyncpg.connect(_asyncpg_dsn(server, "postgres"))
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return make_url(server).set(database=name).render_as_string(hide_password=False)


async def _drop_database(server: str, name: str) -> None:
    admin = await asyncpg.connect(_asyncpg_dsn(server, "postgres"))
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


def _run_in_thread(coroutine: Coroutine[object, object, T]) -> T:
    # A loop of its own in another thread: module-scoped set-up must not touch the test's loop.
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


@pytest_asyncio.fixture(params=DATABASES)
async def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A fresh, empty database of each backend."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
        return
    server: str = request.getfixturevalue("postgres_server")  # only runs that use PostgreSQL need it
    name = f"loraplex_test_{secrets.token_hex(6)}"
    url = await _create_database(server, name)
    try:
        yield url
    finally:
        await _drop_database(server, name)


@pytest.fixture(scope="module")
def migrated_postgres(postgres_server: str) -> Iterator[str]:
    """A PostgreSQL database migrated to head, shared by one test module (``database`` empties it)."""
    name = f"loraplex_test_{secrets.token_hex(6)}"
    url = _run_in_thread(_create_database(postgres_server, name))
    try:

        async def migrate() -> None:
            db = Database(url)
            try:
                await upgrade_to_head(db.engine)
            finally:
                await db.dispose()

        _run_in_thread(migrate())
        yield url
    finally:
        _run_in_thread(_drop_database(postgres_server, name))


@pytest_asyncio.fixture(params=DATABASES)
async def database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Database]:
    """A ``Database`` at head with no rows: a new SQLite file, or the module's PostgreSQL emptied.

    Creating and migrating a PostgreSQL database takes about a second; emptying one, a few ms.
    """
    if request.param == "sqlite":
        db = Database(f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}")
        try:
            await upgrade_to_head(db.engine)
            yield db
        finally:
            await db.dispose()
        return
    db = Database(request.getfixturevalue("migrated_postgres"))
    try:
        async with db.engine.begin() as connection:
            tables = ", ".join(table.name for table in Base.metadata.sorted_tables)
            await connection.execute(text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
        yield db
    finally:
        await db.dispose()
