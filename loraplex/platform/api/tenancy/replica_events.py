"""Events one replica tells the others through Redis pub/sub, so that what they cache follows a change
made through it within the delivery time (milliseconds), not a cache's TTL.

    events = ReplicaEvents.from_url(redis_url, key_prefix)
    await events.start(on_event)        subscribe, then hand the others' events to ``on_event``
    await events.publish(event)         after this replica made the change (and acted on it itself)
    await events.aclose()

| event | published when | each other replica drops |
|---|---|---|
| ``TenantDeleted`` | a tenant is deleted | its key checks, running requests, adapters, cached KV |
| ``TenantChanged`` | quotas, weight, ``disabled`` | its key checks (the row); if disabled, its requests |
| ``KeyRevoked`` | a key is revoked | that key's cached check |
| ``AdapterChanged`` | a new version, or deleted | cached resolutions of the name; its engine versions |

Everything else replicas share is read from the database or Redis per request: quotas are one
count in Redis, a new key or adapter name is looked up when first used.

Delivery is Redis pub/sub's, at most once: a replica subscribed at the time gets an event within
Redis' delivery (and one engine step for a purge); one that was cut off from Redis (or not yet
started) misses it. The caches' TTL is the backstop: a missed key revocation, disabled tenant
or changed quota still reaches every replica within ``auth_cache_ttl_s`` (60 s by default) of
the change, the worst case while Redis is down; a missed adapter change at the next request
that reads the database (adapter resolutions are cached only as an outage's fallback); a missed
deletion leaves that tenant's cached KV until the LRU reuses it or an operator resets the
prefix cache. The channel is ``<key_prefix>:replica-events``, so deployments that share a Redis
(different ``quota_key_prefix``) do not hear each other. Events name tenants by row id (and a
deleted tenant by its engine id, for the purge), never carry a key.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

_RECONNECT_S = 1.0


@dataclass(frozen=True)
class TenantDeleted:
    """A tenant and everything it owned are gone."""

    tenant: str
    """Its engine tenant id (``services.tenants.engine_tenant_id``): the owner of its cached KV."""
    tenant_id: int | None = None
    """Its row id, whose cached key checks go."""
    name: str | None = None
    """Its name: the owner of the adapter versions the engines hold."""


@dataclass(frozen=True)
class TenantChanged:
    """A tenant's row changed: quotas, weight, ``disabled``."""

    tenant_id: int
    disabled: bool = False


@dataclass(frozen=True)
class KeyRevoked:
    """An API key stopped working before its time."""

    key_id: int
    tenant_id: int


@dataclass(frozen=True)
class AdapterChanged:
    """An adapter name got a new version, or lost versions (deleted)."""

    owner: str
    name: str


ReplicaEvent = TenantDeleted | TenantChanged | KeyRevoked | AdapterChanged
OnEvent = Callable[[ReplicaEvent], Awaitable[None]]
"""Called with each event another replica published."""

_TYPES: dict[str, type[ReplicaEvent]] = {
    "tenant_deleted": TenantDeleted,
    "tenant_changed": TenantChanged,
    "key_revoked": KeyRevoked,
    "adapter_changed": AdapterChanged,
}
_NAMES = {cls: name for name, cls in _TYPES.items()}


def encode(event: ReplicaEvent, origin: str) -> str:
    """The JSON message of ``event`` (``type`` names it; ``origin`` is the publishing replica)."""
    return json.dumps({"type": _NAMES[type(event)], "origin": origin, **asdict(event)})


def decode(data: str | bytes) -> tuple[ReplicaEvent, str] | None:
    """(event, origin) of a message; None for an event type this replica does not know (a newer
    replica's); ``ValueError`` for a malformed one."""
    try:
        message = json.loads(data)
        kind, origin = message.pop("type"), message.pop("origin")
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a replica event: {exc}") from None
    cls = _TYPES.get(kind)
    if cls is None:
        return None
    try:
        return cls(**message), str(origin)
    except TypeError as exc:
        raise ValueError(f"malformed {kind}: {exc}") from None


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

    async def start(self, on_event: OnEvent) -> None:
        """Subscribe (before returning, so no event published after this is missed), then listen."""
        pubsub = self.client.pubsub()
        subscribed: PubSub | None = pubsub
        try:
            await pubsub.subscribe(self.channel)
        except (RedisError, OSError) as exc:
            logger.warning("replica events: cannot subscribe to %s yet (%s); retrying", self.channel, exc)
            await _close(pubsub)
            subscribed = None
        self._task = asyncio.create_task(self._listen(subscribed, on_event), name="replica-events")

    async def publish(self, event: ReplicaEvent) -> None:
        """Tell the other replicas (a failure is logged and counted, not raised: the change is made
        either way, and the caches' TTL is the backstop)."""
        try:
            await self.client.publish(self.channel, encode(event, self.replica_id))
        except (RedisError, OSError) as exc:
            self.num_publish_failures += 1
            logger.warning("replica events: could not publish %s: %s", event, exc)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.client.aclose()

    async def _listen(self, pubsub: PubSub | None, on_event: OnEvent) -> None:
        current = pubsub
        while True:
            try:
                if current is None:
                    current = self.client.pubsub()
                    await current.subscribe(self.channel)
                async for message in current.listen():
                    await self._handle(message, on_event)
            except (RedisError, OSError) as exc:
                logger.warning("replica events: lost %s (%s); resubscribing", self.channel, exc)
                await _close(current)
                current = None
                await asyncio.sleep(_RECONNECT_S)
            except asyncio.CancelledError:
                await _close(current)
                raise

    async def _handle(self, message: dict[str, Any], on_event: OnEvent) -> None:
        if message.get("type") != "message":
            return  # subscribe confirmations
        try:
            decoded = decode(message["data"])
        except (ValueError, KeyError):
            logger.warning("replica events: ignored a malformed message on %s", self.channel)
            return
        if decoded is None:
            return
        event, origin = decoded
        if origin == self.replica_id:
            return
        self.num_received += 1
        try:
            await on_event(event)
        except Exception:  # the listener must outlive one failed handler (e.g. the engine stopping)
            logger.exception("replica events: acting on %s from another replica failed", event)


async def _close(pubsub: PubSub | None) -> None:
    if pubsub is not None:
        with contextlib.suppress(RedisError, OSError):
            await pubsub.aclose()
