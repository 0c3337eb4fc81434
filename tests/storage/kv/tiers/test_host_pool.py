"""Host KV tier: exact slots, LRU eviction order, pins, a pool of size 0, integrity checks that bite."""

from __future__ import annotations

import pytest
import torch

from loraplex.storage.kv.kv_cache import KVBlockLayout
from loraplex.storage.kv.tiers.host_pool import HostKVPool

LAYOUT = KVBlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def key(i: int) -> bytes:
    return bytes([i]) * 32


def block(i: int) -> torch.Tensor:
    numel = LAYOUT.bytes_per_block // 4
    return (torch.arange(numel, dtype=torch.float32) + 1000.0 * i).reshape(LAYOUT.block_shape)


def test_capacity_is_whole_blocks() -> None:
    assert LAYOUT.bytes_per_block == 2 * 2 * 4 * 2 * 8 * 4
    pool = HostKVPool(LAYOUT, int(3.5 * LAYOUT.bytes_per_block), pin_memory=False)
    assert pool.num_slots == 3
    assert tuple(pool.storage.shape) == (3, *LAYOUT.block_shape)
    m = pool.metrics()
    assert (m.tier, m.capacity_blocks, m.capacity_bytes, m.used_blocks) == ("host", 3, 3 * 1024, 0)


def test_a_cap_below_one_block_turns_the_tier_off_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING"):
        pool = HostKVPool(LAYOUT, LAYOUT.bytes_per_block - 1, pin_memory=False)
    assert pool.num_slots == 0 and "holds no KV block" in caplog.text
    with caplog.at_level("WARNING"):
        caplog.clear()
        HostKVPool(LAYOUT, 0, pin_memory=False)  # 0 is the documented "off": no warning
    assert "holds no KV block" not in caplog.text


def test_put_get_evict_lru_exact_slots() -> None:
    pool = HostKVPool(LAYOUT, 3 * LAYOUT.bytes_per_block, pin_memory=False)
    assert [pool.put(key(i), block(i)) for i in range(3)] == [0, 1, 2]
    assert pool.put(key(3), block(3)) is None  # full: the caller evicts first
    got = pool.get(key(0))  # 0 becomes the most recently used
    assert got is not None and torch.equal(got, block(0))
    assert pool.held_keys() == [key(1), key(2), key(0)]
    evicted = pool.evict_lru()
    assert evicted is not None
    assert evicted.key == key(1) and torch.equal(evicted.data, block(1)) and evicted.owner == b""
    assert pool.put(key(3), block(3)) == 1  # takes the slot just freed
    assert pool.slot_of(key(3)) == 1 and not pool.contains(key(1))
    assert pool.get(key(1)) is None
    pool.check_integrity()
    m = pool.metrics()
    assert (m.used_blocks, m.hits, m.misses, m.demotions, m.evictions, m.drops) == (3, 1, 1, 4, 1, 1)
    assert (m.bytes_in, m.bytes_out) == (4 * 1024, 1024)


def test_pinned_blocks_are_not_evicted_or_removed() -> None:
    pool = HostKVPool(LAYOUT, 2 * LAYOUT.bytes_per_block, pin_memory=False)
    pool.put(key(0), block(0))
    pool.put(key(1), block(1))
    pool.pin(key(0))
    evicted = pool.evict_lru()
    assert evicted is not None and evicted[0] == key(1)
    pool.put(key(2), block(2))
    pool.pin(key(2))
    assert pool.evict_lru() is None
    with pytest.raises(RuntimeError, match="pinned"):
        pool.remove(key(0))
    pool.unpin(key(0))
    assert pool.remove(key(0), promoted=True)
    assert pool.metrics().promotions == 1
    pool.check_integrity()


def test_size_zero_pool_refuses_and_counts() -> None:
    pool = HostKVPool(LAYOUT, LAYOUT.bytes_per_block - 1, pin_memory=False)
    assert pool.num_slots == 0
    assert pool.put(key(0), block(0)) is None
    assert pool.reserve(key(1)) is None
    assert pool.evict_lru() is None
    assert pool.get(key(0)) is None
    m = pool.metrics()
    assert (m.capacity_blocks, m.used_blocks, m.drops, m.misses) == (0, 0, 2, 1)
    pool.check_integrity()


def test_wrong_block_shape_is_refused() -> None:
    pool = HostKVPool(LAYOUT, LAYOUT.bytes_per_block, pin_memory=False)
    with pytest.raises(ValueError, match="expected"):
        pool.put(key(0), torch.zeros(3, 3))


def test_check_integrity_bites() -> None:
    pool = HostKVPool(LAYOUT, 2 * LAYOUT.bytes_per_block, pin_memory=False)
    pool.put(key(0), block(0))
    pool.check_integrity()
    pool._free.append(0)  # slot 0 is now both used and queued free
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_owners_travel_with_eviction_and_purge_frees_and_zeroes() -> None:
    pool = HostKVPool(LAYOUT, 3 * LAYOUT.bytes_per_block, pin_memory=False)
    a = b"A" * 32
    pool.put(key(0), block(0), owner=a)
    pool.put(key(1), block(1))
    pool.put(key(2), block(2), owner=a)
    pool.pin(key(2))  # a transfer in flight: purged after it ends, not now
    evicted = pool.evict_lru()
    assert evicted is not None and (evicted.key, evicted.owner) == (key(0), a)
    pool.put(key(3), block(3), owner=a)
    assert pool.purge(a) == 1  # 3; 2 is pinned
    assert pool.held_keys() == [key(1), key(2)] and pool.owner_of(key(2)) == a
    assert not pool.storage[0].any()  # key(3) took slot 0: zeroed
    pool.check_integrity()
