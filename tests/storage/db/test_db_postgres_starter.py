"""The throwaway PostgreSQL the database fixtures fall back on when the machine runs none.

CI machines of this project run a PostgreSQL, so the fixtures rarely need this path: this test
keeps it working, so that a machine without the service fails or passes on the code, never on
a starter nobody ran.
"""

from __future__ import annotations

import pytest
from sqlalchemy import make_url
from support.databases import start_postgres
from support.ports import port_open

from loraplex.storage.db import Database, head_revision, schema_diff, upgrade_to_head


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_throwaway_postgres_starts_migrates_and_goes_away() -> None:
    server = start_postgres()
    try:
        url = make_url(server.url)
        assert url.host == "127.0.0.1" and url.port is not None and url.port != 5432
        assert port_open("127.0.0.1", url.port)
        db = Database(url.set(database="postgres"))
        try:
            assert await upgrade_to_head(db.engine) == head_revision()
            assert await schema_diff(db.engine) == []
        finally:
            await db.dispose()
    finally:
        server.stop()
    assert not port_open("127.0.0.1", url.port)
    assert not server.data_dir.exists()
