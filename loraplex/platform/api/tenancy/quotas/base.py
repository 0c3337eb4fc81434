"""The quota contract: ``Quota`` in, ``QuotaDecision`` out, ``settle`` at the end; one Protocol, two backends.

A request passes three per-tenant limits at once, all or nothing:

    admit(tenant, quota, reserve_tokens, request_id) -> QuotaDecision
        allowed: counts one request (rpm), reserves ``reserve_tokens`` (tpm: prompt + max_tokens)
                 and takes one concurrency slot; ``decision.reservation`` says what to settle
        refused: nothing is counted; ``reason`` says which limit, ``retry_after_s`` when to come back
    settle(reservation, used_tokens)
        replaces the reserved count with the real one (the rest is refunded, an overrun is charged)
        and frees the slot; settling again with the same count changes nothing

Windows are sliding logs: an admission at time t counts while ``now < t + window_s``, so a limit
of N refuses exactly the (N+1)-th request inside any window. Tokens count at the time of their
admission, with the settled amount.

| reason | meaning | ``retry_after_s`` | gateway answer |
|---|---|---|---|
| ``rpm`` / ``tpm`` | the window is full | when enough of it ages out | 429, Retry-After |
| ``concurrency`` | ``max_concurrency`` in flight | ``concurrency_retry_after_s`` (hint) | 429, Retry-After |
| ``request_over_tpm`` | this request alone reserves > tpm | None: it never fits | 429 |
| ``unavailable`` | Redis down, ``fail_closed`` | ``unavailable_retry_after_s`` | 503, Retry-After |
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

from loraplex.platform.settings import FailurePolicy, GatewaySettings

QuotaReason = Literal["rpm", "tpm", "concurrency", "request_over_tpm", "unavailable"]
FAILURE_POLICIES: tuple[FailurePolicy, ...] = ("fail_closed", "fail_open")
_GATEWAY_DEFAULTS = {name: info.default for name, info in GatewaySettings.model_fields.items()}


@dataclass(frozen=True)
class Quota:
    """A tenant's limits; None means unlimited."""

    rpm: int | None = None
    """Requests admitted per window (a minute by default)."""
    tpm: int | None = None
    """Tokens (prompt + completion) per window; reserved at admission, settled at the end."""
    max_concurrency: int | None = None
    """Requests in flight at once."""

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm", "max_concurrency"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"quota {name} must be None (unlimited) or an integer >= 1, got {value!r}")

    @property
    def unlimited(self) -> bool:
        return self.rpm is None and self.tpm is None and self.max_concurrency is None


@dataclass(frozen=True)
class QuotaSettings:
    """How the limiters count, the same for every tenant. The three that are server settings
    take their defaults from ``GatewaySettings`` (their one declaration, with their docs:
    ``quota_window_s``, ``quota_failure_policy``, ``quota_key_prefix``); the rest are the
    limiters' own tuning."""

    window_s: float = _GATEWAY_DEFAULTS["quota_window_s"]
    """Length of the sliding window of ``rpm`` and ``tpm`` (tests shorten it)."""
    failure_policy: FailurePolicy = _GATEWAY_DEFAULTS["quota_failure_policy"]
    lease_s: float = 30.0
    """A concurrency slot in Redis expires this long after its last refresh, so the slots of a
    replica that died free themselves; live replicas refresh theirs every ``lease_s / 3``."""
    concurrency_retry_after_s: float = 1.0
    """Retry-After hint for a concurrency refusal (when a slot frees is not known in advance)."""
    unavailable_retry_after_s: float = 1.0
    """Retry-After hint while Redis is unreachable (fail_closed)."""
    outage_probe_interval_s: float = 1.0
    """While Redis is down, at most one call per interval tries it; the others answer by policy at once."""
    redis_timeout_s: float = 0.5
    """Connect and read timeout of the Redis client that ``connect_redis`` builds."""
    key_prefix: str = _GATEWAY_DEFAULTS["quota_key_prefix"]

    def __post_init__(self) -> None:
        for name in (
            "window_s",
            "lease_s",
            "concurrency_retry_after_s",
            "unavailable_retry_after_s",
            "outage_probe_interval_s",
            "redis_timeout_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"quota setting {name} must be a number > 0, got {value!r}")
        if self.window_s < 0.01:
            raise ValueError(
                f"window_s must be >= 0.01 s (Redis counts in milliseconds), got {self.window_s}"
            )
        if self.failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"failure_policy must be one of {FAILURE_POLICIES}, got {self.failure_policy!r}")
        # A brace in the prefix would move the cluster hash tag off the tenant.
        if not self.key_prefix or "{" in self.key_prefix or "}" in self.key_prefix:
            raise ValueError(f"key_prefix must be non-empty and without braces, got {self.key_prefix!r}")

    @property
    def window_ms(self) -> int:
        return max(1, round(self.window_s * 1000))

    @property
    def lease_ms(self) -> int:
        return max(1, round(self.lease_s * 1000))


