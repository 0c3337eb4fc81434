"""The host tier: a fixed pool of KV block slots in host RAM, keyed and LRU.

One tensor ``[num_slots, num_layers, 2, block_size, num_kv_heads, head_dim]`` is
allocated up front (pinned when CUDA is present, so promotions copy by DMA), sized by
``host_kv_cache_bytes``; 0 slots is a valid, disabled pool that refuses every block
(each refusal is a counted drop). Protocol, in paired verbs:

    reserve(key, owner) -> view | None  claim a free slot for ``key`` (caller fills it)
    put(key, data, owner) -> slot | None  reserve and copy ``data`` in
    evict_lru() -> EvictedBlock | None  free the least recently used unpinned slot; its view
                                        stays valid until the next reserve/put (demote it first)
    get(key) -> view | None             a read (hit or miss counted), marks ``key`` recently used
    pin(key) / unpin(key)               a promotion in flight: not evictable, not removable
    remove(key, promoted=...)           free the slot
    clear(keep)                         free (and zero) every unpinned slot not in ``keep``
    purge(owner)                        free (and zero) every unpinned slot ``owner`` owns

``owner`` is the tenant's cache salt (b"": nobody's), kept so that a deleted tenant's blocks
can be purged and carried to the disk tier with the block.

With ``events`` set, a key arriving is a ``BlocksStored`` (CPU) and one leaving (evicted,
removed, purged) a ``BlocksRemoved``; ``clear`` reports nothing (the reset's ``AllCleared`` does).

The pool is not thread-safe: ``TierManager`` serialises every call under its lock.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Collection
from typing import NamedTuple

import torch

from loraplex.storage.kv.kv_cache import KVBlockLayout
from loraplex.storage.kv.kv_events import CPU, KVEventLog
from loraplex.storage.kv.tiers.metrics import TierCounters, TierMetrics

logger = logging.getLogger(__name__)


class EvictedBlock(NamedTuple):
    """A block ``evict_lru`` freed: its data view is valid until the slot is handed out again."""

    key: bytes
    data: torch.Tensor
    owner: bytes


class HostKVPool:
    """Fixed-capacity, LRU, keyed block slots in (pinned) host memory."""

    def __init__(self, layout: KVBlockLayout, capacity_bytes: int, *, pin_memory: bool | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"host_kv_cache_bytes must be >= 0, got {capacity_bytes}")
        self.layout = layout
        self._num_slots = capacity_bytes // layout.bytes_per_block
        pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.storage = torch.empty(
            (self._num_slots, *layout.block_shape), dtype=layout.dtype, pin_memory=pin and self._num_slots > 0
        )
        # OrderedDict as the LRU: oldest first, move_to_end on use.
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._owner: list[bytes | None] = [None] * self._num_slots
        self._free: deque[int] = deque(range(self._num_slots))
        self._pins: dict[bytes, int] = {}
        self._block_owner: dict[bytes, bytes] = {}  # held key -> owner, when it has one
        self.counters = TierCounters()
        self.events: KVEventLog | None = None
        if capacity_bytes and not self._num_slots:
            logger.warning(
                "host_kv_cache_bytes=%d holds no KV block (one is %d bytes): the host tier is off",
                capacity_bytes,
                layout.bytes_per_block,
            )
        if self._num_slots:
            logger.info(
                "host KV tier: %d blocks, %.1f MiB%s",
                self._num_slots,
                self._num_slots * layout.bytes_per_block / 2**20,
                " (pinned)" if pin else "",
            )

    # -- queries ---------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_used_slots(self) -> int:
        return len(self._index)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def contains(self, key: bytes) -> bool:
        return key in self._index

    def slot_of(self, key: bytes) -> int | None:
        """The slot holding ``key``, or None; no LRU touch, nothing counted."""
        return self._index.get(key)

    def held_keys(self) -> list[bytes]:
        """Keys held, least recently used first."""
        return list(self._index)

    def view(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s block tensor (shares the pool's memory)."""
        return self.storage[slot]

    def is_pinned(self, key: bytes) -> bool:
        return key in self._pins

    # -- storing ---------------------------------------------------------------
    def reserve(self, key: bytes, owner: bytes = b"") -> torch.Tensor | None:
        """Claim a free slot for ``key`` and return its view to fill; None (a drop) if none is free.

        The caller evicts first when the pool is full (``evict_lru``); ``key`` must
        not be held already.
        """
        if key in self._index:
            raise KeyError(f"host pool already holds block {key.hex()}")
        if not self._free:
            self.counters.drops += 1
            return None
        slot = self._free.popleft()
        self._owner[slot] = key
        self._index[key] = slot
        if owner:
            self._block_owner[key] = owner
        self.counters.demotions += 1
        self.counters.bytes_in += self.layout.bytes_per_block
        if self.events is not None:
            self.events.stored((key,), CPU, owner)
        return self.storage[slot]

    def put(self, key: bytes, data: torch.Tensor, owner: bytes = b"") -> int | None:
        """Copy ``data`` (``block_shape``) into a free slot for ``key``; the slot, or None (a drop)."""
        if tuple(data.shape) != self.layout.block_shape:
            raise ValueError(f"block is {tuple(data.shape)}, expected {self.layout.block_shape}")
        view = self.reserve(key, owner)
        if view is None:
            return None
        view.copy_(data)
        return self._index[key]

    def evict_lru(self) -> EvictedBlock | None:
        """Free the least recently used unpinned block; its key, a view of its (old) data, its owner.

        The view is valid until the slot is handed out again: demote it before the
        next ``reserve`` / ``put``. None if every held block is pinned or none is held.
        """
        for key, slot in self._index.items():
            if key not in self._pins:
                owner = self._block_owner.get(key, b"")
                self._release(key, report=True)
                self.counters.evictions += 1
                return EvictedBlock(key, self.storage[slot], owner)
        return None

    # -- reading ---------------------------------------------------------------
    def get(self, key: bytes) -> torch.Tensor | None:
        """The block's view (a hit, marked recently used), or None (a miss)."""
        slot = self._index.get(key)
        if slot is None:
            self.counters.misses += 1
            return None
        self._index.move_to_end(key)
        self.counters.hits += 1
        self.counters.bytes_out += self.layout.bytes_per_block
        return self.storage[slot]

    def pin(self, key: bytes) -> None:
        if key not in self._index:
            raise KeyError(f"cannot pin block {key.hex()}: not in the host pool")
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: bytes) -> None:
        count = self._pins.get(key, 0)
        if count <= 0:
            raise KeyError(f"block {key.hex()} is not pinned")
        if count == 1:
            del self._pins[key]
        else:
            self._pins[key] = count - 1

    def remove(self, key: bytes, *, promoted: bool = False) -> bool:
        """Free ``key``'s slot (True if held); ``promoted`` counts it as moved to the device."""
        if key not in self._index:
            return False
        if key in self._pins:
            raise RuntimeError(f"block {key.hex()} is pinned by a transfer in flight")
        self._release(key, report=True)
        if promoted:
            self.counters.promotions += 1
        return True

    def owner_of(self, key: bytes) -> bytes:
        """The owner ``key`` was stored with (b"": nobody, or not held)."""
        return self._block_owner.get(key, b"")

    def clear(self, keep: Collection[bytes] = ()) -> int:
        """Free every unpinned block not in ``keep`` and zero its slot (a prefix-cache reset); how many."""
        gone = [key for key in self._index if key not in self._pins and key not in keep]
        return self._free_and_zero(gone, report=False)

    def purge(self, owner: bytes) -> int:
        """Free and zero every unpinned block ``owner`` owns (a deleted tenant); how many."""
        gone = [key for key, by in self._block_owner.items() if by == owner and key not in self._pins]
        return self._free_and_zero(gone, report=True)

    def keys_of(self, owner: bytes) -> list[bytes]:
        """The keys ``owner`` owns (pinned ones too: ``free_and_zero`` skips those)."""
        return [key for key, by in self._block_owner.items() if by == owner]

    def free_and_zero(self, keys: Collection[bytes]) -> int:
        """Free and zero those of ``keys`` still held and unpinned (a slice of a purge); how many."""
        return self._free_and_zero(
            [key for key in keys if key in self._index and key not in self._pins], report=True
        )

    def _free_and_zero(self, gone: list[bytes], report: bool) -> int:
        for key in gone:
            slot = self._index[key]
            self._release(key, report=False)
            self.storage[slot].zero_()
        if report and self.events is not None:
            self.events.removed(gone, CPU)
        return len(gone)

    def _release(self, key: bytes, report: bool) -> None:
        self._block_owner.pop(key, None)
        slot = self._index.pop(key)
        self._owner[slot] = None
        self._free.append(slot)
        if report and self.events is not None:
            self.events.removed((key,), CPU)

    # -- metrics and invariants ------------------------------------------------
    def metrics(self) -> TierMetrics:
        return self.counters.snapshot("host", self._num_slots, len(self._index), self.layout.bytes_per_block)

    def check_integrity(self) -> None:
        """Each slot is free or holds exactly one key; used + free == capacity; pins are held keys."""
        used, free = len(self._index), len(self._free)
        if used + free != self._num_slots:
            raise AssertionError(f"host pool: {used} used + {free} free != {self._num_slots} slots")
        if len(set(self._free)) != free:
            raise AssertionError("host pool: a slot is queued free twice")
        for key, slot in self._index.items():
            if self._owner[slot] != key:
                raise AssertionError(f"host slot {slot} is indexed as {key.hex()} but owned by another key")
            if slot in self._free:
                raise AssertionError(f"host slot {slot} is both used and free")
        for key in self._pins:
            if key not in self._index:
                raise AssertionError(f"host pool: pinned block {key.hex()} is not held")
        for key in self._block_owner:
            if key not in self._index:
                raise AssertionError(f"host pool: the owner of {key.hex()} is kept but the block is not held")
