"""Quota semantics, the same tests for the in-process limiter and for Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from itertools import count

import pytest
import pytest_asyncio

from loraplex.platform.api.tenancy.quotas import (
    LocalQuotaLimiter,
    Quota,
    QuotaDecision,
    QuotaLimiter,
    QuotaSettings,
    RedisQuotaLimiter,
    Reservation,
)

MakeLimiter = Callable[..., QuotaLimiter]
_ids = count()


@pytest.fixture(params=["local", "redis"])
def backend(request: pytest.FixtureRequest) -> tuple[str, str] | None:
    """None for the in-process limiter, else (Redis URL, a key prefix for this test)."""
    if request.param == "local":
        return None
    return request.getfixturevalue("redis_url"), request.getfixturevalue("redis_key_prefix")


@pytest_asyncio.fixture
async def make_limiter(backend: tuple[str, str] | None) -> AsyncIterator[MakeLimiter]:
    made: list[QuotaLimiter] = []

    def make(window_s: float = 1.0, **settings: object) -> QuotaLimiter:
        if backend is None:
            limiter: QuotaLimiter = LocalQuotaLimiter(QuotaSettings(window_s=window_s, **settings))  # type: ignore[arg-type]
        else:
            url, prefix = backend
            limiter = RedisQuotaLimiter.from_url(
                url,
                QuotaSettings(window_s=window_s, key_prefix=prefix, **settings),  # type: ignore[arg-type]
            )
        made.append(limiter)
        return limiter

    yield make
    for limiter in made:
        if isinstance(limiter, LocalQuotaLimiter):
            limiter.check_integrity()
        await limiter.aclose()


async def admit(
    limiter: QuotaLimiter, quota: Quota, reserve_tokens: int = 1, tenant: str = "acme"
) -> QuotaDecision:
    return await limiter.admit(tenant, quota, reserve_tokens, f"req-{next(_ids)}")


def reservation_of(decision: QuotaDecision) -> Reservation:
    assert decision.allowed and decision.reservation is not None, decision
    return decision.reservation


@pytest.mark.slow
@pytest.mark.asyncio
async def test_rpm_admits_exactly_the_limit_then_recovers_after_the_window(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(window_s=1.0)
    quota = Quota(rpm=5)
    decisions = [await admit(limiter, quota) for _ in range(6)]
    assert [d.allowed for d in decisions] == [True] * 5 + [False]
    refused = decisions[-1]
    assert refused.reason == "rpm" and refused.reservation is None
    assert refused.retry_after_s is not None and 0 < refused.retry_after_s <= 1.0
    assert "5 requests per 1 s" in refused.detail
    assert (await admit(limiter, quota)).reason == "rpm"  # a refusal counts nothing, and frees nothing

    await asyncio.sleep(refused.retry_after_s + 0.05)
    assert [(await admit(limiter, quota)).allowed for _ in range(6)] == [True] * 5 + [False]


@pytest.mark.asyncio
async def test_concurrent_admissions_never_exceed_the_limit(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(window_s=5.0)
    decisions = await asyncio.gather(*(admit(limiter, Quota(rpm=20)) for _ in range(50)))
    assert sum(d.allowed for d in decisions) == 20


@pytest.mark.asyncio
async def test_tpm_reserves_then_settles_and_refunds_the_rest(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(window_s=5.0)
    quota = Quota(tpm=200)
    first = reservation_of(await admit(limiter, quota, 100))
    second = reservation_of(await admit(limiter, quota, 100))
    refused = await admit(limiter, quota, 1)
    assert refused.reason == "tpm" and refused.retry_after_s is not None and 0 < refused.retry_after_s <= 5.0

    await limiter.settle(first, used_tokens=30)  # 70 of its 100 come back
    await limiter.settle(first, used_tokens=30)  # settling twice refunds nothing more
    assert (await admit(limiter, quota, 71)).reason == "tpm"
    third = reservation_of(await admit(limiter, quota, 70))
    assert (await admit(limiter, quota, 1)).reason == "tpm"

    # 30 + 100 + 10 = 140 counted; a request that used more than it reserved is charged the overrun.
    await limiter.settle(third, used_tokens=10)
    await limiter.settle(second, used_tokens=130)
    assert (await admit(limiter, quota, 31)).reason == "tpm"
    assert (await admit(limiter, quota, 30)).allowed


@pytest.mark.slow
@pytest.mark.asyncio
async def test_tpm_tokens_age_out_with_the_window(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(window_s=1.0)
    quota = Quota(tpm=100)
    await limiter.settle(reservation_of(await admit(limiter, quota, 100)), used_tokens=100)
    refused = await admit(limiter, quota, 1)
    assert refused.reason == "tpm" and refused.retry_after_s is not None and 0 < refused.retry_after_s <= 1.0
    await asyncio.sleep(refused.retry_after_s + 0.05)
    assert (await admit(limiter, quota, 100)).allowed


@pytest.mark.asyncio
async def test_a_request_larger_than_tpm_is_never_admissible(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter()
    decision = await admit(limiter, Quota(tpm=100), 101)
    assert not decision.allowed and decision.reason == "request_over_tpm"
    assert decision.retry_after_s is None and decision.retry_after_header is None
    assert "101" in decision.detail and "100" in decision.detail
    assert (await admit(limiter, Quota(tpm=100), 100)).allowed


@pytest.mark.asyncio
async def test_concurrency_refuses_until_a_request_settles(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(concurrency_retry_after_s=2.0)
    quota = Quota(max_concurrency=2)
    first = reservation_of(await admit(limiter, quota))
    reservation_of(await admit(limiter, quota))
    refused = await admit(limiter, quota)
    assert refused.reason == "concurrency" and refused.retry_after_s == 2.0
    assert refused.retry_after_header == "2"
    await limiter.settle(first, used_tokens=0)
    assert (await admit(limiter, quota)).allowed
    assert (await admit(limiter, quota)).reason == "concurrency"


@pytest.mark.asyncio
async def test_admission_is_all_or_nothing(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(window_s=5.0)
    quota = Quota(rpm=3, tpm=100, max_concurrency=1)
    running = reservation_of(await admit(limiter, quota, 50))
    # Refused for concurrency: neither its request nor its 40 tokens may be counted.
    assert (await admit(limiter, quota, 40)).reason == "concurrency"
    await limiter.settle(running, used_tokens=50)
    last = reservation_of(await admit(limiter, quota, 50))  # 50 + 50 = 100 only if the 40 were not kept
    await limiter.settle(last, used_tokens=50)
    assert (await admit(limiter, quota, 0)).allowed  # third request: the refused one did not count
    assert (await admit(limiter, quota, 0)).reason == "rpm"


@pytest.mark.asyncio
async def test_the_reason_is_the_first_full_limit_and_retry_waits_for_all(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter(window_s=1.0, concurrency_retry_after_s=3.0)
    quota = Quota(rpm=1, tpm=10, max_concurrency=1)
    reservation_of(await admit(limiter, quota, 10))
    refused = await admit(limiter, quota, 1)
    assert refused.reason == "rpm" and refused.retry_after_s == 3.0


@pytest.mark.asyncio
async def test_tenants_have_separate_limits(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter()
    quota = Quota(rpm=1, max_concurrency=1)
    for tenant in ("acme", "globex", "a}b{c", "a%7Db"):
        assert (await admit(limiter, quota, tenant=tenant)).allowed, tenant
    for tenant in ("acme", "globex", "a}b{c", "a%7Db"):
        assert not (await admit(limiter, quota, tenant=tenant)).allowed, tenant


@pytest.mark.asyncio
async def test_an_unlimited_quota_counts_nothing(make_limiter: MakeLimiter) -> None:
    limiter = make_limiter()
    for _ in range(20):
        reservation = reservation_of(await admit(limiter, Quota(), 10**9))
        assert not reservation.accounted
        await limiter.settle(reservation, used_tokens=10**9)


def test_quota_and_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="rpm"):
        Quota(rpm=0)
    with pytest.raises(ValueError, match="max_concurrency"):
        Quota(max_concurrency=True)
    with pytest.raises(ValueError, match="failure_policy"):
        QuotaSettings(failure_policy="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="key_prefix"):
        QuotaSettings(key_prefix="lpx{x}")
    with pytest.raises(ValueError, match="window_s"):
        QuotaSettings(window_s=0)