@dataclass(frozen=True)
class Reservation:
    """What one admitted request holds until ``settle``."""

    tenant: str
    request_id: str
    slot_id: str
    """Unique per admission (the request id plus a random suffix): a repeated request id never
    shares or overwrites another request's entries."""
    reserved_tokens: int
    holds_slot: bool
    """True when the quota limits concurrency (a slot was taken)."""
    accounted: bool
    """False when nothing was counted (unlimited quota, or admitted by ``fail_open`` during an
    outage); settling it is a no-op."""


@dataclass(frozen=True)
class QuotaDecision:
    """The answer of ``admit``: allowed with a reservation, or refused with a reason."""

    allowed: bool
    retry_after_s: float | None
    reason: QuotaReason | None
    reservation: Reservation | None
    detail: str = field(default="")
    """One sentence for the client's error message: the limit and its number, never a key or prompt."""

    @classmethod
    def admitted(cls, reservation: Reservation) -> QuotaDecision:
        return cls(allowed=True, retry_after_s=None, reason=None, reservation=reservation)

    @classmethod
    def refused(cls, reason: QuotaReason, retry_after_s: float | None, detail: str) -> QuotaDecision:
        return cls(allowed=False, retry_after_s=retry_after_s, reason=reason, reservation=None, detail=detail)

    @property
    def retry_after_header(self) -> str | None:
        """``Retry-After`` in whole seconds, rounded up (the header takes integers), or None."""
        if self.retry_after_s is None:
            return None
        return str(max(1, math.ceil(self.retry_after_s)))


class QuotaLimiter(Protocol):
    """Per-tenant rpm / tpm / concurrency limits; ``LocalQuotaLimiter`` or ``RedisQuotaLimiter``.

    The gateway calls ``admit`` before it submits a request and ``settle`` once when the request
    ends for any reason (finished, failed, client gone), typically in a ``finally``.
    """

    async def admit(self, tenant: str, quota: Quota, reserve_tokens: int, request_id: str) -> QuotaDecision:
        """Count the request against all three limits at once, or refuse it and count nothing."""
        ...

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        """Settle the token count at ``used_tokens`` and free the concurrency slot. Never raises for
        an unreachable Redis (the slot then expires with its lease)."""
        ...

    async def aclose(self) -> None:
        """Stop background work and close what the limiter owns."""
        ...


def check_admit_args(tenant: str, reserve_tokens: int, request_id: str) -> None:
    """Reject caller bugs before anything is counted (these are not user input: the gateway builds them)."""
    if not tenant:
        raise ValueError("tenant must be a non-empty string")
    if not request_id:
        raise ValueError("request_id must be a non-empty string")
    if isinstance(reserve_tokens, bool) or not isinstance(reserve_tokens, int) or reserve_tokens < 0:
        raise ValueError(f"reserve_tokens must be an integer >= 0, got {reserve_tokens!r}")


def check_used_tokens(used_tokens: int) -> None:
    if isinstance(used_tokens, bool) or not isinstance(used_tokens, int) or used_tokens < 0:
        raise ValueError(f"used_tokens must be an integer >= 0, got {used_tokens!r}")


def never_fits(quota: Quota, reserve_tokens: int, window_s: float) -> QuotaDecision | None:
    """The refusal of a request that reserves more than the whole token window, or None."""
    if quota.tpm is None or reserve_tokens <= quota.tpm:
        return None
    return QuotaDecision.refused(
        "request_over_tpm",
        None,
        f"this request reserves {reserve_tokens} tokens (prompt + max_tokens), more than the limit of "
        f"{quota.tpm} tokens per {_window_text(window_s)}; lower max_tokens or shorten the prompt",
    )


def refusal(
    quota: Quota,
    reserve_tokens: int,
    settings: QuotaSettings,
    *,
    rpm_retry_s: float | None,
    tpm_retry_s: float | None,
    concurrency_full: bool,
) -> QuotaDecision | None:
    """The refusal for the limits found full (a retry time each, None when not full), or None.

    The reason is the first full limit in the order rpm, tpm, concurrency; ``retry_after_s`` is the
    latest of their retry times, since the request needs all of them free at once.
    """
    window = _window_text(settings.window_s)
    full: list[tuple[QuotaReason, float, str]] = []
    if rpm_retry_s is not None:
        full.append(("rpm", rpm_retry_s, f"rate limit reached: {quota.rpm} requests per {window}"))
    if tpm_retry_s is not None:
        full.append(
            (
                "tpm",
                tpm_retry_s,
                f"token rate limit reached: {quota.tpm} tokens per {window} "
                f"(this request reserves {reserve_tokens})",
            )
        )
    if concurrency_full:
        full.append(
            (
                "concurrency",
                settings.concurrency_retry_after_s,
                f"concurrency limit reached: {quota.max_concurrency} requests in flight",
            )
        )
    if not full:
        return None
    reason, _, detail = full[0]
    return QuotaDecision.refused(reason, max(retry_s for _, retry_s, _ in full), detail)


def unavailable(retry_after_s: float) -> QuotaDecision:
    return QuotaDecision.refused(
        "unavailable", retry_after_s, "the quota service is unavailable; retry later"
    )


def _window_text(window_s: float) -> str:
    return "minute" if window_s == 60 else f"{window_s:g} s"
