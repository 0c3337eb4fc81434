"""The tier manager: moves cached KV blocks between the accelerator pool, host RAM and disk.

Every cached block has exactly one authoritative location (``contracts``): the
accelerator pool (its prefix-cache index), a host slot, or a disk slot. The manager
owns the host and disk pools and moves blocks between them and the device::

    device evicts a cached block  -> on_device_evict(block_id, key, owner): copy to a host slot (demote)
    device caches a block         -> on_device_cache(key): drop the copy below, if any (the
                                     device computed it again: after a failed read, a partial
                                     promotion, or beside another sequence that computed it)
    host full                     -> its LRU block is demoted to disk (async write)
    disk full                     -> its LRU record is overwritten (dropped)
    prefix continues below device -> lookup(keys): the run of keys held by host or disk
    prefetch(keys) -> Promotion   -> host blocks pinned, disk reads started, keys hidden;
                                     the caller allocates device blocks (evictions that
                                     causes cannot touch the pinned blocks), then
    Promotion.assign(block_ids)   -> host copies issued (DMA on CUDA)
    Promotion.wait()              -> before the forward: disk blocks written; the chain
                                     stops at the first failure (a miss, never a hit);
                                     loaded blocks leave host/disk (they are on the device)
    swap_out(block_ids) -> SwapHandle  a preempted sequence's blocks (full or not) to host/disk
    swap_in(handle) -> Promotion       ... and back (assign, wait as above)
    discard_swap(handle)               the sequence finished or was aborted while swapped
    clear()                            drop every other block, erase the disk records (a reset)
    purge(owner)                       drop one owner's blocks, erase its disk records, and
                                       store none of its blocks again (a deleted tenant)

A key being promoted is pinned where it is and hidden from ``lookup`` until ``wait``
decides: loaded blocks leave the lower tier, blocks after a failure stay there
(findable again). The caller publishes the loaded device blocks in its prefix cache
only after ``wait``, so nothing reads a block before its data landed.

The one transient exception to one location: the device may cache a key while a
promotion moves it (another sequence computed it meanwhile). The copy below cannot go
then (pinned, or read by a disk worker), so it is marked *superseded* and dropped when
the promotion ends, unless it loaded (then it leaves anyway, and the promoted block
stays keyless on the device). If the device evicts the key before that, the mark is
lifted: the copy below is the only one again. ``check_integrity(device_keys)`` allows
exactly the superseded keys on both sides.

Thread safety: every public method takes one lock; disk I/O runs on the disk pool's
workers, which never take this lock (lock order: manager, then disk pool), and
``Promotion.wait`` blocks on disk reads outside it. ``check_integrity`` can run
while workers write and read.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Collection, Sequence
from concurrent.futures import wait as wait_futures
from typing import TypeVar

import torch

from loraplex.storage.kv.kv_cache import KVBlockLayout
from loraplex.storage.kv.sliced import Steps, chunks, run_to_end
from loraplex.storage.kv.tiers.contracts import DeviceBlockIO, KVTierPool, Location, Tier
from loraplex.storage.kv.tiers.disk_pool import DiskKVPool
from loraplex.storage.kv.tiers.host_pool import HostKVPool
from loraplex.storage.kv.tiers.metrics import TierMetrics
from loraplex.storage.kv.tiers.transfers import (
    Promotion,
    PromotionResult,
    PromotionSource,
    SwapHandle,
    is_swap_key,
    read_result,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

_HOST_CHUNK = 32
"""Host blocks freed and zeroed per piece of a sliced purge (a memset of a block each)."""


class TierManager:
    """Owns the host and disk pools and the one-location rule for cached blocks."""

    def __init__(self, device: DeviceBlockIO, host: HostKVPool, disk: DiskKVPool | None = None) -> None:
        if disk is not None and disk.layout != host.layout:
            raise ValueError(f"host layout {host.layout} differs from disk layout {disk.layout}")
        self.device = device
        self.host = host
        self.disk = disk if disk is not None and disk.num_slots > 0 else None
        self.layout = host.layout
        self._lock = threading.RLock()
        self._moving: set[bytes] = set()  # keys a promotion holds: pinned, hidden from lookup
        # Moving keys the device cached meanwhile: dropped below when their promotion ends.
        self._superseded: set[bytes] = set()
        self._swaps: dict[int, list[bytes]] = {}
        self._swap_ids = itertools.count()
        self._purged: set[bytes] = set()  # owners whose blocks are never stored again
        self._purging: set[bytes] = set()  # purged owners whose sliced purge has not ended
        self.num_dropped_blocks = 0  # left the device and landed nowhere
        self.num_discarded_blocks = 0  # copies below dropped because the device cached the key

    @classmethod
    def create(
        cls,
        device: DeviceBlockIO,
        layout: KVBlockLayout,
        fingerprint: bytes,
        *,
        host_kv_cache_bytes: int,
        disk_kv_path: str | os.PathLike[str] | None = None,
        disk_kv_cache_bytes: int = 0,
        num_io_workers: int = 4,
    ) -> TierManager:
        """The tiers for one engine; 0 bytes turns a tier off (its demotions are counted drops).

        ``fingerprint`` names the model and KV layout: pass the bytes the prefix
        cache's root key binds, so a disk tier of another model is never read.
        """
        host = HostKVPool(layout, host_kv_cache_bytes)
        disk = None
        if disk_kv_cache_bytes > 0:
            if disk_kv_path is None:
                raise ValueError(
                    f"disk_kv_cache_bytes={disk_kv_cache_bytes} needs a disk_kv_path; set one or use 0"
                )
            disk = DiskKVPool(
                disk_kv_path, layout, fingerprint, disk_kv_cache_bytes, num_workers=num_io_workers
            )
        return cls(device, host, disk)

    # -- demotion --------------------------------------------------------------
    def on_device_evict(self, block_id: int, key: bytes, owner: bytes = b"") -> None:
        """The block pool's ``on_evict`` hook: a cached device block is about to be reused."""
        self.demote(block_id, key, owner)

    def demote(self, block_id: int, key: bytes, owner: bytes = b"") -> Location | None:
        """Copy cached device block ``block_id`` (``key``, ``owner``'s) down: host, else disk.
        Where it went, or None.

        Must run before the block is overwritten: the copy is complete when this
        returns. Never raises for a full or disabled tier (a counted drop). A purged
        owner's block is dropped.
        """
        with self._lock:
            held = self._locate(key)
            if held is not None:  # content-addressed: the copy below is the same data
                # Superseded while a promotion moves it: the device copy goes now, so the
                # one below is the block's only location again and must stay.
                self._superseded.discard(key)
                return held
            location = None if owner in self._purged else self._store_from_device(key, block_id, owner)
            if location is None:
                self.num_dropped_blocks += 1
            return location

    def _store_from_device(self, key: bytes, block_id: int, owner: bytes = b"") -> Location | None:
        """Copy device block ``block_id`` to host (else disk) under ``key``; where, or None."""
        view = self._host_slot_for(key, owner)
        if view is not None:
            self.device.read_blocks([block_id], [view])
            slot = self.host.slot_of(key)
            assert slot is not None, f"host slot reserved for {key.hex()} vanished"
            return Location(Tier.HOST, slot)
        if self.disk is not None:
            staging = torch.empty(self.layout.block_shape, dtype=self.layout.dtype)
            self.device.read_blocks([block_id], [staging])
            if self.disk.demote_async(key, staging, persistent=not is_swap_key(key), copy=False, owner=owner):
                slot = self.disk.slot_of(key)
                if slot is not None:
                    return Location(Tier.DISK, slot)
        return None

    def _host_slot_for(self, key: bytes, owner: bytes) -> torch.Tensor | None:
        """A host slot claimed for ``key`` (demoting the LRU block to disk first if full)."""
        if self.host.num_free_slots == 0:
            evicted = self.host.evict_lru()
            # demote_async copies the data before returning, so the slot can be reused.
            if evicted is not None and (
                self.disk is None
                or not self.disk.demote_async(
                    evicted.key, evicted.data, persistent=not is_swap_key(evicted.key), owner=evicted.owner
                )
            ):
                self.num_dropped_blocks += 1
        return self.host.reserve(key, owner)

    # -- lookup and promotion --------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> list[tuple[bytes, Location]]:
        """Where the leading run of ``keys`` lives in host/disk; stops at the first key held by neither.

        Call it with the keys after the device prefix-cache hits end (e.g. to size an
        admission). Nothing is reserved: ``prefetch`` looks again and may find less.
        """
        with self._lock:
            found: list[tuple[bytes, Location]] = []
            for key in keys:
                location = None if key in self._moving else self._locate(key)
                if location is None:
                    break
                found.append((key, location))
            return found

    @property
    def can_hold_blocks(self) -> bool:
        """True if some tier has room for blocks at all (a host pool of 0 slots and no disk has none)."""
        return self.host.num_slots > 0 or self.disk is not None

    def is_moving(self, key: bytes) -> bool:
        """True while a promotion or swap-in holds ``key`` (hidden from ``lookup`` until it ends)."""
        with self._lock:
            return key in self._moving

    def location(self, key: bytes) -> Location | None:
        """Where ``key`` lives below the device (host or disk), or None."""
        with self._lock:
            return self._locate(key)

    def _locate(self, key: bytes) -> Location | None:
        slot = self.host.slot_of(key)
        if slot is not None:
            return Location(Tier.HOST, slot)
        if self.disk is not None:
            slot = self.disk.slot_of(key)
            if slot is not None:
                return Location(Tier.DISK, slot)
        return None

    def prefetch(self, keys: Sequence[bytes]) -> Promotion:
        """Start bringing a chain of ``keys`` up: pin host blocks, start disk reads (see ``transfers``).

        The chain stops at the first key held by neither tier (or already being
        promoted); ``num_started`` says how many device blocks to ``assign``.
        """
        return self._start(list(keys), keep_unloaded=True)

    def promote(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> Promotion:
        """``prefetch`` and ``assign`` at once, for a caller that already holds the device blocks.

        Allocating device blocks can evict cached blocks and push the ones wanted
        here down or out; ``prefetch`` first, then allocate, avoids that.
        """
        if len(keys) != len(block_ids):
            raise ValueError(f"{len(keys)} keys for {len(block_ids)} device blocks")
        promotion = self.prefetch(keys)
        promotion.assign(block_ids[: promotion.num_started])
        return promotion

    def _start(self, keys: list[bytes], keep_unloaded: bool) -> Promotion:
        with self._lock:
            sources: list[PromotionSource] = []
            for key in keys:
                if key in self._moving:
                    break
                slot = self.host.slot_of(key)
                if slot is not None:
                    self.host.pin(key)
                    sources.append(PromotionSource(key, slot, None, self.host.owner_of(key)))
                elif self.disk is not None and self.disk.contains(key):
                    sources.append(PromotionSource(key, None, self.disk.fetch(key), self.disk.owner_of(key)))
                else:
                    break
                self._moving.add(key)
            return Promotion(self, sources, len(keys), keep_unloaded)

    def copy_host_sources(self, promotion: Promotion) -> None:
        """Issue the host -> device copies of an assigned promotion (they overlap planning on CUDA).

        ``Promotion.assign`` calls it (``PromotionMover``); nothing else should."""
        assert promotion.block_ids is not None
        with self._lock:
            pairs = [
                (source, block_id)
                for source, block_id in zip(promotion.sources, promotion.block_ids, strict=False)
                if source.host_slot is not None
            ]
            if not pairs:
                return
            views = [self.host.get(source.key) for source, _ in pairs]  # counted, marked recently used
            self.device.write_blocks([b for _, b in pairs], [v for v in views if v is not None])

    def complete_promotion(
        self, promotion: Promotion, timeout_s: float | None, cancel: bool
    ) -> PromotionResult:
        """End ``promotion``: loaded blocks leave host/disk, the rest stay (a swap-in's are freed).

        ``Promotion.wait`` / ``cancel`` call it (``PromotionMover``); nothing else should."""
        sources = promotion.sources
        block_ids = [] if cancel or promotion.block_ids is None else promotion.block_ids
        assigned = sources[: len(block_ids)]
        reads = [s.read for s in assigned if s.read is not None]
        _, not_done = wait_futures(reads, timeout=timeout_s)
        if not_done:
            raise TimeoutError(
                f"{len(not_done)} of {len(reads)} disk reads still running after {timeout_s} s"
            )
        num_loaded = 0
        from_disk: list[tuple[int, torch.Tensor]] = []
        for source, block_id in zip(assigned, block_ids, strict=True):
            if source.read is not None:
                data = read_result(source.read)
                if data is None:
                    break  # a failed disk read: the chain stops here
                from_disk.append((block_id, data))
            num_loaded += 1
        try:
            if from_disk:
                self.device.write_blocks([b for b, _ in from_disk], [d for _, d in from_disk])
            # Host slots stay pinned until the device is done copying from them.
            self.device.synchronize()
        except BaseException:
            # The device blocks may hold anything: nothing counts as loaded, every key stays
            # where it was (findable again), and the caller releases its device blocks.
            self._release_sources(promotion, 0)
            raise
        self._release_sources(promotion, num_loaded)
        return PromotionResult(
            num_loaded=num_loaded,
            num_requested=promotion.num_requested,
            keys=[s.key for s in sources[:num_loaded]],
            block_ids=block_ids[:num_loaded],
        )

    def _release_sources(self, promotion: Promotion, num_loaded: int) -> None:
        """Unhide and unpin a finished promotion's keys; the loaded ones leave host/disk."""
        with self._lock:
            for position, source in enumerate(promotion.sources):
                self._moving.discard(source.key)
                loaded = position < num_loaded
                superseded = source.key in self._superseded
                self._superseded.discard(source.key)
                # Not loaded but superseded: the device cached the key meanwhile, so the
                # copy below would be a second location.
                drop = loaded or not promotion.keep_unloaded or superseded
                removed = False
                if source.host_slot is not None:
                    self.host.unpin(source.key)
                    if drop:
                        removed = self.host.remove(source.key, promoted=loaded)
                elif self.disk is not None and drop:
                    removed = self.disk.remove(source.key, promoted=loaded)
                if removed and superseded and not loaded:
                    self.num_discarded_blocks += 1

    def on_device_cache(self, key: bytes) -> None:
        """The block pool's ``on_cache`` hook: the device now caches ``key``; drop the copy below."""
        self.discard((key,))

    def discard(self, keys: Collection[bytes]) -> int:
        """Drop the host/disk copies of ``keys``, which the device holds now (one location per
        block); how many went now.

        A disk write in flight for a key is cancelled (never published). A key a promotion
        is moving is marked superseded instead and goes when the promotion ends (module
        docstring).
        """
        with self._lock:
            dropped = 0
            for key in keys:
                if key in self._moving:
                    self._superseded.add(key)
                elif self._forget(key):
                    dropped += 1
            self.num_discarded_blocks += dropped
            return dropped

    def clear(self) -> tuple[int, int]:
        """Drop every host and disk block, and erase the disk records (a prefix-cache reset);
        (host, disk) blocks dropped. Blocks a promotion or a swapped sequence holds stay."""
        with self._lock:
            keep = set(self._moving) | {key for keys in self._swaps.values() for key in keys}
            host = self.host.clear(keep)
            disk = self.disk.clear(keep)[0] if self.disk is not None else 0
            return host, disk

    def purge(self, owner: bytes) -> tuple[int, int]:
        """Drop ``owner``'s host and disk blocks, erase its disk records (also those of its
        promoted blocks), and store none of its blocks from now on (a deleted tenant);
        (host, disk) blocks dropped. Blocks a promotion holds stay until it ends: the device
        pool refuses to cache them (``BlockPool.purge_owner``), so they are reused keyless."""
        return run_to_end(self.purge_steps(owner))

    def purge_steps(self, owner: bytes) -> Steps[tuple[int, int]]:
        """``purge`` in bounded pieces (``sliced``), each under the lock: from the first on, none
        of ``owner``'s blocks is stored; then its host blocks go ``_HOST_CHUNK`` at a time (a
        zeroed slot is a memset of a whole block), then its disk blocks and records."""
        if not owner:
            raise ValueError("purge needs an owner: blocks of nobody are cleared, not purged")
        with self._lock:
            self._purged.add(owner)
            self._purging.add(owner)
            keys = self.host.keys_of(owner)
        try:
            host = 0
            for chunk in chunks(keys, _HOST_CHUNK):
                yield None
                with self._lock:
                    host += self.host.free_and_zero(chunk)
            disk = 0
            if self.disk is not None:
                disk = (yield from self._locked(self.disk.purge_steps(owner)))[0]
            return host, disk
        finally:
            with self._lock:
                self._purging.discard(owner)

    def clear_steps(self) -> Steps[tuple[int, int]]:
        """``clear`` with its disk part in bounded pieces (``sliced``); the host part runs at once."""
        with self._lock:
            keep = set(self._moving) | {key for keys in self._swaps.values() for key in keys}
            host = self.host.clear(keep)
        disk = 0
        if self.disk is not None:
            disk = (yield from self._locked(self.disk.clear_steps(keep)))[0]
        return host, disk

    def _locked(self, steps: Steps[T]) -> Steps[T]:
        """``steps`` with the lock held during each piece (never across a yield)."""
        while True:
            with self._lock:
                try:
                    signal = next(steps)
                except StopIteration as stop:
                    result: T = stop.value
                    return result
            yield signal

    def _forget(self, key: bytes) -> bool:
        return self.host.remove(key) or (self.disk is not None and self.disk.remove(key))

    # -- swap preemption -------------------------------------------------------
    def swap_out(self, block_ids: Sequence[int]) -> SwapHandle | None:
        """Copy a preempted sequence's device blocks (full or partial) to host, else disk.

        Complete when it returns: the device blocks may be freed. None if the tiers
        could not take every block (nothing is kept; recompute instead). An error while
        copying leaves nothing stored either, then is raised.
        """
        with self._lock:
            handle = SwapHandle(next(self._swap_ids), len(block_ids))
            keys = handle.block_keys()
            try:
                for key, block_id in zip(keys, block_ids, strict=True):
                    if self._store_from_device(key, block_id) is None:
                        break
            except BaseException:
                for key in keys:
                    self._forget(key)
                raise
            # A later block may have pushed an earlier one out of host and found the disk full.
            if not all(self._locate(key) is not None for key in keys):
                for key in keys:
                    self._forget(key)
                return None
            self._swaps[handle.swap_id] = keys
            return handle

    def swap_in(self, handle: SwapHandle) -> Promotion:
        """Start bringing a swapped sequence back (``assign`` its new device blocks, then ``wait``).

        ``wait().num_loaded`` leading blocks are back; the sequence recomputes from
        there. The handle is consumed either way (unloaded blocks are freed).
        """
        with self._lock:
            keys = self._swaps.pop(handle.swap_id, None)
            if keys is None:
                raise KeyError(f"swap {handle.swap_id} is unknown or was already swapped in")
            return self._start(keys, keep_unloaded=False)

    def discard_swap(self, handle: SwapHandle) -> None:
        """Free what a swapped-out sequence holds (finished or aborted while swapped)."""
        with self._lock:
            for key in self._swaps.pop(handle.swap_id, []):
                self._forget(key)

    @property
    def num_swapped_blocks(self) -> int:
        with self._lock:
            return sum(len(keys) for keys in self._swaps.values())

    # -- shutdown --------------------------------------------------------------
    def spill_to_disk(self) -> int:
        """Demote every unpinned host block to disk (before a graceful shutdown); how many went."""
        if self.disk is None:
            return 0
        with self._lock:
            moved = 0
            for key in self.host.held_keys():
                if is_swap_key(key) or self.host.is_pinned(key):
                    continue
                slot = self.host.slot_of(key)
                assert slot is not None
                if self.disk.demote_async(key, self.host.view(slot), owner=self.host.owner_of(key)):
                    self.host.remove(key)
                    moved += 1
            return moved

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for disk writes in flight; True if none is left."""
        return self.disk.flush(timeout_s) if self.disk is not None else True

    def close(self) -> None:
        """Finish and fsync the disk writes in flight, stop the I/O workers."""
        if self.disk is not None:
            self.disk.close()

    # -- metrics and invariants ------------------------------------------------
    def metrics(self) -> list[TierMetrics]:
        """One snapshot per tier below the device: host, then disk (zeros when disabled)."""
        with self._lock:
            disk = self.disk.metrics() if self.disk is not None else TierMetrics.disabled("disk")
            return [self.host.metrics(), disk]

    def check_integrity(self, device_keys: Collection[bytes] = ()) -> None:
        """Each key lives in at most one tier; each pool conserves its slots; disk stays capped.

        ``device_keys``: the keys the accelerator pool's prefix cache holds now; none may be
        held here too, but for the superseded keys of promotions in flight (module
        docstring). Without them only host against disk is checked.
        """
        with self._lock:
            pools: list[KVTierPool] = [self.host] if self.disk is None else [self.host, self.disk]
            for pool in pools:
                pool.check_integrity()
            host_keys = set(self.host.held_keys())
            # Disk workers only publish or drop keys, never add one: no false overlap below.
            disk_keys = set(self.disk.held_keys()) if self.disk is not None else set()
            both = host_keys & disk_keys
            if both:
                raise AssertionError(
                    f"{len(both)} blocks are in host and disk, e.g. {next(iter(both)).hex()}"
                )
            if not self._superseded <= self._moving:
                stale = next(iter(self._superseded - self._moving))
                raise AssertionError(f"block {stale.hex()} is marked superseded but no promotion moves it")
            on_device = (set(device_keys) & (host_keys | disk_keys)) - self._superseded
            if on_device:
                raise AssertionError(
                    f"{len(on_device)} device blocks also live below, e.g. {next(iter(on_device)).hex()}"
                )
            for key in self._moving:
                if self.host.contains(key) and not self.host.is_pinned(key):
                    raise AssertionError(
                        f"block {key.hex()} is being promoted but its host slot is not pinned"
                    )
            for owner in self._purged - self._purging:  # a purge in progress still holds some
                kept = [
                    k
                    for k in (host_keys | disk_keys) - self._moving
                    if owner
                    in (self.host.owner_of(k), self.disk.owner_of(k) if self.disk is not None else b"")
                ]
                if kept:
                    raise AssertionError(
                        f"{len(kept)} blocks of a purged owner are still held, e.g. {kept[0].hex()}"
                    )
            swap_keys = {key for keys in self._swaps.values() for key in keys}
            stray = {k for k in host_keys | disk_keys if is_swap_key(k)} - swap_keys - self._moving
            if stray:
                raise AssertionError(f"{len(stray)} swap blocks belong to no swap handle")
