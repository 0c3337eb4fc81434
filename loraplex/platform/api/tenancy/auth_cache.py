"""Authentication that survives a database outage: key checks cached for a short, bounded time.

    Authenticator(db, mode, ttl_s, stale_s, size).tenant(request)   the caller's tenant, or 401 / 503

Every API key's check (its tenant, with the quotas and status the tenant row had) is cached by
the key's sha256 for ``ttl_s``: within it the key is accepted without a database round trip,
which is also the bound on how late a revocation, an expiry, a deletion or a disabled tenant
reaches a replica (a key's own ``expires_at`` is honoured exactly; the replica whose admin API
made the change forgets its cache at once). After ``ttl_s`` the key is
checked again. While the database is unreachable (``DatabaseUnavailable``) a cached check up to
``ttl_s + stale_s`` old still serves; a key with no such entry gets 503 with ``Retry-After``,
never 401: the gateway cannot know whether the key is good.

Only keys that passed are cached: a wrong key is checked against the database every time, so a
new key works at once. Adapter resolutions (``model`` -> the version it runs on) use the same
``TTLCache`` in ``tenant_gate``, as the fallback of an outage only.

A change made through another replica reaches this one as a replica event (``replica_events``):
``drop_tenant`` (quotas, weight, disabled, deleted) and ``drop_key`` (revoked) make the cached
checks they concern stale at once, in O(1): each check remembers its tenant's epoch when it was
stored, and a revoked key id is remembered for as long as a cached check could outlive it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from typing import Generic, TypeVar

from starlette.requests import Request

from loraplex.platform.api.errors import unauthorized
from loraplex.platform.api.services import keys
from loraplex.platform.api.tenancy.auth import (
    LOCAL_TENANT,
    bearer_token,
    check_open_mode_credential,
    local_tenant,
)
from loraplex.platform.settings import AuthMode
from loraplex.storage.db import Database, DatabaseUnavailable, Tenant
from loraplex.storage.db.models import utcnow

K = TypeVar("K")
V = TypeVar("V")


class TTLCache(Generic[K, V]):
    """At most ``size`` entries, each with the ``time.monotonic()`` it was stored at; the least
    recently used goes first. Used on the event loop only (no lock)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[K, tuple[float, V]] = OrderedDict()

    def get(self, key: K, max_age_s: float) -> V | None:
        """The value stored for ``key`` less than ``max_age_s`` ago, else None."""
        entry = self._entries.get(key)
        if entry is None or time.monotonic() - entry[0] >= max_age_s:
            return None
        self._entries.move_to_end(key)
        return entry[1]

    def put(self, key: K, value: V) -> None:
        self._entries[key] = (time.monotonic(), value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def discard(self, key: K) -> None:
        self._entries.pop(key, None)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True)
class _Checked:
    tenant: Tenant
    expires_at: datetime | None
    key_id: int | None = None
    epoch: int = 0
    """The tenant's epoch when this was checked: a later ``drop_tenant`` makes it stale."""


class Authenticator:
    """The tenant of each request's API key (``local`` with auth="open"), through the cache."""

    def __init__(self, db: Database, mode: AuthMode, ttl_s: float, stale_s: float, size: int) -> None:
        self.db = db
        self.mode = mode
        self.ttl_s = ttl_s
        self.stale_s = stale_s
        self.cache: TTLCache[str, _Checked] = TTLCache(size)
        self.num_cache_hits = 0
        """Authentications answered from the cache within the TTL (no database round trip)."""
        self.num_outage_hits = 0
        """Authentications answered from the cache because the database was unreachable."""
        self._epochs: dict[int, int] = {}  # tenant id -> bumped by drop_tenant
        self._num_drops = 0  # drop_tenant calls so far
        self._revoked: dict[int, float] = {}  # key id -> monotonic time of the drop_key

    def forget(self) -> None:
        """Drop every cached check: after an operator changed keys or tenants through this replica,
        which then sees the change at once (the others through replica events, or the TTL)."""
        self.cache.clear()

    def drop_tenant(self, tenant_id: int) -> None:
        """Every cached check of tenant ``tenant_id``'s keys is stale from now on (its row changed)."""
        self._epochs[tenant_id] = self._epochs.get(tenant_id, 0) + 1
        self._num_drops += 1

    def drop_key(self, key_id: int) -> None:
        """The cached check of key ``key_id`` is stale from now on (it was revoked)."""
        now = time.monotonic()
        self._revoked[key_id] = now
        # Past ttl + stale no cached check is used any more: its mark can go.
        horizon = now - self.ttl_s - self.stale_s
        if len(self._revoked) > 1024:
            self._revoked = {k: t for k, t in self._revoked.items() if t > horizon}

    def _current(self, entry: _Checked) -> bool:
        """Not made stale by a replica event since it was checked."""
        if entry.epoch != self._epochs.get(entry.tenant.id, 0):
            return False
        return entry.key_id is None or entry.key_id not in self._revoked

    async def tenant(self, request: Request) -> Tenant:
        """The request's tenant; 401 for a missing, wrong, revoked or expired key or a disabled
        tenant; ``DatabaseUnavailable`` (503) when the database cannot tell and nothing is cached."""
        if self.mode == "open":
            check_open_mode_credential(request)
            return await self._through_cache(LOCAL_TENANT, None)
        token = bearer_token(request)
        if token is None:
            raise unauthorized(
                "You didn't provide an API key. Send it as 'Authorization: Bearer <API key>' "
                "(an operator creates keys with `loraplex keys create`)."
            )
        if not keys.well_formed(token):
            raise _refused()
        return await self._through_cache(keys.hash_key(token), token)

    async def _through_cache(self, key: str, token: str | None) -> Tenant:
        fresh = self.cache.get(key, self.ttl_s)
        if fresh is not None and _valid(fresh) and self._current(fresh):
            self.num_cache_hits += 1
            return fresh.tenant
        try:
            checked = await self._check(token)
        except DatabaseUnavailable:
            stale = self.cache.get(key, self.ttl_s + self.stale_s)
            if stale is None or not _valid(stale) or not self._current(stale):
                raise
            self.num_outage_hits += 1
            return stale.tenant
        if checked is None:
            self.cache.discard(key)
            raise _refused()
        self.cache.put(key, checked)
        return checked.tenant

    async def _check(self, token: str | None) -> _Checked | None:
        # A tenant event that lands while the database is read (the row may predate the change)
        # leaves this check stale, never current: it is stored under an epoch no tenant has.
        drops = self._num_drops
        if token is None:  # open mode: local_tenant raises 401 itself while it is disabled
            tenant = await local_tenant(self.db)
            return _Checked(tenant, None, None, self._epoch_since(tenant.id, drops))
        async with self.db.transaction() as session:
            checked = await keys.check_key(session, token)
        if checked is None:
            return None
        return _Checked(
            checked.tenant, checked.expires_at, checked.key_id, self._epoch_since(checked.tenant.id, drops)
        )

    def _epoch_since(self, tenant_id: int, drops: int) -> int:
        return self._epochs.get(tenant_id, 0) if drops == self._num_drops else -1


def _valid(entry: _Checked) -> bool:
    return entry.expires_at is None or entry.expires_at > utcnow()


def _refused() -> Exception:
    return unauthorized("Incorrect API key provided, or the key was revoked or has expired.")
