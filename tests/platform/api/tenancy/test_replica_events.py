"""``ReplicaEvents`` on a real Redis: others' events reach the callback, typed, one's own do not; a
malformed message, an unknown event type or a failing callback does not stop the listener;
prefixes keep deployments apart."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import redis.asyncio

from loraplex.platform.api.tenancy.replica_events import (
    AdapterChanged,
    KeyRevoked,
    ReplicaEvent,
    ReplicaEvents,
    TenantChanged,
    TenantDeleted,
    decode,
    encode,
)


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_every_event_survives_its_wire_form() -> None:
    for event in (
        TenantDeleted("1:acme:123", 1, "acme"),
        TenantChanged(4, disabled=True),
        KeyRevoked(9, 4),
        AdapterChanged("acme", "style"),
    ):
        assert decode(encode(event, "r1")) == (event, "r1")
    assert decode('{"type": "from_the_future", "origin": "r2", "x": 1}') is None
    with pytest.raises(ValueError):
        decode('{"type": "key_revoked", "origin": "r2", "key": 1}')
    with pytest.raises(ValueError):
        decode("[1, 2]")


@pytest.mark.asyncio
async def test_events_reach_the_other_replicas_only(redis_url: str, redis_key_prefix: str) -> None:
    heard: dict[str, list[ReplicaEvent]] = {"a": [], "b": [], "other": []}

    def recorder(name: str) -> Callable[[ReplicaEvent], Awaitable[None]]:
        async def on_event(event: ReplicaEvent) -> None:
            if event == KeyRevoked(0, 0):
                raise RuntimeError("the engine stopped")
            heard[name].append(event)

        return on_event

    a = ReplicaEvents.from_url(redis_url, redis_key_prefix)
    b = ReplicaEvents.from_url(redis_url, redis_key_prefix)
    other = ReplicaEvents.from_url(redis_url, redis_key_prefix + "-other-deployment")
    for events, name in ((a, "a"), (b, "b"), (other, "other")):
        await events.start(recorder(name))
    try:
        await a.publish(KeyRevoked(0, 0))  # b's callback fails: it keeps listening
        raw = redis.asyncio.Redis.from_url(redis_url)
        await raw.publish(a.channel, b"not json")
        await raw.publish(a.channel, b'{"type": "from_the_future", "origin": "x"}')
        await raw.aclose()
        await a.publish(TenantDeleted("1:acme:123", 1, "acme"))
        await a.publish(TenantChanged(2, disabled=True))
        await b.publish(AdapterChanged("beta", "style"))
        await wait_until(lambda: len(heard["b"]) == 2 and len(heard["a"]) == 1)
        assert heard["b"] == [TenantDeleted("1:acme:123", 1, "acme"), TenantChanged(2, disabled=True)]
        assert heard["a"] == [AdapterChanged("beta", "style")]
        assert b.num_received == 3 and a.num_received == 1
        await asyncio.sleep(0.2)
        assert heard["other"] == []
    finally:
        for events in (a, b, other):
            await events.aclose()
