"""``loraplex db upgrade``, the chart's migration Job: two at once (a Job racing a replica's
start-up, or a re-run Job) both succeed and leave the database at head, once."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from loraplex.storage.db import Database, current_revision, head_revision, schema_diff


def _upgrade_twice_at_once(database_url: str, cwd: Path) -> list[subprocess.CompletedProcess[str]]:
    env = {**os.environ, "LORAPLEX_DATABASE_URL": database_url}
    command = [sys.executable, "-m", "loraplex.platform.cli", "db", "upgrade"]
    runs = [
        subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    done = []
    for run in runs:
        out, err = run.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(command, run.returncode, out, err))
    return done


def test_two_concurrent_upgrades_leave_the_database_at_head(database_url: str, tmp_path: Path) -> None:
    runs = _upgrade_twice_at_once(database_url, tmp_path)
    head = head_revision()
    for run in runs:
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == f"database at revision {head}"
    # One of them upgraded, the other waited for the lock and found nothing to do.
    upgraded = [run for run in runs if "database schema upgraded from empty" in run.stderr]
    assert len(upgraded) <= 1, [run.stderr for run in runs]

    async def check() -> None:
        db = Database(database_url)
        try:
            assert await current_revision(db.engine) == head
            assert await schema_diff(db.engine) == []
        finally:
            await db.dispose()

    asyncio.run(check())
