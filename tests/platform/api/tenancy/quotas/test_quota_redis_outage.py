"""Redis stopped and restarted under the limiter: the failure policy, one log line, recovery by itself.

Runs on a private redis-server (``redis_process``), never the machine's shared one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from itertools import count

import pytest
import pytest_asyncio
import redis
from support.redis import RedisProcess

from loraplex.platform.api.tenancy.quotas import (
    FailurePolicy,
    Quota,
    QuotaDecision,
    QuotaSettings,
    RedisQuotaLimiter,
)

OUTAGE_LOGGER = "loraplex.platform.api.tenancy.quotas.outage"
_ids = count()


@pytest_asyncio.fixture
async def limiters(redis_process: RedisProcess) -> AsyncIterator[list[RedisQuotaLimiter]]:
    made: list[RedisQuotaLimiter] = []
    yield made
    for limiter in made:
        await limiter.aclose()


def make(limiters: list[RedisQuotaLimiter], url: str, policy: FailurePolicy) -> RedisQuotaLimiter:
    settings = QuotaSettings(
        window_s=5.0, failure_policy=policy, outage_probe_interval_s=0.05, unavailable_retry_after_s=2.0
    )
    limiter = RedisQuotaLimiter.from_url(url, settings)
    limiters.append(limiter)
    return limiter


async def admit(limiter: RedisQuotaLimiter, quota: Quota) -> QuotaDecision:
    return await limiter.admit("acme", quota, 10, f"req-{next(_ids)}")


async def admit_when_back(limiter: RedisQuotaLimiter, quota: Quota, timeout_s: float = 5.0) -> QuotaDecision:
    """Admit until a decision counted in Redis comes back (the outage is over)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        decision = await admit(limiter, quota)
        if decision.reservation is not None and decision.reservation.accounted:
            return decision
        await asyncio.sleep(0.05)
    raise AssertionError(f"the limiter did not recover within {timeout_s} s: {decision}")


def outage_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == OUTAGE_LOGGER]


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
async def test_redis_outage_follows_the_policy_and_recovers_by_itself(
    policy: FailurePolicy,
    redis_process: RedisProcess,
    limiters: list[RedisQuotaLimiter],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=OUTAGE_LOGGER)
    limiter = make(limiters, redis_process.url, policy)
    quota = Quota(rpm=3, tpm=1000, max_concurrency=5)
    before = await admit(limiter, quota)
    assert before.reservation is not None and before.reservation.accounted

    redis_process.kill()
    during = [await admit(limiter, quota) for _ in range(10)]
    await asyncio.sleep(0.1)  # past the probe interval: Redis is tried (and fails) again
    during += [await admit(limiter, quota) for _ in range(10)]
    if policy == "fail_closed":
        assert {(d.allowed, d.reason, d.retry_after_s) for d in during} == {(False, "unavailable", 2.0)}
    else:
        assert all(d.allowed and d.reservation is not None and not d.reservation.accounted for d in during)
        for d in during:
            assert d.reservation is not None
            await limiter.settle(d.reservation, used_tokens=10)  # no-op: nothing was counted
    assert before.reservation is not None
    await limiter.settle(before.reservation, used_tokens=10)  # must not raise while Redis is down
    assert limiter.health.down
    messages = outage_messages(caplog)
    assert len(messages) == 1 and "unreachable" in messages[0], messages  # once per outage

    redis_process.start()  # same port, empty data, empty script cache
    await admit_when_back(limiter, quota)
    assert not limiter.health.down
    messages = outage_messages(caplog)
    assert len(messages) == 2 and "answers again" in messages[1], messages
    # Counting again from an empty Redis: the admission above and two more make 3 per window.
    assert [(await admit(limiter, quota)).reason for _ in range(3)] == [None, None, "rpm"]


@pytest.mark.asyncio
async def test_a_redis_down_at_start_is_an_outage_like_any_other(
    redis_process: RedisProcess, limiters: list[RedisQuotaLimiter]
) -> None:
    redis_process.kill()
    limiter = make(limiters, redis_process.url, "fail_closed")
    assert (await admit(limiter, Quota(rpm=1))).reason == "unavailable"
    redis_process.start()
    await admit_when_back(limiter, Quota(rpm=1))
    assert (await admit(limiter, Quota(rpm=1))).reason == "rpm"


@pytest.mark.asyncio
async def test_scripts_are_reloaded_after_the_script_cache_is_flushed(
    redis_process: RedisProcess, limiters: list[RedisQuotaLimiter]
) -> None:
    limiter = make(limiters, redis_process.url, "fail_closed")
    quota = Quota(rpm=2, max_concurrency=5)
    first = await admit(limiter, quota)
    assert first.reservation is not None
    client = redis.Redis.from_url(redis_process.url)
    try:
        client.script_flush()
    finally:
        client.close()
    assert (await admit(limiter, quota)).allowed  # NOSCRIPT -> loaded again, still counting
    await limiter.settle(first.reservation, used_tokens=1)
    assert (await admit(limiter, quota)).reason == "rpm"
