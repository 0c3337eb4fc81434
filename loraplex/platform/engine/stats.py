"""``EngineStats``: one consistent picture of the engine, built on its thread after every step.

The counters live where the work happens (the scheduler, the KV cache and its tiers, the
adapter manager, the engine's per-tenant usage), on the engine thread and the tiers' I/O
workers. Nothing on another thread reads them there: at the end of each step (and after the
commands it ran between steps) the engine freezes them into one ``EngineStats`` and publishes
it by swapping one reference, so a reader (``/metrics``, the admin UI, a test) always sees the
state of one step, however many fields it reads::

    stats = async_engine.stats        # any thread; never blocks the engine
    stats.num_waiting, stats.kv.num_used_device_blocks, stats.tenants["..."].generated_tokens

Counters are cumulative since start-up (Prometheus counters); the others are gauges.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from loraplex.adapters import AdapterStats
from loraplex.platform.engine.kv_events.publisher import PublisherCounters
from loraplex.platform.engine.policy import FairSharePolicy
from loraplex.platform.engine.sequence import Sequence
from loraplex.platform.engine.speculative import SpecCounters
from loraplex.storage.kv.prefix_cache import PrefixCacheStats
from loraplex.storage.kv.tier_metrics import TierMetrics
from loraplex.storage.kv.tiered_kv import KVBlockCounts

if TYPE_CHECKING:
    from loraplex.platform.engine.engine import LLMEngine


@dataclass(frozen=True)
class TenantUsage:
    """What one tenant's requests cost the engine since start-up (``""``: requests without a tenant)."""

    num_requests: int = 0
    """Requests added."""
    prompt_tokens: int = 0
    """Prompt tokens of the requests added."""
    cached_tokens: int = 0
    """Prompt tokens of finished requests served from the prefix cache."""
    generated_tokens: int = 0
    """Tokens sampled (every completion of ``n``)."""
    num_finished: int = 0
    num_failed: int = 0
    """Requests that ended with an error (an adapter removed, a failed step, ...)."""


@dataclass(frozen=True)
class EngineStats:
    """The engine after one step (see the module docstring)."""

    step: int
    """Steps run since start-up (this snapshot is after the ``step``-th)."""
    timestamp: float
    """Unix time the snapshot was built."""
    num_waiting: int
    """Sequences waiting to be admitted (new, preempted, or waiting for blocks from a tier)."""
    num_running: int
    num_swapped: int
    """Waiting sequences whose partial last block is held by a tier."""
    num_promotions_in_flight: int
    num_preemptions: int
    num_batched_tokens: int
    """Tokens run through the model (prefill, recompute and decode)."""
    kv: KVBlockCounts
    prefix_cache: PrefixCacheStats
    """Device-pool lookups and hits; the tiers' own hits are in ``tiers``."""
    tiers: tuple[TierMetrics, ...]
    """Host, then disk (zeros for a tier that is off): hits, promotions, demotions, faults."""
    adapters: AdapterStats | None
    """None without LoRA."""
    tenants: Mapping[str, TenantUsage]
    """Per engine tenant id (the server's ``tenant_id``; ``""`` for requests without one)."""
    virtual_counters: Mapping[str, float] = field(default_factory=dict)
    """Fair share: each tenant's virtual token counter (weighted service received; empty under
    fcfs / priority). Gauges: they only grow, but an idle tenant is lifted when it returns."""
    tenant_weights: Mapping[str, float] = field(default_factory=dict)
    """Fair share: the weight each tenant's newest request carried."""
    num_maintenance_jobs: int = 0
    """Purges and prefix-cache resets in progress (run in slices between steps)."""
    num_maintenance_slices: int = 0
    """Slices of such work run between steps since start-up (a counter)."""
    max_maintenance_slice_s: float = 0.0
    """The longest slice of such work between two steps so far: the most it delayed a step."""
    rejections: Mapping[str, int] = field(default_factory=dict)
    """Requests refused at submission or ended by the engine, by reason: ``overload`` (past
    ``max_queued_requests``), ``deadline`` (past ``request_timeout_s``). Counters."""
    running_adapters: tuple[str, ...] = ()
    """The adapters of the running sequences, by the name clients use (vLLM's
    ``running_lora_adapters``), each once, in the order the sequences run."""
    waiting_adapters: tuple[str, ...] = ()
    """The same for the waiting sequences (``waiting_lora_adapters``)."""
    kv_events: PublisherCounters | None = None
    spec_decode: SpecCounters | None = None
    """Speculative drafts proposed and accepted (``speculative_config``); None when it is off."""
    """KV event batches published and dropped (``kv_events_config``); None when events are off."""

    @property
    def num_unfinished(self) -> int:
        return self.num_waiting + self.num_running


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

    def count(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1
            self._frozen = MappingProxyType(dict(self._counts))

    def snapshot(self) -> Mapping[str, int]:
        return self._frozen


def build_stats(engine: LLMEngine) -> EngineStats:
    """Freeze ``engine``'s counters into one ``EngineStats`` (on the engine's thread)."""
    scheduler = engine.scheduler
    policy = scheduler.policy
    kv = engine.kv
    return EngineStats(
        step=engine.num_steps,
        timestamp=time.time(),
        num_waiting=len(scheduler.waiting),
        num_running=len(scheduler.running),
        num_swapped=sum(seq.swapped is not None for seq in scheduler.waiting),
        num_promotions_in_flight=scheduler.num_promotions_in_flight,
        num_preemptions=scheduler.num_preemptions,
        num_batched_tokens=engine.num_batched_tokens,
        kv=kv.block_counts(),
        prefix_cache=kv.prefix_cache_stats(),
        tiers=tuple(kv.tier_metrics()),
        adapters=engine.lora_manager.manager.stats() if engine.lora_manager is not None else None,
        tenants=engine.usage.snapshot(),
        virtual_counters=policy.snapshot() if isinstance(policy, FairSharePolicy) else {},
        tenant_weights=MappingProxyType(dict(policy.weights)) if isinstance(policy, FairSharePolicy) else {},
        num_maintenance_jobs=len(engine.maintenance),
        num_maintenance_slices=engine.maintenance.num_slices,
        max_maintenance_slice_s=engine.maintenance.max_slice_s,
        rejections=engine.rejections.snapshot(),
        running_adapters=_adapter_names(scheduler.running),
        waiting_adapters=_adapter_names(scheduler.waiting),
        kv_events=engine.kv_events.counters if engine.kv_events is not None else None,
        spec_decode=engine.speculator.counters.snapshot() if engine.speculator is not None else None,
    )


def _adapter_names(seqs: Iterable[Sequence]) -> tuple[str, ...]:
    """The display names of the adapters ``seqs`` run on, each once, in order."""
    names = {seq.request.adapter.display_name: None for seq in seqs if seq.request.adapter is not None}
    return tuple(names)
