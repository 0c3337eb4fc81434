"""``RedisQuotaLimiter``: the quota contract shared by every replica through one Redis.

Each decision is one Lua script (``redis_scripts``): admission checks rpm, tpm and concurrency
together and reserves all or nothing; settle refunds tokens and frees the slot. Two limiters on
one Redis therefore enforce one limit, not one each.

Concurrency slots are leases: a slot's score is its deadline, the limiter that holds it pushes
the deadline ``lease_s`` ahead every ``lease_s / 3`` while the request runs, and admission drops
slots past their deadline -- the slots of a replica that died free themselves within ``lease_s``.

Redis failures follow ``settings.failure_policy`` (see ``outage``). ``redis.asyncio`` script
objects reload a script that a restarted Redis no longer knows (NOSCRIPT), and its connection
pool reconnects, so the limiter recovers by itself.

Left open by design: a request cancelled after its admission script ran in Redis but before the
reply arrived keeps its rpm / tpm count and its slot until the lease runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from loraplex.platform.api.tenancy.quotas import redis_scripts
from loraplex.platform.api.tenancy.quotas.base import (
    Quota,
    QuotaDecision,
    QuotaSettings,
    Reservation,
    check_admit_args,
    check_used_tokens,
    never_fits,
    refusal,
    unavailable,
)
from loraplex.platform.api.tenancy.quotas.outage import REDIS_UNAVAILABLE, RedisHealth

logger = logging.getLogger(__name__)

_UNLIMITED = -1
"""How a None limit travels to the scripts."""


def connect_redis(url: str, settings: QuotaSettings | None = None) -> Redis:
    """A client for the limiter: short timeouts and one immediate retry.

    The retry covers a pooled connection that a Redis restart broke; redis-py's default (ten
    retries with backoff) would hold each request for seconds during an outage.
    """
    timeout_s = (settings or QuotaSettings()).redis_timeout_s
    return Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), retries=1),
    )


@dataclass(frozen=True)
class TenantKeys:
    """The Redis keys of one tenant; see the table in ``redis_scripts``."""

    rpm: str
    tpm: str
    tpm_tokens: str
    tpm_sum: str
    slots: str

    @classmethod
    def of(cls, key_prefix: str, tenant: str) -> TenantKeys:
        # Escaping the braces keeps the hash tag exactly the tenant (and the mapping one-to-one).
        tag = tenant.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
        base = f"{key_prefix}:{{{tag}}}"
        return cls(f"{base}:rpm", f"{base}:tpm", f"{base}:tpm:tokens", f"{base}:tpm:sum", f"{base}:slots")

    def script_keys(self) -> list[str]:
        """KEYS[1..5] of the admit and settle scripts."""
        return [self.rpm, self.tpm, self.tpm_tokens, self.tpm_sum, self.slots]


class RedisQuotaLimiter:
    """``QuotaLimiter`` over Redis: one limit for all replicas, exact sliding windows."""

    def __init__(self, client: Redis, settings: QuotaSettings | None = None, *, owns_client: bool = False):
        """``client``: build it with ``connect_redis`` (timeouts); ``owns_client``: ``aclose`` closes it."""
        self.settings = settings or QuotaSettings()
        self.client = client
        self.health = RedisHealth(self.settings.failure_policy, self.settings.outage_probe_interval_s)
        self._owns_client = owns_client
        self._admit_script = client.register_script(redis_scripts.ADMIT)
        self._settle_script = client.register_script(redis_scripts.SETTLE)
        self._refresh_script = client.register_script(redis_scripts.REFRESH)
        self._held_slots: dict[str, set[str]] = {}
        """tenant -> slot ids this limiter holds in Redis (refreshed by the lease task)."""
        self._lease_task: asyncio.Task[None] | None = None

    @classmethod
    def from_url(cls, url: str, settings: QuotaSettings | None = None) -> RedisQuotaLimiter:
        """A limiter with its own client (``connect_redis``), closed by ``aclose``."""
        return cls(connect_redis(url, settings), settings, owns_client=True)

    def keys(self, tenant: str) -> TenantKeys:
        return TenantKeys.of(self.settings.key_prefix, tenant)

    async def admit(self, tenant: str, quota: Quota, reserve_tokens: int, request_id: str) -> QuotaDecision:
        """See ``QuotaLimiter.admit``; while Redis is unreachable, answers by the failure policy."""
        check_admit_args(tenant, reserve_tokens, request_id)
        too_large = never_fits(quota, reserve_tokens, self.settings.window_s)
        if too_large is not None:
            return too_large
        slot_id = f"{request_id}:{secrets.token_hex(8)}"
        if quota.unlimited:
            return self._admitted_unaccounted(tenant, request_id, slot_id, reserve_tokens)
        if not self.health.should_try():
            return self._by_policy(tenant, request_id, slot_id, reserve_tokens)
        try:
            reply = await self._admit_script(
                keys=self.keys(tenant).script_keys(),
                args=[
                    slot_id,
                    _limit(quota.rpm),
                    _limit(quota.tpm),
                    _limit(quota.max_concurrency),
                    reserve_tokens,
                    self.settings.window_ms,
                    self.settings.lease_ms,
                ],
            )
        except REDIS_UNAVAILABLE as exc:
            self.health.failed(exc)
            return self._by_policy(tenant, request_id, slot_id, reserve_tokens)
        self.health.succeeded()

        admitted, rpm_retry_ms, tpm_retry_ms, slots_full = (int(value) for value in reply)
        if not admitted:
            refused = refusal(
                quota,
                reserve_tokens,
                self.settings,
                rpm_retry_s=_seconds(rpm_retry_ms),
                tpm_retry_s=_seconds(tpm_retry_ms),
                concurrency_full=bool(slots_full),
            )
            assert refused is not None, f"admit script refused without a full limit: {reply!r}"
            return refused
        holds_slot = quota.max_concurrency is not None
        if holds_slot:
            self._held_slots.setdefault(tenant, set()).add(slot_id)
            self._ensure_lease_task()
        return QuotaDecision.admitted(
            Reservation(tenant, request_id, slot_id, reserve_tokens, holds_slot=holds_slot, accounted=True)
        )

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        """See ``QuotaLimiter.settle``. If Redis is unreachable the slot expires with its lease and
        the reserved tokens stay counted until they age out of the window."""
        check_used_tokens(used_tokens)
        if not reservation.accounted:
            return
        if reservation.holds_slot:
            # First stop refreshing: a slot settled while Redis is down then expires with its lease.
            held = self._held_slots.get(reservation.tenant)
            if held is not None:
                held.discard(reservation.slot_id)
                if not held:
                    del self._held_slots[reservation.tenant]
        if not self.health.should_try():
            return
        try:
            await self._settle_script(
                keys=self.keys(reservation.tenant).script_keys(),
                args=[reservation.slot_id, used_tokens, self.settings.window_ms],
            )
        except REDIS_UNAVAILABLE as exc:
            self.health.failed(exc)
            return
        self.health.succeeded()

    async def aclose(self) -> None:
        """Stop refreshing leases (held slots then expire) and close the client if this limiter made it."""
        task, self._lease_task = self._lease_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._owns_client:
            await self.client.aclose()

    @property
    def num_held_slots(self) -> int:
        """Concurrency slots this limiter holds (admitted, not settled)."""
        return sum(len(slot_ids) for slot_ids in self._held_slots.values())

    def _admitted_unaccounted(
        self, tenant: str, request_id: str, slot_id: str, reserve_tokens: int
    ) -> QuotaDecision:
        return QuotaDecision.admitted(
            Reservation(tenant, request_id, slot_id, reserve_tokens, holds_slot=False, accounted=False)
        )

    def _by_policy(self, tenant: str, request_id: str, slot_id: str, reserve_tokens: int) -> QuotaDecision:
        if self.settings.failure_policy == "fail_open":
            return self._admitted_unaccounted(tenant, request_id, slot_id, reserve_tokens)
        return unavailable(self.settings.unavailable_retry_after_s)

    def _ensure_lease_task(self) -> None:
        if self._lease_task is None or self._lease_task.done():
            self._lease_task = asyncio.create_task(self._refresh_leases(), name="quota-lease-refresh")
            self._lease_task.add_done_callback(_log_crash)

    async def _refresh_leases(self) -> None:
        """Push the deadlines of this limiter's slots ahead while it holds any; then end."""
        interval_s = self.settings.lease_s / 3
        while self._held_slots:
            await asyncio.sleep(interval_s)
            if not self.health.should_try():
                continue
            for tenant, slot_ids in list(self._held_slots.items()):
                try:
                    await self._refresh_script(
                        keys=[self.keys(tenant).slots], args=[self.settings.lease_ms, *slot_ids]
                    )
                except REDIS_UNAVAILABLE as exc:
                    self.health.failed(exc)
                    break
                self.health.succeeded()


def _limit(value: int | None) -> int:
    return _UNLIMITED if value is None else value


def _seconds(retry_ms: int) -> float | None:
    """A script's retry time in seconds; -1 (the limit is not full) becomes None."""
    if retry_ms < 0:
        return None
    # Never 0: the client must wait for the entry to age out, and Redis counts whole milliseconds.
    return max(retry_ms, 1) / 1000


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("quota lease refresh stopped; held slots will expire", exc_info=task.exception())
