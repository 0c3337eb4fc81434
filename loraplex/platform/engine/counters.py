"""Counters the engine keeps on its thread and freezes into each ``EngineStats``: per-tenant usage
(``TenantCounters``) and refusals by reason (``RejectionCounters``)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from loraplex.platform.engine.errors import RejectionReason
from loraplex.platform.engine.stats import TenantUsage


@dataclass
class _Counts:
    num_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    num_finished: int = 0
    num_failed: int = 0


@dataclass
class TenantCounters:
    """Per-tenant usage, counted on the engine thread; ``snapshot`` copies only what changed."""

    _counts: dict[str, _Counts] = field(default_factory=dict)
    _dirty: set[str] = field(default_factory=set)
    _frozen: dict[str, TenantUsage] = field(default_factory=dict)

    def _of(self, tenant: str | None) -> _Counts:
        key = tenant or ""
        self._dirty.add(key)
        counts = self._counts.get(key)
        if counts is None:
            counts = self._counts[key] = _Counts()
        return counts

    def added(self, tenant: str | None, prompt_tokens: int) -> None:
        counts = self._of(tenant)
        counts.num_requests += 1
        counts.prompt_tokens += prompt_tokens

    def generated(self, tenant: str | None, num_tokens: int) -> None:
        self._of(tenant).generated_tokens += num_tokens

    def finished(self, tenant: str | None, cached_tokens: int, failed: bool) -> None:
        counts = self._of(tenant)
        counts.cached_tokens += cached_tokens
        counts.num_finished += 1
        counts.num_failed += failed

    def snapshot(self) -> Mapping[str, TenantUsage]:
        """An immutable copy (a new mapping only when something changed since the last one)."""
        if self._dirty:
            frozen = dict(self._frozen)
            for key in self._dirty:
                c = self._counts[key]
                frozen[key] = TenantUsage(
                    c.num_requests,
                    c.prompt_tokens,
                    c.cached_tokens,
                    c.generated_tokens,
                    c.num_finished,
                    c.num_failed,
                )
            self._frozen = frozen
            self._dirty = set()
        return MappingProxyType(self._frozen)


class RejectionCounters:
    """Counts by reason; ``count`` is safe from any thread (the server refuses on its event loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._frozen: Mapping[str, int] = MappingProxyType({})

    def count(self, reason: RejectionReason) -> None:
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1
            self._frozen = MappingProxyType(dict(self._counts))

    def snapshot(self) -> Mapping[str, int]:
        return self._frozen
