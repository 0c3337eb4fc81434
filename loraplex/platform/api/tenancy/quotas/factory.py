"""``make_quota_limiter``: Redis when a URL is configured, else the in-process limiter."""

from __future__ import annotations

from loraplex.platform.api.tenancy.quotas.base import QuotaLimiter, QuotaSettings
from loraplex.platform.api.tenancy.quotas.local_limiter import LocalQuotaLimiter
from loraplex.platform.api.tenancy.quotas.redis_limiter import RedisQuotaLimiter


def make_quota_limiter(redis_url: str | None, settings: QuotaSettings | None = None) -> QuotaLimiter:
    """The limiter for ``LORAPLEX_REDIS_URL``: shared through Redis, or per process when unset.

    Connecting is lazy: a Redis that is down at start-up is an outage like any other (the
    failure policy answers until it returns), so replicas can start before Redis.
    """
    if redis_url:
        return RedisQuotaLimiter.from_url(redis_url, settings)
    return LocalQuotaLimiter(settings)
