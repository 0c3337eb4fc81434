"""``loraplex db upgrade``, the chart's migration Job, racing itself (a Job and a replica's start-up,
or a Job run twice): both succeed and the database ends at head. On PostgreSQL the test holds the
migration lock first, so both are made to wait on it and then race for real."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy import make_url

from loraplex.storage.db import Database, current_revision, head_revision, schema_diff
from loraplex.storage.db.migrate import PG_LOCK_KEY

COMMAND = [sys.executable, "-m", "loraplex.cli", "db", "upgrade"]


def start_upgrades(database_url: str, cwd: Path, count: int = 2) -> list[subprocess.Popen[str]]:
    env = {**os.environ, "LORAPLEX_DATABASE_URL": database_url}
    return [
        subprocess.Popen(COMMAND, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(count)
    ]


def finish(runs: list[subprocess.Popen[str]]) -> None:
    head = head_revision()
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
        assert out.strip() == f"database at revision {head}"


async def at_head(database_url: str) -> bool:
    db = Database(database_url)
    try:
        return await current_revision(db.engine) == head_revision() and await schema_diff(db.engine) == []
    finally:
        await db.dispose()


@pytest.mark.slow
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_two_upgrades_at_once_on_sqlite(database_url: str, tmp_path: Path) -> None:
    finish(start_upgrades(database_url, tmp_path))
    assert asyncio.run(at_head(database_url))


@pytest.mark.slow
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
@pytest.mark.asyncio
async def test_two_upgrades_wait_for_the_lock_then_migrate_once_on_postgresql(
    database_url: str, tmp_path: Path
) -> None:
    dsn = make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)
    holder = await asyncpg.connect(dsn)
    try:
        await holder.execute("SELECT pg_advisory_lock($1)", PG_LOCK_KEY)
        runs = await asyncio.to_thread(start_upgrades, database_url, tmp_path)
        # Both reach the lock and wait on it (advisory locks are per database: only ours count).
        waiting_sql = (
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
            "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        for _ in range(1200):
            if await holder.fetchval(waiting_sql) == 2:
                break
            assert all(run.poll() is None for run in runs), [run.communicate() for run in runs]
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the upgrades never waited for the migration lock")
        tables = await holder.fetchval("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
        assert tables == 0, "a migration ran while another holder had the lock"
    finally:
        await holder.close()  # releases the lock: the two race for it now
    await asyncio.to_thread(finish, runs)
    assert await at_head(database_url)
