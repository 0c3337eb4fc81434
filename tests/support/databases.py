"""Databases for the tests: a throwaway PostgreSQL, and fixtures that run a test on SQLite *and* PostgreSQL.

Fixtures (a pytest plugin, listed in ``pytest_plugins`` of tests/conftest.py):

    database_url      a fresh, empty database of each backend: a file in tmp_path, or a new
                      PostgreSQL database (CREATE DATABASE with a random name, dropped after the test)
    database          a ``Database`` at head with no rows, disposed after the test: a new SQLite
                      file, or the test module's PostgreSQL database, emptied (TRUNCATE)
    postgres_server   the URL of the PostgreSQL the two above use (no database part)
    postgres_process  a PostgreSQL of the test module's own (``PostgresServer``), which its tests
                      may halt, resume, pause and unpause; stopped after the module

PostgreSQL is the server named by ``LORAPLEX_TEST_POSTGRES_URL`` (no database part, e.g.
``postgresql+asyncpg://postgres@127.0.0.1:5432``), else the one on 127.0.0.1:5432 (trust auth,
user postgres), else a throwaway one that ``start_postgres`` runs for the session.
``LORAPLEX_TEST_POSTGRES_URL=start`` forces the throwaway server. A PostgreSQL that cannot be had
fails the tests; it never skips them.

A missing server is never a reason to skip a test. When no PostgreSQL answers, ``start_postgres``
runs one from the machine's binaries (``initdb`` + ``pg_ctl`` from PATH, /usr/local/bin or
/usr/lib/postgresql/<version>/bin; as root, Debian's ``postgresql`` package is installed first
if none is found) in a temporary directory, on a free port, with trust auth for ``postgres``,
and deletes it all when stopped. ``initdb`` refuses to run as root, so as root the server runs
as the ``postgres`` system user (created if missing).

Outage tests take the server away under a running gateway and bring it back, on the same port
and data: ``halt()`` / ``resume()`` (a stopped server: connections refused) and ``pause()`` /
``unpause()`` (SIGSTOP on every server process: connections hang).
"""

from __future__ import annotations

import asyncio
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import asyncpg
import pytest
import pytest_asyncio
from sqlalchemy import make_url, text

from loraplex.storage.db import Base, Database, upgrade_to_head
from support.ports import free_port, port_open

_PG_USER = "postgres"


