"""``AdapterStats``: the adapter tiers at one moment, as ``EngineStats`` reports them.

``AdapterManager.stats`` calls ``tier_stats`` under its lock: how many adapters each tier
holds, the cumulative moves between them, which adapters are resident where
(``resident.py``) and how long device loads took (``load_times.py``), all from one pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.adapters.config import AdapterManagerConfig
from loraplex.adapters.host_cache import HostAdapterCache
from loraplex.adapters.load_times import EMPTY_LOAD_TIMES, LoadTimes, LoadTimesSnapshot
from loraplex.adapters.registry import AdapterRegistry
from loraplex.adapters.residency import DeviceResidency
from loraplex.adapters.resident import ResidentAdapter, resident_adapters
from loraplex.adapters.store_reads import StoreReads


@dataclass(frozen=True)
class AdapterStats:
    """The adapter tiers at one moment: how many adapters each holds, and cumulative moves."""

    num_registered: int
    """Adapters registered (every one is on disk, in the store)."""
    max_loras: int | None
    """The cap on resident adapters, None when memory alone bounds them."""
    num_on_device: int
    """Adapters resident (pages in the device pool)."""
    num_pinned_slots: int
    """Resident adapters a running sequence uses."""
    pool_used_bytes: int
    """Bytes of adapter pages in use."""
    pool_bytes: int
    """Bytes the adapter page pools hold (used and free pages)."""
    pool_budget_bytes: int
    """``lora_memory``: the most the pools may hold."""
    pages_used: dict[str, int]
    """Pages in use per projection group."""
    num_evictions: int
    """Resident adapters evicted to make room since start-up."""
    num_in_host: int
    """Registered adapters whose weights are in host memory."""
    host_capacity: int | None
    """``max_cpu_loras``: the most adapters the host LRU holds (None: bytes alone bound it)."""
    host_bytes: int
    """Bytes of adapter weights in the host LRU."""
    host_budget_bytes: int | None
    """``cpu_lora_memory``: the most bytes the host LRU holds (None: no byte cap)."""
    num_slot_loads: int
    """Adapters written into a device slot since start-up."""
    num_disk_reads: int
    """Adapters read from the store into host memory since start-up (host-cache misses)."""
    num_loading: int
    """Background reads in flight."""
    resident: tuple[ResidentAdapter, ...] = ()
    """The adapters in device pages (``gpu``), then those only in the host LRU (``cpu``), most
    recently used first within each level."""
    load_times: LoadTimesSnapshot = EMPTY_LOAD_TIMES
    """How long each device load took (the store read of a host-cache miss included)."""


def tier_stats(
    config: AdapterManagerConfig,
    registry: AdapterRegistry,
    residency: DeviceResidency,
    host: HostAdapterCache,
    reads: StoreReads,
    load_times: LoadTimes,
) -> AdapterStats:
    """The snapshot of the tiers now (the caller holds the manager's lock)."""
    slots, pool = residency.slots, residency.pool
    entries = registry.entries()
    on_device = sum(slots.slot_of(e.identity.adapter_id) is not None for e in entries)
    in_host = sum(e.identity.version in host for e in entries)
    return AdapterStats(
        resident=resident_adapters(entries, slots, host),
        load_times=load_times.snapshot(),
        num_registered=len(entries),
        max_loras=config.max_loras,
        num_on_device=on_device,
        num_pinned_slots=slots.num_pinned,
        pool_used_bytes=pool.used_nbytes,
        pool_bytes=pool.nbytes,
        pool_budget_bytes=pool.budget_bytes,
        pages_used={g: pool.num_used(g) for g in pool.groups()},
        num_evictions=residency.num_evictions,
        num_in_host=in_host,
        host_capacity=config.max_cpu_loras,
        host_bytes=host.nbytes,
        host_budget_bytes=config.cpu_lora_memory,
        num_slot_loads=residency.num_slot_loads,
        num_disk_reads=reads.num_reads,
        num_loading=reads.num_in_flight,
    )
