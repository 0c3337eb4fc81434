"""Tier manager on a real CPU KV cache and real files: exact locations, conservation, faults, swap."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loraplex.storage.kv.block_pool import BlockPool
from loraplex.storage.kv.kv_cache import KVBlockLayout, KVCache
from loraplex.storage.kv.tiers import block_codec
from loraplex.storage.kv.tiers.contracts import Location, Tier
from loraplex.storage.kv.tiers.disk_pool import DiskKVPool
from loraplex.storage.kv.tiers.host_pool import HostKVPool
from loraplex.storage.kv.tiers.manager import TierManager

LAYOUT = KVBlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
BLOCK = LAYOUT.bytes_per_block
RECORD = block_codec.record_bytes(LAYOUT)
FP = b"model-A/layout-1"
HOST, DISK = Tier.HOST, Tier.DISK


def key(i: int) -> bytes:
    return bytes([i]) * 32


def block(i: int) -> torch.Tensor:
    return (torch.arange(BLOCK // 4, dtype=torch.float32) + 1000.0 * i).reshape(LAYOUT.block_shape)


def make_cache(num_blocks: int = 8) -> KVCache:
    return KVCache(2, num_blocks, 4, 2, 8, torch.float32, torch.device("cpu"))


def device_block(cache: KVCache, block_id: int) -> torch.Tensor:
    out = torch.empty(LAYOUT.block_shape)
    cache.read_blocks([block_id], [out])
    return out


def set_device_block(cache: KVCache, block_id: int, data: torch.Tensor) -> None:
    cache.write_blocks([block_id], [data])


def make_tiers(
    tmp_path: Path, cache: KVCache, host_blocks: int, disk_blocks: int, fingerprint: bytes = FP
) -> TierManager:
    host = HostKVPool(LAYOUT, host_blocks * BLOCK, pin_memory=False)
    disk = DiskKVPool(tmp_path / "kv", LAYOUT, fingerprint, disk_blocks * RECORD, num_workers=2)
    return TierManager(cache, host, disk)


@pytest.fixture
def cache() -> KVCache:
    return make_cache()


@pytest.fixture
def tiers(tmp_path: Path, cache: KVCache) -> Iterator[TierManager]:
    manager = make_tiers(tmp_path, cache, host_blocks=2, disk_blocks=2)
    yield manager
    manager.close()


def evict(tiers: TierManager, cache: KVCache, i: int, block_id: int = 0) -> Location | None:
    """The device reuses block ``block_id`` that held cached block ``i``."""
    set_device_block(cache, block_id, block(i))
    location = tiers.demote(block_id, key(i))
    tiers.check_integrity()
    return location


def where(tiers: TierManager, ids: range) -> dict[int, Location | None]:
    tiers.flush()
    return {i: tiers.location(key(i)) for i in ids}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_io_round_trip(dtype: torch.dtype) -> None:
    cache = KVCache(2, 8, 4, 2, 8, dtype, torch.device("cpu"))
    blocks = [block(i).to(dtype) for i in (1, 2, 3)]
    cache.write_blocks([5, 0, 3], blocks)
    outs = [torch.empty(LAYOUT.block_shape, dtype=dtype) for _ in range(3)]
    cache.read_blocks([5, 0, 3], outs)
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks, strict=True))
    # The layout: block [layer, K/V] is the device's k[layer][block_id] / v[layer][block_id].
    assert torch.equal(cache.k[1][0], blocks[1][1, 0]) and torch.equal(cache.v[0][3], blocks[2][0, 1])
    with pytest.raises(IndexError):
        cache.read_blocks([8], [outs[0]])
    with pytest.raises(ValueError, match="contiguous CPU"):
        cache.write_blocks([1], [blocks[0].transpose(0, 1)])


def test_exact_locations_through_demotions_and_promotions(tiers: TierManager, cache: KVCache) -> None:
    assert evict(tiers, cache, 0) == Location(HOST, 0)
    assert evict(tiers, cache, 1) == Location(HOST, 1)
    # Host full: its LRU block (0) goes to disk slot 0, and 2 takes host slot 0.
    assert evict(tiers, cache, 2) == Location(HOST, 0)
    assert evict(tiers, cache, 3) == Location(HOST, 1)
    assert where(tiers, range(4)) == {
        0: Location(DISK, 0),
        1: Location(DISK, 1),
        2: Location(HOST, 0),
        3: Location(HOST, 1),
    }
    # Host and disk full: 2 goes down, the disk's LRU record (0) is dropped.
    assert evict(tiers, cache, 4) == Location(HOST, 0)
    assert where(tiers, range(5)) == {
        0: None,
        1: Location(DISK, 1),
        2: Location(DISK, 0),
        3: Location(HOST, 1),
        4: Location(HOST, 0),
    }
    host, disk = tiers.metrics()
    assert (host.demotions, host.evictions, host.used_blocks) == (5, 3, 2)
    assert (disk.demotions, disk.evictions, disk.used_blocks) == (3, 1, 2)
    assert tiers.lookup([key(0), key(1)]) == []  # the chain starts with a block held nowhere
    assert tiers.lookup([key(1), key(3), key(9), key(4)]) == [
        (key(1), Location(DISK, 1)),
        (key(3), Location(HOST, 1)),
    ]

    promotion = tiers.promote([key(1), key(3)], [5, 6])
    result = promotion.wait()
    assert result.complete and result.num_loaded == 2
    assert (result.keys, result.block_ids) == ([key(1), key(3)], [5, 6])
    assert torch.equal(device_block(cache, 5), block(1))
    assert torch.equal(device_block(cache, 6), block(3))
    # Exactly one location: the promoted blocks left host and disk (the prefix cache has them).
    assert where(tiers, range(5)) == {
        0: None,
        1: None,
        2: Location(DISK, 0),
        3: None,
        4: Location(HOST, 0),
    }
    tiers.check_integrity(device_keys=[key(1), key(3)])
    host, disk = tiers.metrics()
    assert (host.promotions, host.hits, disk.promotions, disk.hits) == (1, 1, 1, 1)
    assert host.used_blocks == disk.used_blocks == 1


def test_failed_disk_read_stops_the_chain(tiers: TierManager, cache: KVCache, tmp_path: Path) -> None:
    for i in range(4):
        evict(tiers, cache, i)
    tiers.flush()
    # 0 on disk 0, 1 on disk 1 (corrupted), 2 and 3 in host.
    slot1 = tmp_path / "kv" / "slot_000001.kvb"
    data = bytearray(slot1.read_bytes())
    data[block_codec.HEADER_BYTES + 7] ^= 1
    slot1.write_bytes(bytes(data))
    chain = [key(0), key(1), key(2), key(3)]
    assert [loc.tier for _, loc in tiers.lookup(chain)] == [DISK, DISK, HOST, HOST]
    result = tiers.promote(chain, [4, 5, 6, 7]).wait()
    assert result.num_loaded == 1 and result.block_ids == [4] and not result.complete
    assert torch.equal(device_block(cache, 4), block(0))
    # The bad record is gone (a counted miss); what follows it stays where it was, findable.
    assert where(tiers, range(4)) == {0: None, 1: None, 2: Location(HOST, 0), 3: Location(HOST, 1)}
    assert tiers.lookup([key(2), key(3)]) == [(key(2), Location(HOST, 0)), (key(3), Location(HOST, 1))]
    host, disk = tiers.metrics()
    assert (disk.checksum_failures, disk.misses, disk.promotions) == (1, 1, 1)
    assert host.promotions == 0
    tiers.check_integrity(device_keys=[key(0)])


def test_keys_in_flight_are_hidden_then_resolved(tiers: TierManager, cache: KVCache) -> None:
    for i in range(3):
        evict(tiers, cache, i)
    tiers.flush()
    promotion = tiers.promote([key(0), key(1)], [6, 7])  # 0 from disk, 1 from host
    assert tiers.lookup([key(0)]) == [] and tiers.lookup([key(1)]) == []
    assert tiers.promote([key(1)], [5]).num_started == 0  # one promotion per key at a time
    tiers.check_integrity()
    # The host block cannot be evicted while it is being promoted.
    evict(tiers, cache, 3)
    assert tiers.location(key(1)) == Location(HOST, 1)
    assert promotion.wait().num_loaded == 2
    assert torch.equal(device_block(cache, 6), block(0)) and torch.equal(device_block(cache, 7), block(1))
    tiers.check_integrity(device_keys=[key(0), key(1)])


def test_cancel_leaves_everything_in_place(tiers: TierManager, cache: KVCache) -> None:
    for i in range(3):
        evict(tiers, cache, i)
    before = where(tiers, range(3))
    promotion = tiers.promote([key(0), key(1), key(2)], [5, 6, 7])
    promotion.cancel()
    assert where(tiers, range(3)) == before
    assert len(tiers.lookup([key(0), key(1), key(2)])) == 3
    tiers.check_integrity()


def test_host_pool_of_size_zero(tmp_path: Path, cache: KVCache) -> None:
    tiers = make_tiers(tmp_path, cache, host_blocks=0, disk_blocks=2)
    try:
        assert evict(tiers, cache, 0) == Location(DISK, 0)  # straight to disk
        tiers.flush()
        assert tiers.metrics()[0].drops == 1
        result = tiers.promote([key(0)], [3]).wait()
        assert result.num_loaded == 1 and torch.equal(device_block(cache, 3), block(0))
    finally:
        tiers.close()
    # No disk either: every demotion is a counted drop, nothing breaks.
    no_tiers = TierManager(cache, HostKVPool(LAYOUT, 0, pin_memory=False))
    assert evict(no_tiers, cache, 1) is None
    assert no_tiers.num_dropped_blocks == 1 and no_tiers.lookup([key(1)]) == []
    assert no_tiers.promote([key(1)], [3]).wait().num_loaded == 0
    host, disk = no_tiers.metrics()
    assert (host.drops, disk.capacity_blocks) == (1, 0)
    assert no_tiers.swap_out([0]) is None


def test_swap_out_and_in(tmp_path: Path, cache: KVCache) -> None:
    tiers = make_tiers(tmp_path, cache, host_blocks=2, disk_blocks=4)
    try:
        evict(tiers, cache, 9, block_id=7)  # a cached block, pushed to disk by the swap
        for block_id, i in zip([1, 2, 3], [11, 12, 13], strict=True):
            set_device_block(cache, block_id, block(i))
        handle = tiers.swap_out([1, 2, 3])
        assert handle is not None and handle.num_blocks == 3
        assert tiers.num_swapped_blocks == 3
        tiers.check_integrity()
        pushed_down = tiers.location(key(9))
        assert pushed_down is not None and pushed_down.tier is DISK
        for block_id in (1, 2, 3):  # the device blocks are reused meanwhile
            set_device_block(cache, block_id, block(0))
        promotion = tiers.swap_in(handle)
        assert promotion.num_started == 3
        promotion.assign([4, 5, 6])
        result = promotion.wait()
        assert result.complete and result.block_ids == [4, 5, 6]
        for block_id, i in zip([4, 5, 6], [11, 12, 13], strict=True):
            assert torch.equal(device_block(cache, block_id), block(i))
        assert tiers.num_swapped_blocks == 0
        with pytest.raises(KeyError):
            tiers.swap_in(handle)
        host, disk = tiers.metrics()
        assert host.used_blocks == 0 and disk.used_blocks == 1  # only the cached block 9 is left
        # discard_swap frees what a swapped-out sequence held.
        handle2 = tiers.swap_out([1, 2])
        assert handle2 is not None
        tiers.discard_swap(handle2)
        assert tiers.num_swapped_blocks == 0 and tiers.metrics()[0].used_blocks == 0
        tiers.check_integrity()
    finally:
        tiers.close()


def test_swap_that_does_not_fit_keeps_nothing(tmp_path: Path, cache: KVCache) -> None:
    tiers = make_tiers(tmp_path, cache, host_blocks=1, disk_blocks=1)
    try:
        assert tiers.swap_out([0, 1, 2, 3]) is None  # 1 host + 1 disk slot: no room for 4
        tiers.flush()
        host, disk = tiers.metrics()
        assert host.used_blocks == 0 and disk.used_blocks == 0
        tiers.check_integrity()
    finally:
        tiers.close()


def test_warm_restart_finds_blocks_and_ignores_swaps(tmp_path: Path, cache: KVCache) -> None:
    tiers = make_tiers(tmp_path, cache, host_blocks=0, disk_blocks=4)
    for i in range(3):
        evict(tiers, cache, i)
    set_device_block(cache, 0, block(7))
    assert tiers.swap_out([0]) is not None
    tiers.close()

    fresh = make_cache()
    again = make_tiers(tmp_path, fresh, host_blocks=2, disk_blocks=4)
    try:
        assert [loc.tier for _, loc in again.lookup([key(0), key(1), key(2)])] == [DISK, DISK, DISK]
        result = again.promote([key(0), key(1), key(2)], [1, 2, 3]).wait()
        assert result.complete
        for i in range(3):
            assert torch.equal(device_block(fresh, i + 1), block(i))
        assert again.metrics()[1].used_blocks == 0  # the swap block was not restored
        again.check_integrity()
    finally:
        again.close()
    other = make_tiers(tmp_path, make_cache(), host_blocks=2, disk_blocks=4, fingerprint=b"model-B")
    try:
        assert other.lookup([key(0)]) == []
    finally:
        other.close()


def test_spill_to_disk_before_shutdown(tmp_path: Path, cache: KVCache) -> None:
    tiers = make_tiers(tmp_path, cache, host_blocks=2, disk_blocks=4)
    evict(tiers, cache, 0)
    evict(tiers, cache, 1)
    assert tiers.spill_to_disk() == 2
    tiers.close()
    again = make_tiers(tmp_path, make_cache(), host_blocks=2, disk_blocks=4)
    try:
        assert [loc.tier for _, loc in again.lookup([key(0), key(1)])] == [DISK, DISK]
    finally:
        again.close()


def test_wired_to_the_block_pool(tiers: TierManager, cache: KVCache) -> None:
    """The block pool's eviction hook demotes; a promotion lands in ``allocate_for_key``'s block."""
    pool = BlockPool(cache.num_blocks)
    pool.on_evict = tiers.on_device_evict
    blocks = pool.allocate(cache.num_blocks)
    for b in blocks:
        set_device_block(cache, b.block_id, block(b.block_id))
        assert pool.cache_block(b.block_id, key(b.block_id))
    pool.decref_all(b.block_id for b in blocks)  # all free, still cached
    reused = pool.allocate(3)  # evicts cached blocks 0, 1, 2 -> host, host (0 -> disk), ...
    assert [b.block_id for b in reused] == [0, 1, 2]
    assert where(tiers, range(3)) == {0: Location(DISK, 0), 1: Location(HOST, 1), 2: Location(HOST, 0)}
    tiers.check_integrity(device_keys=[key(i) for i in range(3, 8)])
    for b in reused:
        set_device_block(cache, b.block_id, block(99))  # overwritten by new tokens
    pool.decref_all(b.block_id for b in reused)

    # Prefetch first: the device allocations below evict 3, 4, 5 into the tiers, and the
    # pinned blocks on their way up must survive that.
    promotion = tiers.prefetch([key(0), key(1), key(2)])
    assert promotion.num_started == 3
    targets = [pool.allocate_for_key(k) for k in promotion.keys]
    assert None not in targets
    promotion.assign([t for t in targets if t is not None])
    result = promotion.wait()
    assert result.complete
    for block_id in result.block_ids:
        pool.publish_promoted(block_id)
    for i in range(3):
        block_id = pool.lookup(key(i))
        assert block_id is not None and torch.equal(device_block(cache, block_id), block(i))
    device_keys = [b.key for b in pool.blocks if b.key is not None]
    tiers.check_integrity(device_keys=device_keys)
    pool.check_integrity()


def test_check_integrity_bites(tiers: TierManager, cache: KVCache) -> None:
    evict(tiers, cache, 0)
    with pytest.raises(AssertionError, match="device blocks also live below"):
        tiers.check_integrity(device_keys=[key(0)])
    assert tiers.disk is not None
    tiers.disk.demote_async(key(0), block(0))  # behind the manager's back: two tiers hold 0
    with pytest.raises(AssertionError, match="in host and disk"):
        tiers.check_integrity()


def test_concurrent_demote_promote_keep_integrity(tmp_path: Path) -> None:
    """Threads demote and promote through small tiers while a checker runs; hits are never wrong."""
    num_threads, per_thread = 3, 4  # device blocks per thread: 2 to evict from, 2 to promote into
    cache = make_cache(num_threads * per_thread)
    tiers = make_tiers(tmp_path, cache, host_blocks=3, disk_blocks=5)
    errors: list[BaseException] = []
    stop = threading.Event()
    loaded = [0]

    def worker(t: int) -> None:
        rng = random.Random(t)
        base = t * per_thread
        try:
            for _ in range(60):
                i = t * 40 + rng.randrange(10)  # each thread its own keys: one device copy each
                src = base + rng.randrange(2)
                set_device_block(cache, src, block(i))
                tiers.demote(src, key(i))
                chain = [key(t * 40 + rng.randrange(10)) for _ in range(2)]
                found = tiers.lookup(chain)
                targets = [base + 2 + n for n in range(len(found))]
                result = tiers.promote([k for k, _ in found], targets).wait(timeout_s=60)
                for k, block_id in zip(result.keys, result.block_ids, strict=True):
                    assert torch.equal(device_block(cache, block_id), block(k[0])), "wrong data loaded"
                    loaded[0] += 1
        except BaseException as exc:
            errors.append(exc)

    def checker() -> None:
        try:
            while not stop.is_set():
                tiers.check_integrity()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(num_threads)]
    check = threading.Thread(target=checker)
    check.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    check.join()
    try:
        assert not errors, errors
        tiers.flush()
        tiers.check_integrity()
        assert loaded[0] > 0
        host, disk = tiers.metrics()
        assert disk.demotions > 0 and disk.hits + host.hits > 0
        assert disk.io_errors == disk.checksum_failures == 0
    finally:
        tiers.close()


def test_create_builds_and_validates_the_tiers(tmp_path: Path, cache: KVCache) -> None:
    with pytest.raises(ValueError, match="needs a disk_kv_path"):
        TierManager.create(cache, LAYOUT, FP, host_kv_cache_bytes=0, disk_kv_cache_bytes=RECORD)
    off = TierManager.create(cache, LAYOUT, FP, host_kv_cache_bytes=0)
    assert off.host.num_slots == 0 and off.disk is None
    assert [m.capacity_blocks for m in off.metrics()] == [0, 0]
    tiers = TierManager.create(
        cache,
        LAYOUT,
        FP,
        host_kv_cache_bytes=2 * BLOCK,
        disk_kv_path=tmp_path / "kv",
        disk_kv_cache_bytes=3 * RECORD,
    )
    try:
        assert [m.capacity_blocks for m in tiers.metrics()] == [2, 3]
    finally:
        tiers.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_through_pinned_host(tmp_path: Path) -> None:
    gpu = KVCache(2, 8, 4, 2, 8, torch.bfloat16, torch.device("cuda"))
    tiers = TierManager.create(
        gpu,
        gpu.layout,
        FP,
        host_kv_cache_bytes=2 * gpu.layout.bytes_per_block,
        disk_kv_path=tmp_path / "kv",
        disk_kv_cache_bytes=4 * block_codec.record_bytes(gpu.layout),
    )
    try:
        assert tiers.host.storage.is_pinned()
        data = [block(i).to(torch.bfloat16) for i in range(4)]
        gpu.write_blocks([0, 1, 2, 3], data)
        for i in range(4):  # 0 and 1 end on disk, 2 and 3 in host
            tiers.demote(i, key(i))
        tiers.flush()
        promotion = tiers.prefetch([key(i) for i in range(4)])
        promotion.assign([4, 5, 6, 7])
        assert promotion.wait().complete
        outs = [torch.empty(gpu.layout.block_shape, dtype=torch.bfloat16) for _ in range(4)]
        gpu.read_blocks([4, 5, 6, 7], outs)
        assert all(torch.equal(o, d) for o, d in zip(outs, data, strict=True))
        tiers.check_integrity(device_keys=[key(i) for i in range(4)])
    finally:
        tiers.close()


def test_clear_drops_every_block_but_transfers_in_flight(tmp_path: Path, cache: KVCache) -> None:
    """A prefix-cache reset: host slots freed and zeroed, disk records erased (a restart finds
    none); a promotion in flight and a swapped-out sequence keep their blocks."""
    tiers = make_tiers(tmp_path, cache, host_blocks=3, disk_blocks=4)
    try:
        for i in range(5):
            evict(tiers, cache, i)
        set_device_block(cache, 5, block(50))
        handle = tiers.swap_out([5])  # the swap block takes a host slot, pushing 2 down
        assert handle is not None
        assert where(tiers, range(5)) == {
            0: Location(DISK, 0),
            1: Location(DISK, 1),
            2: Location(DISK, 2),
            3: Location(HOST, 0),
            4: Location(HOST, 1),
        }
        promotion = tiers.promote([key(3)], [6])  # in flight: pinned in host
        assert tiers.clear() == (1, 3)  # host: 4 (3 moves, the swap block stays); disk: 0, 1, 2
        tiers.check_integrity()
        assert [tiers.location(key(i)) for i in (0, 1, 2, 4)] == [None] * 4
        assert tiers.lookup([key(0)]) == [] and tiers.lookup([key(4)]) == []
        assert not tiers.host.storage[1].any()  # 4's slot is zeroed, not just unindexed
        assert promotion.wait().num_loaded == 1 and torch.equal(device_block(cache, 6), block(3))
        back = tiers.swap_in(handle)
        back.assign([7])
        assert back.wait().complete and torch.equal(device_block(cache, 7), block(50))
        host, disk = tiers.metrics()
        assert host.used_blocks == disk.used_blocks == 0
        tiers.check_integrity(device_keys=[key(3)])
    finally:
        tiers.close()
    restarted = make_tiers(tmp_path, cache, host_blocks=3, disk_blocks=4)
    try:
        assert restarted.disk is not None and restarted.disk.restart.restored == 0
        assert restarted.lookup([key(i) for i in range(5)]) == []
    finally:
        restarted.close()


def test_owners_go_down_and_come_back_and_a_purged_owner_is_stored_nowhere(
    tmp_path: Path, cache: KVCache
) -> None:
    """The tenant tag travels with a block: device -> host -> disk and back up; a purge drops
    the owner's blocks on both tiers (erasing its disk records) and refuses later demotions."""
    a, b = b"A" * 32, b"B" * 32
    tiers = make_tiers(tmp_path, cache, host_blocks=2, disk_blocks=4)
    try:
        pool = BlockPool(cache.num_blocks)
        pool.on_evict = tiers.on_device_evict
        blocks = pool.allocate(6)
        for blk, owner in zip(blocks, [a, b, a, b, a, b""], strict=True):
            set_device_block(cache, blk.block_id, block(blk.block_id))
            assert pool.cache_block(blk.block_id, key(blk.block_id), owner)
        pool.decref_all(blk.block_id for blk in blocks)
        pool.allocate(cache.num_blocks)  # evicts all 6: 0..3 end on disk, 4 and 5 on host
        assert where(tiers, range(6)) == {
            0: Location(DISK, 0),
            1: Location(DISK, 1),
            2: Location(DISK, 2),
            3: Location(DISK, 3),
            4: Location(HOST, 0),
            5: Location(HOST, 1),
        }
        assert tiers.disk is not None
        assert [tiers.disk.owner_of(key(i)) for i in range(4)] == [a, b, a, b]
        assert [tiers.host.owner_of(key(i)) for i in (4, 5)] == [a, b""]
        promotion = tiers.prefetch([key(1)])  # comes back up with its owner
        assert promotion.owners == [b]
        promotion.cancel()

        assert tiers.purge(a) == (1, 2)  # host: 4; disk: 0 and 2
        assert [tiers.location(key(i)) is not None for i in range(6)] == [
            False,
            True,
            False,
            True,
            False,
            True,
        ]
        tiers.check_integrity()
        set_device_block(cache, 0, block(9))
        assert tiers.demote(0, key(9), a) is None  # a purged owner is stored nowhere again
        assert tiers.demote(1, key(10), b) is not None
        tiers.check_integrity()
    finally:
        tiers.close()
    restarted = make_tiers(tmp_path, cache, host_blocks=2, disk_blocks=4)
    try:
        # Disk only (host blocks go down at an engine's shutdown, not here): b's two records.
        assert restarted.disk is not None and sorted(restarted.disk.held_keys()) == sorted([key(1), key(3)])
    finally:
        restarted.close()


