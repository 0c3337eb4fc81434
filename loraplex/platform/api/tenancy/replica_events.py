"""Events one replica tells the others through Redis pub/sub: a tenant deleted here, purge its KV there.

    events = ReplicaEvents.from_url(redis_url, key_prefix)
    await events.start(on_tenant_deleted)        subscribe, then deliver others' events to the callback
    await events.tenant_deleted(engine_tenant)   after this replica deleted the tenant and purged its KV
    await events.aclose()

Only the purge travels this way. Everything else replicas share is read from the database or
Redis: adapter versions per request (a re-upload is current on every replica at its next
request), API keys through a cache of checks (a revocation within ``auth_cache_ttl_s``), quotas
in Redis. A deleted tenant's cached KV is the one
thing no request looks up again (its prefix-cache salt binds the tenant's row id and creation
time, so nothing can hit it), so a version check on the request path would never find it: the
other replicas must be told. Their disk tiers hold records derived from its prompts.

Delivery is Redis pub/sub's, at most once: a replica subscribed at the time gets the event within
Redis' delivery plus one engine step; one that was cut off from Redis (or not yet started) misses
it, and those blocks stay until the LRU reuses them or an operator resets the prefix cache. The
channel is ``<key_prefix>:replica-events``, so deployments that share a Redis (different
``quota_key_prefix``) do not hear each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

_RECONNECT_S = 1.0
TENANT_DELETED = "tenant_deleted"

OnTenantDeleted = Callable[[str], Awaitable[None]]
"""Called with the engine tenant id (``services.tenants.engine_tenant_id``) of a tenant deleted elsewhere."""


class ReplicaEvents:
    """This replica's end of the channel: publishes its events, hands the others' to a callback."""

    def __init__(self, client: Redis, channel: str) -> None:
        self.client = client
        self.channel = channel
        self.replica_id = secrets.token_hex(8)
        """Marks this replica's own events, which it skips (it acted on them already)."""
        self.num_received = 0
        self.num_publish_failures = 0
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def from_url(cls, url: str, key_prefix: str) -> ReplicaEvents:
        # No socket timeout: the subscriber's connection waits for events indefinitely.
        return cls(Redis.from_url(url), f"{key_prefix}:replica-events")

    async def start(self, on_tenant_deleted: OnTenantDeleted) -> None:
        """Subscribe (before returning, so no event published after this is missed), then listen."""
        pubsub = self.client.pubsub()
        subscribed: PubSub | None = pubsub
        try:
            await pubsub.subscribe(self.channel)
        except (RedisError, OSError) as exc:
            logger.warning("replica events: cannot subscribe to %s yet (%s); retrying", self.channel, exc)
            await _close(pubsub)
            subscribed = None
        self._task = asyncio.create_task(self._listen(subscribed, on_tenant_deleted), name="replica-events")

    async def tenant_deleted(self, engine_tenant_id: str) -> None:
        """Tell the other replicas to purge this tenant's cached KV (a failure is logged, not raised:
        the tenant is deleted either way)."""
        event = {"type": TENANT_DELETED, "tenant": engine_tenant_id, "origin": self.replica_id}
        try:
            await self.client.publish(self.channel, json.dumps(event))
        except (RedisError, OSError) as exc:
            self.num_publish_failures += 1
            logger.warning("replica events: could not publish the deletion of %s: %s", engine_tenant_id, exc)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.client.aclose()

    async def _listen(self, pubsub: PubSub | None, on_tenant_deleted: OnTenantDeleted) -> None:
        current = pubsub
        while True:
            try:
                if current is None:
                    current = self.client.pubsub()
                    await current.subscribe(self.channel)
                async for message in current.listen():
                    await self._handle(message, on_tenant_deleted)
            except (RedisError, OSError) as exc:
                logger.warning("replica events: lost %s (%s); resubscribing", self.channel, exc)
                await _close(current)
                current = None
                await asyncio.sleep(_RECONNECT_S)
            except asyncio.CancelledError:
                await _close(current)
                raise

    async def _handle(self, message: dict[str, Any], on_tenant_deleted: OnTenantDeleted) -> None:
        if message.get("type") != "message":
            return  # subscribe confirmations
        try:
            event = json.loads(message["data"])
            kind, tenant, origin = event["type"], event["tenant"], event["origin"]
        except (ValueError, KeyError, TypeError):
            logger.warning("replica events: ignored a malformed message on %s", self.channel)
            return
        if origin == self.replica_id or kind != TENANT_DELETED:
            return
        self.num_received += 1
        try:
            await on_tenant_deleted(str(tenant))
        except Exception:  # the listener must outlive one failed purge (e.g. the engine stopping)
            logger.exception("replica events: purging tenant %s deleted on another replica failed", tenant)


async def _close(pubsub: PubSub | None) -> None:
    if pubsub is not None:
        with contextlib.suppress(RedisError, OSError):
            await pubsub.aclose()
