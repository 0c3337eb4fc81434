"""The gateway's metadata database: tenants, API keys, adapters, usage (SQLAlchemy 2, async).

- ``models``: the tables as ``Mapped[...]`` classes (``Tenant``, ``ApiKey``, ``Adapter``,
  ``UsageRecord``), with timezone-aware UTC timestamps on every backend;
- ``session``: ``Database`` (engine + sessions for a ``sqlite+aiosqlite`` or
  ``postgresql+asyncpg`` URL) and what SQLite needs to behave as a server's database;
- ``availability``: ``DatabaseUnavailable`` (what an outage raises) and ``DatabaseHealth``;
- ``migrate``: ``upgrade_to_head`` under a lock at start-up (several replicas at once),
  ``schema_diff`` for drift checks;
- ``migrations/``: Alembic's environment and the revisions (``versions/NNNN_*.py``).

What the tables mean to tenants (who may see what) is the gateway's business:
``loraplex.platform.api.services``. Nothing here imports the platform or the adapters.
"""

from loraplex.storage.db.availability import DatabaseHealth, DatabaseUnavailable, is_unavailable
from loraplex.storage.db.migrate import (
    current_revision,
    head_revision,
    schema_diff,
    upgrade_database,
    upgrade_to_head,
)
from loraplex.storage.db.models import (
    USAGE_STATUSES,
    VISIBILITIES,
    Adapter,
    ApiKey,
    Base,
    Tenant,
    UsageRecord,
    UsageStatus,
    Visibility,
)
from loraplex.storage.db.session import (
    Backend,
    Database,
    DatabaseURLError,
    PoolSettings,
    create_engine,
    database_url,
)

__all__ = [
    "USAGE_STATUSES",
    "VISIBILITIES",
    "Adapter",
    "ApiKey",
    "Backend",
    "Base",
    "Database",
    "DatabaseHealth",
    "DatabaseURLError",
    "DatabaseUnavailable",
    "PoolSettings",
    "Tenant",
    "UsageRecord",
    "UsageStatus",
    "Visibility",
    "create_engine",
    "current_revision",
    "database_url",
    "head_revision",
    "is_unavailable",
    "schema_diff",
    "upgrade_database",
    "upgrade_to_head",
]
