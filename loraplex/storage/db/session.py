"""Open a database: the async engine and the session factories for one URL.

Accepted URLs: ``sqlite+aiosqlite:///path/to.db`` and ``postgresql+asyncpg://user@host/db``;
``sqlite:///...`` and ``postgresql://...`` mean those drivers. ``Database.transaction()``
is the unit of work: services flush, the transaction commits (or rolls back on an error).

SQLite gets on every connection what a server needs from it:

| setting | why |
|---|---|
| ``PRAGMA foreign_keys=ON`` | off by default in SQLite: ON DELETE CASCADE would do nothing |
| ``PRAGMA journal_mode=WAL`` | readers and the one writer do not block each other |
| busy timeout | a writer waits for the lock instead of failing at once |
| SQLAlchemy emits ``BEGIN`` | the driver's legacy mode begins no transaction for SELECT or DDL (1) |

(1) so a migration would not be all-or-nothing, and SAVEPOINT would not nest.

SQLite is for one replica: the file is local, and a second process on another machine cannot
share it. Several replicas need PostgreSQL, whose connections get ``PoolSettings``: a pool of
``pool_size`` (+ ``max_overflow``) connections checked before use (pre-ping), a connect
timeout, and a statement timeout enforced by the client (asyncpg's ``command_timeout``: it
also fires when the server hangs) and by the server (``statement_timeout``). A request never
waits longer than those for the database; ``transaction()`` turns an outage into
``DatabaseUnavailable`` (``availability``) and ``health`` remembers it.

The price of real transactions on SQLite: a transaction that reads, then writes fails with
"database is locked" when another connection committed in between (its snapshot is stale,
and waiting cannot help). Open transactions that read and then write with ``write=True``:
on SQLite that is ``BEGIN IMMEDIATE`` (take the write lock first, wait for it); on
PostgreSQL it changes nothing (row locks and unique constraints do that job there).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sqlalchemy import URL, Connection, event, make_url, text
from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry

from loraplex.storage.db.availability import DatabaseHealth, DatabaseUnavailable, is_unavailable

logger = logging.getLogger(__name__)

Backend = Literal["sqlite", "postgresql"]

_DRIVERS: dict[str, tuple[Backend, str]] = {
    "sqlite": ("sqlite", "sqlite+aiosqlite"),
    "sqlite+aiosqlite": ("sqlite", "sqlite+aiosqlite"),
    "postgresql": ("postgresql", "postgresql+asyncpg"),
    "postgresql+asyncpg": ("postgresql", "postgresql+asyncpg"),
}
SQLITE_BUSY_TIMEOUT_S = 10.0
_WRITE_OPTION = "loraplex_write"  # execution option read by the SQLite BEGIN hook


@dataclass(frozen=True)
class PoolSettings:
    """How a server's PostgreSQL connections behave (SQLite, a local file, ignores them).

    ``None`` for a timeout means none (the CLI and migrations, which may wait on a lock)."""

    connect_timeout_s: float | None = None
    """Longest wait to open a connection (TCP + start-up), and for a pooled one to come free."""
    statement_timeout_s: float | None = None
    """Longest wait for one statement's answer (client side, and the server's statement_timeout)."""
    pool_size: int = 5
    max_overflow: int = 10
    pre_ping: bool = True
    """Check a pooled connection before handing it out (one that died with a restart is replaced)."""


class DatabaseURLError(ValueError):
    """The database URL names a backend or driver the gateway does not support."""


def database_url(url: str | URL) -> URL:
    """``url`` parsed, with the async driver of its backend; ``DatabaseURLError`` otherwise."""
    try:
        parsed = make_url(url)
    except ArgumentError as e:
        raise DatabaseURLError(f"not a database URL: {e}") from None
    driver = _DRIVERS.get(parsed.drivername)
    if driver is None:
        raise DatabaseURLError(
            f"unsupported database driver {parsed.drivername!r}: use sqlite+aiosqlite:///path.db "
            "or postgresql+asyncpg://user@host/dbname"
        )
    return parsed.set(drivername=driver[1])


def backend_of(url: URL) -> Backend:
    """``"sqlite"`` or ``"postgresql"``, for a URL ``database_url`` accepted."""
    return _DRIVERS[url.drivername][0]


def sqlite_file(url: URL) -> Path | None:
    """The database file of a SQLite URL; None for an in-memory database."""
    database = url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


def _configure_sqlite(engine: AsyncEngine) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
        # None = the driver never emits BEGIN itself; _on_begin does.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(connection: Connection) -> None:
        write = connection.get_execution_options().get(_WRITE_OPTION, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def create_engine(url: str | URL, *, echo: bool = False, pool: PoolSettings | None = None) -> AsyncEngine:
    """An async engine for ``url``, with the SQLite settings of the module docstring and, for
    PostgreSQL, ``pool`` (default: ``PoolSettings()``, no timeouts).

    A SQLite file's parent directory is created if missing (the default database lives
    in the data directory, which may not exist yet on a fresh machine).
    """
    pool = pool or PoolSettings()
    parsed = database_url(url)
    if backend_of(parsed) == "sqlite":
        path = sqlite_file(parsed)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        engine = create_async_engine(parsed, echo=echo, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_S})
        _configure_sqlite(engine)
        return engine
    connect_args: dict[str, object] = {}
    pool_args: dict[str, object] = {}
    if pool.connect_timeout_s is not None:
        connect_args["timeout"] = pool.connect_timeout_s
        pool_args["pool_timeout"] = pool.connect_timeout_s
    if pool.statement_timeout_s is not None:
        connect_args["command_timeout"] = pool.statement_timeout_s
        connect_args["server_settings"] = {"statement_timeout": str(int(pool.statement_timeout_s * 1000))}
    # pre_ping: a pooled connection that died with a PostgreSQL restart is replaced, not handed out.
    return create_async_engine(
        parsed,
        echo=echo,
        pool_pre_ping=pool.pre_ping,
        pool_size=pool.pool_size,
        max_overflow=pool.max_overflow,
        connect_args=connect_args,
        **pool_args,
    )


class Database:
    """The engine and session factories of one database URL.

    ``expire_on_commit=False``: an async session cannot lazily reload attributes, so objects
    a service returned stay readable after the transaction committed.
    """

    def __init__(self, url: str | URL, *, echo: bool = False, pool: PoolSettings | None = None) -> None:
        self.pool = pool or PoolSettings()
        self.engine = create_engine(url, echo=echo, pool=self.pool)
        self.health = DatabaseHealth()
        """Whether the database answers now, and how often it did not (``availability``)."""
        self.url: URL = self.engine.url
        self.backend: Backend = backend_of(self.url)
        self._sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        self._write_sessions = async_sessionmaker(
            self.engine.execution_options(**{_WRITE_OPTION: True}), expire_on_commit=False
        )

    def session(self, *, write: bool = False) -> AsyncSession:
        """A new session; the caller begins, commits and closes it."""
        return (self._write_sessions if write else self._sessions)()

    @asynccontextmanager
    async def transaction(self, *, write: bool = False) -> AsyncIterator[AsyncSession]:
        """A session in a transaction: committed when the block ends, rolled back if it raises.

        ``DatabaseUnavailable`` instead of the driver's error when a PostgreSQL database cannot
        be reached or does not answer in time, and at once during an outage (but for one probe
        per interval: ``DatabaseHealth``).
        """
        self.health.check()
        try:
            async with self.session(write=write) as session, session.begin():
                yield session
        except DatabaseUnavailable:
            raise
        except Exception as exc:
            # SQLite is a local file: its OperationalError ("database is locked": a stale snapshot
            # or a busy writer) is contention or a bug, not an outage, and propagates as it is.
            if self.backend == "postgresql" and is_unavailable(exc):
                raise self.health.failed(exc) from exc
            raise
        self.health.succeeded()

    async def ping(self) -> None:
        """One round trip (``SELECT 1``); ``DatabaseUnavailable`` if the database does not answer."""
        async with self.transaction() as session:
            await session.execute(text("SELECT 1"))

    async def dispose(self) -> None:
        """Close every pooled connection (at shutdown, and before dropping a test database)."""
        await self.engine.dispose()

    def __repr__(self) -> str:
        return f"Database({self.url.render_as_string(hide_password=True)!r})"
