"""``Gateway``: the multi-tenant services one app holds, and the operations that span them.

    database     tenants, keys, adapter rows, usage (SQLite or PostgreSQL; migrated at start-up)
    limiter      quotas: through Redis when ``redis_url`` is set (every replica), else in process
    store        the content-addressed adapter store, shared with the engine (served in place)
    catalog      uploads and deletions, keeping files, rows and the engine in step
    gate         ``TenantGate``: API keys, per-tenant models, quotas, usage records

Operations the routes (and the admin UI) call, so none of them lives in a route:

    delete_tenant(name)       rows, the adapter files nobody else uses, its engine adapters, its KV
    reset_prefix_cache()      every cached KV block on every tier (``EngineBusy`` while requests run)

At start-up (``start``): migrations under a lock (replicas may start together), the store opened,
the ``local`` tenant when auth="open". At shutdown (``stop``): pending usage written, the limiter
and the database closed. The engine belongs to the caller.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from loraplex.adapters.store import AdapterStore
from loraplex.adapters.uploads import AdapterValidator
from loraplex.platform.api.background import BackgroundWork
from loraplex.platform.api.catalog.catalog import AdapterCatalog
from loraplex.platform.api.catalog.engine_adapters import EngineAdapters
from loraplex.platform.api.services import tenants
from loraplex.platform.api.services.errors import EngineBusy
from loraplex.platform.api.tenancy.auth import local_tenant
from loraplex.platform.api.tenancy.quotas import QuotaSettings, RedisQuotaLimiter, make_quota_limiter
from loraplex.platform.api.tenancy.tenant_gate import TenantGate
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.settings import GatewaySettings
from loraplex.storage.db import Database, head_revision, upgrade_to_head

logger = logging.getLogger(__name__)

_DRAIN_S = 10.0


def quota_settings(settings: GatewaySettings) -> QuotaSettings:
    """The limiter's settings (the rest keep ``QuotaSettings``' defaults)."""
    return QuotaSettings(
        window_s=settings.quota_window_s,
        failure_policy=settings.quota_failure_policy,
        key_prefix=settings.quota_key_prefix,
    )


@dataclass(frozen=True)
class GatewayStats:
    """The gateway's own counters at one moment (the engine's are ``EngineStats``). They live on
    the event loop, so a snapshot taken there is consistent without a lock."""

    num_usage_write_failures: int
    """Usage records that could not be written (logged each time)."""
    num_background_pending: int
    num_background_failed: int
    quota_backend: str
    """``redis`` or ``local``."""
    quota_backend_down: bool
    """Redis for quotas is unreachable now (always False for the in-process limiter)."""
    num_quota_backend_failures: int
    num_quota_backend_outages: int


@dataclass(frozen=True)
class TenantDeleted:
    """What deleting a tenant removed."""

    name: str
    adapters_removed: int
    kv_blocks_purged: int


class Gateway:
    """The database, quotas, adapter store and catalog of one multi-tenant app."""

    def __init__(self, engine: AsyncEngine, settings: GatewaySettings, served_model_name: str) -> None:
        self.engine = engine
        self.settings = settings
        self.db = Database(settings.database_url_or_default)
        self.limiter = make_quota_limiter(settings.redis_url, quota_settings(settings))
        self.store = AdapterStore(settings.adapter_store_dir)
        self.engine_adapters = EngineAdapters(engine, self.store)
        limits = engine.limits
        self.catalog = AdapterCatalog(
            self.db,
            self.store,
            AdapterValidator(engine.adapter_spec, limits.max_lora_rank, limits.dtype),
            served_model_name,
            self.engine_adapters,
        )
        self.background = BackgroundWork()
        self.head_revision = head_revision()
        """The code's newest migration: ``/ready`` wants the database there."""
        self.gate = TenantGate(
            self.db,
            settings.auth,
            self.limiter,
            engine,
            self.engine_adapters,
            served_model_name,
            self.background,
        )

    async def start(self) -> None:
        """Migrate the database, open the store, create ``local`` in open mode."""
        revision = await upgrade_to_head(self.db.engine)
        self.store.open()
        if self.settings.auth == "open":
            await local_tenant(self.db)
        logger.info(
            "gateway ready: database at revision %s, adapter store %s, quotas %s, auth %s",
            revision,
            self.store.root,
            "in Redis" if self.settings.redis_url else "in process",
            self.settings.auth,
        )

    async def stop(self) -> None:
        """Write pending usage, close the limiter and the database."""
        await self.background.drain(_DRAIN_S)
        await self.limiter.aclose()
        await self.db.dispose()

    def stats(self) -> GatewayStats:
        """The gateway's counters now (call it on the event loop)."""
        health = self.limiter.health if isinstance(self.limiter, RedisQuotaLimiter) else None
        return GatewayStats(
            num_usage_write_failures=self.gate.num_usage_write_failures,
            num_background_pending=self.background.num_pending,
            num_background_failed=self.background.num_failed,
            quota_backend="local" if health is None else "redis",
            quota_backend_down=bool(health is not None and health.down),
            num_quota_backend_failures=0 if health is None else health.num_failures,
            num_quota_backend_outages=0 if health is None else health.num_outages,
        )

    # -- operations ----------------------------------------------------------------------
    async def delete_tenant(self, name: str) -> TenantDeleted:
        """Delete a tenant with its keys, adapters (files too), usage and cached KV on every tier.

        Its cached KV can never be hit again (a tenant created again gets another salt), but the
        disk tier's records are data derived from its prompts: they are erased now.
        """
        async with self.db.transaction(write=True) as session:
            engine_id = tenants.engine_tenant_id(await tenants.get_tenant(session, name))
            refs = await tenants.delete_tenant(session, name)
        await self.catalog.forget(refs)
        device, host, disk = await self.engine.purge_tenant(engine_id)
        return TenantDeleted(name, len(refs), device + host + disk)

    async def reset_prefix_cache(self) -> None:
        """Drop every cached KV block (device, host, disk records erased). The engine does it only
        when idle: ``EngineBusy`` while requests run (new ones keep coming; retry)."""
        if not await self.engine.reset_prefix_cache():
            raise EngineBusy(
                "Requests are running; the prefix cache can be reset only while the engine is idle. Retry."
            )
