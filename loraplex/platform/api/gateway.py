"""``Gateway``: the multi-tenant services one app holds, and the operations that span them.

    database     tenants, keys, adapter rows, usage (SQLite or PostgreSQL; migrated at start-up)
    limiter      quotas: through Redis when ``redis_url`` is set (every replica), else in process
    store        the content-addressed adapter store, shared with the engine (served in place)
    catalog      uploads and deletions, keeping files, rows and the engine in step
    gate         ``TenantGate``: API keys (``Authenticator``, cached), per-tenant models, quotas
    usage        ``UsageBuffer``: usage records on their way to the database (an outage delays them)

Operations the routes (and the admin UI) call, so none of them lives in a route:

    delete_tenant(name)       rows, the adapter files nobody else uses, its engine adapters, its KV
                              (here, and on the other replicas through ``replica_events``)
    reset_prefix_cache()      every cached KV block on every tier (``EngineBusy`` while requests run)

and what a route calls after it committed a change that other replicas cache: this replica acts
at once, the others when the replica event arrives (``replica_events``; the TTL otherwise)::

    tenant_changed(tenant)          quotas, weight, disabled: cached key checks go (requests end)
    key_revoked(key_id, tenant_id)  that key's cached check goes
    adapter_changed(owner, name)    (the catalog calls it) cached resolutions and engine versions go

At start-up (``start``): migrations under a lock (replicas may start together; on a connection
without the serving timeouts, as waiting for that lock is expected), the store opened, the
``local`` tenant when auth="open", the usage writer started. At shutdown (``stop``): pending
usage written, the limiter and the database closed. The engine belongs to the caller.

While the database is unreachable, what needs it answers 503 + ``Retry-After``
(``DatabaseUnavailable``); known keys and their adapters keep serving from the caches, usage
waits in the buffer (docs/operations.md, "Database outages").
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import Request

from loraplex.adapters import AdapterValidationError
from loraplex.adapters.store import AdapterStore
from loraplex.adapters.uploads import AdapterValidator
from loraplex.platform.api.background import BackgroundWork
from loraplex.platform.api.catalog.catalog import AdapterCatalog, parse_visibility
from loraplex.platform.api.catalog.engine_adapters import EngineAdapters
from loraplex.platform.api.catalog.runtime_loras import RuntimeLoRAs
from loraplex.platform.api.catalog.upload_form import UploadDeadlines, read_upload_form
from loraplex.platform.api.errors import bad_field, rejected_adapter
from loraplex.platform.api.gateway_stats import GatewayStats
from loraplex.platform.api.services import tenants
from loraplex.platform.api.services.errors import EngineBusy
from loraplex.platform.api.tenancy import replica_events
from loraplex.platform.api.tenancy.auth import local_tenant
from loraplex.platform.api.tenancy.auth_cache import Authenticator
from loraplex.platform.api.tenancy.quotas import QuotaSettings, RedisQuotaLimiter, make_quota_limiter
from loraplex.platform.api.tenancy.replica_events import ReplicaEvents
from loraplex.platform.api.tenancy.tenant_gate import TenantGate
from loraplex.platform.api.tenancy.upload_admission import UploadAdmission
from loraplex.platform.api.usage_buffer import UsageBuffer
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.settings import GatewaySettings
from loraplex.storage.db import (
    Adapter,
    Database,
    DatabaseUnavailable,
    PoolSettings,
    Tenant,
    head_revision,
    upgrade_database,
)
from loraplex.storage.db.session import sqlite_file

logger = logging.getLogger(__name__)

_DRAIN_S = 10.0


def pool_settings(settings: GatewaySettings) -> PoolSettings:
    """The serving connections' pool and timeouts (PostgreSQL; SQLite ignores them)."""
    return PoolSettings(
        connect_timeout_s=settings.database_connect_timeout_s,
        statement_timeout_s=settings.database_statement_timeout_s,
        pool_size=settings.database_pool_size,
        max_overflow=settings.database_max_overflow,
        pre_ping=settings.database_pool_pre_ping,
    )


def quota_settings(settings: GatewaySettings) -> QuotaSettings:
    """The limiter's settings (the rest keep ``QuotaSettings``' defaults)."""
    return QuotaSettings(
        window_s=settings.quota_window_s,
        failure_policy=settings.quota_failure_policy,
        key_prefix=settings.quota_key_prefix,
    )


