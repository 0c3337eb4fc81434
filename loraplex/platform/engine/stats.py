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

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplex.adapters import AdapterStats
from loraplex.platform.engine.kv_events.publisher import PublisherCounters
from loraplex.platform.engine.speculative import SpecCounters
from loraplex.storage.kv.prefix_cache import PrefixCacheStats
from loraplex.storage.kv.tiers.metrics import TierMetrics
from loraplex.storage.kv.tiers.tiered_kv import KVBlockCounts

if TYPE_CHECKING:
    pass


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
