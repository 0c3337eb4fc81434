"""Contracts of the KV tiers below the accelerator pool: where a block lives, and the device side.

Every cached block has exactly one location at a time (the one-location rule)::

    DEVICE(block_id)   in the accelerator pool (the prefix cache's index says which block)
    HOST(slot)         in a slot of the host pool (``HostKVPool``, pinned RAM on CUDA)
    DISK(slot)         in a slot file of the disk pool (``DiskKVPool``), or on its way there

Blocks move down on eviction (device -> host -> disk -> gone) and up on a hit
(host or disk -> a fresh device block). When the device caches a key that host or disk
still holds (it computed the block again: after a failed read, a partial promotion, or
beside a copy demoted meanwhile), the copy below is dropped (``BlockPool.on_cache`` ->
``TierManager.on_device_cache``, wired by ``TieredKV``). The one transient exception: a
key a promotion is moving, which the device cached meanwhile, is *superseded* and leaves
its tier when the promotion ends, unless the device evicted its copy first (``promoter``).
``TieredKV.check_integrity`` checks the rule with the device's keys; ``TieredKV.persist``
copies the device's blocks down at shutdown and closes the tiers, ending it.

Outside the accelerator a block travels as one tensor ``KVBlockLayout.block_shape``:
``[num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from loraplex.storage.kv.tiers.metrics import TierMetrics


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


@dataclass(frozen=True)
class Location:
    """Where one block lives: its tier and its index there (device block id, or slot)."""

    tier: Tier
    index: int


class DeviceBlockIO(Protocol):
    """What the tiers need from the accelerator pool (``KVCache`` implements it).

    Host blocks are contiguous CPU tensors of ``KVBlockLayout.block_shape``, one per block.
    """

    def read_blocks(self, block_ids: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
        """Copy device blocks into ``outs``; complete when it returns (``outs`` are read next)."""
        ...

    def write_blocks(self, block_ids: Sequence[int], blocks: Sequence[torch.Tensor]) -> None:
        """Copy ``blocks`` into device blocks, ordered before the next forward on the device.

        May still be running when it returns; ``synchronize`` waits for it, after which
        ``blocks`` may be reused.
        """
        ...

    def synchronize(self) -> None:
        """Wait for every ``write_blocks`` issued so far."""
        ...


class KVTierPool(Protocol):
    """What the host and disk pools share: a keyed, LRU, fixed-capacity store of blocks."""

    @property
    def num_slots(self) -> int:
        """Capacity in blocks (0: the tier is off and refuses every block, counted)."""
        ...

    @property
    def num_used_slots(self) -> int: ...

    def contains(self, key: bytes) -> bool: ...

    def held_keys(self) -> list[bytes]:
        """Keys held, least recently used first."""
        ...

    def remove(self, key: bytes, *, promoted: bool = False) -> bool:
        """Forget ``key`` (True if it was here); ``promoted`` counts it as moved up."""
        ...

    def metrics(self) -> TierMetrics: ...

    def check_integrity(self) -> None:
        """Raise AssertionError if slots are not conserved (used + free == capacity)."""
        ...
