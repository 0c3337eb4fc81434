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
decides (``promoter``, with the one transient exception to one location: a *superseded*
key). Where a block goes down and where it is: ``placement``.

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
from typing import TypeVar

from loraplex.storage.kv.kv_cache import KVBlockLayout
from loraplex.storage.kv.sliced import Steps, chunks, run_to_end
from loraplex.storage.kv.tiers.contracts import DeviceBlockIO, Location
from loraplex.storage.kv.tiers.disk_pool import DiskKVPool
from loraplex.storage.kv.tiers.host_pool import HostKVPool
from loraplex.storage.kv.tiers.metrics import TierMetrics
from loraplex.storage.kv.tiers.placement import TierPlacement
from loraplex.storage.kv.tiers.promoter import Promoter
from loraplex.storage.kv.tiers.transfers import Promotion, SwapHandle, is_swap_key

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
        self._placement = TierPlacement(device, host, self.disk)
        self._promoter = Promoter(self._lock, self._placement)
        self._swaps: dict[int, list[bytes]] = {}
        self._swap_ids = itertools.count()
        self._purging: set[bytes] = set()  # purged owners whose sliced purge has not ended

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
            held = self._placement.locate(key)
            if held is not None:  # content-addressed: the copy below is the same data
                # Superseded while a promotion moves it: the device copy goes now, so the
                # one below is the block's only location again and must stay.
                self._promoter.keep_below(key)
                return held
            return self._placement.demote(key, block_id, owner)

    # -- lookup and promotion --------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> list[tuple[bytes, Location]]:
        """Where the leading run of ``keys`` lives in host/disk; stops at the first key held by neither.

        Call it with the keys after the device prefix-cache hits end (e.g. to size an
        admission). Nothing is reserved: ``prefetch`` looks again and may find less.
        """
        with self._lock:
            found: list[tuple[bytes, Location]] = []
            for key in keys:
                location = None if key in self._promoter.moving else self._placement.locate(key)
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
            return key in self._promoter.moving

    def location(self, key: bytes) -> Location | None:
        """Where ``key`` lives below the device (host or disk), or None."""
        with self._lock:
            return self._placement.locate(key)

    def prefetch(self, keys: Sequence[bytes]) -> Promotion:
        """Start bringing a chain of ``keys`` up: pin host blocks, start disk reads (see ``transfers``).

        The chain stops at the first key held by neither tier (or already being
        promoted); ``num_started`` says how many device blocks to ``assign``.
        """
        return self._promoter.start(list(keys), keep_unloaded=True)

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

    def on_device_cache(self, key: bytes) -> None:
        """The block pool's ``on_cache`` hook: the device now caches ``key``; drop the copy below."""
        self.discard((key,))

    def discard(self, keys: Collection[bytes]) -> int:
        """Drop the host/disk copies of ``keys``, which the device holds now (one location per
        block); how many went now.

        A disk write in flight for a key is cancelled (never published). A key a promotion
        is moving is marked superseded instead and goes when the promotion ends (``promoter``).
        """
        return self._promoter.discard(keys)

    def clear(self) -> tuple[int, int]:
        """Drop every host and disk block, and erase the disk records (a prefix-cache reset);
        (host, disk) blocks dropped. Blocks a promotion or a swapped sequence holds stay."""
        with self._lock:
            keep = set(self._promoter.moving) | self._swap_keys()
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
            self._placement.refuse(owner)
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
            keep = set(self._promoter.moving) | self._swap_keys()
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

    def _swap_keys(self) -> set[bytes]:
        return {key for keys in self._swaps.values() for key in keys}

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
                    if self._placement.store(key, block_id) is None:
                        break
            except BaseException:
                for key in keys:
                    self._placement.forget(key)
                raise
            # A later block may have pushed an earlier one out of host and found the disk full.
            if not all(self._placement.locate(key) is not None for key in keys):
                for key in keys:
                    self._placement.forget(key)
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
            return self._promoter.start(keys, keep_unloaded=False)

    def discard_swap(self, handle: SwapHandle) -> None:
        """Free what a swapped-out sequence holds (finished or aborted while swapped)."""
        with self._lock:
            for key in self._swaps.pop(handle.swap_id, []):
                self._placement.forget(key)

    @property
    def num_swapped_blocks(self) -> int:
        with self._lock:
            return sum(len(keys) for keys in self._swaps.values())

    # -- shutdown --------------------------------------------------------------
    def spill_to_disk(self) -> int:
        """Demote every unpinned host block to disk (before a graceful shutdown); how many went."""
        with self._lock:
            return self._placement.spill_to_disk()

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

    @property
    def num_dropped_blocks(self) -> int:
        """Blocks that left the device and landed nowhere (no room, or a purged owner's)."""
        return self._placement.num_dropped_blocks

    @property
    def num_discarded_blocks(self) -> int:
        """Copies below dropped because the device cached their key."""
        return self._promoter.num_discarded_blocks

    def check_integrity(self, device_keys: Collection[bytes] = ()) -> None:
        """Each key lives in at most one tier; each pool conserves its slots; disk stays capped.

        ``device_keys``: the keys the accelerator pool's prefix cache holds now; none may be
        held here too, but for the superseded keys of promotions in flight (``promoter``).
        Without them only host against disk is checked.
        """
        with self._lock:
            host_keys, disk_keys = self._placement.check_integrity()
            moving, superseded = self._promoter.moving, self._promoter.superseded
            if not superseded <= moving:
                stale = next(iter(superseded - moving))
                raise AssertionError(f"block {stale.hex()} is marked superseded but no promotion moves it")
            on_device = (set(device_keys) & (host_keys | disk_keys)) - superseded
            if on_device:
                raise AssertionError(
                    f"{len(on_device)} device blocks also live below, e.g. {next(iter(on_device)).hex()}"
                )
            for key in moving:
                if self.host.contains(key) and not self.host.is_pinned(key):
                    raise AssertionError(
                        f"block {key.hex()} is being promoted but its host slot is not pinned"
                    )
            for owner in self._placement.refused - self._purging:  # a purge in progress still holds some
                held = (host_keys | disk_keys) - moving
                kept = [k for k in held if owner in self._placement.owners_of(k)]
                if kept:
                    raise AssertionError(
                        f"{len(kept)} blocks of a purged owner are still held, e.g. {kept[0].hex()}"
                    )
            stray = {k for k in host_keys | disk_keys if is_swap_key(k)} - self._swap_keys() - moving
            if stray:
                raise AssertionError(f"{len(stray)} swap blocks belong to no swap handle")
