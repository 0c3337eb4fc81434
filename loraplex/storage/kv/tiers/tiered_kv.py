"""``TieredKV``: the engine's KV cache as one object, the accelerator pool and the tiers below it.

It owns the ``KVBlockManager`` (block tables, prefix cache, the device pool) and, when host
or disk bytes are configured, the ``TierManager``, and wires the two together itself::

    pool.on_evict -> tiers.on_device_evict   a cached block the pool reuses goes down a tier
    pool.on_cache -> tiers.on_device_cache   a key the device caches (recomputed) leaves host/disk

so that every cached block has one location (``contracts``). Whole-cache operations run
here, with the device pool's keys wherever the tiers need them::

    reset()              forget every cached block on every tier (the caller checks it is idle)
    purge(owner)         forget one owner's blocks on every tier; cache none of them again
    persist()            before a shutdown: cached device blocks down, host spilled to disk, closed
    check_integrity()    the block manager, then the tiers against the device's cached keys
    prefix_cache_stats() / tier_metrics() / block_counts()   read-only, for a stats snapshot

Per-sequence work (admission, promotion, swap: ``prefix_promotion`` and the engine's tier
admission) uses the two parts, ``block_manager`` and ``tiers``, directly.

``attach_events(log)`` has every tier report the blocks it stores and drops to one
``KVEventLog`` (``kv_events``); a reset is one ``AllCleared``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import NamedTuple

from loraplex.storage.kv.block_manager import KVBlockManager
from loraplex.storage.kv.kv_cache import KVCache
from loraplex.storage.kv.kv_events import AllCleared, KVEventLog
from loraplex.storage.kv.prefix_cache import PrefixCacheStats
from loraplex.storage.kv.sliced import Steps, run_to_end
from loraplex.storage.kv.tiers.manager import TierManager
from loraplex.storage.kv.tiers.metrics import TierMetrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVBlockCounts:
    """How many blocks each tier has and holds now (capacities are 0 for a tier that is off)."""

    num_device_blocks: int
    num_used_device_blocks: int  # held by a sequence or a promotion in flight
    num_adapter_device_blocks: int  # lent to the adapter page arena (``kv_arena``)
    num_cached_device_blocks: int  # findable by key, in use or free
    num_host_blocks: int
    num_used_host_blocks: int
    num_disk_blocks: int
    num_used_disk_blocks: int  # published or being written
    num_swapped_blocks: int  # held below for preempted sequences' tails (in host or disk)
    num_window_freed_blocks: int = 0  # since start-up: blocks sliding windows gave back mid-sequence


class PersistReport(NamedTuple):
    """What ``persist`` kept for a restart."""

    num_cached: int  # device blocks cached when it ran
    num_kept: int  # of those, held by a tier afterwards
    num_spilled: int  # host blocks written to disk


class TieredKV:
    """The accelerator pool's blocks and the host/disk tiers below it, wired as one cache."""

    def __init__(self, block_manager: KVBlockManager, tiers: TierManager | None = None) -> None:
        self.block_manager = block_manager
        self.tiers = tiers
        self.events: KVEventLog | None = None
        if tiers is not None:
            pool = block_manager.pool
            pool.on_evict = tiers.on_device_evict
            pool.on_cache = tiers.on_device_cache

    @classmethod
    def create(
        cls,
        device: KVCache,
        fingerprint: bytes,
        *,
        enable_prefix_caching: bool,
        host_kv_cache_bytes: int = 0,
        disk_kv_path: str | os.PathLike[str] | None = None,
        disk_kv_cache_bytes: int = 0,
        sliding_window: int | None = None,
    ) -> TieredKV:
        """The cache for ``device``'s blocks; tiers only if host or disk bytes are given.

        ``fingerprint`` names the model and KV layout: it roots every prefix-cache key and
        heads every disk record, so a cache of another model or layout is never read.
        ``sliding_window``: every layer's window, when all layers slide (blocks behind it are
        freed while a sequence runs: ``KVBlockManager``).
        """
        block_manager = KVBlockManager(
            device.num_blocks,
            device.block_size,
            enable_prefix_caching=enable_prefix_caching,
            fingerprint=fingerprint,
            sliding_window=sliding_window,
        )
        tiers = None
        if host_kv_cache_bytes or disk_kv_cache_bytes:
            tiers = TierManager.create(
                device,
                device.layout,
                fingerprint,
                host_kv_cache_bytes=host_kv_cache_bytes,
                disk_kv_path=disk_kv_path,
                disk_kv_cache_bytes=disk_kv_cache_bytes,
            )
        return cls(block_manager, tiers)

    def attach_events(self, log: KVEventLog) -> None:
        """Report every block stored and dropped, in every tier, to ``log`` from now on."""
        self.events = log
        self.block_manager.pool.events = log
        if self.tiers is not None:
            self.tiers.host.events = log
            if self.tiers.disk is not None:
                self.tiers.disk.events = log

    @property
    def can_swap(self) -> bool:
        """True if a tier can hold blocks, so a preempted sequence's tail may be swapped out."""
        return self.tiers is not None and self.tiers.can_hold_blocks

    # -- whole-cache operations -----------------------------------------------------
    def reset(self) -> tuple[int, int, int]:
        """Forget every cached block on every tier; (device, host, disk) blocks forgotten.

        For an idle cache (the caller checks, and lands promotions in flight first): free
        device blocks lose their keys and are reused without a demotion (blocks in use would
        keep theirs), host slots are freed and zeroed, disk records dropped and their slot
        files erased, so a restart on the same path finds none. Counters stay cumulative.
        """
        start = time.perf_counter()
        self._cleared()
        device = self.block_manager.pool.uncache_free()
        host, disk = self.tiers.clear() if self.tiers is not None else (0, 0)
        logger.info(
            "prefix cache reset in %.2f s: %d device, %d host and %d disk blocks forgotten",
            time.perf_counter() - start,
            device,
            host,
            disk,
        )
        return device, host, disk

    def purge(self, owner: bytes) -> tuple[int, int, int]:
        """Forget ``owner``'s cached blocks on every tier and cache none of them again (a deleted
        tenant); (device, host, disk) blocks forgotten.

        Safe while sequences run: its blocks in use keep their keys until freed, then are
        reused without a demotion; its disk records are erased now, with those its promoted
        blocks left in free slot files.
        """
        return run_to_end(self.purge_steps(owner))

    def purge_steps(self, owner: bytes) -> Steps[tuple[int, int, int]]:
        """``purge`` in bounded pieces (``sliced``: the engine runs them between steps): the
        device pool's part and the ban on storing ``owner``'s blocks come first, at once."""
        start = time.perf_counter()
        device = self.block_manager.pool.purge_owner(owner)
        host = disk = 0
        if self.tiers is not None:
            yield None
            host, disk = yield from self.tiers.purge_steps(owner)
        logger.info(
            "purged an owner's cached KV in %.2f s: %d device, %d host and %d disk blocks",
            time.perf_counter() - start,
            device,
            host,
            disk,
        )
        return device, host, disk

    def reset_steps(self) -> Steps[tuple[int, int, int]]:
        """``reset`` with the disk tier's part in bounded pieces (``sliced``)."""
        start = time.perf_counter()
        self._cleared()
        device = self.block_manager.pool.uncache_free()
        host = disk = 0
        if self.tiers is not None:
            yield None
            host, disk = yield from self.tiers.clear_steps()
        logger.info(
            "prefix cache reset in %.2f s: %d device, %d host and %d disk blocks forgotten",
            time.perf_counter() - start,
            device,
            host,
            disk,
        )
        return device, host, disk

    def _cleared(self) -> None:
        # Before the keys go: a router that reads it forgets this replica's blocks, and a block
        # cached again after the reset is a later event.
        if self.events is not None:
            self.events.emit(AllCleared())

    def persist(self) -> PersistReport:
        """Keep the cache for a restart on the same disk path, then close the tiers.

        Cached device blocks are copied down (host, then disk) with their owners, host blocks
        are written to disk (up to its cap), and every write finishes and is fsynced. The
        caller lands promotions in flight first. The tiers are detached afterwards (``tiers``
        is None): the device blocks stay cached as well, so the one-location rule, like the
        tiers, ends here. Without tiers there is nothing to do.
        """
        tiers = self.tiers
        if tiers is None:
            return PersistReport(0, 0, 0)
        start = time.perf_counter()
        cached = self.block_manager.pool.cached_blocks()
        kept = sum(tiers.demote(b.block_id, b.key, b.owner) is not None for b in cached)
        spilled = tiers.spill_to_disk()
        tiers.close()
        pool = self.block_manager.pool
        pool.on_evict = None
        pool.on_cache = None
        self.tiers = None
        logger.info(
            "KV tiers closed in %.1f s: %d of %d cached device blocks kept in a tier, "
            "%d host blocks written to disk",
            time.perf_counter() - start,
            kept,
            len(cached),
            spilled,
        )
        return PersistReport(len(cached), kept, spilled)

    # -- invariants and stats -------------------------------------------------------
    def check_integrity(self) -> None:
        """Blocks and ref counts (``KVBlockManager.check_integrity``), then the tiers with the
        device's cached keys: no key cached on the device is also held below (one location
        per block, but for a promotion's superseded keys: ``manager``)."""
        self.block_manager.check_integrity()
        if self.tiers is not None:
            self.tiers.check_integrity(self.block_manager.pool.cached_keys())

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The device prefix cache's hit, miss and eviction counters."""
        return self.block_manager.prefix_cache_stats()

    def tier_metrics(self) -> list[TierMetrics]:
        """Host, then disk (zeros for a tier that is off)."""
        if self.tiers is None:
            return [TierMetrics.disabled("host"), TierMetrics.disabled("disk")]
        return self.tiers.metrics()

    def block_counts(self) -> KVBlockCounts:
        """How many blocks each tier has and holds now."""
        bm, tiers = self.block_manager, self.tiers
        host, disk = self.tier_metrics()
        return KVBlockCounts(
            num_device_blocks=bm.num_blocks,
            num_used_device_blocks=bm.num_blocks - bm.num_free_blocks - bm.pool.num_lent,
            num_adapter_device_blocks=bm.pool.num_lent,
            num_cached_device_blocks=bm.pool.num_cached_blocks,
            num_host_blocks=host.capacity_blocks,
            num_used_host_blocks=host.used_blocks,
            num_disk_blocks=disk.capacity_blocks,
            num_used_disk_blocks=disk.used_blocks,
            num_swapped_blocks=tiers.num_swapped_blocks if tiers is not None else 0,
            num_window_freed_blocks=bm.num_window_freed_blocks,
        )
