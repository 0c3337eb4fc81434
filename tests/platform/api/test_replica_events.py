"""``ReplicaEvents`` on a real Redis: others' deletions reach the callback, one's own do not; a
malformed message or a failing callback does not stop the listener; prefixes keep deployments apart."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio

from loraplex.platform.api.tenancy.replica_events import ReplicaEvents


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.mark.asyncio
async def test_deletions_reach_the_other_replicas_only(redis_url: str, redis_key_prefix: str) -> None:
    heard: dict[str, list[str]] = {"a": [], "b": [], "other": []}

    def recorder(name: str) -> Callable[[str], Awaitable[None]]:
        async def on_deleted(tenant: str) -> None:
            if tenant == "boom":
                raise RuntimeError("the engine stopped")
            heard[name].append(tenant)

        return on_deleted

    a = ReplicaEvents.from_url(redis_url, redis_key_prefix)
    b = ReplicaEvents.from_url(redis_url, redis_key_prefix)
    other = ReplicaEvents.from_url(redis_url, redis_key_prefix + "-other-deployment")
    for events, name in ((a, "a"), (b, "b"), (other, "other")):
        await events.start(recorder(name))
    try:
        await a.tenant_deleted("boom")  # b's callback fails: it keeps listening
        raw = redis.asyncio.Redis.from_url(redis_url)
        await raw.publish(a.channel, b"not json")
        await raw.aclose()
        await a.tenant_deleted("1:acme:123")
        await b.tenant_deleted("2:beta:456")
        await wait_until(lambda: heard["b"] == ["1:acme:123"] and heard["a"] == ["2:beta:456"])
        assert b.num_received == 2 and a.num_received == 1
        await asyncio.sleep(0.2)
        assert heard["other"] == []
    finally:
        for events in (a, b, other):
            await events.aclose()
