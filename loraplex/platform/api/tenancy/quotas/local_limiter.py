"""``LocalQuotaLimiter``: the quota contract for one process (no Redis configured).

The same sliding logs as the Redis scripts, in Python, timed by ``time.monotonic``. Each
``admit`` / ``settle`` runs start to end without an ``await``, so on the event loop it is
atomic the way a Lua script is atomic in Redis; a lock would guard nothing more.

Concurrency slots have no lease here: the slots and the process that holds them die together.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from dataclasses import dataclass, field

from loraplex.platform.api.tenancy.quotas.base import (
    Quota,
    QuotaDecision,
    QuotaSettings,
    Reservation,
    check_admit_args,
    check_used_tokens,
    never_fits,
    refusal,
)


@dataclass
class _TokenEntry:
    admitted_s: float
    slot_id: str
    tokens: int
    """Reserved at admission, replaced by the used count at settle."""


@dataclass
class _TenantWindow:
    """One tenant's logs; only the limited dimensions are written."""

    admissions_s: deque[float] = field(default_factory=deque)
    token_log: deque[_TokenEntry] = field(default_factory=deque)
    token_entries: dict[str, _TokenEntry] = field(default_factory=dict)
    num_tokens: int = 0
    """Sum of ``tokens`` over ``token_log``."""
    slot_ids: set[str] = field(default_factory=set)

    def trim(self, now_s: float, window_s: float) -> None:
        """Drop what was admitted at least ``window_s`` ago (an admission at t counts while now < t + w)."""
        cutoff_s = now_s - window_s
        while self.admissions_s and self.admissions_s[0] <= cutoff_s:
            self.admissions_s.popleft()
        while self.token_log and self.token_log[0].admitted_s <= cutoff_s:
            entry = self.token_log.popleft()
            del self.token_entries[entry.slot_id]
            self.num_tokens -= entry.tokens

    @property
    def empty(self) -> bool:
        return not (self.admissions_s or self.token_log or self.slot_ids)


class LocalQuotaLimiter:
    """In-process ``QuotaLimiter``: one limit per process, exact sliding windows."""

    def __init__(self, settings: QuotaSettings | None = None) -> None:
        self.settings = settings or QuotaSettings()
        self._windows: dict[str, _TenantWindow] = {}

    async def admit(self, tenant: str, quota: Quota, reserve_tokens: int, request_id: str) -> QuotaDecision:
        """See ``QuotaLimiter.admit``."""
        check_admit_args(tenant, reserve_tokens, request_id)
        too_large = never_fits(quota, reserve_tokens, self.settings.window_s)
        if too_large is not None:
            return too_large
        slot_id = f"{request_id}:{secrets.token_hex(8)}"
        if quota.unlimited:
            return QuotaDecision.admitted(
                Reservation(tenant, request_id, slot_id, reserve_tokens, holds_slot=False, accounted=False)
            )
        now_s = time.monotonic()
        window_s = self.settings.window_s
        state = self._windows.setdefault(tenant, _TenantWindow())
        state.trim(now_s, window_s)

        rpm_retry_s = None
        if quota.rpm is not None and len(state.admissions_s) >= quota.rpm:
            # The oldest admission whose expiry brings the count below the limit.
            rpm_retry_s = state.admissions_s[len(state.admissions_s) - quota.rpm] + window_s - now_s
        tpm_retry_s = None
        if quota.tpm is not None and state.num_tokens + reserve_tokens > quota.tpm:
            tpm_retry_s = self._tokens_free_in(state, state.num_tokens + reserve_tokens - quota.tpm, now_s)
        concurrency_full = quota.max_concurrency is not None and len(state.slot_ids) >= quota.max_concurrency
        refused = refusal(
            quota,
            reserve_tokens,
            self.settings,
            rpm_retry_s=rpm_retry_s,
            tpm_retry_s=tpm_retry_s,
            concurrency_full=concurrency_full,
        )
        if refused is not None:
            return refused

        if quota.rpm is not None:
            state.admissions_s.append(now_s)
        if quota.tpm is not None:
            entry = _TokenEntry(now_s, slot_id, reserve_tokens)
            state.token_log.append(entry)
            state.token_entries[slot_id] = entry
            state.num_tokens += reserve_tokens
        holds_slot = quota.max_concurrency is not None
        if holds_slot:
            state.slot_ids.add(slot_id)
        return QuotaDecision.admitted(
            Reservation(tenant, request_id, slot_id, reserve_tokens, holds_slot=holds_slot, accounted=True)
        )

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        """See ``QuotaLimiter.settle``."""
        check_used_tokens(used_tokens)
        state = self._windows.get(reservation.tenant)
        if not reservation.accounted or state is None:
            return
        state.trim(time.monotonic(), self.settings.window_s)
        state.slot_ids.discard(reservation.slot_id)
        # Gone from the log when the request outlived the window: its tokens already aged out.
        entry = state.token_entries.get(reservation.slot_id)
        if entry is not None:
            state.num_tokens += used_tokens - entry.tokens
            entry.tokens = used_tokens
        if state.empty:
            del self._windows[reservation.tenant]

    async def aclose(self) -> None:
        """Nothing runs in the background."""

    def check_integrity(self) -> None:
        """Token sums match the logs, and every window in the map holds something (tests call this)."""
        for tenant, state in self._windows.items():
            total = sum(entry.tokens for entry in state.token_log)
            assert total == state.num_tokens, f"{tenant}: tokens {state.num_tokens} != log sum {total}"
            assert len(state.token_entries) == len(state.token_log), f"{tenant}: token index out of sync"
            assert not state.empty, f"{tenant}: empty window kept"

    def _tokens_free_in(self, state: _TenantWindow, num_needed: int, now_s: float) -> float:
        """Seconds until ``num_needed`` tokens of the log have aged out, oldest first."""
        num_freed = 0
        for entry in state.token_log:
            num_freed += entry.tokens
            if num_freed >= num_needed:
                return entry.admitted_s + self.settings.window_s - now_s
        # Unreachable while num_tokens is the log's sum (check_integrity) and the request fits tpm.
        return self.settings.window_s