def test_a_key_the_device_caches_leaves_host_and_disk_even_mid_write(tmp_path: Path, cache: KVCache) -> None:
    """One location per block: when the device caches a key again (it recomputed the block),
    ``on_device_cache`` drops the copy below; a disk write still in flight is never published."""
    tiers = make_tiers(tmp_path, cache, host_blocks=1, disk_blocks=2)
    assert tiers.disk is not None
    files = tiers.disk._files
    write_record, gate = files.write_record, threading.Event()

    def held_write(slot: int, header: bytes, payload: memoryview, fsync: bool) -> None:
        gate.wait(timeout=30)  # latency injected into the real file write
        write_record(slot, header, payload, fsync)

    files.write_record = held_write  # type: ignore[method-assign]
    try:
        evict(tiers, cache, 0)
        evict(tiers, cache, 1)  # host full: 0 goes to disk, its write held in flight
        assert tiers.location(key(0)) == Location(DISK, 0) and not tiers.disk.is_published(key(0))
        with pytest.raises(AssertionError, match="device blocks also live below"):
            tiers.check_integrity(device_keys=[key(0), key(1)])
        tiers.on_device_cache(key(0))
        tiers.on_device_cache(key(1))
        tiers.on_device_cache(key(7))  # held nowhere: nothing to do
        assert tiers.num_discarded_blocks == 2
        tiers.check_integrity(device_keys=[key(0), key(1)])
        gate.set()
        tiers.flush()
        assert where(tiers, range(2)) == {0: None, 1: None}  # the write finished unpublished
        assert tiers.disk.metrics().used_blocks == 0
        tiers.check_integrity(device_keys=[key(0), key(1)])
    finally:
        gate.set()
        tiers.close()


