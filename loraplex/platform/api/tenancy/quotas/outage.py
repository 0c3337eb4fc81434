"""Whether Redis answers: one log line when an outage starts and one when it ends, and a probe gate.

While Redis is down, every request would otherwise pay a connect timeout before the failure
policy answers it. ``RedisHealth.should_try`` lets one call per ``probe_interval_s`` try Redis;
the others are answered by the policy at once. The first call that succeeds ends the outage:
redis-py reconnects by itself, so no restart is needed.
"""

from __future__ import annotations

import logging
import time

from redis.exceptions import (
    ClusterDownError,
    ConnectionError,
    MasterDownError,
    ReadOnlyError,
    TimeoutError,
    TryAgainError,
)

from loraplex.platform.settings import FailurePolicy

logger = logging.getLogger(__name__)

REDIS_UNAVAILABLE: tuple[type[Exception], ...] = (
    ConnectionError,  # includes BusyLoadingError: a restarted Redis still loading its data
    TimeoutError,
    ReadOnlyError,  # a replica promoted away from us during a failover
    MasterDownError,
    ClusterDownError,
    TryAgainError,
)
"""Errors that mean "Redis is not there now"; any other Redis error is a bug and propagates."""

_POLICY_TEXT: dict[FailurePolicy, str] = {
    "fail_closed": "every limited request is refused (503)",
    "fail_open": "requests are admitted without quotas",
}


class RedisHealth:
    """Outage state of one limiter's Redis."""

    def __init__(self, policy: FailurePolicy, probe_interval_s: float) -> None:
        self.policy = policy
        self.probe_interval_s = probe_interval_s
        self.down_since_s: float | None = None
        """``time.monotonic()`` of the first failure of the current outage, None while Redis answers."""
        self.num_failures = 0
        """Calls that failed or were not tried because Redis was down, over the limiter's life."""
        self.num_outages = 0
        self._next_probe_s = 0.0

    @property
    def down(self) -> bool:
        return self.down_since_s is not None

    def should_try(self) -> bool:
        """True while Redis is up, and for one call per probe interval while it is down."""
        if self.down_since_s is None:
            return True
        now_s = time.monotonic()
        if now_s < self._next_probe_s:
            self.num_failures += 1
            return False
        self._next_probe_s = now_s + self.probe_interval_s
        return True

    def failed(self, exc: Exception) -> None:
        self.num_failures += 1
        now_s = time.monotonic()
        self._next_probe_s = now_s + self.probe_interval_s
        if self.down_since_s is None:
            self.down_since_s = now_s
            self.num_outages += 1
            logger.warning(
                "Redis for quotas is unreachable (%s: %s); %s until it answers again",
                type(exc).__name__,
                exc,
                _POLICY_TEXT[self.policy],
            )

    def succeeded(self) -> None:
        if self.down_since_s is not None:
            logger.warning(
                "Redis for quotas answers again after %.1f s; quotas are enforced again",
                time.monotonic() - self.down_since_s,
            )
            self.down_since_s = None