@dataclass
class PostgresServer:
    """A server started by ``start_postgres``; ``url`` names no database (add ``/dbname``)."""

    url: str
    data_dir: Path
    _bin_dir: Path
    _run_as: str | None
    _options: str = ""

    def halt(self) -> None:
        """Stop the server at once, keeping its data (``resume`` starts it again)."""
        pg_ctl = [str(self._bin_dir / "pg_ctl"), "-D", str(self.data_dir)]
        _run(self._run_as, [*pg_ctl, "-m", "immediate", "stop"])

    def resume(self) -> None:
        """Start a halted server again on the same port and data (nothing if it runs)."""
        if (self.data_dir / "postmaster.pid").exists():
            return
        log = str(self.data_dir.parent / "server.log")
        pg_ctl = [str(self._bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-l", log]
        _run(self._run_as, [*pg_ctl, "-w", "-t", "60", "-o", self._options, "start"])

    def pause(self) -> None:
        """SIGSTOP the postmaster and every backend: the port accepts, nothing answers."""
        for pid in self._pids():
            os.kill(pid, signal.SIGSTOP)

    def unpause(self) -> None:
        for pid in self._pids():
            os.kill(pid, signal.SIGCONT)

    def _pids(self) -> list[int]:
        postmaster = int((self.data_dir / "postmaster.pid").read_text().split()[0])
        children = subprocess.run(
            ["pgrep", "-P", str(postmaster)], capture_output=True, text=True, check=False
        ).stdout.split()
        return [postmaster, *(int(pid) for pid in children)]

    def stop(self) -> None:
        """Stop the server at once (no checkpoint: its data is thrown away) and delete its files."""
        try:
            pg_ctl = [str(self._bin_dir / "pg_ctl"), "-D", str(self.data_dir)]
            _run(self._run_as, [*pg_ctl, "-m", "immediate", "stop"])
        finally:
            shutil.rmtree(self.data_dir.parent, ignore_errors=True)


def find_postgres_bin() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl``, newest major version first."""
    candidates: list[Path] = []
    on_path = shutil.which("pg_ctl")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)
    candidates.append(Path("/usr/local/bin"))
    installed = Path("/usr/lib/postgresql").glob("*/bin")
    candidates += sorted(
        installed, key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0, reverse=True
    )
    for directory in candidates:
        if (directory / "initdb").exists() and (directory / "pg_ctl").exists():
            return directory
    return None


def start_postgres() -> PostgresServer:
    """Start a throwaway PostgreSQL on 127.0.0.1 and a free port; ``RuntimeError`` if impossible."""
    bin_dir = find_postgres_bin()
    if bin_dir is None:
        _install_postgres()
        bin_dir = find_postgres_bin()
        if bin_dir is None:
            raise RuntimeError("PostgreSQL was installed but initdb/pg_ctl are still not found")
    run_as = _server_user()
    root = Path(tempfile.mkdtemp(prefix="loraplex-pg-"))
    data_dir = root / "data"
    if run_as is not None:
        entry = pwd.getpwnam(run_as)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    initdb = [str(bin_dir / "initdb"), "-D", str(data_dir), "-U", _PG_USER, "-A", "trust", "-E", "UTF8"]
    _run(run_as, [*initdb, "--no-sync", "--no-instructions"])
    port = free_port()
    # Durability is pointless for data thrown away at the end: no fsync makes every test faster.
    options = f"-p {port} -c listen_addresses=127.0.0.1 -k {root} -c fsync=off -c full_page_writes=off"
    pg_ctl = [str(bin_dir / "pg_ctl"), "-D", str(data_dir), "-l", str(root / "server.log")]
    _run(run_as, [*pg_ctl, "-w", "-t", "60", "-o", options, "start"])
    return PostgresServer(
        f"postgresql+asyncpg://{_PG_USER}@127.0.0.1:{port}", data_dir, bin_dir, run_as, options
    )


def _server_user() -> str | None:
    if os.geteuid() != 0:
        return None  # initdb runs as whoever we are
    try:
        pwd.getpwnam(_PG_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", _PG_USER], check=True
        )
    return _PG_USER


def _install_postgres() -> None:
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise RuntimeError(
            "no PostgreSQL answers on 127.0.0.1:5432 and no initdb/pg_ctl was found: install PostgreSQL "
            "(Debian: apt-get install postgresql) or set LORAPLEX_TEST_POSTGRES_URL"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "postgresql"], check=True, env=env)


def _run(run_as: str | None, argv: Sequence[str]) -> None:
    command = list(argv) if run_as is None else ["runuser", "-u", run_as, "--", *argv]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd="/")
    if result.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )


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


@pytest.fixture(scope="module")
def postgres_process() -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL of the test module's own: its tests may halt and pause it."""
    server = start_postgres()
    try:
        yield server
    finally:
        if (server.data_dir / "postmaster.pid").exists():
            server.unpause()  # a test that paused it and failed
        server.stop()


def _asyncpg_dsn(server: str, database: str) -> str:
    return (
        make_url(server).set(drivername="postgresql", database=database).render_as_string(hide_password=False)
    )


async def create_database(server: str, name: str) -> str:
    """CREATE DATABASE ``name`` on ``server`` (a URL with no database part); the new database's URL."""
    admin = await asyncpg.connect(_asyncpg_dsn(server, "postgres"))
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    return make_url(server).set(database=name).render_as_string(hide_password=False)


async def drop_database(server: str, name: str) -> None:
    """DROP DATABASE ``name`` on ``server``, closing whatever is still connected to it."""
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
    url = await create_database(server, name)
    try:
        yield url
    finally:
        await drop_database(server, name)


@pytest.fixture(scope="module")
def migrated_postgres(postgres_server: str) -> Iterator[str]:
    """A PostgreSQL database migrated to head, shared by one test module (``database`` empties it)."""
    name = f"loraplex_test_{secrets.token_hex(6)}"
    url = _run_in_thread(create_database(postgres_server, name))
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
        _run_in_thread(drop_database(postgres_server, name))


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
