"""Alembic environment for the gateway's database.

At start-up ``migrate.upgrade_to_head`` hands over its connection, already in the transaction
that holds the migration lock, in ``config.attributes["connection"]``. Run any other way (the
``alembic`` command while writing a migration: see README.md here), this file opens the
database named by ``-x url=...`` or ``sqlalchemy.url`` and takes the same lock itself.
"""

from __future__ import annotations

import asyncio
from typing import Literal

from alembic import context
from alembic.autogenerate.api import AutogenContext
from sqlalchemy import Connection

from loraplex.storage.db.migrate import migration_lock
from loraplex.storage.db.models import Base, UTCDateTime
from loraplex.storage.db.session import create_engine


def _render_item(kind: str, item: object, _context: AutogenContext) -> str | Literal[False]:
    # Revisions must not import the models (they change; a revision must not): UTCDateTime
    # converts in Python only, its column is a plain timestamptz.
    if kind == "type" and isinstance(item, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        compare_type=True,
        render_item=_render_item,
        # SQLite cannot ALTER most things in place; batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def _url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url") or context.config.get_main_option(
        "sqlalchemy.url"
    )
    if not url:
        raise RuntimeError("no database: pass -x url=sqlite+aiosqlite:///path.db (or set sqlalchemy.url)")
    return url


async def _run_on_own_connection(url: str) -> None:
    engine = create_engine(url)
    try:
        async with migration_lock(engine) as connection:
            await connection.run_sync(_run)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=Base.metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    given = context.config.attributes.get("connection")
    if given is None:
        asyncio.run(_run_on_own_connection(_url()))
    else:
        _run(given)