def test_a_key_a_promotion_moves_is_superseded_until_the_promotion_ends(
    tiers: TierManager, cache: KVCache
) -> None:
    """The device caches keys a promotion holds (another sequence computed them): they stay
    below while pinned (allowed by the check only as superseded), and go when the promotion
    ends without loading them, unless the device evicted its copy meanwhile."""
    for i in range(3):
        evict(tiers, cache, i)  # 0 on disk, 1 and 2 in host
    tiers.flush()
    promotion = tiers.prefetch([key(0), key(1), key(2)])
    assert promotion.num_started == 3
    with pytest.raises(AssertionError, match="device blocks also live below"):
        tiers.check_integrity(device_keys=[key(1)])  # moving alone is no excuse
    for i in range(3):
        tiers.on_device_cache(key(i))
    assert tiers.num_discarded_blocks == 0  # pinned or being read: nothing can go yet
    tiers.check_integrity(device_keys=[key(0), key(1), key(2)])
    set_device_block(cache, 3, block(2))
    assert tiers.demote(3, key(2)) == Location(HOST, 0)  # the device evicts 2: below is its copy
    tiers.check_integrity(device_keys=[key(0), key(1)])
    with pytest.raises(AssertionError, match="device blocks also live below"):
        tiers.check_integrity(device_keys=[key(2)])  # no longer superseded
    promotion.assign([])  # no device block for any of them (a partial promotion)
    assert promotion.wait().num_loaded == 0
    assert where(tiers, range(3)) == {0: None, 1: None, 2: Location(HOST, 0)}
    assert tiers.num_discarded_blocks == 2
    tiers.check_integrity(device_keys=[key(0), key(1)])
    assert tiers.lookup([key(2)]) == [(key(2), Location(HOST, 0))]
