"""Where a cached block lives below the device, and the demotion policy that puts it there.

Host RAM and disk as one place below the accelerator pool (``TierManager`` owns one)::

    locate(key) -> Location | None     host first, then disk
    demote(key, block_id, owner)       a device block down: host, else disk; else a counted drop,
                                       and always a drop for an owner ``refuse`` named
    store(key, block_id)               the same, for anyone, its own miss not counted (a swapped
                                       block: ``swap_out`` gives up and recomputes instead)
    forget(key)                        drop the copy below, wherever it is
    spill_to_disk()                    every unpinned host block down to disk (a shutdown)

Host full: its least recently used block goes down to disk first (an asynchronous write,
its data copied before the slot is reused); disk full: its LRU record is overwritten.
A copy is complete when ``demote`` returns, so the device block may be reused at once.

Not thread-safe: the manager calls it under its lock.
"""

from __future__ import annotations

import torch

from loraplex.storage.kv.tiers.contracts import DeviceBlockIO, KVTierPool, Location, Tier
from loraplex.storage.kv.tiers.disk_pool import DiskKVPool
from loraplex.storage.kv.tiers.host_pool import HostKVPool
from loraplex.storage.kv.tiers.transfers import is_swap_key


class TierPlacement:
    """The host and disk pools as one place below the device: where a key is, how a block goes down."""

    def __init__(self, device: DeviceBlockIO, host: HostKVPool, disk: DiskKVPool | None) -> None:
        self.device = device
        self.host = host
        self.disk = disk
        self.refused: set[bytes] = set()  # owners (purged) whose blocks are never stored again
        self.num_dropped_blocks = 0  # left the device and landed nowhere

    def locate(self, key: bytes) -> Location | None:
        """Where ``key`` lives below the device (host or disk), or None."""
        slot = self.host.slot_of(key)
        if slot is not None:
            return Location(Tier.HOST, slot)
        if self.disk is not None:
            slot = self.disk.slot_of(key)
            if slot is not None:
                return Location(Tier.DISK, slot)
        return None

    def refuse(self, owner: bytes) -> None:
        """Store none of ``owner``'s blocks from now on (a deleted tenant)."""
        self.refused.add(owner)

    def demote(self, key: bytes, block_id: int, owner: bytes = b"") -> Location | None:
        """Copy device block ``block_id`` down under ``key`` (host, else disk); where, or None
        (a counted drop: no room, or ``owner`` refused)."""
        location = None if owner in self.refused else self.store(key, block_id, owner)
        if location is None:
            self.num_dropped_blocks += 1
        return location

    def store(self, key: bytes, block_id: int, owner: bytes = b"") -> Location | None:
        """Copy device block ``block_id`` to host (else disk) under ``key``; where, or None."""
        view = self._host_slot_for(key, owner)
        if view is not None:
            self.device.read_blocks([block_id], [view])
            slot = self.host.slot_of(key)
            assert slot is not None, f"host slot reserved for {key.hex()} vanished"
            return Location(Tier.HOST, slot)
        if self.disk is not None:
            staging = torch.empty(self.host.layout.block_shape, dtype=self.host.layout.dtype)
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

    def forget(self, key: bytes) -> bool:
        """Drop ``key``'s copy below (a disk write in flight is cancelled); True if there was one."""
        return self.host.remove(key) or (self.disk is not None and self.disk.remove(key))

    def spill_to_disk(self) -> int:
        """Demote every unpinned host block to disk (before a graceful shutdown); how many went."""
        if self.disk is None:
            return 0
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

    def check_integrity(self) -> tuple[set[bytes], set[bytes]]:
        """Each pool conserves its slots, no key is in both; the (host, disk) keys held."""
        pools: list[KVTierPool] = [self.host] if self.disk is None else [self.host, self.disk]
        for pool in pools:
            pool.check_integrity()
        host_keys = set(self.host.held_keys())
        # Disk workers only publish or drop keys, never add one: no false overlap below.
        disk_keys = set(self.disk.held_keys()) if self.disk is not None else set()
        both = host_keys & disk_keys
        if both:
            raise AssertionError(f"{len(both)} blocks are in host and disk, e.g. {next(iter(both)).hex()}")
        return host_keys, disk_keys

    def owners_of(self, key: bytes) -> tuple[bytes, bytes]:
        """The owner ``key`` has on host and on disk (b"": nobody, or not held there)."""
        return self.host.owner_of(key), self.disk.owner_of(key) if self.disk is not None else b""
