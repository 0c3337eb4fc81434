"""Per-tenant quotas: requests per minute, tokens per minute, concurrent requests.

The gateway calls ``admit`` before it submits a request and ``settle`` when the request ends
(see ``base`` for the contract and the table of refusal reasons).

| module | owns |
|---|---|
| ``base`` | ``Quota``, ``QuotaSettings``, ``Reservation``, ``QuotaDecision``, the ``QuotaLimiter`` Protocol |
| ``local_limiter`` | ``LocalQuotaLimiter``: one process, sliding logs in memory |
| ``redis_limiter`` | ``RedisQuotaLimiter``: every replica through one Redis, one Lua script per decision |
| ``redis_scripts`` | the Lua scripts and the Redis key layout |
| ``outage`` | Redis failure handling: which errors mean "down", one log line per outage, probe gate |
| ``factory`` | ``make_quota_limiter(redis_url, settings)`` |
| ``refusal`` | ``quota_refusal``: a refused admission as the client's 429 / 503 and its metrics reason |
"""

from loraplex.platform.api.tenancy.quotas.base import (
    FAILURE_POLICIES,
    FailurePolicy,
    Quota,
    QuotaDecision,
    QuotaLimiter,
    QuotaReason,
    QuotaSettings,
    Reservation,
)
from loraplex.platform.api.tenancy.quotas.factory import make_quota_limiter
from loraplex.platform.api.tenancy.quotas.local_limiter import LocalQuotaLimiter
from loraplex.platform.api.tenancy.quotas.redis_limiter import RedisQuotaLimiter, connect_redis

__all__ = [
    "FAILURE_POLICIES",
    "FailurePolicy",
    "LocalQuotaLimiter",
    "Quota",
    "QuotaDecision",
    "QuotaLimiter",
    "QuotaReason",
    "QuotaSettings",
    "RedisQuotaLimiter",
    "Reservation",
    "connect_redis",
    "make_quota_limiter",
]