def _restrict_sqlite_files(db: Database) -> None:
    """A SQLite database holds key hashes and usage: only this user may read it (0600)."""
    path = sqlite_file(db.url) if db.backend == "sqlite" else None
    if path is None:
        return
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(f"{path}{suffix}", 0o600)


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
        self.db = Database(settings.database_url_or_default, pool=pool_settings(settings))
        self.limiter = make_quota_limiter(settings.redis_url, quota_settings(settings))
        self.store = AdapterStore(settings.adapter_store_dir)
        self.engine_adapters = EngineAdapters(engine, self.store, settings.operator_tenant)
        limits = engine.limits
        validator = AdapterValidator(engine.adapter_spec, limits.max_lora_rank, limits.dtype)
        self.max_upload_bytes = settings.max_upload_bytes or validator.max_upload_bytes
        """Largest upload (files together): the setting, else sized from the largest valid adapter."""
        self.upload_deadlines = UploadDeadlines(settings.upload_idle_timeout_s, settings.upload_timeout_s)
        self.upload_executor = ThreadPoolExecutor(settings.upload_workers, thread_name_prefix="lpx-upload")
        self.catalog = AdapterCatalog(
            self.db, self.store, validator, served_model_name, self.engine_adapters, self.upload_executor
        )
        self.background = BackgroundWork()
        # Replicas share Redis when there is more than one: the channel that reaches the others.
        self.replica_events = (
            ReplicaEvents.from_url(settings.redis_url, settings.quota_key_prefix)
            if settings.redis_url
            else None
        )
        self.usage = UsageBuffer(self.db, settings.usage_buffer_size)
        authenticator = Authenticator(
            self.db,
            settings.auth,
            ttl_s=settings.auth_cache_ttl_s,
            stale_s=settings.auth_cache_stale_s,
            size=settings.auth_cache_size,
        )
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
            authenticator,
            self.usage,
            shared_tenant=settings.operator_tenant,
            max_sequences_per_tenant=settings.max_sequences_per_tenant,
        )
        self.uploads = UploadAdmission(self.gate, settings.max_uploads_per_tenant)
        self.runtime_loras = RuntimeLoRAs(
            self.db, self.catalog, settings.operator_tenant, settings.lora_load_root, self.max_upload_bytes
        )
        """``/v1/load_lora_adapter``: the operator's adapters, public, loaded at run time."""
        self.on_tenant_deleted: list[Callable[[str], None]] = []
        """Called with a tenant's name once it is deleted, here or on another replica (the
        metrics drop its series)."""

    async def start(self) -> None:
        """Migrate the database, open the store, create ``local`` in open mode."""
        revision = await upgrade_database(self.db)
        _restrict_sqlite_files(self.db)
        self.store.open()
        await self.catalog.sweep()
        if self.settings.auth == "open":
            await local_tenant(self.db)
        self.usage.start()
        self.catalog.on_change = self.adapter_changed
        if self.replica_events is not None:
            await self.replica_events.start(self._on_replica_event)
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
        await self.usage.flush(_DRAIN_S)
        self.upload_executor.shutdown(wait=False, cancel_futures=True)
        if self.replica_events is not None:
            await self.replica_events.aclose()
        await self.limiter.aclose()
        await self.db.dispose()

    async def receive_upload(self, request: Request, tenant: Tenant) -> Adapter:
        """Read a multipart upload (``name``, ``visibility``, the files) and store it for ``tenant``:
        the one code path of uploads, for ``POST /v1/adapters`` and the admin UI's upload form."""
        async with self.uploads.admit(tenant):  # rpm, concurrency, uploads in flight: before the body
            staging = self.store.new_staging()
            try:
                form = await read_upload_form(request, staging, self.max_upload_bytes, self.upload_deadlines)
                name = form.fields.get("name")
                if not name:
                    raise bad_field("name", "Missing required field 'name' (the adapter's name).")
                given = form.fields.get("visibility")
                visibility = parse_visibility(given) if given else None  # None: keep the name's
                try:
                    return await self.catalog.upload(tenant, form.files, staging, name, visibility)
                except AdapterValidationError as exc:
                    raise rejected_adapter(exc, hide=(str(staging),)) from None
            finally:
                self.store.discard(staging)

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
            database_down=self.db.health.down,
            num_database_errors=self.db.health.num_errors,
            num_database_outages=self.db.health.num_outages,
            num_auth_cache_hits=self.gate.authenticator.num_cache_hits,
            num_auth_cache_outage_hits=(
                self.gate.authenticator.num_outage_hits + self.gate.num_resolution_outage_hits
            ),
            num_usage_pending=self.usage.num_pending,
            num_usage_dropped=self.usage.num_dropped,
            num_quota_refusals=self.gate.num_quota_refusals,
        )

    async def database_ready(self) -> tuple[bool, str]:
        """(True, "") when the metadata database answers a round trip now; else (False, why).

        For ``/ready``: within the connect / statement timeouts, and at once during an outage
        between probes. Known keys keep serving meanwhile, so a replica that is not ready for
        the database can still be worth keeping in a load balancer: that is /ready's call.
        """
        try:
            await self.db.ping()
        except DatabaseUnavailable as exc:
            return False, exc.reason
        return True, ""

    # -- operations ----------------------------------------------------------------------
    async def delete_tenant(self, name: str) -> TenantDeleted:
        """Delete a tenant with its keys, adapters (files too), usage and cached KV on every tier.

        Its cached KV can never be hit again (a tenant created again gets another salt), but the
        disk tier's records are data derived from its prompts: they are erased now.
        """
        async with self.db.transaction(write=True) as session:
            tenant = await tenants.get_tenant(session, name)
            tenant_id, engine_id = tenant.id, tenants.engine_tenant_id(tenant)
            refs = await tenants.delete_tenant(session, name)
        self.gate.authenticator.drop_tenant(tenant_id)
        self.gate.revoke(tenant_id, deleted=True)
        await self.catalog.forget(refs)
        device, host, disk = await self.engine.purge_tenant(engine_id)
        self._tenant_gone(name)
        await self._publish(replica_events.TenantDeleted(engine_id, tenant_id, name))
        return TenantDeleted(name, len(refs), device + host + disk)

    # -- changes the other replicas must hear of ---------------------------------------------
    async def tenant_changed(self, tenant: Tenant) -> None:
        """``tenant``'s row changed and is committed (quotas, weight, disabled): its cached key
        checks go here now (and its running requests end if it is disabled), then elsewhere."""
        self.gate.authenticator.drop_tenant(tenant.id)
        if tenant.disabled:
            self.gate.revoke(tenant.id, deleted=False)
        await self._publish(replica_events.TenantChanged(tenant.id, tenant.disabled))

    async def key_revoked(self, key_id: int, tenant_id: int) -> None:
        """Key ``key_id`` was revoked (committed): its cached check goes here now, then elsewhere."""
        self.gate.authenticator.drop_key(key_id)
        await self._publish(replica_events.KeyRevoked(key_id, tenant_id))

    async def adapter_changed(self, owner: str, name: str) -> None:
        """``owner``'s adapter ``name`` got a version or lost some (committed; the catalog calls this):
        cached resolutions of it go here now, then elsewhere, where its engine versions go too."""
        self.gate.drop_resolutions(owner, name)
        await self._publish(replica_events.AdapterChanged(owner, name))

    async def _publish(self, event: replica_events.ReplicaEvent) -> None:
        if self.replica_events is not None:
            await self.replica_events.publish(event)

    async def _on_replica_event(self, event: replica_events.ReplicaEvent) -> None:
        """Another replica changed something this one caches: drop it (``replica_events``)."""
        if isinstance(event, replica_events.TenantDeleted):
            await self._deleted_elsewhere(event)
        elif isinstance(event, replica_events.TenantChanged):
            self.gate.authenticator.drop_tenant(event.tenant_id)
            if event.disabled:
                self.gate.revoke(event.tenant_id, deleted=False)
        elif isinstance(event, replica_events.KeyRevoked):
            self.gate.authenticator.drop_key(event.key_id)
        else:
            self.gate.drop_resolutions(event.owner, event.name)
            await self.engine_adapters.unload_name(event.owner, event.name)

    def _tenant_gone(self, name: str) -> None:
        for listener in self.on_tenant_deleted:
            listener(name)

    async def _deleted_elsewhere(self, event: replica_events.TenantDeleted) -> None:
        if event.tenant_id is not None:
            self.gate.authenticator.drop_tenant(event.tenant_id)
            self.gate.revoke(event.tenant_id, deleted=True)
        if event.name is not None:
            self._tenant_gone(event.name)
            await self.engine_adapters.unload_owner(event.name)
        device, host, disk = await self.engine.purge_tenant(event.tenant)
        logger.info(
            "tenant %s was deleted on another replica: purged %d cached KV blocks here "
            "(device %d, host %d, disk %d)",
            event.tenant,
            device + host + disk,
            device,
            host,
            disk,
        )

    async def reset_prefix_cache(self) -> None:
        """Drop every cached KV block (device, host, disk records erased). The engine does it only
        when idle: ``EngineBusy`` while requests run (new ones keep coming; retry)."""
        if not await self.engine.reset_prefix_cache():
            raise EngineBusy(
                "Requests are running; the prefix cache can be reset only while the engine is idle. Retry."
            )
