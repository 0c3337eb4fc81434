"""Redis quotas across replicas: one limit for all, leases of a dead replica, cluster-safe keys."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from itertools import count

import pytest
import pytest_asyncio
import redis
from redis.crc import key_slot

from loraplex.platform.api.tenancy.quotas import (
    Quota,
    QuotaDecision,
    QuotaSettings,
    RedisQuotaLimiter,
    Reservation,
)

MakeReplica = Callable[..., RedisQuotaLimiter]
_ids = count()


@pytest_asyncio.fixture
async def make_replica(redis_url: str, redis_key_prefix: str) -> AsyncIterator[MakeReplica]:
    """Each call is one more replica: its own limiter and its own Redis client, one shared Redis."""
    made: list[RedisQuotaLimiter] = []

    def make(**settings: object) -> RedisQuotaLimiter:
        limiter = RedisQuotaLimiter.from_url(
            redis_url,
            QuotaSettings(key_prefix=redis_key_prefix, **settings),  # type: ignore[arg-type]
        )
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        await limiter.aclose()


async def admit(limiter: RedisQuotaLimiter, quota: Quota, reserve_tokens: int = 1) -> QuotaDecision:
    return await limiter.admit("acme", quota, reserve_tokens, f"req-{next(_ids)}")


def reservation_of(decision: QuotaDecision) -> Reservation:
    assert decision.allowed and decision.reservation is not None, decision
    return decision.reservation


@pytest.mark.asyncio
async def test_two_replicas_enforce_one_limit(make_replica: MakeReplica) -> None:
    a, b = make_replica(), make_replica()
    assert a.client is not b.client
    quota = Quota(rpm=5)
    assert [(await admit(replica, quota, 0)).allowed for replica in (a, b, a, b, a)] == [True] * 5
    assert (await admit(b, quota, 0)).reason == "rpm"
    assert (await admit(a, quota, 0)).reason == "rpm"

    c, d = make_replica(), make_replica()
    quota = Quota(tpm=100, max_concurrency=2)
    on_c = reservation_of(await admit(c, quota, 60))
    reservation_of(await admit(d, quota, 30))
    assert (await admit(c, quota, 1)).reason == "concurrency"
    await c.settle(on_c, used_tokens=20)  # frees a slot and 40 tokens for every replica
    assert (await admit(d, quota, 51)).reason == "tpm"
    assert (await admit(d, quota, 50)).allowed


@pytest.mark.asyncio
async def test_racing_replicas_admit_exactly_the_limit(make_replica: MakeReplica) -> None:
    replicas = [make_replica(window_s=5.0) for _ in range(3)]
    quota = Quota(rpm=30)
    decisions = await asyncio.gather(*(admit(replicas[i % 3], quota) for i in range(90)))
    assert sum(d.allowed for d in decisions) == 30


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_live_replica_keeps_its_slot_and_a_dead_ones_slot_expires(make_replica: MakeReplica) -> None:
    lease_s = 0.3
    holder, other = make_replica(lease_s=lease_s), make_replica(lease_s=lease_s)
    quota = Quota(max_concurrency=1)
    reservation_of(await admit(holder, quota))

    # Alive: the holder refreshes its lease, so the slot outlasts several leases.
    await asyncio.sleep(4 * lease_s)
    assert (await admit(other, quota)).reason == "concurrency"
    assert holder.num_held_slots == 1

    # The holder dies without settling: no more refreshes, the slot frees within one lease.
    await holder.aclose()
    await asyncio.sleep(lease_s + 0.15)
    assert (await admit(other, quota)).allowed


@pytest.mark.asyncio
async def test_a_tenants_keys_share_one_cluster_slot(
    make_replica: MakeReplica, redis_url: str, redis_key_prefix: str
) -> None:
    limiter = make_replica()
    tenants = ["acme", "a}b{c", "{x}"]
    for tenant in tenants:
        await limiter.admit(tenant, Quota(rpm=5, tpm=100, max_concurrency=2), 10, f"req-{next(_ids)}")
    client = redis.Redis.from_url(redis_url)
    try:
        stored = {key.decode() for key in client.scan_iter(match=f"{redis_key_prefix}:*")}
    finally:
        client.close()
    for tenant in tenants:
        keys = limiter.keys(tenant).script_keys()
        assert set(keys) <= stored, (tenant, stored)
        assert len({key_slot(key.encode()) for key in keys}) == 1, tenant
    assert len(stored) == 5 * len(tenants)
